"""Issue 53: ``gep-fed tune --rehearse``, a choice made on the server's own validation data
before any site trains, so that the one run it picks has the whole budget."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tune_task import SMALL_TRIAL, TUNE_TASK

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.accounting.selection import TruncatedNegativeBinomial
from gep_fed.data.registry import resolve_task
from gep_fed.data.rehearsal import parse_rehearsal_name, rehearsal_task_name
from gep_fed.data.task import TaskSettings, dataset_targets
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.site_score import SiteScore
from gep_fed.federation.tuning import (
    REHEARSAL_EPSILON,
    Rehearsal,
    TuneConfig,
    search_of_run_config,
)
from gep_fed.flower.interrupt import RunInterrupted
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


@pytest.mark.parametrize("name", ["rehearsal:2/2:digits", "rehearsal:0/1:digits"])
def test_a_rehearsal_name_of_a_fold_out_of_range_is_named(name):
    with pytest.raises(ValueError, match=r"fold must be one of 0\.\.folds-1"):
        parse_rehearsal_name(name)


def test_only_a_rehearsals_own_names_are_read_as_one():
    assert parse_rehearsal_name(rehearsal_task_name("a/b.py:T", 1, 4)) == (1, 4, "a/b.py:T")
    # a user's module named rehearsal resolves as any module does
    for name in ("digits", "rehearsal:MyTask", "rehearsal:a/2:digits", "rehearsal:0/2"):
        assert parse_rehearsal_name(name) is None


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


def test_a_distributed_rehearsal_carries_the_noise_of_every_sites_share():
    """K sites each add 1/t of the variance: K/t times central's on the sum."""
    real = base(mode="distributed", num_sites=8, noise_shares=2, sample_rate=0.25, rounds=3)
    rehearsed = Rehearsal(2).emulation(real, 0, 1000, 250)
    assert rehearsed.mode == "central" and rehearsed.sample_rate == 1.0
    assert rehearsed.noise_multiplier == pytest.approx(2 * real.contract.noise_multiplier)


def test_a_rehearsal_that_cannot_carry_the_real_noise_is_refused_with_what_to_change():
    real = base(sample_rate=1.0, rounds=40)
    with pytest.raises(ConfigError, match="give the server more validation data"):
        Rehearsal(2).emulation(real, 0, 1_000_000, 90)


def test_a_rehearsal_of_one_fold_is_refused():
    with pytest.raises(ConfigError, match=r"rehearsal folds must be an integer in \[2, 20\]"):
        Rehearsal(1)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"trials": 2}, r"drop trials \(--trials, tune-trials\)"),
        ({"site_score": SiteScore(0.2, 2.0)}, "drop site validation"),
        (
            {"random_trials": TruncatedNegativeBinomial.from_mean(1.0, 2.0), "mode": "central"},
            r"drop random trials \(--random-trials",
        ),
        ({"rehearsal": 2}, "rehearsal must be a Rehearsal"),
    ],
)
def test_a_rehearsal_with_settings_it_would_ignore_is_refused(settings, message):
    settings = {"rehearsal": Rehearsal(), **settings}
    mode = settings.pop("mode", "client")
    with pytest.raises(ConfigError, match=message):
        TuneConfig(base(mode=mode), CANDIDATES, **settings)


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
    record = {"tune-candidates": str(file), "tune-rehearse": True}  # a bare --rehearse
    assert search_of_run_config(record, 1).rehearsal == Rehearsal(2)
    with pytest.raises(ConfigError, match="tune-rehearse must be true or a number of folds"):
        search_of_run_config({"tune-candidates": str(file), "tune-rehearse": "two"}, 1)


@pytest.mark.slow  # four rehearsal runs and one trial, in process (~12 s)
def test_a_rehearsed_tuning_chooses_on_the_servers_data_and_the_sites_record_one_run(
    tmp_path, monkeypatch
):
    """Real simulations: both candidates rehearsed on two folds of the server's validation
    data, the better mean chosen (a step of 0.01 barely moves the model), and only its run
    at the sites: each site's ledger holds one trial's steps at the whole budget. A rehearsal
    stopped by Ctrl-C runs again whole (its folder kept); a tuning stopped in its trial
    resumes there without rehearsing again."""
    from gep_fed.flower import search
    from gep_fed.flower.interrupt import RunInterrupted
    from gep_fed.flower.tuning import TuneInterrupted

    out = tmp_path / "tune"
    config = TuneConfig(
        base(rounds=3, total_examples=400, sample_rate=0.5, noise_seed=5),
        CANDIDATES,
        target_epsilon=8.0,
        out_dir=str(out),
        rehearsal=Rehearsal(2),
    )
    options = {"engine": "in-process"}

    def stopped_rehearsal(specs, on_trial, **kwargs):
        folder = Path(specs[0].fed.run_dir)
        folder.mkdir(parents=True)
        (folder / "its-runs").write_text("kept")
        raise search.SearchInterrupted(2, 1, "rerun")

    with monkeypatch.context() as patch:
        patch.setattr(search, "simulate_search", stopped_rehearsal)
        with pytest.raises(TuneInterrupted, match="to rehearse again") as stop:
            tune(config, simulate_options=options)
    assert "in the rehearsal of candidate 1 on fold 2" in stop.value.line()

    def stopped_trial(specs, on_trial):
        raise RunInterrupted(1)

    lines = []
    with pytest.raises(TuneInterrupted, match=r"in trial 1 of 1 .* to resume"):
        tune(config, simulate_options=options, log=lines.append, run_trials=stopped_trial)
    assert (out / "rehearsal" / "attempt-1" / "its-runs").read_text() == "kept"
    assert any("an earlier rehearsal (attempt-1) left no recorded choice" in x for x in lines)
    assert any("the rehearsal chooses candidate 2" in line for line in lines)
    lines.clear()
    result = tune(config, simulate_options=options, log=lines.append)
    assert not any("rehearsing" in line for line in lines)  # the recorded choice, resumed
    assert sorted(p.name for p in (out / "rehearsal").iterdir()) == ["attempt-1", "attempt-2"]
    record = result.rehearsal
    assert [(r["candidate"], r["fold"]) for r in record["runs"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["problem"] is None for r in record["runs"])
    means = [np.mean([r["score"] for r in record["runs"] if r["candidate"] == c]) for c in (1, 2)]
    assert record["scores"] == pytest.approx(means)
    assert record["chosen"] == 2 and means[1] > means[0] + 0.1
    assert record["examples"] == [90, 90] and record["sites_examples"] == 400
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


def test_under_flwr_run_a_rehearsal_needs_the_sites_declared_total(tmp_path):
    config = TuneConfig(base(), CANDIDATES, out_dir=str(tmp_path / "t"), rehearsal=Rehearsal())

    def grid_trials(specs, on_trial):
        raise AssertionError("no trial may run")

    with pytest.raises(ConfigError, match=r"declare their total in the run config"):
        tune(config, run_trials=grid_trials)
    assert not (tmp_path / "t" / "rehearsal").exists()  # refused before anything ran


def test_a_rehearsal_runs_as_many_sites_as_the_simulations_own_data_names(tmp_path, monkeypatch):
    """``--site-data`` sets the trials' number of sites; the rehearsal's runs have as many
    (in client mode each site's noise adds up: fewer would understate it)."""
    from gep_fed.flower import search
    from gep_fed.flower import tuning as flower_tuning
    from gep_fed.flower.simulation import SimulationResult

    seen = []

    def scored(specs, on_trial, **options):
        for spec in specs:
            seen.append(spec.fed)
            row = {"round": 1, "applied": True, "val_balanced_accuracy": 0.5 + 0.1 * len(seen)}
            on_trial(spec, SimulationResult(tmp_path, [row], None, 0.0))

    monkeypatch.setattr(search, "simulate_search", scored)
    config = TuneConfig(
        base(
            total_examples=400,
            partition="dirichlet",
            mode="distributed",
            num_sites=3,
            noise_shares=2,
        ),
        CANDIDATES,
        rehearsal=Rehearsal(),
    )
    record = rehearse(config, tmp_path, 400, lambda line: None, num_sites=4)
    # the sites' own data is no Dirichlet split: each fold is shared out IID, to 4 sites
    assert [(f.num_sites, f.partition) for f in seen] == [(4, "iid")] * 4
    assert record["sites"] == 4 and record["chosen"] == 2  # the later runs scored higher
    real = replace(config.candidate_config(0), num_sites=4)  # 4 sites' shares of t = 2
    assert seen[0].noise_multiplier / seen[0].sample_rate == pytest.approx(
        2**0.5 * real.contract.noise_multiplier / real.contract.sample_rate * 90 / 400
    )
    with pytest.raises(ConfigError, match=r"trains on 90 .* too few to share by 91 sites"):
        rehearse(config, tmp_path, 400, lambda line: None, num_sites=91)
    asked = {}

    def capture(config, out, sites_examples, say, **kwargs):
        asked.update(kwargs)
        raise ConfigError("captured")

    monkeypatch.setattr(flower_tuning, "rehearse", capture)
    site_data = {f"h{i}": str(tmp_path / f"h{i}") for i in range(5)}
    with pytest.raises(ConfigError, match="captured"):
        tune(config, simulate_options={"site_data": site_data, "engine": "in-process"})
    assert asked["num_sites"] == 5


def test_a_rehearsal_numbers_its_attempt_after_the_highest_and_keeps_every_earlier_one(
    tmp_path, monkeypatch
):
    from gep_fed.flower import search

    folders = []

    def stopped(specs, on_trial, **options):
        folders.append(Path(specs[0].fed.run_dir).name)
        raise search.SearchInterrupted(1, 0, "rerun")

    monkeypatch.setattr(search, "simulate_search", stopped)
    for name in ("attempt-2", "attempt-10", "attempt-notes"):
        (tmp_path / "rehearsal" / name).mkdir(parents=True)
    config = TuneConfig(base(total_examples=400), CANDIDATES, rehearsal=Rehearsal())
    lines = []
    with pytest.raises(RunInterrupted):
        rehearse(config, tmp_path, 400, lines.append)
    assert folders == ["attempt-11"]
    assert "an earlier rehearsal (attempt-10) left no recorded choice" in lines[0]
    assert {p.name for p in (tmp_path / "rehearsal").iterdir()} >= {"attempt-2", "attempt-10"}


def test_a_file_where_the_tuning_keeps_its_rehearsal_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "tune"
    out.mkdir()
    (out / "rehearsal").write_text("not a folder")
    config = TuneConfig(base(), CANDIDATES, out_dir=str(out), rehearsal=Rehearsal())
    with pytest.raises(ConfigError, match="rehearsal is a file, not a folder: choose another"):
        tune(config, simulate_options={"engine": "in-process"})


def test_a_stop_request_of_the_caller_reaches_the_rehearsals_simulation(tmp_path, monkeypatch):
    """``flwr stop`` (the ServerApp's stop request) ends a rehearsal as it ends a trial."""
    from gep_fed.flower import flwr_app, search
    from gep_fed.flower.interrupt import StopRequest

    given = []

    def stopped(specs, on_trial, **options):
        given.append(options["stop"])
        raise search.SearchInterrupted(1, 0, "rerun")

    monkeypatch.setattr(search, "simulate_search", stopped)
    config = TuneConfig(
        base(total_examples=400), CANDIDATES, out_dir=str(tmp_path / "t"), rehearsal=Rehearsal()
    )
    request = StopRequest()
    with pytest.raises(RunInterrupted):
        tune(config, run_trials=lambda specs, on_trial: None, stop=request)
    assert given == [request]
    passed = {}

    def recording_tune(config, **kwargs):
        passed.update(kwargs)
        raise ConfigError("recorded")

    monkeypatch.setattr(flwr_app, "tune", recording_tune)
    with pytest.raises(ConfigError, match="recorded"):
        flwr_app.run_search(config, grid=None, context=None)
    assert isinstance(passed["stop"], StopRequest)


def test_tied_rehearsal_scores_choose_the_first_declared_and_say_so(tmp_path, monkeypatch):
    from gep_fed.flower import search
    from gep_fed.flower.simulation import SimulationResult

    def tied(specs, on_trial, **options):
        for spec in specs:
            row = {"round": 1, "applied": True, "val_balanced_accuracy": 0.5}
            on_trial(spec, SimulationResult(tmp_path, [row], None, 0.0))

    monkeypatch.setattr(search, "simulate_search", tied)
    config = TuneConfig(base(total_examples=400), CANDIDATES, rehearsal=Rehearsal())
    lines = []
    assert rehearse(config, tmp_path, 400, lines.append)["chosen"] == 1
    assert "chooses candidate 1 (mean score 0.5000, tied with candidate(s) [2]" in lines[-1]
