"""The standard benchmark's log: it resumes across sessions and keeps its protocol."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
standard = pytest.importorskip("standard")

DATASETS = ("mnist", "fmnist", "cifar10")


def _model_options(record: dict) -> list[str]:
    """The --head / --width a record's model label (``linear``, ``cnn``, ``cnn-w2``) came from;
    raw-pixel models take none."""
    if record["features"] == "raw":
        return []
    head, _, width = record["head"].partition("-w")
    return ["--head", head] + (["--width", width] if width else [])


def _args(record: dict):
    tan = record.get("tan", 1) if record["stage"] == "tune" else 8
    return standard.parse_args(
        [
            "--dataset",
            record["dataset"],
            "--epsilon",
            str(record["epsilon"] or standard.GOALS[record["dataset"]][0]),
            "--tan",
            str(tan),
            "--features",
            record["features"],
            "--seed",
            str(record.get("seed", 0)),  # logged since the second seeds; 0 before
            *_model_options(record),
        ]
    )


@pytest.mark.parametrize("dataset", DATASETS)
def test_every_logged_run_is_found_again_by_its_key(dataset):
    """A rerun skips what the log holds only if the key it computes is the logged one."""
    records = standard.read_log(dataset, superseded=True)
    assert records, f"no log for {dataset}"
    for r in records:
        assert standard.run_key(_args(r), r["method"], r["setting"], r["stage"]) == r["key"]


@pytest.mark.parametrize("dataset", DATASETS)
def test_tan_tuning_keeps_the_noise_per_example_of_the_target_run(dataset):
    """TAN: batch / R and sigma / R at the same steps leave sigma / (q n) unchanged."""
    tuned = [r for r in standard.read_log(dataset) if r.get("tan", 1) > 1]
    assert tuned
    for r in tuned:
        target = r["target"]
        assert r["sigma"] / r["expected_batch"] == pytest.approx(
            target["sigma"] / target["expected_batch"], rel=1e-9
        )


def test_every_tuning_grid_gives_each_method_the_same_budget():
    for name, grid in standard.GRIDS.items():
        sizes = {method: len(settings) for method, settings in grid.items()}
        assert len(set(sizes.values())) == 1, (name, sizes)
        assert set(grid) == set(standard.METHODS), name


def test_the_grids_file_is_checked_for_equal_tuning_budgets(tmp_path):
    text = standard.GRIDS_FILE.read_text()
    assert standard.load_grids() == standard.GRIDS
    one_axis_shorter = "axes = { epochs = [5] }"
    unequal = text.replace("axes = { epochs = [5, 10], lr = [0.05, 0.1] }", one_axis_shorter)
    (tmp_path / "grids.toml").write_text(unequal)
    with pytest.raises(ValueError, match="unequal tuning budgets"):
        standard.load_grids(tmp_path / "grids.toml")


class _Shaped:
    feature_shape = (243, 8, 8)  # CIFAR-10's ScatterNet features


def test_the_dimension_sweep_widens_the_scatternet_cnn_from_50k_to_1m_parameters():
    """Issue 23's model family on CIFAR-10: the linear head, the CNN at widths 1-6, and
    ResNet20-GN on raw pixels, each named apart in the log's key."""
    sizes, labels = {}, set()
    for argv in (
        ["--head", "linear"],
        *(["--head", "cnn", "--width", str(w)] for w in (1, 2, 4, 6)),
        ["--features", "raw"],
    ):
        args = standard.parse_args(["--dataset", "cifar10", *argv])
        model = standard.build_model(args, _Shaped())
        sizes[standard.model_label(args)] = sum(p.numel() for p in model.parameters())
        labels.add(standard.run_key(args, "gp", {"lr": 1}, "tune"))
    assert len(labels) == 6
    widths = [sizes[k] for k in ("cnn", "cnn-w2", "cnn-w4", "cnn-w6")]
    assert 40_000 < widths[0] < 70_000 and 800_000 < widths[-1] < 1_200_000
    assert widths == sorted(widths)
    assert sizes["linear"] == 155_530 and sizes["resnet20"] == 272_474


def test_a_width_on_another_model_is_refused():
    with pytest.raises(SystemExit, match="--width 2"):
        standard.parse_args(["--width", "2"])


def test_a_settings_weight_decay_and_learning_rate_drop_reach_the_optimizer():
    from gep_fed.training import OptimizerConfig

    paper = standard.optimizer_config({"lr": 0.1, "wd": 1e-4, "decay_at": 0.5, "batch": 1000})
    assert paper == OptimizerConfig(lr=0.1, momentum=0.9, weight_decay=1e-4, decay_at=0.5)
    assert standard.optimizer_config({"lr": 2.0}) == OptimizerConfig(lr=2.0, momentum=0.9)


def test_opacus_runs_follow_the_settings_weight_decay_and_learning_rate_drop():
    """Zero inputs and no noise: only the weight decay moves the weights, less after the drop."""
    import torch

    def final_norm(setting: dict) -> float:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2, bias=False)
        x, y = torch.zeros(8, 3), torch.zeros(8, dtype=torch.long)
        opt = standard.optimizer_config({"lr": 1.0, **setting})
        model, _ = standard.train_opacus_poisson(model, x, y, 0.0, 1.0, 0.5, 6, opt, 0, 8)
        return float(model._module.weight.norm())

    plain, decayed = final_norm({}), final_norm({"wd": 0.1})
    dropped = final_norm({"wd": 0.1, "decay_at": 0.5})
    assert decayed < dropped < plain


def test_a_warm_start_on_200_public_classes_keeps_all_but_the_models_classifier():
    """Tiny-ImageNet's labels train a 200-way twin; the 10-way model takes every tensor but its
    classifier from it, on the public images the lever names."""
    import torch

    class PublicOnly:  # the part of ``Data`` a warm start reads: public images and labels
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(40, 3, 32, 32, generator=g), torch.arange(40) % 200
            self.y[0] = 199
            self.asked = None

        def public_images(self, count):
            self.asked = count
            return self.x[:count], self.y[:count]

    args = standard.parse_args(["--dataset", "cifar10", "--features", "raw"])
    data = PublicOnly()
    torch.manual_seed(0)
    model = standard.build_model(args, data)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    standard.warm_start(args, model, data, {"warm": 1, "warm_public": 32}, seed=0)
    after = model.state_dict()
    assert data.asked == 32
    assert torch.equal(after["fc.weight"], before["fc.weight"])
    assert torch.equal(after["fc.bias"], before["fc.bias"])
    assert not torch.equal(after["conv1.weight"], before["conv1.weight"])
    assert not torch.equal(after["layer3.2.conv2.weight"], before["layer3.2.conv2.weight"])
    standard.warm_start(args, model, data, {"warm": 1}, seed=0)
    assert data.asked == args.num_public  # without warm_public: the held anchors


def test_the_spread_over_seeds_groups_one_setting_and_leaves_single_runs_out():
    import standard_table

    def rec(method, seed, acc, lr=1.0):
        return {
            "method": method,
            "features": "raw",
            "head": "resnet20",
            "params": 1,
            "setting": {"lr": lr},
            "tan": 8,
            "seed": seed,
            "accuracy": acc,
        }

    tunes = [
        rec("gp", 0, 0.25),
        rec("gp", 1, 0.21),
        rec("gp", 2, 0.29),
        rec("gp", 0, 0.5, 2.0),
        rec("opacus", 0, 0.30),
        rec("opacus", 1, 0.30),
    ]
    spread = standard_table.seed_spread(tunes)
    assert [(r["method"], sorted(acc)) for r, acc in spread] == [
        ("gp", [0.21, 0.25, 0.29]),
        ("opacus", [0.30, 0.30]),
    ]


def test_the_sweep_compares_gep_with_the_better_dp_sgd_on_test_where_all_three_were_tested():
    import standard_table

    def rec(method, stage, acc, head="cnn", params=50_000, seed=0):
        return {
            "method": method,
            "stage": stage,
            "features": "scatter",
            "head": head,
            "params": params,
            "epsilon": 8.0,
            "seed": seed,
            "accuracy": acc,
        }

    records = [
        *(rec(m, "tune", a) for m, a in (("gep", 0.50), ("gep", 0.52), ("gp", 0.49))),
        rec("opacus", "tune", 0.51),
        rec("gp", "tune", 0.60, seed=1),  # another seed: not the grid's
        *(rec(m, "final", a) for m, a in (("gep", 0.55), ("gp", 0.56), ("opacus", 0.53))),
        # a wider model without final runs yet: compared on validation
        *(rec(m, "tune", a, "cnn-w2", 150_000) for m, a in (("gep", 0.58), ("gp", 0.55))),
        rec("opacus", "tune", 0.56, "cnn-w2", 150_000),
        rec("gep", "tune", 0.7, "cnn-w4", 600_000),  # no DP-SGD run: no row
    ]
    rows = standard_table.sweep_rows(records)
    assert [(r["model"], r["split"], round(100 * r["gap"], 2)) for r in rows] == [
        ("scatter+cnn (50,000)", "test", -1.0),
        ("scatter+cnn-w2 (150,000)", "val", 2.0),
    ]
    assert rows[0]["gep_val"] == 0.52 and rows[0]["gp_val"] == 0.49
