"""Issue 53: a search's trials run as one Flower run (``gep_fed.flower.search``): the sites
see one run whose rounds keep increasing across trials, and check and record each trial as
they do any round."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from gep_fed.accounting.events import epsilon_rdp
from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.federation import wire
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.tuning import TrialPlanner, TuneConfig
from gep_fed.flower import clientapp, search
from gep_fed.flower.search import TrialSpec, simulate_search, trial_rounds
from gep_fed.flower.tuning import tune
from gep_fed.validation import ConfigError

TASK = "tune_task:ValidatedDigits"  # tests/tune_task.py: digits with a validation split
BASE = dict(task=TASK, num_public=100, num_basis=8, rounds=2, local_steps=2, sample_rate=1.0)


def test_each_trial_numbers_its_rounds_after_the_trials_before_it():
    specs = [
        TrialSpec(n, FederationConfig(**{**BASE, "rounds": rounds}))
        for n, rounds in ((1, 2), (2, 3), (3, 1))
    ]
    assert trial_rounds(specs) == [(1, 2), (3, 5), (6, 6)]


def test_a_search_is_one_flower_run_whose_rounds_keep_increasing_at_every_site(
    tmp_path, monkeypatch
):
    """Two trials of two rounds, two sites, one Flower run: the sites are sent rounds 1 to 4
    (a second trial numbered from 1 again would be refused as replayed), each site's record
    gives each trial's own rounds, and its one ledger holds both trials."""
    launches, rounds = [], []
    launch, handle = search.launch, clientapp.handle_train

    def counted_launch(*args):
        launches.append(args)
        return launch(*args)

    def seen(msg, context, *args):
        record = msg.content.config_records.get(wire.ROUND_CONFIG)
        if record is not None:
            rounds.append(record["round"])
        return handle(msg, context, *args)

    monkeypatch.setattr(search, "launch", counted_launch)
    monkeypatch.setattr(clientapp, "handle_train", seen)
    config = TuneConfig(
        FederationConfig(**{**BASE, "num_sites": 2, "noise_seed": 3}),
        [{"server-lr": 0.5}, {"server-lr": 2.0}],
        target_epsilon=4.0,
        out_dir=str(tmp_path / "tune"),
    )
    result = tune(config, simulate_options={"engine": "in-process"})
    assert len(launches) == 1
    assert [t.status for t in result.trials] == ["finished", "finished"]
    assert sorted(rounds) == [1, 1, 2, 2, 3, 3, 4, 4]
    planner, epsilon = TrialPlanner(config), result.per_trial_epsilon
    both = [e for i in (0, 1) for e in planner.trial(i, epsilon)[1]]
    for site in ("site-0", "site-1"):
        folder = tmp_path / "tune" / "sites" / site
        rows = [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]
        assert [(r["trial"], r["round"], r["outcome"]) for r in rows] == [
            (1, 1, "accepted"),
            (1, 2, "accepted"),
            (2, 1, "accepted"),
            (2, 2, "accepted"),
        ]
        ledger = PrivacyLedger.load_keyed(folder / "ledger.json")
        assert ledger.epsilon() == pytest.approx(epsilon_rdp(both, 1e-5))


def test_a_distributed_search_signs_and_masks_each_trials_rounds_apart(tmp_path):
    """Distributed mode: every trial's secure sums run under round numbers of their own in
    the shared run (the sites' signed keys name them, and a site refuses to advertise a key
    for a round it has passed), so both trials apply every round."""
    config = TuneConfig(
        FederationConfig(**{**BASE, "num_sites": 3, "mode": "distributed", "rounds": 1}),
        [{"server-lr": 0.5}, {"server-lr": 2.0}],
        target_epsilon=4.0,
        out_dir=str(tmp_path / "tune"),
    )
    result = tune(config, simulate_options={"engine": "in-process"})
    assert [t.status for t in result.trials] == ["finished", "finished"], result.trials
    for trial in result.trials:
        lines = (Path(trial.run_dir) / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line) for line in lines]
        assert [(m["round"], m["applied"], m["sites_ok"]) for m in metrics] == [(1, True, 3)]


def test_trials_with_different_numbers_of_sites_are_refused_before_any_runs(tmp_path):
    specs = [
        TrialSpec(1, FederationConfig(**{**BASE, "num_sites": 2, "run_dir": str(tmp_path)})),
        TrialSpec(2, FederationConfig(**{**BASE, "num_sites": 3, "run_dir": str(tmp_path)})),
    ]
    ran = []
    with pytest.raises(ConfigError, match="the same number of sites"):
        simulate_search(specs, lambda spec, sim: ran.append(spec) or True, engine="in-process")
    assert ran == [] and not any(tmp_path.iterdir())


def test_an_error_in_a_trial_is_raised_to_the_caller_with_the_trials_before_it_kept(tmp_path):
    """``on_trial`` raising in the ServerApp ends the run; the caller gets that exception,
    not Flower's log line, and the first trial's run directory stays."""
    fed = FederationConfig(**{**BASE, "num_sites": 2, "run_dir": str(tmp_path)})
    specs = [TrialSpec(n, replace(fed, run_name=f"trial-{n}")) for n in (1, 2)]

    def judge(spec, sim):
        raise ValueError(f"cannot judge trial {spec.number}")

    with pytest.raises(ValueError, match="cannot judge trial 1"):
        simulate_search(specs, judge, engine="in-process")
    assert (tmp_path / "trial-1" / "metrics.jsonl").exists()
    assert not (tmp_path / "trial-2").exists()
