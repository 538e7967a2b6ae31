"""Issue 53: ``gep-fed tune``, private selection among declared candidates under one total
budget that every site's ledger records and enforces."""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tune_task import SMALL_TRIAL, TUNE_TASK

from gep_fed.accounting.events import (
    ImpossibleTargetError,
    epsilon_pld,
    epsilon_rdp,
    rdp_curve,
)
from gep_fed.accounting.ledger import PrivacyLedger, default_key_path, read_ledger_key
from gep_fed.accounting.selection import PoissonTrials
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import RunDirectory
from gep_fed.federation.site_score import SiteScore
from gep_fed.federation.site_selection import selection_folder, trial_run_curve
from gep_fed.federation.tuning import (
    TrialPlanner,
    TuneConfig,
    calibrate_selection_epsilon,
    calibrate_trial_epsilon,
    candidates_from_toml,
)
from gep_fed.flower import search
from gep_fed.flower.simulation import SimulationResult
from gep_fed.flower.tuning import OUTSIDE, SEARCH_ID, TuneInterrupted, result_lines, tune
from gep_fed.validation import ConfigError

TASK, BASE = TUNE_TASK, SMALL_TRIAL  # tests/tune_task.py: digits with a validation split


def base(**settings) -> FederationConfig:
    return FederationConfig(**{**BASE, **settings})


def test_the_trials_compose_to_just_below_the_total_budget():
    config = TuneConfig(
        base(),
        [{"server-lr": 0.5}, {"server_lr": 2.0, "rounds": 3}, {"local-steps": 1}],
        trials=5,
        target_epsilon=2.0,
        delta=1e-5,
    )
    plan = config.plan(random.Random(3))
    assert len(plan) == 5 and set(plan) <= {0, 1, 2}
    epsilon, composed = calibrate_trial_epsilon(config, plan)
    planner = TrialPlanner(config)
    events = [e for i in plan for e in planner.trial(i, epsilon)[1]]
    assert epsilon_rdp(events, 1e-5) == pytest.approx(composed)
    assert 2.0 - 1e-3 <= composed <= 2.0
    # each trial spends its own budget e over its own steps: one trial alone is within e
    for i in set(plan):
        assert epsilon_rdp(planner.trial(i, epsilon)[1], 1e-5) <= epsilon + 1e-9
    # every candidate once, in the declared order, when T is their number
    assert TuneConfig(base(), [{}, {"server-lr": 2.0}]).plan() == (0, 1)


def test_a_budget_too_small_for_the_trials_is_refused_with_what_to_change():
    config = TuneConfig(base(rounds=50), [{}, {"server-lr": 2.0}], trials=40, target_epsilon=0.01)
    with pytest.raises(ImpossibleTargetError, match="Raise the total or run fewer trials"):
        calibrate_trial_epsilon(config, config.plan(random.Random(0)))


@pytest.mark.parametrize(
    ("candidates", "message"),
    [
        ([{"server-lr": 1.0}, {"server-lrr": 2.0}], "candidate 2: unknown setting 'server-lrr'"),
        ([{"clip-norm": -1.0}], "candidate 1: .*clip_norm"),
        ([{}, {"mechanism": "sgd"}], "candidate 2: mechanism must be one of"),
        ([{"seed": 3}], "candidate 1: 'seed' cannot differ between candidates"),
        ([{"target-epsilon": 3.0}], "candidate 1: 'target-epsilon' cannot differ"),
        ([{"server-lr": 1.0, "server_lr": 2.0}], "candidate 1: 'server_lr' is given twice"),
        ([{"mechanism": "langevin", "model": "linear"}], "candidate 1: tune does not run langevin"),
        ([], "at least one candidate"),
    ],
)
def test_a_bad_candidate_is_named(candidates, message):
    with pytest.raises(ConfigError, match=message):
        TuneConfig(base(), candidates)


def test_a_fixed_sigma_or_an_unknown_site_setting_is_refused():
    with pytest.raises(ConfigError, match="leave noise-multiplier at auto"):
        TuneConfig(base(noise_multiplier=1.0), [{}])
    with pytest.raises(ConfigError, match="site setting 'budget'"):
        TuneConfig(base(), [{}], site_settings={"budget": 1.0})


def test_a_task_without_validation_data_is_refused(tmp_path):
    config = TuneConfig(FederationConfig(num_public=100), [{}], out_dir=str(tmp_path / "t"))
    with pytest.raises(ConfigError, match=r"--site-validation .*never selects on the test"):
        tune(config)
    assert not (tmp_path / "t").exists()


def test_a_folder_holding_another_run_is_refused_as_a_tunings_out_and_left_as_it_was(tmp_path):
    """A simulation's run directory as --out: its site ledgers would have counted as the
    tuning's spending, and the tuning's files would have mixed with the run's."""
    out = tmp_path / "run"
    (out / "sites").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    config = TuneConfig(base(), [{}, {"server-lr": 2.0}], out_dir=str(out))
    with pytest.raises(ConfigError, match=r"run is not empty \(metrics.jsonl\) and holds no"):
        tune(config)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "sites"]
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        tune(replace(config, out_dir=str(tmp_path / "file")))


# Digits has no validation split at the server: the sites score on examples they hold out.
NO_VALIDATION = dict(BASE, task="digits", num_sites=2, rounds=1, noise_seed=3)


@pytest.mark.slow  # two trials, in process (~4 s)
def test_without_server_validation_the_sites_noised_counts_choose_and_are_accounted(tmp_path):
    """Real simulations: each trial's final model is scored by the sites' noised counts on
    their held-out examples; each site's ledger records one score per trial beside the
    trial's rounds, and the plan's composition (scores included) is what the ledgers hold."""
    score = SiteScore(0.2, 2.0)
    config = TuneConfig(
        FederationConfig(**NO_VALIDATION),
        [{"server-lr": 0.01}, {"server-lr": 2.0}],
        target_epsilon=6.0,
        out_dir=str(tmp_path / "tune"),
        site_score=score,
        reference=True,
    )
    result = tune(config, simulate_options={"engine": "in-process"})
    assert [t.status for t in result.trials] == ["finished", "finished"]
    # the reference scores on the same held-out examples, exactly (outside the guarantee)
    assert result.reference["chosen"]["candidate"] == 2
    assert all(r["finished"] for r in result.reference["runs"])
    assert result.chosen.candidate == 2  # a step size of 0.01 barely moves the model
    assert result.trials[1].validation_score > result.trials[0].validation_score + 0.2
    epsilon = result.per_trial_epsilon
    planner = TrialPlanner(config)
    planned = [e for i in (0, 1) for e in planner.trial(i, epsilon)[1]]
    assert sum(e.mechanism == "site-score" for e in planned) == 2
    for site in ("site-0", "site-1"):
        ledger = PrivacyLedger.load_keyed(tmp_path / "tune" / "sites" / site / "ledger.json")
        scores = [e for e in ledger.events if e.mechanism == "site-score"]
        assert [e.accounting_noise_multiplier for e in scores] == [2.0 / 2**0.5] * 2
        assert ledger.epsilon() == pytest.approx(epsilon_rdp(planned, 1e-5))
        assert ledger.epsilon() <= 6.0
    assert result.model_path.name == "model.pt"
    text = (tmp_path / "tune" / "tune.md").read_text()
    assert "sites' noised per-class counts on the 0.2 of their examples" in text
    saved = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert saved["settings"]["site_score"] == {"fraction": 0.2, "noise_std": 2.0}


@pytest.mark.slow  # a tuning in process (~3 s)
def test_a_site_refuses_a_trial_whose_score_its_budget_cannot_hold_before_spending(tmp_path):
    """A site whose budget holds a trial's rounds but not its score: every round config
    says a score will be asked, so the site plans it with the rounds and refuses the trial
    from its first round; nothing is spent, and the trial is refused, the site named."""
    score = SiteScore(0.2, 2.0)
    config = TuneConfig(
        FederationConfig(**NO_VALIDATION),
        [{"server-lr": 2.0}],
        target_epsilon=6.0,
        out_dir=str(tmp_path / "tune"),
        site_score=score,
    )
    epsilon, composed = calibrate_trial_epsilon(config, config.plan())
    assert epsilon < 6.0 and composed <= 6.0  # one trial: its rounds and its score within 6
    rounds = [e for e in TrialPlanner(config).trial(0, epsilon)[1] if e.mechanism != "site-score"]
    config = replace(config, site_settings={"epsilon-budget": epsilon_rdp(rounds, 1e-5) + 1e-3})
    result = tune(config, simulate_options={"engine": "in-process"})
    assert result.trials[0].status == "refused" and result.chosen is None
    assert result.trials[0].refused_by == {
        "site-0": "over budget in round(s) 1",
        "site-1": "over budget in round(s) 1",
    }
    ledger = PrivacyLedger.load_keyed(tmp_path / "tune" / "sites" / "site-0" / "ledger.json")
    assert not ledger.events and ledger.epsilon() == 0


@pytest.mark.slow  # K trials in process (~5 s)
def test_a_random_number_of_trials_scored_by_the_sites_is_one_selection_whose_runs_hold_their_score(
    tmp_path,
):
    """Central mode, a logarithmic K (seeded here), no server validation: the published
    choice's figure is the selection whose run is a trial's rounds and its score, equal to
    dp-accounting's RepeatAndSelectDpEvent of that run and to the independent Papernot &
    Steinke figure over the candidates' curves (rounds and score); every site's ledger holds
    every trial's rounds and score (the other sites see them all), within its own budget,
    here larger than the search's total; each trial's own ledgers at the sites hold its
    rounds and one score, under the selection's bound of one trial; the sites' noised counts
    choose."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    from gep_fed.accounting.events import RDP_ORDERS, Selection

    score = SiteScore(0.2, 2.0)
    config = TuneConfig(
        FederationConfig(**{**NO_VALIDATION, "mode": "central"}),
        [{"server-lr": 0.01}, {"server-lr": 2.0}],
        random_trials=logarithmic(2.0),
        target_epsilon=8.0,
        out_dir=str(tmp_path / "tune"),
        site_score=score,
        site_settings={"epsilon-budget": 100.0},
    )
    selection = config.selection
    assert selection == Selection(selection.mean, 0.0, 2.0 / 2**0.5)
    assert selection.mean == pytest.approx(2.0)
    rng = random.Random(5)
    plan = config.plan(random.Random(5))
    assert len(plan) >= 2 and set(plan) == {0, 1}  # this seed runs both candidates
    result = tune(config, rng=rng, simulate_options={"engine": "in-process"})
    assert [t.status for t in result.trials] == ["finished"] * len(plan)
    epsilon = result.per_trial_epsilon
    planner = TrialPlanner(config)
    event = planner.selection_event(epsilon)
    rounds = replace(event, selection=None)
    accountant = rdp_lib.RdpAccountant(list(RDP_ORDERS))
    run = dp_event.ComposedDpEvent(
        [rounds.dp_event(), dp_event.GaussianDpEvent(score.event().accounting_noise_multiplier)]
    )
    accountant.compose(dp_event.RepeatAndSelectDpEvent(run, selection.mean, 0.0))
    independent = independent_selection_epsilon(config, epsilon)  # its curves hold the scores
    published = result.planned_epsilon_rdp
    assert published == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    # one candidate's rounds ride on the other's (same rounds, sigma): the bound is exact
    assert published == pytest.approx(independent, rel=1e-6) and published <= 8.0
    without = TuneConfig(config.base, config.candidates, random_trials=logarithmic(2.0))
    assert published > epsilon_rdp([TrialPlanner(without).selection_event(epsilon)], 1e-5)
    saved = json.loads((tmp_path / "tune" / "tune.json").read_text())["procedure_epsilon"]
    assert saved["published_choice_rdp"] == pytest.approx(published)
    every_trial = [e for t in result.trials for e in planner.trial(t.candidate - 1, epsilon)[1]]
    for site in ("site-0", "site-1"):
        ledger = PrivacyLedger.load_keyed(tmp_path / "tune" / "sites" / site / "ledger.json")
        assert not any(e.selection for e in ledger.events)  # every trial's rounds and score
        assert [e.mechanism for e in ledger.events].count("site-score") == len(plan)
        assert ledger.epsilon() == pytest.approx(epsilon_rdp(every_trial, 1e-5), rel=1e-9)
    site_ledger = tmp_path / "tune" / "sites" / "site-0" / "ledger.json"
    search_id = (tmp_path / "tune" / SEARCH_ID).read_text()
    run_bound = trial_run_curve(replace(event, party="site-0"))
    for trial in result.trials:  # each trial's own ledgers: its rounds and one score
        path = selection_folder(site_ledger, search_id) / f"trial-{trial.trial:03d}.json"
        key = read_ledger_key(default_key_path(site_ledger))
        ledger = PrivacyLedger.load(path, key, path.with_suffix(".mark"))
        assert [e.mechanism for e in ledger.events][-1] == "site-score"
        assert np.all(rdp_curve(ledger.events) <= run_bound * (1 + 1e-9))
        assert ledger.epsilon() == pytest.approx(
            epsilon_rdp(planner.trial(trial.candidate - 1, epsilon)[1], 1e-5)
        )
    assert result.chosen.candidate == 2  # a step size of 0.01 barely moves the model
    text = (tmp_path / "tune" / "tune.md").read_text()
    assert "each run of the selection ends with it" in text


def test_central_modes_estimate_divides_by_the_examples_the_sites_train_on():
    from gep_fed.flower.tuning import _trained_examples

    fed = FederationConfig(**{**NO_VALIDATION, "mode": "central"})
    pooled = len(fed.make_task().train_dataset())
    assert _trained_examples(fed, {"validation-fraction": 0.2}, {}) == round(0.8 * pooled)
    assert _trained_examples(fed, {}, {}) == pooled


def test_site_scores_of_a_multilabel_task_are_refused_before_anything_runs(tmp_path):
    fed = FederationConfig(**{**NO_VALIDATION, "task": "example_task:TwoFindingsTask"})
    config = TuneConfig(fed, [{}], out_dir=str(tmp_path / "t"), site_score=SiteScore(0.2, 2.0))
    with pytest.raises(ConfigError, match=r"is multilabel.*multiclass or binary"):
        tune(config)
    assert not (tmp_path / "t").exists()


def test_site_scores_need_both_options_and_the_tunings_own_keys():
    for key in ("validation-fraction", "score-noise"):  # the tuning's, from SiteScore
        with pytest.raises(ConfigError, match=f"site setting '{key}'"):
            TuneConfig(base(), [{}], site_settings={key: 0.2})
    from gep_fed.cli.tune import site_score

    both = argparse.Namespace(site_validation=0.2, score_noise=2.0)
    assert site_score(both) == SiteScore(0.2, 2.0)
    assert site_score(argparse.Namespace(site_validation=None, score_noise=None)) is None
    with pytest.raises(ConfigError, match="--site-validation and --score-noise go together"):
        site_score(argparse.Namespace(site_validation=0.2, score_noise=None))


def per_trial(simulate):
    """A stand-in for ``search.simulate_search`` that runs each trial with ``simulate`` (a
    stand-in for one trial's run), in order, until ``on_trial`` stops the search."""

    def simulate_search(specs, on_trial, **options):
        for spec in specs:
            scored = {"score_sites": True} if spec.score_sites else {}
            sites = dict(spec.site_settings) or None
            sim = simulate(spec.fed, site_settings=sites, **options, **scored)
            if not on_trial(spec, sim):
                return

    return simulate_search


def canned_simulate(scores: dict[float, float], calls: list):
    """A stand-in for ``simulate``: validation scores by server_lr, a test score that would
    pick another candidate (it must never be used to choose)."""

    def fake(fed, progress=True, site_settings=None, **options):
        calls.append((fed, site_settings))
        run = RunDirectory(fed.run_directory(""))
        if run.path.exists():  # a resumed tuning's finished run: simulate trains nothing
            return SimulationResult(run.path, run.read_metrics(), None, 0.0, {})
        run.path.mkdir(parents=True)
        val = scores[fed.server_lr]
        rows = []
        for r in range(1, fed.rounds + 1):
            row = {"round": r, "applied": True, "sites_ok": fed.num_sites}
            row.update(val_balanced_accuracy=val * r / fed.rounds, val_accuracy=0.99)
            row.update(test_accuracy=1 - val, test_balanced_accuracy=1 - val + r / 100)
            run.append_metrics(row)
            rows.append(row)
        run.file("best_model.pt").write_bytes(b"model")
        return SimulationResult(run.path, rows, None, 0.0, {})

    return fake


# Validation scores by server step size (canned_simulate); the middle one is best.
THREE_SCORES = {0.5: 0.6, 2.0: 0.8, 4.0: 0.7}


def three_step_sizes(out: Path) -> TuneConfig:
    """Four trials drawn among three step sizes, total epsilon 3, with the reference."""
    return TuneConfig(
        base(),
        [{"server-lr": lr} for lr in THREE_SCORES],
        trials=4,
        target_epsilon=3.0,
        reference=True,
        out_dir=str(out),
    )


def test_tune_chooses_the_best_validation_score_and_reports_every_trial(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(search, "simulate_search", per_trial(canned_simulate(THREE_SCORES, calls)))
    config = three_step_sizes(tmp_path / "tune")
    lines = []
    result = tune(config, rng=random.Random(5), log=lines.append)
    plan = config.plan(random.Random(5))
    assert result.plan == tuple(i + 1 for i in plan)
    assert [t.candidate for t in result.trials] == list(result.plan)
    assert all(t.status == "finished" for t in result.trials)
    best = max(result.trials, key=lambda t: (t.validation_score, -t.trial))
    assert result.chosen == best and result.chosen.best_round == 2
    assert result.chosen.validation_score == THREE_SCORES[result.chosen.settings["server_lr"]]
    assert result.model_path == Path(result.chosen.run_dir) / "best_model.pt"
    # the chosen run's test metrics at its best round, and only the chosen one's
    assert result.test_metrics["balanced_accuracy"] == pytest.approx(
        1 - result.chosen.validation_score + 0.02
    )
    # every trial ran at the calibrated budget, with the sites' ledgers in one folder
    trial_calls = [c for c in calls if c[1] is not None]
    assert len(trial_calls) == 4
    for fed, sites in trial_calls:
        assert fed.target_epsilon == pytest.approx(result.per_trial_epsilon)
        assert sites["ledger-dir"] == str(tmp_path / "tune" / "sites")
        assert sites["epsilon-budget"] == 3.0 and sites["delta"] == 1e-5
    assert 3.0 - 1e-3 <= result.planned_epsilon_rdp <= 3.0
    # the reference: every candidate once at the whole budget, own ledgers, labelled
    reference_calls = [c for c in calls if c[1] is None]
    assert [c[0].target_epsilon for c in reference_calls] == [3.0, 3.0, 3.0]
    assert result.reference["label"] == OUTSIDE and result.reference["chosen"]["candidate"] == 2
    saved = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert [t["status"] for t in saved["trials"]] == ["finished"] * 4
    assert saved["chosen"]["candidate"] == result.chosen.candidate
    assert not [k for t in saved["trials"] for k in t if "test" in k]  # no test figures
    text = (tmp_path / "tune" / "tune.md").read_text()
    assert "**Chosen**: trial" in text and f"## Non-private reference ({OUTSIDE})" in text
    assert len([x for x in lines if x.startswith("trial ")]) == 4
    with pytest.raises(ConfigError, match="holds an earlier tuning"):
        tune(config)


def test_a_candidates_file_names_its_bad_tables(tmp_path):
    good = tmp_path / "c.toml"
    good.write_text(
        '[base]\nrounds = 2\n\n[[candidate]]\nserver-lr = 2\n\n[[candidate]]\nmodel = "mlp"\n'
    )
    assert candidates_from_toml(good) == ({"rounds": 2}, [{"server-lr": 2}, {"model": "mlp"}])
    bad = tmp_path / "bad.toml"
    bad.write_text("[[candidates]]\nserver-lr = 2\n")
    with pytest.raises(ConfigError, match=r"unknown table\(s\) \['candidates'\]"):
        candidates_from_toml(bad)
    bad.write_text("[base]\nrounds = 2\n")
    with pytest.raises(ConfigError, match=r"declares no \[\[candidate\]\] table"):
        candidates_from_toml(bad)
    bad.write_text("[[candidate]\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        candidates_from_toml(bad)


@pytest.mark.slow
def test_a_site_refuses_a_trial_beyond_its_budget_mid_search_and_its_ledger_is_intact(tmp_path):
    """Real simulations (two sites, two rounds a trial): each site's budget holds one trial
    and a half, so both refuse the second trial from its first round (its last round is out
    of reach) to its end, though its last round alone would fit; the search stops there,
    the third never runs, and each ledger holds exactly the first trial's releases."""
    fed = base(num_sites=2, rounds=2, noise_seed=3)
    config = TuneConfig(
        fed,
        [{"server-lr": 0.5}, {"server-lr": 1.0}, {"server-lr": 2.0}],
        target_epsilon=3.0,
        out_dir=str(tmp_path / "tune"),
    )
    epsilon, _ = calibrate_trial_epsilon(config, config.plan())
    planner = TrialPlanner(config)
    one = planner.trial(0, epsilon)[1]
    and_a_half = one + one[: len(one) // 2]
    budget = (epsilon_rdp(and_a_half, 1e-5) + epsilon_rdp(one * 2, 1e-5)) / 2
    config = TuneConfig(
        fed,
        config.candidates,
        target_epsilon=3.0,
        out_dir=str(tmp_path / "tune"),
        site_settings={"epsilon-budget": budget},
    )
    result = tune(config, simulate_options={"engine": "in-process"})
    assert [t.status for t in result.trials] == ["finished", "refused"]
    refused = result.trials[1]
    assert refused.refused_by == {
        "site-0": "over budget in round(s) 1-2",
        "site-1": "over budget in round(s) 1-2",
    }
    assert "trial 2 (candidate 2) refused by site-0" in result.stopped
    assert result.chosen.trial == 1 and result.model_path.exists()
    for site in ("site-0", "site-1"):
        ledger = PrivacyLedger.load_keyed(tmp_path / "tune" / "sites" / site / "ledger.json")
        assert ledger.steps == sum(e.steps for e in one) == 4
        assert ledger.epsilon() == pytest.approx(epsilon_rdp(one, 1e-5))
        assert ledger.budget_epsilon == pytest.approx(budget)
        assert result.site_epsilons[site]["steps"] == 4
    assert result.epsilon_rdp == pytest.approx(epsilon_rdp(one, 1e-5))
    saved = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert [t["status"] for t in saved["trials"]] == ["finished", "refused"]
    assert "**Stopped early**: trial 2" in (tmp_path / "tune" / "tune.md").read_text()


def two_candidates_file(tmp_path: Path, more_base: str = "") -> Path:
    """A candidates file: server-lr 1 (an int, as TOML reads it) and 3, over a small base."""
    path = tmp_path / "candidates.toml"
    path.write_text(
        "[base]\nnum-public = 100\nnum-basis = 8\nrounds = 2\nsample-rate = 1.0\n"
        f"{more_base}\n[[candidate]]\nserver-lr = 1\n\n[[candidate]]\nserver_lr = 3\n"
    )
    return path


def test_the_command_line_tunes_from_a_candidates_file(tmp_path, monkeypatch, capsys):
    from gep_fed.cli.main import main

    calls = []
    monkeypatch.setattr(
        search, "simulate_search", per_trial(canned_simulate({1.0: 0.5, 3.0: 0.9}, calls))
    )
    path = two_candidates_file(tmp_path, "local-steps = 2\n")
    out = tmp_path / "tune"
    args = ["tune", "--task", TASK, "--candidates", str(path), "--epsilon", "2", "--out"]
    assert main([*args, str(out)]) == 0
    printed = capsys.readouterr().out
    assert "trial 1/2: candidate 1 (server-lr=1)" in printed
    assert "chosen: candidate 2 (server-lr=3)" in printed and "; trial 2\n" in printed
    assert f"report:           {out / 'tune.md'}" in printed
    assert [c[0].server_lr for c in calls] == [1.0, 3.0]  # ints read as the float fields
    # a bad candidate names its index; a failure is one line and a non-zero exit
    path.write_text("[[candidate]]\nserver-lr = 1\n\n[[candidate]]\nclip-norm = -1\n")
    assert main([*args, str(tmp_path / "t2")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("gep-fed tune: error: candidate 2: ") and "clip_norm" in line
    path.write_text("[base]\nrounds = 0\n[[candidate]]\nserver-lr = 1\n")
    assert main([*args, str(tmp_path / "t3")]) == 2
    assert "[base]: rounds" in capsys.readouterr().err


def test_the_command_line_fails_when_no_trial_finished(tmp_path, monkeypatch, capsys):
    from gep_fed.cli.main import main

    def failing(fed, progress=True, site_settings=None, **options):
        run = RunDirectory(fed.run_directory(""))
        run.path.mkdir(parents=True)
        rows = [{"round": 1, "applied": False, "sites_ok": 0, "val_accuracy": 0.1}]
        return SimulationResult(run.path, rows, None, 0.0, {})

    monkeypatch.setattr(search, "simulate_search", per_trial(failing))
    path = tmp_path / "candidates.toml"
    path.write_text("[base]\nnum-public = 100\nrounds = 1\nsample-rate = 1.0\n[[candidate]]\n")
    args = ["tune", "--task", TASK, "--candidates", str(path), "--out", str(tmp_path / "t")]
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["FAILED: no trial finished: every trial failed (see tune.md)"]
    assert (
        "failed: the model was not updated in round(s) 1"
        in (tmp_path / "t" / "tune.md").read_text()
    )


@pytest.mark.slow
def test_the_task_guides_first_run_tunes_the_hospital_example(tmp_path, monkeypatch, capsys):
    """docs/tasks.md's first run, as written, on the worked example: three hospitals' PNG
    folders of 60 PneumoniaMNIST images each, 2 rounds a run, its three candidates (two
    models) rehearsed on the server's validation data, and the chosen one alone run at the
    hospitals in a Flower simulation on Ray."""
    import re
    import tomllib

    import numpy as np
    from conftest import SHARED_DATA, shared_file
    from PIL import Image

    from gep_fed.cli.main import main

    data = np.load(shared_file("medmnist/pneumoniamnist.npz"))
    images, labels = data["train_images"], data["train_labels"].ravel()
    sites = []
    for n, site in enumerate(("hospital-a", "hospital-b", "hospital-c")):
        for i in range(60 * n, 60 * (n + 1)):
            folder = tmp_path / site / ("normal", "pneumonia")[labels[i]]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[i]).save(folder / f"{i}.png")
        sites += ["--site-data", f"{site}={tmp_path / site}"]
    root = Path(__file__).parents[1]
    guide = (root / "docs" / "tasks.md").read_text()
    section = guide.split("## Your first run")[1].split("\n## ")[0]
    (command,) = re.findall(r"```bash\n(gep-fed tune .*?)```", section, re.S)
    args = command.replace("\\\n", " ").split()[1:]
    assert args[args.index("--task") + 1] == "examples/hospital/task.py:ChestXrayFolders"
    declared = root / args[args.index("--candidates") + 1]
    table = tomllib.loads(declared.read_text())
    models = [c["model"] for c in table["candidate"]]
    assert models == ["scatter-linear", "scatter-linear", "public-pretrained"]
    small = tmp_path / "candidates.toml"  # the same candidates, 2 rounds and 100 anchors
    small.write_text(
        declared.read_text()
        .replace("rounds = 40", "rounds = 2")
        .replace(
            "[base]\n",
            f'[base]\nnum-public = 100\nnum-anchors = 100\ndata-dir = "{SHARED_DATA}"\n',
        )
    )
    args[args.index("--candidates") + 1] = str(small)
    monkeypatch.chdir(root)
    out = tmp_path / "tune"
    command = [*args, *sites, "--out", str(out)]  # as written: the Simulation Engine (Ray)
    assert main(command) == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    for n in (1, 2, 3):
        for fold in (1, 2):
            assert f"rehearsal: candidate {n}, fold {fold}/2: score" in printed
    saved = json.loads((out / "tune.json").read_text())
    chosen = saved["rehearsal"]["chosen"]
    assert saved["rehearsal"]["sites"] == 3 and saved["rehearsal"]["sites_examples"] == 180
    assert f"trial 1/1: candidate {chosen}" in printed
    assert [(t["candidate"], t["status"]) for t in saved["trials"]] == [(chosen, "finished")]
    assert set(saved["sites"]) == {"hospital-a", "hospital-b", "hospital-c"}
    assert saved["total_epsilon"] == 8 and 7.9 < saved["procedure_epsilon"]["rdp"] <= 8
    assert all(site["steps"] == 2 for site in saved["sites"].values())  # one run of 2 rounds


# -- a random number of trials (Papernot & Steinke), central mode --------------------------


def geometric(mean: float):
    from gep_fed.accounting.selection import TruncatedNegativeBinomial

    return TruncatedNegativeBinomial.from_mean(1.0, mean)


def logarithmic(mean: float):
    from gep_fed.accounting.selection import TruncatedNegativeBinomial

    return TruncatedNegativeBinomial.from_mean(0.0, mean)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(mode="client"), "in client mode the server sees every trial's releases"),
        (dict(mode="distributed"), "in distributed mode the server sees every trial"),
        (dict(mode="central", trials=3), "either trials .* or random_trials, not both"),
        (dict(mode="central", law="tnb-0.5"), "a TNB of eta >= 0"),
        (dict(mode="central", law=3), "random_trials must be a TruncatedNegativeBinomial"),
        # K = 0 would reach no site: the sites would record only selections of K >= 1
        (dict(mode="central", law="poisson"), "a Poisson number of trials may draw K = 0"),
    ],
)
def test_a_random_number_of_trials_is_refused_where_its_bound_would_not_hold(settings, message):
    from gep_fed.accounting.selection import TruncatedNegativeBinomial

    law = settings.get("law", geometric(3.0))
    if law == "tnb-0.5":
        law = TruncatedNegativeBinomial(-0.5, 0.5)
    if law == "poisson":
        law = PoissonTrials(2.0)
    with pytest.raises(ConfigError, match=message):
        TuneConfig(
            base(mode=settings["mode"]),
            [{}, {"server-lr": 2.0}],
            trials=settings.get("trials"),
            random_trials=law,
        )


def independent_selection_epsilon(config: TuneConfig, epsilon: float) -> float:
    """Papernot & Steinke over the candidates' own curves at per-trial budget ``epsilon``,
    by ``gep_fed.accounting.selection`` (the formulas of ours, not dp-accounting's)."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    from gep_fed.accounting.events import RDP_ORDERS
    from gep_fed.accounting.selection import random_search_rdp, selection_rdp

    planner = TrialPlanner(config)
    curves = [planner.trial(i, epsilon)[1] for i in range(len(config.candidates))]
    exact = selection_rdp(random_search_rdp(curves), RDP_ORDERS, config.random_trials)
    return compute_epsilon(RDP_ORDERS, exact, config.total_delta)[0]


def test_a_random_number_of_trials_is_one_selection_that_every_round_config_carries(
    tmp_path, monkeypatch
):
    """Central mode, K ~ logarithmic of mean 3 (seeded here; the OS draws it in real use):
    the search runs the K trials drawn, each at the per-trial budget, with the sites' one
    ledger each and their whole budget; every trial's round configs carry the selection's
    terms for the sites to record (tests/test_site_selection.py): the search's one id, the
    trial, and the whole selection as one event (dp-accounting's RepeatAndSelectDpEvent),
    equal to the independent Papernot & Steinke computation over the candidates' curves."""

    from gep_fed.accounting.selection import TruncatedNegativeBinomial
    from gep_fed.federation.wire import SelectionTerms

    calls, specs = [], []
    trials = per_trial(canned_simulate({0.5: 0.6, 2.0: 0.8}, calls))
    monkeypatch.setattr(
        search,
        "simulate_search",
        lambda given, on_trial, **options: specs.extend(given) or trials(given, on_trial),
    )
    config = TuneConfig(
        base(mode="central", rounds=4),
        [{"server-lr": 0.5}, {"server-lr": 2.0, "mechanism": "gp"}],
        random_trials=TruncatedNegativeBinomial.from_mean(0.0, 3.0),
        target_epsilon=4.0,
        out_dir=str(tmp_path / "tune"),
    )
    result = tune(config, rng=random.Random(11))
    plan = config.plan(random.Random(11))
    assert result.plan == tuple(i + 1 for i in plan) and len(plan) == len(calls) >= 1
    for fed, sites in calls:  # each trial at the per-trial budget, the sites' own ledgers
        assert fed.target_epsilon == pytest.approx(result.per_trial_epsilon)
        assert sites["epsilon-budget"] == 4.0
        assert sites["ledger-dir"] == str(tmp_path / "tune" / "sites")
    assert 4.0 - 1e-3 <= result.planned_epsilon_rdp <= 4.0
    independent = independent_selection_epsilon(config, result.per_trial_epsilon)
    search_id = (tmp_path / "tune" / SEARCH_ID).read_text()
    for spec in specs:
        terms = SelectionTerms.from_json(spec.selection)
        assert (terms.search, terms.trial) == (search_id, spec.number)
        assert terms.event.selection == config.selection
        assert epsilon_rdp([terms.event], 1e-5) == pytest.approx(independent, abs=1e-6)
        assert epsilon_rdp([terms.event], 1e-5) == pytest.approx(result.planned_epsilon_rdp)
        assert math.isnan(epsilon_pld([terms.event], 1e-5))  # no PLD for a selection
    # three trials composed would each get less (2.16 against 2.81)
    fixed = TuneConfig(config.base, config.candidates, trials=3, target_epsilon=4.0)
    assert result.per_trial_epsilon > calibrate_trial_epsilon(fixed, fixed.plan())[0] + 0.1
    saved = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert saved["selection"]["distribution"] == "truncated-negative-binomial"
    assert saved["selection"]["shape"] == 0.0
    assert "the other sites, which saw every trial's rounds" in saved["procedure_epsilon"]["covers"]
    assert "trusted server publishes" in saved["procedure_epsilon"]["published_choice_covers"]
    assert saved["procedure_epsilon"]["published_choice_rdp"] == result.planned_epsilon_rdp
    text = (tmp_path / "tune" / "tune.md").read_text()
    assert f"**The trusted server's record, {OUTSIDE} if published.**" in text


def test_candidates_of_different_lengths_are_bounded_by_their_worst_release_repeated():
    """One repeated release bounds every candidate's trial (checked on each curve): above the
    exact random-search figure when candidates differ in rounds, never below it."""
    config = TuneConfig(
        base(mode="central", rounds=4),
        [{"server-lr": 0.5}, {"rounds": 3, "mechanism": "gp"}],
        random_trials=geometric(3.0),
        target_epsilon=4.0,
    )
    epsilon, selected = calibrate_selection_epsilon(config)
    assert 4.0 - 1e-3 <= selected <= 4.0
    assert independent_selection_epsilon(config, epsilon) < selected - 0.1


def test_a_site_records_every_trial_of_a_random_search_and_refuses_those_beyond_its_budget(
    tmp_path,
):
    """The other sites see every trial's rounds, so each site's ledger composes every trial
    it took part in, against its own budget (the search's total of 4 by default): with K >= 3
    drawn, a later trial is refused by every site, named, and the published choice's
    figure, which assumes K unhindered runs, is said not to hold."""
    seed = next(s for s in range(200) if geometric(3.0).sample(random.Random(s)) >= 3)
    config = TuneConfig(
        base(mode="central"),
        [{"server-lr": 0.5}],
        random_trials=geometric(3.0),
        target_epsilon=4.0,
        out_dir=str(tmp_path / "tune"),
    )
    result = tune(config, rng=random.Random(seed), simulate_options={"engine": "in-process"})
    statuses = [t.status for t in result.trials]
    assert statuses[0] == "finished" and statuses[-1] == "refused" and "refused" in result.stopped
    assert all("over budget" in why for why in result.trials[-1].refused_by.values())
    finished = statuses.count("finished")
    for site in ("site-0", "site-1", "site-2"):
        ledger = PrivacyLedger.load_keyed(tmp_path / "tune" / "sites" / site / "ledger.json")
        assert ledger.steps == finished * config.base.rounds and ledger.epsilon() <= 4.0
    assert result.epsilon_rdp == pytest.approx(ledger.epsilon())
    printed = "\n".join(result_lines(result))
    assert "the published choice's figure does not hold" in printed
    text = (tmp_path / "tune" / "tune.md").read_text()
    assert "The published choice's figure does not hold" in text


def test_the_command_line_draws_a_random_number_of_trials_in_central_mode_only(
    tmp_path, monkeypatch, capsys
):
    from gep_fed.cli.main import main

    calls = []
    monkeypatch.setattr(
        search, "simulate_search", per_trial(canned_simulate({1.0: 0.5, 3.0: 0.9}, calls))
    )
    path = two_candidates_file(tmp_path)
    args = ["tune", "--task", TASK, "--candidates", str(path), "--epsilon", "4"]
    args += ["--random-trials", "2", "--trials-law", "logarithmic"]
    assert main([*args, "--mode", "central", "--out", str(tmp_path / "t")]) == 0
    printed = capsys.readouterr().out
    assert "a random number of trials (logarithmic, mean 2) of 2 candidate(s)" in printed
    # (no site ran here: the sites' composition is theirs; the published choice's figure)
    assert "each site's own ledger records every trial it took part in" in printed
    assert "epsilon of the published choice alone (Papernot & Steinke" in printed
    # the chosen trial's number tells K >= it, which the bound does not cover
    assert re.search(r"; trial \d+ \(OUTSIDE THE GUARANTEE if published\)\n", printed)
    assert "chosen: trial" not in printed
    assert main([*args, "--mode", "client", "--out", str(tmp_path / "t2")]) == 2
    assert "in client mode the server sees every trial" in capsys.readouterr().err
    assert main([*args[:-4], "--random-trials", "0.5", "--out", str(tmp_path / "t3")]) == 2
    assert "--random-trials must be a mean number of trials >= 1" in capsys.readouterr().err


def interrupting(fake, at_call: int, calls: list):
    """``fake`` that stops (as Ctrl-C does, after round 1) at its ``at_call``-th call, once."""
    from gep_fed.flower.interrupt import RunInterrupted

    state = {"calls": 0}

    def simulate(fed, progress=True, site_settings=None, **options):
        state["calls"] += 1
        if state["calls"] == at_call:
            calls.append((fed, site_settings))
            raise RunInterrupted(1)
        return fake(fed, progress, site_settings, **options)

    return simulate


def test_an_interrupted_tuning_resumes_its_own_plan_from_the_trial_it_stopped_in(
    tmp_path, monkeypatch
):
    calls = []
    fake = canned_simulate(THREE_SCORES, calls)
    monkeypatch.setattr(search, "simulate_search", per_trial(interrupting(fake, 3, calls)))
    out = tmp_path / "tune"
    config = three_step_sizes(out)
    with pytest.raises(TuneInterrupted) as stop:
        tune(config, rng=random.Random(5))
    assert stop.value.line() == (
        f"tune interrupted in trial 3 of 4 (after its round 1): rerun the same command with "
        f"--out {out} to resume"
    )
    saved = json.loads((out / "tune.json").read_text())
    assert saved["complete"] is False and len(saved["trials"]) == 2
    assert "**Not finished**" in (out / "tune.md").read_text()
    # other settings do not resume it
    with pytest.raises(ConfigError, match=r"other settings \(target_epsilon differ\)"):
        tune(replace(config, target_epsilon=2.0))
    # the same settings resume it: the plan on disk (not a new draw), from trial 3; and
    # once more from the reference's second candidate
    monkeypatch.setattr(search, "simulate_search", per_trial(interrupting(fake, 4, calls)))
    with pytest.raises(TuneInterrupted, match="in the reference's candidate 2 of 3"):
        tune(config, rng=random.Random(99))
    result = tune(config, rng=random.Random(99))
    assert (
        result.plan == tuple(saved["plan"]) == tuple(i + 1 for i in config.plan(random.Random(5)))
    )
    runs = [f"trial-00{n}" for n in (1, 2, 3, 3, 4)] + [f"candidate-00{n}" for n in (1, 2, 1, 2, 3)]
    assert [c[0].run_name for c in calls] == runs
    assert [t.trial for t in result.trials] == [1, 2, 3, 4] and result.complete
    assert json.loads((out / "tune.json").read_text())["complete"] is True
    with pytest.raises(ConfigError, match="holds an earlier tuning"):
        tune(config)


def test_a_resumed_random_search_is_recorded_once_and_its_trials_rounds_once(tmp_path, monkeypatch):
    """Ctrl-C in the second trial's first round; the rerun resumes the plan on disk (the OS
    would draw a new K) under the same search id: each site's ledger holds each trial's
    rounds once (its budget larger than the search's total here), and each trial's own
    ledger each of its rounds once."""
    import os
    import signal

    from gep_fed.federation import wire
    from gep_fed.flower import clientapp

    seed = next(s for s in range(100) if geometric(3.0).sample(random.Random(s)) >= 2)
    config = TuneConfig(
        base(mode="central"),
        [{"server-lr": 0.5}, {"server-lr": 2.0}],
        random_trials=geometric(3.0),
        target_epsilon=4.0,
        out_dir=str(tmp_path / "tune"),
        site_settings={"epsilon-budget": 100.0},
    )
    rounds, handle, sent = config.base.rounds, clientapp.handle_train, []

    def interrupting(msg, context, *args):
        record = msg.content.config_records.get(wire.ROUND_CONFIG)
        if record is not None and record["round"] == rounds + 1 and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: a stop request
        return handle(msg, context, *args)

    monkeypatch.setattr(clientapp, "handle_train", interrupting)
    options = {"engine": "in-process"}
    with pytest.raises(TuneInterrupted, match="in trial 2 of"):
        tune(config, rng=random.Random(seed), simulate_options=options)
    result = tune(config, simulate_options=options)
    assert result.plan == tuple(i + 1 for i in config.plan(random.Random(seed)))
    assert [t.status for t in result.trials] == ["finished"] * len(result.plan)
    search_id = (tmp_path / "tune" / SEARCH_ID).read_text()
    for site in ("site-0", "site-1", "site-2"):
        ledger = PrivacyLedger.load_keyed(tmp_path / "tune" / "sites" / site / "ledger.json")
        assert ledger.steps == len(result.plan) * rounds  # each round once
        for n in range(1, len(result.plan) + 1):
            path = selection_folder(ledger.path, search_id) / f"trial-{n:03d}.json"
            trial = PrivacyLedger.load(path, ledger.key, path.with_suffix(".mark"))
            # each round once (numbered as the sites were sent it: the rerun is a new run)
            assert len(trial.events) == trial.steps == rounds
