"""The task interface: a user's own task (tests/example_task.py, outside gep_fed) runs in a
real Flower simulation in both modes; task names are resolved or refused by name."""

import math
from pathlib import Path

import pytest
from conftest import SHARED_DATA, shared_file

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.config import ConfigError, FederationConfig
from gep_fed.data.task import resolve_task
from gep_fed.data.tasks import DigitsTask
from gep_fed.flower.simulation import simulate

TESTS = Path(__file__).parent


@pytest.mark.parametrize(
    "name, problem",
    [
        ("no_such_module:Task", "cannot import"),
        ("example_task:NoSuchClass", "is not a gep_fed Task"),
        ("example_task:FindingsDataset", "is not a gep_fed Task"),
        ("imagenet", "neither a built-in task"),
    ],
)
def test_a_bad_task_name_is_refused_by_name(name, problem):
    with pytest.raises(ConfigError, match=problem):
        FederationConfig(task=name)


def test_built_in_names_and_import_paths_resolve():
    assert resolve_task("digits") is DigitsTask
    assert resolve_task("example_task:TwoFindingsTask").kind == "multilabel"


@pytest.mark.parametrize("mode", ["central", "client"])
def test_a_users_own_task_trains_in_a_flower_simulation(tmp_path, monkeypatch, mode):
    # Ray's workers import the task by its path, as a deployed site does
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    fed = FederationConfig(
        task="example_task:TwoFindingsTask",
        mode=mode,
        rounds=2,
        local_steps=2,
        num_basis=16,
        num_public=200,
        sample_rate=0.2,
        noise_seed=3,
        run_dir=str(tmp_path),
        run_name="r",
    )
    result = simulate(fed, progress=False)
    assert [m["round"] for m in result.metrics] == [1, 2]
    assert all(m["sites_ok"] == 3 and m["applied"] for m in result.metrics)
    last = result.metrics[-1]
    assert 0 <= last["test_auroc"] <= 1 and not math.isnan(last["test_balanced_accuracy"])
    steps = 2 if mode == "central" else 2 * 2
    for site in range(3):
        ledger = PrivacyLedger.load_keyed(result.run_dir / "sites" / f"site-{site}" / "ledger.json")
        assert ledger.steps == steps


def test_cifar10_with_resnet20_gn_runs_in_both_modes_reduced(tmp_path):
    """The CIFAR-10 worked example (batches 1-2 private, batch 5 for the server,
    Tiny-ImageNet anchors, ResNet20-GN), reduced to one round per mode."""
    shared_file("cifar10/cifar-10-batches-bin/data_batch_5.bin")
    shared_file("tinyimagenet/tinyimagenet_val_32x32.npz")
    for mode in ("central", "client"):
        fed = FederationConfig(
            task="cifar10",
            data_dir=str(SHARED_DATA),
            mode=mode,
            rounds=1,
            local_steps=1,
            num_basis=20,
            num_public=64,
            sample_rate=0.002,
            noise_seed=1,
            run_dir=str(tmp_path),
            run_name=mode,
        )
        result = simulate(fed, progress=False)
        (metrics,) = result.metrics
        assert metrics["sites_ok"] == 3 and metrics["applied"]
        assert 0 <= metrics["test_accuracy"] <= 1
