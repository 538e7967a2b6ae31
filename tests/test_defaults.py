"""The defaults are the settings that won on validation (issues 13 and 24). Their provenance
is a data file, benchmarks/results/defaults.json (each default's winning setting, its
validation and test accuracy, its log), written from the benchmark's logs by
benchmarks/defaults_provenance.py: if a rerun of a benchmark chooses another setting, the file
is stale; if a default drifts from the file, the default is wrong. Either fails here."""

import json
import math
import sys
from pathlib import Path

import pytest

from gep_fed.data.builtin_tasks import Cifar10Task, FashionMnistTask
from gep_fed.data.registry import BUILT_IN_TASKS
from gep_fed.federation.config import FederationConfig
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.validation import ConfigError

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
standard = pytest.importorskip("standard")
defaults_provenance = pytest.importorskip("defaults_provenance")
dev_sets = pytest.importorskip("dev_sets")

PROVENANCE = json.loads((BENCHMARKS / "results" / "defaults.json").read_text())
GRIDS = defaults_provenance.GRIDS
N_TRAIN = {"fmnist": 60_000, "cifar10": 20_000}
MOMENTUM = 0.9  # benchmarks/standard.py trains every private method with SGD momentum 0.9


def validation_winner(dataset: str, method: str) -> dict:
    """The data set's winning grid setting for ``method``, as the provenance file records it."""
    return PROVENANCE["standard"][dataset][method]["setting"]


def test_the_provenance_file_is_what_the_benchmarks_logs_say():
    """Recomputed from the logs (the best validation run of each complete grid, checked to be
    the one retrained and tested), the provenance is the file's, figure for figure."""
    assert defaults_provenance.provenance() == PROVENANCE


@pytest.mark.parametrize("dataset", sorted(GRIDS))
def test_gep_config_defaults_are_the_step_every_standard_benchmark_chose(dataset):
    gep, gp = validation_winner(dataset, "gep"), validation_winner(dataset, "gp")
    contract = PrivacyContract("gep", 1.0, 0.1)
    config = GEPConfig(contract)
    assert contract.clip_embedding == gep["clip"]
    assert contract.clip_residual == pytest.approx(gep["clip"] * gep["s2_ratio"])
    assert config.num_basis == gep["k"]
    assert config.num_anchors == gep["anchors"]
    assert config.basis_refresh == gep["refresh"]
    assert contract.clip_norm == gp["clip"]
    assert config.past_releases == 0  # the lever helped on one data set only (+0.17, one seed)


def test_a_step_config_holds_the_contract_and_repeats_none_of_its_fields():
    """One declaration: the clip norms' defaults exist once, in PrivacyContract."""
    from dataclasses import fields

    own = {f.name for f in fields(GEPConfig)}
    assert own & {f.name for f in fields(PrivacyContract)} == set()
    assert "contract" in own


@pytest.mark.parametrize("dataset, task", [("fmnist", FashionMnistTask), ("cifar10", Cifar10Task)])
def test_a_task_recommends_its_data_sets_validation_winner(dataset, task):
    gep, gp = validation_winner(dataset, "gep"), validation_winner(dataset, "gp")
    q, steps = standard.schedule(N_TRAIN[dataset], gep["batch"], gep["epochs"])
    rec = task.recommended_settings
    assert rec["model"] == "scatter-linear" and task.default_model == "scatter-linear"
    assert rec["sample_rate"] == pytest.approx(q) and rec["rounds"] == steps
    assert rec["server_lr"] == gep["lr"] and rec["server_momentum"] == MOMENTUM
    assert (rec["clip_embedding"], rec["num_basis"], rec["basis_refresh"]) == (
        gep["clip"],
        gep["k"],
        gep["refresh"],
    )
    assert rec["clip_residual"] == pytest.approx(gep["clip"] * gep["s2_ratio"])
    assert rec["num_anchors"] == gep["anchors"]
    assert rec["clip_norm"] == gp["clip"]
    # client mode: one local step of lr 1 per round, so the server's step moves the model as
    # far per private step as central mode's
    assert rec["local_steps"] == 1 and rec["local_lr"] == 1.0 and rec["local_momentum"] == 0.0


def test_cifar10_recommends_the_model_that_won_geps_validation_across_the_sweep():
    """Issue 23's sweep (linear head, ScatterNet CNNs of growing width, ResNet20-GN at
    epsilon 8): the model of GEP's best validation run is the task's recommended one. (GP's
    and Opacus's best is the width-4 CNN; the recommendation serves GEP, the default.)"""
    tuned = [
        r
        for r in standard.read_log("cifar10")
        if r["stage"] == "tune"
        and r["method"] == "gep"
        and r["epsilon"] == standard.GOALS["cifar10"][0]
        and r.get("seed", 0) == 0
        and "lever" not in r
    ]
    assert {r["head"] for r in tuned} >= {"linear", "cnn", "cnn-w2", "cnn-w4", "resnet20"}
    best = max(tuned, key=lambda r: r["accuracy"])
    assert (best["features"], best["head"]) == ("scatter", "linear")
    assert Cifar10Task.recommended_settings["model"] == "scatter-linear"


def test_fashion_mnist_holds_the_benchmarks_public_anchor_pool():
    # benchmarks/standard.py held 2,000 KMNIST images and drew 1,000 anchors per subspace
    assert FashionMnistTask.recommended_settings["num_public"] == 2000


def test_a_tasks_recommendations_apply_below_the_users_own_settings():
    fed = FederationConfig.for_task("fashion-mnist", rounds=5, clip_residual=0.2)
    assert fed.rounds == 5 and fed.clip_residual == 0.2  # the user's
    assert fed.num_basis == 100 and fed.model == "scatter-linear"  # the task's
    assert FederationConfig.for_task("digits") == FederationConfig()  # nothing recommended


def test_every_built_in_tasks_recommendations_are_valid_settings():
    for name, cls in BUILT_IN_TASKS.items():
        if cls.recommended_settings:
            assert isinstance(FederationConfig.for_task(name), FederationConfig), name


def test_an_unknown_task_or_recommended_setting_is_refused_by_name(monkeypatch):
    with pytest.raises(ConfigError, match="neither a built-in task"):
        FederationConfig.for_task("imagenet")
    monkeypatch.setattr(FashionMnistTask, "recommended_settings", {"epochs": 20})
    with pytest.raises(ConfigError, match=r"recommends unknown setting\(s\) \['epochs'\]"):
        FederationConfig.for_task("fashion-mnist")


def test_the_recommended_sample_rate_takes_a_whole_number_of_batches_per_epoch():
    for task in (FashionMnistTask, Cifar10Task):
        q = task.recommended_settings["sample_rate"]
        assert math.isclose(1 / q, round(1 / q))


def test_a_new_tasks_step_is_the_small_data_sweeps_validation_winner():
    """SMALL_DATA_RECIPE is GEP's best validation setting of benchmarks/small_data.py
    (PneumoniaMNIST, 1,000 images, epsilon 8), which every user task gets unless it declares
    its own."""
    from gep_fed.data.builtin_tasks import DigitsTask
    from gep_fed.data.task import SMALL_DATA_RECIPE, Task

    best = PROVENANCE["small_data"]["point"]
    recipe = SMALL_DATA_RECIPE
    assert recipe["sample_rate"] == best["sample_rate"] and recipe["rounds"] == best["steps"]
    assert recipe["clip_embedding"] == best["clip"] == 2 * recipe["clip_residual"]
    assert recipe["server_lr"] == pytest.approx(best["lr_times_clip"] / best["clip"])
    assert Task.recommended_settings is recipe
    assert DigitsTask.recommended_settings == {}  # the main job keeps its own defaults


def test_a_small_image_tasks_defaults_are_the_candidate_the_development_sets_chose():
    """SMALL_IMAGE_RECIPE (model included) is the candidate of benchmarks/dev_sets.py with
    the best mean validation score over five development sets, every seed of every candidate
    logged: the library default, chosen by the selection without privacy, never on a test
    split. MedMNIST recommends it."""
    from gep_fed.data.builtin_tasks import MedMnistTask
    from gep_fed.data.task import SMALL_IMAGE_RECIPE

    chosen = PROVENANCE["dev_sets"]
    means = {int(i): m for i, m in chosen["mean_validation"].items()}
    assert len(chosen["seeds"]) >= 5 and all(len(s) >= 5 for s in chosen["seeds"].values())
    assert (
        len(means) == len(dev_sets.CANDIDATES) and max(means, key=means.get) == chosen["candidate"]
    )
    assert dict(SMALL_IMAGE_RECIPE) == chosen["settings"]
    assert MedMnistTask.recommended_settings is SMALL_IMAGE_RECIPE
