"""Issue 53: ``gep-fed tune --rehearse``, a choice made on the server's own validation data
before any site trains, so that the one run it picks has the whole budget."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from tune_task import SMALL_TRIAL, TUNE_TASK

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.data.registry import resolve_task
from gep_fed.data.rehearsal import parse_rehearsal_name, rehearsal_task_name
from gep_fed.data.task import TaskSettings, dataset_targets
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.tuning import (
    REHEARSAL_EPSILON,
    Rehearsal,
    TuneConfig,
    search_of_run_config,
)
from gep_fed.flower.rehearsal import rehearse
from gep_fed.flower.tuning import tune
from gep_fed.validation import ConfigError

CANDIDATES = [{"server-lr": 0.01}, {"server-lr": 2.0}]


def base(**settings) -> FederationConfig:
    return FederationConfig(**{**SMALL_TRIAL, **settings})


def test_a_rehearsal_trains_and_validates_on_disjoint_folds_of_the_servers_validation_data():
    inner = resolve_task(TUNE_TASK)(TaskSettings(seed=3))
    validation = inner.validation_dataset()
    seen = []
    for fold in (0, 1, 2):
        task = resolve_task(rehearsal_task_name(TUNE_TASK, fold, 3))(TaskSettings(seed=3))
        trained, held = task.train_dataset(), task.validation_dataset()
        assert task.eval_dataset().indices == held.indices
        assert not set(trained.indices) & set(held.indices)
        assert sorted([*trained.indices, *held.indices]) == list(range(len(validation)))
        assert len(held) in (len(validation) // 3, len(validation) // 3 + 1)
        # the labels the partitions read are the validation examples' own
        expected = dataset_targets(validation)[np.asarray(trained.indices)]
        assert np.array_equal(dataset_targets(trained), expected)
        seen += held.indices
    assert sorted(seen) == list(range(len(validation)))  # each example held out once
    again = resolve_task(rehearsal_task_name(TUNE_TASK, 0, 3))(TaskSettings(seed=3))
    assert (
        again.validation_dataset().indices
        == resolve_task(rehearsal_task_name(TUNE_TASK, 0, 3))(TaskSettings(seed=3))
        .validation_dataset()
        .indices
    )  # the public seed decides the cut
    with pytest.raises(NotImplementedError, match="never a site's data"):
        task.site_dataset("anything")


def test_a_rehearsal_reads_no_site_data(monkeypatch):
    cls = resolve_task(TUNE_TASK)

    def forbidden(self):
        raise AssertionError("the rehearsal read the sites' pooled data")

    monkeypatch.setattr(cls, "train_dataset", forbidden)
    task = resolve_task(rehearsal_task_name(TUNE_TASK, 1, 2))(TaskSettings())
    assert len(task.train_dataset()) + len(task.validation_dataset()) == 180


@pytest.mark.parametrize(
    "name, message",
    [
        ("rehearsal:2/2:digits", "fold must be one of"),
        ("rehearsal:0/1:digits", "fold must be one of"),
        ("rehearsal:a/2:digits", "is named 'rehearsal:<fold>/<folds>:<task>'"),
        ("rehearsal:0/2", "is named 'rehearsal:<fold>/<folds>:<task>'"),
    ],
)
def test_a_malformed_rehearsal_name_is_named(name, message):
    with pytest.raises(ValueError, match=message):
        parse_rehearsal_name(name)
    assert parse_rehearsal_name("digits") is None
    assert parse_rehearsal_name(rehearsal_task_name("a/b.py:T", 1, 4)) == (1, 4, "a/b.py:T")


@pytest.mark.parametrize("mode", ["client", "central", "distributed"])
@pytest.mark.parametrize("sites_examples, examples", [(1000, 400), (1000, 250), (10_000, 300)])
def test_the_emulation_keeps_the_noise_on_the_update_relative_to_its_signal(
    mode, sites_examples, examples
):
    real = base(mode=mode, sample_rate=0.25, rounds=3, num_sites=3, local_steps=1)
    contract = real.contract
    rehearsed = Rehearsal(2).emulation(real, 1, sites_examples, examples)
    # the noise's std over the expected sum of clipped gradients, the same as the real run's
    ratio = contract.noise_multiplier / (contract.sample_rate * sites_examples)
    assert rehearsed.noise_multiplier / (rehearsed.sample_rate * examples) == pytest.approx(ratio)
    if examples >= 0.25 * sites_examples:  # the folds hold the real expected sample: same sigma
        assert rehearsed.sample_rate * examples == pytest.approx(0.25 * sites_examples)
        assert rehearsed.noise_multiplier == pytest.approx(contract.noise_multiplier)
    else:
        assert rehearsed.sample_rate == 1.0
    assert rehearsed.mode == ("central" if mode == "distributed" else mode)
    assert rehearsed.task == rehearsal_task_name(TUNE_TASK, 1, 2)
    assert rehearsed.target_epsilon == REHEARSAL_EPSILON and rehearsed.total_examples is None


def test_a_rehearsal_that_cannot_carry_the_real_noise_is_refused_with_what_to_change():
    real = base(sample_rate=1.0, rounds=40)
    with pytest.raises(ConfigError, match="give the server more validation data"):
        Rehearsal(2).emulation(real, 0, 1_000_000, 90)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"trials": 2}, "drop trials"),
        ({"site_score": "score"}, "drop site validation"),
        ({"rehearsal": "one fold"}, "rehearsal folds must be"),
        ({"rehearsal": 2}, "rehearsal must be a Rehearsal"),
    ],
)
def test_a_rehearsal_with_settings_it_would_ignore_is_refused(settings, message):
    from gep_fed.federation.site_score import SiteScore

    if settings.get("site_score") == "score":
        settings = {"site_score": SiteScore(0.2, 2.0)}
    if settings.get("rehearsal") == "one fold":  # built here: the dataclass refuses it
        with pytest.raises(ConfigError, match=message):
            Rehearsal(1)
        return
    if "rehearsal" not in settings:
        settings = {**settings, "rehearsal": Rehearsal()}
    with pytest.raises(ConfigError, match=message):
        TuneConfig(base(), CANDIDATES, **settings)


def test_the_command_line_and_a_run_config_ask_for_the_same_rehearsal(tmp_path):
    from gep_fed.cli.tune import add_tune_parser, tune_config

    file = tmp_path / "candidates.toml"
    file.write_text(
        f'[base]\ntask = "{TUNE_TASK}"\nrounds = 2\n'
        "[[candidate]]\nserver-lr = 0.5\n[[candidate]]\nserver-lr = 2.0\n"
    )
    parser = argparse.ArgumentParser()
    add_tune_parser(parser.add_subparsers())
    for given, folds in (([], None), (["--rehearse"], 2), (["--rehearse", "3"], 3)):
        args = parser.parse_args(["tune", "--candidates", str(file), *given])
        config = tune_config(args)
        assert (config.rehearsal and config.rehearsal.folds) == folds
        record = {"tune-candidates": str(file), **({"tune-rehearse": folds} if folds else {})}
        flwr = search_of_run_config(record, 1)
        assert (flwr.rehearsal and flwr.rehearsal.folds) == folds
    with pytest.raises(ConfigError, match="tune-rehearse must be a number of folds"):
        search_of_run_config({"tune-candidates": str(file), "tune-rehearse": "two"}, 1)


@pytest.mark.slow  # four rehearsal runs and one trial, in process (~10 s)
def test_a_rehearsed_tuning_chooses_on_the_servers_data_and_the_sites_record_one_run(tmp_path):
    """Real simulations: both candidates rehearsed on two folds of the server's validation
    data, the better mean chosen (a step of 0.01 barely moves the model), and only its run
    at the sites: each site's ledger holds one trial's steps at the whole budget."""
    out = tmp_path / "tune"
    (out / "rehearsal" / "left-by-a-stopped-rehearsal").mkdir(parents=True)
    config = TuneConfig(
        base(rounds=3, total_examples=400, sample_rate=0.5, noise_seed=5),
        CANDIDATES,
        target_epsilon=8.0,
        out_dir=str(out),
        rehearsal=Rehearsal(2),
    )
    lines = []
    result = tune(config, simulate_options={"engine": "in-process"}, log=lines.append)
    record = result.rehearsal
    assert [(r["candidate"], r["fold"]) for r in record["runs"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["problem"] is None for r in record["runs"])
    means = [np.mean([r["score"] for r in record["runs"] if r["candidate"] == c]) for c in (1, 2)]
    assert record["scores"] == pytest.approx(means)
    assert record["chosen"] == 2 and means[1] > means[0] + 0.1
    assert record["examples"] == [90, 90] and record["sites_examples"] == 400
    assert not (out / "rehearsal" / "left-by-a-stopped-rehearsal").exists()
    # the rehearsal's runs trained on 90 examples with the real run's noise per signal
    real = config.candidate_config(1).contract
    for run in record["runs"]:
        assert run["noise_multiplier"] / (run["sample_rate"] * 90) == pytest.approx(
            real.noise_multiplier / (real.sample_rate * 400)
        )
    assert [t.candidate for t in result.trials] == [2] and result.chosen.candidate == 2
    assert result.per_trial_epsilon == 8.0
    assert result.trials[0].noise_multiplier == pytest.approx(real.noise_multiplier)
    for site in ("site-0", "site-1"):
        ledger = PrivacyLedger.load_keyed(out / "sites" / site / "ledger.json")
        assert ledger.steps == 3 * 2  # one trial: 3 rounds of 2 local steps
        assert 7.9 < ledger.epsilon() <= 8.0
    saved = json.loads((out / "tune.json").read_text())
    assert saved["rehearsal"]["chosen"] == 2 and saved["settings"]["rehearsal"] == {"folds": 2}
    text = (out / "tune.md").read_text()
    assert "## Rehearsal on the server's validation data" in text and "| 2 (chosen) |" in text
    assert any("the rehearsal chooses candidate 2" in line for line in lines)


def test_a_rehearsal_that_scores_no_candidate_fails_before_any_site_trains(tmp_path, monkeypatch):
    from gep_fed.flower import search
    from gep_fed.flower.simulation import SimulationResult

    def nothing_scored(specs, on_trial, **options):
        for spec in specs:
            on_trial(spec, SimulationResult(tmp_path, [], "stopped before round 1", 0.0))

    monkeypatch.setattr(search, "simulate_search", nothing_scored)
    config = TuneConfig(base(total_examples=400), CANDIDATES, rehearsal=Rehearsal())
    with pytest.raises(ConfigError, match=r"the rehearsal scored no candidate .*no site trained"):
        rehearse(config, tmp_path, 400, lambda line: None)


def test_a_deployment_must_declare_the_sites_total_for_a_rehearsal(tmp_path, monkeypatch):
    cls = resolve_task(TUNE_TASK)

    def deployed(self):
        raise NotImplementedError("no pooled data")

    monkeypatch.setattr(cls, "train_dataset", deployed)
    config = TuneConfig(base(), CANDIDATES, out_dir=str(tmp_path / "t"), rehearsal=Rehearsal())
    with pytest.raises(ConfigError, match="declare their total \\(total-examples\\)"):
        tune(config, simulate_options={"engine": "in-process"})
    assert not (tmp_path / "t" / "sites").exists()  # no site was formed
