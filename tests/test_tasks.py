"""The task interface: a user's own task (tests/example_task.py, outside gep_fed) runs in a
real Flower simulation in both modes; task names are resolved or refused by name."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA, shared_file

from gep_fed.accounting.events import epsilon_rdp
from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.formats import DataError
from gep_fed.data.registry import resolve_task
from gep_fed.data.task import TaskSettings
from gep_fed.federation.config import FederationConfig
from gep_fed.flower.simulation import simulate
from gep_fed.validation import ConfigError

TESTS = Path(__file__).parent


@pytest.mark.parametrize(
    "name, problem",
    [
        ("no_such_module:Task", "cannot import"),
        ("example_task:NoSuchClass", "has no class 'NoSuchClass'"),
        ("example_task:FindingsDataset", "is not a subclass of gep_fed's Task"),
        ("imagenet", "neither a built-in task"),
    ],
)
def test_a_bad_task_name_is_refused_by_name(name, problem):
    with pytest.raises(ConfigError, match=problem):
        FederationConfig(task=name)


def test_built_in_names_and_import_paths_resolve():
    assert resolve_task("digits") is DigitsTask
    assert resolve_task("example_task:TwoFindingsTask").kind == "multilabel"


def test_a_task_file_path_resolves_from_any_folder_and_a_missing_one_is_named(
    tmp_path, monkeypatch
):
    from gep_fed.data.registry import task_file_name

    monkeypatch.chdir(TESTS.parent)
    name = task_file_name("tests/example_task.py:TwoFindingsTask")
    assert name == f"{TESTS / 'example_task.py'}:TwoFindingsTask"
    monkeypatch.chdir(tmp_path)
    assert resolve_task(name).kind == "multilabel"
    assert FederationConfig(task=name).make_task().kind == "multilabel"
    with pytest.raises(ConfigError, match=f"no file {tmp_path / 'task.py'}"):
        FederationConfig(task="task.py:Task")


@pytest.mark.parametrize(
    "source, error",
    [
        ("import torch\ndef broken(:\n", r": SyntaxError: invalid syntax \(task.py, line 2\)"),
        ("import torch\nimport not_a_module_anywhere\n", " at line 2: ModuleNotFoundError"),
        ("x = 1\nraise RuntimeError('no data path set')\n", " at line 2: RuntimeError: no data"),
    ],
    ids=["syntax", "import", "raises"],
)
def test_a_task_file_that_fails_to_import_is_named_with_its_line_and_error(tmp_path, source, error):
    path = tmp_path / "task.py"
    path.write_text(source)
    with pytest.raises(ConfigError, match=f"task '{path}:Task': importing {path} failed{error}"):
        FederationConfig(task=f"{path}:Task")


def test_scatter_dataset_takes_an_array_of_images_or_a_function_returning_one():
    from gep_fed.data.builtin_tasks import scatter_dataset

    images = np.random.default_rng(0).integers(0, 256, (3, 28, 28), dtype=np.uint8)
    labels = np.array([0, 1, 0])
    from_array = scatter_dataset(images, labels, cache=False)
    from_function = scatter_dataset(lambda: images, labels, cache=False)
    assert len(from_array) == 3
    assert torch.equal(from_array[2][0], from_function[2][0])


def small_run(tmp_path, monkeypatch, task: str, **settings) -> dict:
    """A short client-mode simulation's settings for ``task`` of tests/example_task.py."""
    # Ray's workers import the task by its path, as a deployed site does
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    small = dict(rounds=2, local_steps=2, num_basis=16, num_public=200, sample_rate=0.2)
    return dict(
        task=f"example_task:{task}",
        mode="client",
        noise_seed=3,
        run_dir=str(tmp_path),
        run_name="r",
        **{**small, **settings},
    )


@pytest.mark.slow
def test_a_users_own_task_trains_in_a_flower_simulation(tmp_path, monkeypatch):
    """Client mode (central mode with a user's task is the deployment guide's first run)."""
    fed = FederationConfig(**small_run(tmp_path, monkeypatch, "TwoFindingsTask"))
    result = simulate(fed, progress=False, engine="in-process")
    assert [m["round"] for m in result.metrics] == [1, 2]
    assert all(m["sites_ok"] == 3 and m["applied"] for m in result.metrics)
    last = result.metrics[-1]
    assert 0 <= last["test_auroc"] <= 1 and not math.isnan(last["test_balanced_accuracy"])
    steps = 2 * 2  # rounds x local steps
    for site in range(3):
        ledger = PrivacyLedger.load_keyed(result.run_dir / "sites" / f"site-{site}" / "ledger.json")
        assert ledger.steps == steps


@pytest.mark.slow
def test_every_site_averages_over_the_augmented_copies_the_run_asks_for(tmp_path, monkeypatch):
    """``augmentation_copies`` reaches the simulated sites through the round config, and
    they augment with their own task's augmentation, K copies of every sampled example;
    the run's noise and accounting are those of the same run without copies. (Client mode;
    the other modes' site code is tested on the library side, tests/test_federation.py.)"""
    log = tmp_path / "augmented_rows.txt"
    monkeypatch.setenv("GEP_FED_TEST_AUGMENTATION_LOG", str(log))
    settings = small_run(tmp_path, monkeypatch, "AugmentedDigits", max_chunk=32)
    fed = FederationConfig(augmentation_copies=3, **settings)
    result = simulate(fed, progress=False, engine="in-process")
    assert all(m["sites_ok"] == 3 and m["applied"] for m in result.metrics)
    rows = [int(n) for n in log.read_text().split()]
    # the server's anchors are never augmented; every site call is whole examples' copies
    assert rows and all(n % 3 == 0 and n <= 30 for n in rows)
    steps = 2 * 2  # each site's: rounds x local steps
    assert sum(rows) / 3 == pytest.approx(0.2 * 1437 * steps, rel=0.2)
    assert fed.contract == FederationConfig(augmentation_copies=0, **settings).contract
    ledger = PrivacyLedger.load_keyed(result.run_dir / "sites/site-0/ledger.json")
    assert ledger.epsilon() == pytest.approx(
        epsilon_rdp(fed.contract.events(steps), fed.delta), rel=1e-9
    )


@pytest.mark.slow
def test_the_server_keeps_the_best_round_on_the_tasks_validation_set(tmp_path, monkeypatch):
    """A task with a validation set: every round is scored on it, best_model.pt holds the
    model of the best round by validation balanced accuracy (re-evaluating it gives that
    round's figure), and the final model stays the result in model.pt."""
    fed = FederationConfig(**small_run(tmp_path, monkeypatch, "DigitsWithValidation", rounds=4))
    result = simulate(fed, progress=False, engine="in-process")
    rows = result.metrics
    scores = [r["val_balanced_accuracy"] for r in rows]
    best = 1 + scores.index(max(scores))
    assert [r["best_round"] for r in rows] == [
        1 + scores.index(max(scores[:i])) for i in range(1, len(rows) + 1)
    ]
    saved = torch.load(result.run_dir / "best_model.pt", weights_only=True)
    assert saved["round"] == best
    task = fed.make_task()
    model = task.build_model()
    model.load_state_dict(saved["model"])
    from gep_fed.data.metrics import predict

    again = task.metrics(*predict(model, task.validation_dataset()))
    assert again["balanced_accuracy"] == pytest.approx(max(scores), abs=1e-9)
    final = torch.load(result.run_dir / "model.pt", weights_only=True)["model"]
    assert best == len(rows) or any(not torch.equal(final[k], saved["model"][k]) for k in final)


def test_a_task_without_a_validation_set_keeps_no_best_model():
    assert DigitsTask(TaskSettings(num_public=50)).validation_dataset() is None


@pytest.mark.slow
def test_cifar10_with_resnet20_gn_trains_a_client_mode_round_reduced(tmp_path):
    """The CIFAR-10 worked example (batches 1-2 private, batch 5 for the server,
    Tiny-ImageNet anchors, ResNet20-GN), reduced to one round of client mode and a server
    evaluation on 500 images (central mode's site code is the same clipped sums, simulated
    on digits in tests/test_simulation.py)."""
    shared_file("cifar10/cifar-10-batches-bin/data_batch_5.bin")
    shared_file("tinyimagenet/tinyimagenet_val_32x32.npz")
    fed = FederationConfig(
        task="example_task:Cifar10ShortEvaluation",
        model="resnet20",
        data_dir=str(SHARED_DATA),
        mode="client",
        rounds=1,
        local_steps=1,
        num_basis=20,
        num_public=64,
        sample_rate=0.002,
        noise_seed=1,
        run_dir=str(tmp_path),
        run_name="client",
    )
    result = simulate(fed, progress=False, engine="in-process")
    (metrics,) = result.metrics
    assert metrics["sites_ok"] == 3 and metrics["applied"]
    assert 0 <= metrics["test_accuracy"] <= 1


@pytest.mark.slow
def test_scatter_linear_trains_on_digits_in_a_flower_simulation(tmp_path, monkeypatch):
    """ScatterNet features + linear head through the whole federation, Flower's apps run in
    process (the sites compute or read the cached features of the pooled data; processes
    sharing the cache: tests/test_files.py)."""
    monkeypatch.setenv("GEP_FED_CACHE", str(tmp_path / "cache"))
    fed = FederationConfig(
        task="digits",
        model="scatter-linear",
        rounds=2,
        local_steps=2,
        num_basis=8,
        num_public=100,
        noise_seed=0,
        run_dir=str(tmp_path),
        run_name="r",
    )
    result = simulate(fed, progress=False, engine="in-process")
    assert all(m["sites_ok"] == 3 and m["applied"] for m in result.metrics)
    assert result.metrics[-1]["test_accuracy"] > 0.2  # 10 classes: above chance after 4 steps


def test_a_sites_scatter_features_are_computed_in_memory_never_cached(tmp_path, monkeypatch):
    """Features of a deployed site's private file stay in its memory; only the task's own
    (built-in, public) data sets are cached on disk."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("GEP_FED_CACHE", str(cache))
    task = DigitsTask(TaskSettings(model="scatter-linear", num_public=20))
    rng = np.random.default_rng(0)
    site = tmp_path / "site.npz"
    np.savez(
        site, images=rng.integers(0, 256, (30, 8, 8), dtype=np.uint8), labels=np.arange(30) % 10
    )
    x, y = task.site_dataset(str(site))[3]
    assert tuple(x.shape) == (81, 2, 2) and int(y) == 3
    assert not cache.exists() or not any(cache.rglob("*.pt"))
    task.public_dataset()[0]  # the task's own (public) data: computed on first read, cached
    assert len(list(cache.rglob("*.pt"))) == 1
    assert sum(p.numel() for p in task.build_model().parameters()) == 81 * 2 * 2 * 10 + 10


@pytest.mark.parametrize(
    "model, params",
    # the sweep's models: 56,394 and 477,450 parameters
    [("auto", 243 * 64 * 10 + 10), ("scatter-cnn", 56_394), ("scatter-cnn-w4", 477_450)],
)
def test_a_cifar10_sites_file_is_served_as_scatter_features_never_cached(
    tmp_path, monkeypatch, model, params
):
    cache = tmp_path / "cache"
    monkeypatch.setenv("GEP_FED_CACHE", str(cache))
    rng = np.random.default_rng(0)
    records = np.concatenate(
        [np.arange(5, dtype=np.uint8)[:, None], rng.integers(0, 256, (5, 3072), dtype=np.uint8)],
        axis=1,
    )
    site = tmp_path / "site.bin"
    records.tofile(site)
    task = resolve_task("cifar10")(TaskSettings(data_dir=str(tmp_path), model=model))
    x, y = task.site_dataset(str(site))[2]
    assert tuple(x.shape) == (243, 8, 8) and int(y) == 2
    assert not cache.exists()
    net = task.build_model()
    assert sum(p.numel() for p in net.parameters()) == params
    assert net(x[None]).shape == (1, 10)


def test_fashion_mnist_serves_the_standard_split_with_scatter_features():
    shared_file("fashion-mnist/t10k-images-idx3-ubyte.gz")
    shared_file("kmnist/kmnist-test-imgs.npz")
    fed = FederationConfig.for_task("fashion-mnist", data_dir=str(SHARED_DATA), num_public=40)
    task = fed.make_task()
    assert (len(task.train[1]), len(task.test[1])) == (60_000, 10_000)
    x, _ = task.public_dataset()[0]
    assert tuple(x.shape) == (81, 7, 7)
    assert sum(p.numel() for p in task.build_model().parameters()) == 39_700


def test_langevin_accepts_the_scatter_linear_model_it_is_convex_in():
    FederationConfig(mechanism="langevin", mode="client", model="scatter-linear")
    with pytest.raises(ConfigError, match="linear model only"):
        FederationConfig(mechanism="langevin", mode="client", model="scatter-cnn")


def test_counting_or_partitioning_pooled_features_does_not_compute_them():
    """A central-mode server counts the pooled data and a simulation partitions it by label;
    neither needs the features (60,000 x 3,969 floats for Fashion-MNIST)."""
    from gep_fed.data.task import FeatureDataset

    def never():
        raise AssertionError("features computed")

    ds = FeatureDataset(never, np.arange(5) % 2)
    assert len(ds) == 5 and list(ds.targets()) == [0, 1, 0, 1, 0]
    with pytest.raises(DataError, match="3 feature rows but 5 labels"):
        FeatureDataset(lambda: torch.zeros(3, 2), np.arange(5))[0]


@pytest.mark.parametrize(
    "model, augmented", [("resnet20", True), ("cnn", True), ("scatter-linear", False)]
)
def test_cifar10_augments_pixels_and_not_precomputed_scatternet_features(model, augmented):
    from gep_fed.data.augment import crop_and_flip
    from gep_fed.data.builtin_tasks import Cifar10Task

    augmentation = Cifar10Task(TaskSettings(model=model)).augmentation()
    assert (augmentation is crop_and_flip) if augmented else augmentation is None


def test_an_error_inside_the_tasks_evaluation_data_is_not_blamed_on_its_absence():
    from gep_fed.flower.simulation import check_simulated_sites

    with pytest.raises(ConfigError, match=r"eval_dataset\(\) failed: TypeError: broken inside"):
        check_simulated_sites(FederationConfig(task="example_task:BrokenEvaluation"))
