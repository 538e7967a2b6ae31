"""Issue 54 in the standard benchmark: the grid's TAN read from the log, the new levers,
the GEP paper's protocol (its accounting, shuffled batches, best-epoch reporting) kept apart
from the honest results."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
standard = pytest.importorskip("standard")
import standard_table  # noqa: E402

GRID = {"gep": [{"lr": 4.0}, {"lr": 8.0}], "gp": [{"lr": 4.0}, {"lr": 8.0}]}


def _args(**over) -> argparse.Namespace:
    args = standard.parse_args(["--dataset", "fmnist", "--stage", "levers", "--methods", "gep"])
    return argparse.Namespace(**{**vars(args), **over})


def _done(args, tan: int, methods=("gep",)) -> dict:
    at = argparse.Namespace(**{**vars(args), "seed": 0, "tan": tan})
    return {
        standard.run_key(at, m, s, "tune"): {"stage": "tune", "accuracy": 0.5}
        for m in methods
        for s in GRID[m]
    }


def test_the_levers_stage_finds_a_grid_tuned_at_another_tan_without_being_told():
    """The bug of issue 54's first session: ``--stage levers`` without ``--tan 8`` looked
    for the grid at TAN 1 and reported 0/6 runs done; the TAN is now read from the log."""
    args = _args()
    assert (args.tan, args.grid_tan) == (None, None)
    standard.resolve_grid_tan(args, GRID, _done(args, 8))
    assert (args.tan, args.grid_tan) == (8, 8)
    # a TAN given on the command line is kept: the levers at the real batch, grid from the log
    args = _args(tan=1)
    standard.resolve_grid_tan(args, GRID, _done(args, 8))
    assert (args.tan, args.grid_tan) == (1, 8)
    # nothing logged: TAN 1, as before
    args = _args()
    standard.resolve_grid_tan(args, GRID, {})
    assert (args.tan, args.grid_tan) == (1, 1)
    # tuning keeps its default of 1
    assert standard.parse_args(["--stage", "tune"]).tan == 1


def test_honest_final_keys_are_unchanged_and_paper_runs_are_keyed_apart():
    args = _args(stage="final", tan=8, grid_tan=8)
    honest = json.loads(standard.run_key(args, "gep", {"lr": 1.0}, "final"))
    assert "protocol" not in honest
    paper = argparse.Namespace(**{**vars(args), "protocol": "paper"})
    assert json.loads(standard.run_key(paper, "gep", {"lr": 1.0}, "final"))["protocol"] == "paper"
    # tuning runs never carry the protocol: a paper final reuses the honest grid
    tune = json.loads(standard.run_key(paper, "gep", {"lr": 1.0}, "tune"))
    assert "protocol" not in tune


def test_the_paper_protocol_is_for_finals_of_gep_and_gp_only():
    with pytest.raises(SystemExit):
        standard.parse_args(["--protocol", "paper", "--stage", "tune"])
    with pytest.raises(SystemExit):
        standard.parse_args(["--protocol", "paper", "--stage", "final", "--methods", "opacus"])
    args = standard.parse_args(
        ["--protocol", "paper", "--stage", "final", "--methods", "gep", "gp"]
    )
    assert args.protocol == "paper"
    assert standard.parse_args([]).protocol == "honest"


def test_the_new_levers_exist_and_lr_wd_scales_weight_decay_with_the_step_size():
    gep = standard.LEVERS["gep"]
    for lever in ({"s2_ratio": 0.2}, {"s2_ratio": 0.1}, {"lr_wd": 1e-5}, {"refresh": 5}):
        assert lever in gep
    assert {"lr_wd": 1e-5} in standard.LEVERS["gp"]
    opt = standard.optimizer_config({"lr": 8.0, "lr_wd": 1e-4})
    assert opt.weight_decay == pytest.approx(1.25e-5)
    assert standard.optimizer_config({"lr": 8.0}).weight_decay == 0.0
    # on a grid with its own wd (ResNet20-GN's 1e-4), the lever replaces it
    assert standard.weight_decay({"lr": 4.0, "wd": 1e-4, "lr_wd": 1e-5}) == pytest.approx(2.5e-6)


def test_the_paper_accounting_is_two_independent_subsampled_gaussians():
    """``compute_rdp(q, sigma, T) * 2``: one subsampled Gaussian for 2T steps. It allows less
    noise than the joint release's accounting (sensitivity sqrt(2)) at the same target, and
    the sigma it gives has a larger true epsilon."""
    q, steps = 0.04, 300
    honest = standard.calibrate_noise_multiplier(3.0, standard.DELTA, q, steps, "gep")
    paper = standard.paper_sigma(3.0, q, steps, "gep")
    assert paper < honest
    assert standard.paper_epsilon(paper, q, steps, "gep") == pytest.approx(3.0, abs=1e-2)
    assert standard.epsilons("gep", paper, q, steps)[0] > 3.05
    # GP's accounting is the same either way
    gp = standard.calibrate_noise_multiplier(3.0, standard.DELTA, q, steps, "gp")
    assert standard.paper_sigma(3.0, q, steps, "gp") == pytest.approx(gp)


def test_shuffled_training_visits_each_example_once_an_epoch_and_tests_each_epoch():
    from gep_fed import GEPConfig, PrivacyContract
    from gep_fed.training import OptimizerConfig

    torch.manual_seed(0)
    x, y = torch.randn(40, 6), torch.randint(3, (40,))
    model = torch.nn.Linear(6, 3)
    seen = []
    original = standard.torch.tensor_split

    def spy(perm, parts):
        out = original(perm, parts)
        seen.append(torch.cat(out).sort().values)
        return out

    config = GEPConfig(PrivacyContract("gp", 1.0, 0.25, clip_norm=1.0))
    evaluations = iter([0.2, 0.6, 0.4])
    standard.torch.tensor_split = spy
    try:
        final, history = standard.train_shuffled(
            model, x, y, None, config, 12, 4, OptimizerConfig(lr=0.1), 0, None,
            lambda m: {"accuracy": next(evaluations)},
        )  # fmt: skip
    finally:
        standard.torch.tensor_split = original
    assert history == [0.2, 0.6, 0.4] and final == 0.4
    assert all(torch.equal(s, torch.arange(40)) for s in seen) and len(seen) == 3


def _rec(method, stage, acc, **over):
    setting = {"batch": 4096, "epochs": 20, "lr": 8.0, "clip": 0.1}
    if method == "gep":
        setting |= {"s2_ratio": 0.5, "k": 100, "anchors": 1000, "refresh": 20}
    return {
        "stage": stage,
        "dataset": "fmnist",
        "features": "scatter",
        "head": "linear",
        "method": method,
        "epsilon": 3.0,
        "grid": "main2",
        "setting": setting,
        "seed": 0,
        "tan": 8 if stage == "tune" else 1,
        "accuracy": acc,
        "sigma": 2.0,
        "q": 0.067,
        "steps": 300,
        "seconds": 10.0,
        "cpu_seconds": 10.0,
        "epsilon_rdp": 3.0,
        "epsilon_pld": 2.7,
        "target": {"epsilon_rdp": 3.0, "epsilon_pld": 2.7},
        **over,
    }


def test_the_tables_show_the_levers_and_keep_the_paper_protocol_apart(tmp_path):
    base = _rec("gep", "tune", 0.89)
    lever = {"s2_ratio": 0.2}
    levered = _rec("gep", "tune", 0.90, lever=lever, base=base["setting"])
    levered["setting"] = {**base["setting"], **lever}
    final = _rec("gep", "final", 0.888, chosen_val_accuracy=0.89)
    paper = _rec(
        "gep",
        "final",
        0.892,
        protocol="paper",
        sigma=1.8,
        epsilon_rdp=3.4,
        epsilon_pld=3.1,
        epsilon_paper_accounting=3.0,
        sampling="shuffled",
        best_epoch_accuracy=0.897,
        best_epoch=17,
        epoch_accuracies=[0.8] * 16 + [0.897, 0.89, 0.891, 0.892],
    )
    records = [base, levered, final, paper]
    path = standard_table.write_table(
        "fmnist",
        records,
        standard.DATASETS["fmnist"],
        standard.GOALS["fmnist"],
        tmp_path / "fmnist.jsonl",
        tmp_path / "fmnist.md",
    )
    text = path.read_text()
    main = text.split("## Published figures")[0]
    assert "89.20" not in main  # the paper run is no result
    assert "| s2_ratio=0.2 |" in text and "+1.00" in text
    paper_part = text.split("## The GEP paper's protocol")[1]
    assert "| paper | gep |" in paper_part and "| honest | gep |" in paper_part
    assert "89.70 (17)" in paper_part
    assert "+0.90 points from protocol alone" in paper_part


def test_a_warm_refresh_lever_trains_with_the_warm_step_and_restores_the_library_step():
    import warm_refresh

    import gep_fed.training
    from gep_fed import GEPConfig, PrivacyContract
    from gep_fed.training import OptimizerConfig, train_private

    assert {"refresh": 5, "anchors": 200, "warm_memory": 0.8} in standard.LEVERS["gep"]
    torch.manual_seed(0)
    x, y, public = torch.randn(64, 6), torch.randint(3, (64,)), torch.randn(20, 6)
    config = GEPConfig(
        PrivacyContract("gep", 1.0, 0.25, 1.0, 0.5), num_basis=4, num_anchors=8, basis_refresh=2
    )
    seen = []
    original = gep_fed.training.GEPStep
    with warm_refresh.warm_steps(0.5):
        train_private(
            torch.nn.Linear(6, 3), x, y, public, config, 6, OptimizerConfig(lr=0.1),
            generator=torch.Generator().manual_seed(0),
            on_step=lambda i, step: seen.append((type(step).memory, step._warm is not None)),
        )  # fmt: skip
    assert gep_fed.training.GEPStep is original
    assert seen == [(0.5, True)] * 6


def test_exact_levers_name_one_lever_so_that_runs_side_by_side_take_one_each():
    gep = standard.LEVERS["gep"]
    combo = ["s2_ratio=0.2", "lr_wd=0.0001"]
    assert [lv for lv in gep if standard.lever_selected(lv, combo, exact=True)] == [
        {"s2_ratio": 0.2, "lr_wd": 1e-4}
    ]
    assert [lv for lv in gep if standard.lever_selected(lv, ["s2_ratio=0.2"], exact=True)] == [
        {"s2_ratio": 0.2}
    ]
    # without --lever-exact an item picks every lever setting that knob to that value
    assert len([lv for lv in gep if standard.lever_selected(lv, ["s2_ratio=0.2"])]) == 2
    with pytest.raises(SystemExit, match="no such lever"):
        standard.parse_args(["--levers", "s2_ratio=0.2", "k=300", "--lever-exact"])
