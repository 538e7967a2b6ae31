"""Issue 53: a search's trials run as one Flower run (``gep_fed.flower.search``): the sites
see one run whose rounds keep increasing across trials, and check and record each trial as
they do any round."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from tune_task import SMALL_TRIAL, TUNE_TASK

from gep_fed.accounting.events import epsilon_rdp
from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.federation import wire
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.policy import SIMULATED_SITE_DEFAULTS
from gep_fed.federation.tuning import (
    TrialPlanner,
    TuneConfig,
    run_settings,
    search_of_run_config,
)
from gep_fed.flower import clientapp, search
from gep_fed.flower.search import TrialSpec, simulate_search, trial_rounds
from gep_fed.flower.tuning import tune
from gep_fed.validation import ConfigError

TASK, BASE = TUNE_TASK, SMALL_TRIAL  # tests/tune_task.py: digits with a validation split


def test_each_trial_numbers_its_rounds_after_the_trials_before_it():
    specs = [
        TrialSpec(n, FederationConfig(**{**BASE, "rounds": rounds}))
        for n, rounds in ((1, 2), (2, 3), (3, 1))
    ]
    assert trial_rounds(specs) == [(1, 2), (3, 5), (6, 6)]


def two_step_sizes(out) -> TuneConfig:
    """Two trials (server step 0.5 and 2) of two rounds at two sites, total epsilon 4."""
    return TuneConfig(
        FederationConfig(**{**BASE, "num_sites": 2, "noise_seed": 3}),
        [{"server-lr": 0.5}, {"server-lr": 2.0}],
        target_epsilon=4.0,
        out_dir=str(out),
    )


def both_trials(config: TuneConfig, epsilon: float) -> float:
    """The RDP epsilon of the two trials composed, as a site's one ledger should hold them."""
    planner = TrialPlanner(config)
    return epsilon_rdp([e for i in (0, 1) for e in planner.trial(i, epsilon)[1]], 1e-5)


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
    config = two_step_sizes(tmp_path / "tune")
    result = tune(config, simulate_options={"engine": "in-process"})
    assert len(launches) == 1
    assert [t.status for t in result.trials] == ["finished", "finished"]
    assert sorted(rounds) == [1, 1, 2, 2, 3, 3, 4, 4]
    both = both_trials(config, result.per_trial_epsilon)
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
        assert ledger.epsilon() == pytest.approx(both)


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


# -- a search under flwr run: the run config names a candidates file ---------------------------

ROOT = Path(__file__).parents[1]


def candidates_file(tmp_path: Path, site_steps: bool = True) -> Path:
    """Two step sizes over a small base; ``site_steps`` False: without the sites' own steps
    (a central search's base: its mode takes none, and refuses them)."""
    path = tmp_path / "candidates.toml"
    path.write_text(
        "[base]\nnum-public = 100\nnum-basis = 8\nrounds = 2\n"
        + ("local-steps = 2\n" if site_steps else "")
        + "sample-rate = 1.0\nnum-sites = 2\nnoise-seed = 3\n\n"
        "[[candidate]]\nserver-lr = 0.5\n\n[[candidate]]\nserver-lr = 2.0\n"
    )
    return path


def flwr_run_config(overrides: dict) -> dict:
    """The run config ``flwr run . --run-config ...`` gives the apps (Flower's own fusion)."""
    from flwr.common.config import get_fused_config_from_dir

    return get_fused_config_from_dir(ROOT, overrides)


def search_run_config(path: Path, runs: Path) -> dict:
    """A run config naming the candidates file ``path``, total epsilon 4, its run directory
    ``runs/search``."""
    overrides = {"tune-candidates": str(path), "task": TASK, "target-epsilon": 4.0}
    return flwr_run_config({**overrides, "run-dir": str(runs), "run-name": "search"})


def test_flwr_run_and_the_command_line_declare_the_same_search(tmp_path):
    """One path: the run config's keys and ``gep-fed tune``'s options of the same names
    give the same trials, budget and choice rule."""
    from gep_fed.cli.main import build_parser
    from gep_fed.cli.tune import tune_config

    path, runs = candidates_file(tmp_path), str(tmp_path / "runs")
    options = ["--candidates", str(path), "--task", TASK, "--epsilon", "4", "--trials", "3"]
    options += ["--reference", "--site-validation", "0.2", "--score-noise", "2"]
    cli = tune_config(build_parser().parse_args(["tune", *options, "--run-dir", runs]))
    record = flwr_run_config(
        {
            "tune-candidates": str(path),
            "task": TASK,
            "target-epsilon": 4.0,
            "tune-trials": 3,
            "tune-reference": True,
            "tune-site-validation": 0.2,
            "tune-score-noise": 2.0,
            "run-dir": runs,
            "run-name": "search",
        }
    )
    flwr = search_of_run_config(record, 7)
    assert flwr.out_dir == str(tmp_path / "runs" / "search")
    assert (
        (flwr.total_epsilon, flwr.total_delta) == (cli.total_epsilon, cli.total_delta) == (4, 1e-5)
    )
    assert (flwr.num_trials, flwr.reference, flwr.site_score) == (3, True, cli.site_score)
    assert flwr.candidates == cli.candidates
    for index in range(2):  # the run's name aside: the search names every trial's run
        for epsilon in (None, 1.5):
            trials = [c.candidate_config(index, epsilon) for c in (flwr, cli)]
            assert len({replace(t, run_name="") for t in trials}) == 1
    # a simulated site under flwr run builds its task and data as the search's base does
    settings = run_settings(record)
    assert (settings.task, settings.num_public, settings.seed) == (TASK, 100, flwr.base.seed)
    assert settings.run_directory(7) == flwr.out_dir


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"tune-candidates": None, "tune-trials": 3}, r"\['tune-trials'\] need tune-candidates"),
        ({"tune-candidates": 5}, "tune-candidates must be a file path"),
        ({"tune-candidates": "c.toml"}, "'c.toml' is not found from .*: give its absolute path"),
        ({"tune-trials": "3"}, "tune-trials must be a number of trials"),
        ({"tune-reference": 1}, "tune-reference must be true or false"),
        ({"tune-random-trials": 3.0}, "in client mode the server sees every trial's releases"),
        ({"tune-random-trials": 0.5}, "tune-random-trials must be a mean number of trials >= 1"),
        ({"tune-trials-law": "geometric"}, "tune-trials-law needs tune-random-trials"),
        (
            {"tune-random-trials": 2.0, "tune-trials-law": "zipf", "mode": "central"},
            "the law of run config tune-random-trials must be one of",
        ),
        ({"tune-site-validation": 0.2}, "tune-site-validation and tune-score-noise go together"),
        ({"task": "digits"}, "names task .* the run config task 'digits'"),
    ],
)
def test_a_bad_search_in_a_run_config_is_named(tmp_path, given, message):
    path = candidates_file(tmp_path, site_steps=given.get("mode") != "central")
    path.write_text(f'[base]\ntask = "{TASK}"\n' + path.read_text().removeprefix("[base]\n"))
    record = {"tune-candidates": str(path), "task": TASK, **given}
    record = {k: v for k, v in record.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        search_of_run_config(flwr_run_config(record), 1)


def test_flwr_run_of_a_search_runs_its_trials_over_the_runs_grid(tmp_path, capsys):
    """``server/app.py``'s ServerApp and ``client/app.py``'s ClientApp, as ``flwr run`` runs
    them (in process here): the run config names a candidates file, so the trials run one
    after another over the run's grid; the simulated sites (which know no trials) keep one
    ledger each in the run directory, holding both trials, and the summary is
    ``gep-fed tune``'s."""
    from gep_fed.flower import make_client_app, make_flwr_server_app
    from gep_fed.flower.in_process import run_in_process

    runs = tmp_path / "runs"
    record = search_run_config(candidates_file(tmp_path), runs)
    run_in_process(make_flwr_server_app(), make_client_app(), 2, run_config=record)
    printed = capsys.readouterr().out
    assert "chosen: candidate" in printed and f"tuning directory: {runs / 'search'}" in printed
    saved = json.loads((runs / "search" / "tune.json").read_text())
    assert [t["status"] for t in saved["trials"]] == ["finished", "finished"]
    config = search_of_run_config(record, 1)
    both = both_trials(config, saved["per_trial_epsilon"])
    for site in ("site-0", "site-1"):
        ledger = PrivacyLedger.load_keyed(runs / "search" / "sites" / site / "ledger.json")
        assert ledger.epsilon() == pytest.approx(both)
        # the site's own budget (its node config; a simulated one's default), not the server's
        assert ledger.budget_epsilon == SIMULATED_SITE_DEFAULTS["epsilon-budget"]


def random_search_run_config(tmp_path: Path) -> dict:
    """A central-mode search of a random number of trials (geometric, mean 2) under flwr run,
    total epsilon 4."""
    record = search_run_config(candidates_file(tmp_path, site_steps=False), tmp_path / "runs")
    return {**record, "mode": "central", "tune-random-trials": 2.0}


def central_sites():
    """The ClientApp of simulated sites that accept central mode and selections of up to 2
    trials on average, seeded as the search's server is (their node configs': a site without
    a seed refuses a central round whose server noise is seeded)."""
    from gep_fed.flower import make_client_app

    sites = {"accept-modes": "central", "max-selection-mean": 2.0, "noise-seed": 1}
    return make_client_app(simulation=sites)


def test_flwr_run_and_the_command_line_declare_the_same_random_search(tmp_path):
    from gep_fed.cli.main import build_parser
    from gep_fed.cli.tune import tune_config

    record = random_search_run_config(tmp_path)
    record["tune-trials-law"] = "logarithmic"
    options = ["--candidates", record["tune-candidates"], "--task", TASK, "--epsilon", "4"]
    options += ["--mode", "central", "--random-trials", "2", "--trials-law", "logarithmic"]
    cli = tune_config(build_parser().parse_args(["tune", *options]))
    flwr = search_of_run_config(record, 1)
    assert flwr.random_trials == cli.random_trials and flwr.selection == cli.selection
    assert flwr.base.mode == cli.base.mode == "central"


def test_a_random_search_under_flwr_run_is_recorded_by_each_site_once_and_each_trial_apart(
    tmp_path,
):
    """Under flwr run the sites record the search themselves, from the round configs: each
    site's own ledger holds every trial's rounds (the other sites see them all), and each
    trial's rounds lie in a ledger of the trial's own beside it too, under the selection's
    bound of one trial, on which the published choice's figure (Papernot & Steinke's bound)
    rests."""
    import numpy as np

    from gep_fed.accounting.events import rdp_curve
    from gep_fed.federation.site_selection import selection_folder, trial_run_curve
    from gep_fed.flower import make_flwr_server_app
    from gep_fed.flower.in_process import run_in_process
    from gep_fed.flower.tuning import SEARCH_ID

    record = random_search_run_config(tmp_path)
    run_in_process(make_flwr_server_app(), central_sites(), 2, run_config=record)
    out = tmp_path / "runs" / "search"
    saved = json.loads((out / "tune.json").read_text())
    assert [t["status"] for t in saved["trials"]] == ["finished"] * len(saved["plan"])
    event = TrialPlanner(search_of_run_config(record, 1)).selection_event(
        saved["per_trial_epsilon"]
    )
    search_id = (out / SEARCH_ID).read_text()
    published = saved["procedure_epsilon"]["published_choice_rdp"]
    assert published == pytest.approx(epsilon_rdp([event], 1e-5)) and published <= 4.0
    for site in ("site-0", "site-1"):
        ledger = PrivacyLedger.load_keyed(out / "sites" / site / "ledger.json")
        assert ledger.steps == 2 * len(saved["plan"]) and not any(
            e.selection for e in ledger.events
        )
        folder = selection_folder(ledger.path, search_id)
        trials = sorted(folder.glob("trial-*.json"))
        assert len(trials) == len(saved["plan"])
        for path in trials:
            trial = PrivacyLedger.load(path, ledger.key, path.with_suffix(".mark"))
            assert trial.steps == 2  # its two central rounds, one step each
            assert np.all(rdp_curve(trial.events) <= trial_run_curve(event) * (1 + 1e-9))
    assert "The published choice alone: epsilon" in (out / "tune.md").read_text()


def test_a_site_under_flwr_run_refuses_a_random_search_its_budget_cannot_hold_before_any_round(
    tmp_path,
):
    """A site whose ledger already holds other work, so that the first trial no longer fits
    its budget (its own, 8), refuses the trial's rounds: the search stops there, and its
    ledger holds exactly its other work; the trial's own ledger holds nothing."""
    from gep_fed.accounting.ledger import create_ledger_key, default_key_path
    from gep_fed.federation.tuning import calibrate_selection_epsilon
    from gep_fed.flower import make_flwr_server_app
    from gep_fed.flower.in_process import run_in_process
    from gep_fed.flower.serverapp import RunFailedError

    record = random_search_run_config(tmp_path)
    config = search_of_run_config(record, 1)

    epsilon, _ = calibrate_selection_epsilon(config)
    one = TrialPlanner(config).trial(0, epsilon)[1]
    ledger_path = tmp_path / "runs" / "search" / "sites" / "site-0" / "ledger.json"
    ledger_path.parent.mkdir(parents=True)
    key = create_ledger_key(default_key_path(ledger_path))
    budget = SIMULATED_SITE_DEFAULTS["epsilon-budget"]
    other = PrivacyLedger.open(ledger_path, 1e-5, budget, "site-0", key=key, create=True)
    k = next(k for k in range(1, 400) if epsilon_rdp(one * (k + 1), 1e-5) > budget)
    assert epsilon_rdp(one * k, 1e-5) <= budget
    other.record(*[replace(e, party="site-0") for e in one * k])  # before the search
    before = PrivacyLedger.load_keyed(ledger_path).events
    with pytest.raises(RunFailedError, match=r"trial 1 .* refused by site-0 .*over budget"):
        run_in_process(make_flwr_server_app(), central_sites(), 2, run_config=record)
    saved = json.loads((tmp_path / "runs" / "search" / "tune.json").read_text())
    assert saved["trials"][0]["status"] == "refused"
    assert saved["trials"][0]["refused_by"] == {"site-0": "over budget in round(s) 1-2"}
    assert len(saved["trials"]) == 1  # the search stops at a refused trial
    assert PrivacyLedger.load_keyed(ledger_path).events == before
    for path in (ledger_path.parent / "ledger.json.selections").glob("*/trial-*.json"):
        assert PrivacyLedger.load(path, key, path.with_suffix(".mark")).events == ()


def test_a_site_under_flwr_run_refuses_a_trial_beyond_its_budget_named_by_its_own_rounds(
    tmp_path,
):
    """Under flwr run a simulated site knows no trials. One whose ledger already holds other
    work, so that its budget (its own, 8) holds one more trial but not two, refuses the
    second trial from its first round; the search names the trial's own rounds (1-2, not the
    run's 3-4), stops, and the site's ledger holds exactly its other work and one trial."""
    from gep_fed.accounting.ledger import create_ledger_key, default_key_path
    from gep_fed.federation.tuning import calibrate_trial_epsilon
    from gep_fed.flower import make_client_app, make_flwr_server_app
    from gep_fed.flower.in_process import run_in_process

    runs = tmp_path / "runs"
    record = search_run_config(candidates_file(tmp_path), runs)
    config = search_of_run_config(record, 1)
    epsilon, _ = calibrate_trial_epsilon(config, config.plan())
    one = TrialPlanner(config).trial(0, epsilon)[1]
    ledger_path = runs / "search" / "sites" / "site-0" / "ledger.json"
    ledger_path.parent.mkdir(parents=True)
    key = create_ledger_key(default_key_path(ledger_path))
    budget = SIMULATED_SITE_DEFAULTS["epsilon-budget"]
    k = next(k for k in range(1, 200) if epsilon_rdp(one * (k + 2), 1e-5) > budget)
    assert epsilon_rdp(one * (k + 1), 1e-5) <= budget
    other = PrivacyLedger.open(ledger_path, 1e-5, budget, "site-0", key=key, create=True)
    other.record(*[replace(e, party="site-0") for e in one * k])  # before the search
    run_in_process(make_flwr_server_app(), make_client_app(), 2, run_config=record)
    saved = json.loads((runs / "search" / "tune.json").read_text())
    assert [t["status"] for t in saved["trials"]] == ["finished", "refused"]
    assert saved["trials"][1]["refused_by"] == {"site-0": "over budget in round(s) 1-2"}
    ledger = PrivacyLedger.load_keyed(ledger_path)
    assert ledger.epsilon() == pytest.approx(epsilon_rdp(one * (k + 1), 1e-5))


def resumes_both_trials_once(config: TuneConfig, out: Path) -> None:
    """The same tuning rerun finishes both trials, and each site's one ledger holds both
    trials' rounds exactly once."""
    result = tune(config, simulate_options={"engine": "in-process"})
    assert [t.status for t in result.trials] == ["finished", "finished"] and result.complete
    both = both_trials(config, result.per_trial_epsilon)
    for site in ("site-0", "site-1"):
        ledger = PrivacyLedger.load_keyed(out / "sites" / site / "ledger.json")
        assert ledger.epsilon() == pytest.approx(both)


def test_a_search_stopped_by_ctrl_c_in_its_second_trial_resumes_there(tmp_path, monkeypatch):
    """The first Ctrl-C during the second trial's first round: that round completes, the
    search stops naming trial 2 and its round 1, and the same tuning rerun resumes trial 2
    at its round 2 (a new Flower run, numbered from 1 again), so each site's one ledger holds
    both trials' rounds exactly once."""
    import os
    import signal

    from gep_fed.flower.tuning import TuneInterrupted

    handle, sent = clientapp.handle_train, []

    def interrupting(msg, context, *args):
        record = msg.content.config_records.get(wire.ROUND_CONFIG)
        if record is not None and record["round"] == 3 and not sent:
            sent.append(3)
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: a stop request
        return handle(msg, context, *args)

    monkeypatch.setattr(clientapp, "handle_train", interrupting)
    config = two_step_sizes(tmp_path / "tune")
    with pytest.raises(TuneInterrupted) as stopped:
        tune(config, simulate_options={"engine": "in-process"})
    assert "in trial 2 of 2 (after its round 1)" in stopped.value.line()
    resumes_both_trials_once(config, tmp_path / "tune")


def test_a_search_killed_in_a_trial_after_its_checkpoint_resumes_it(tmp_path, monkeypatch):
    """A process killed during a trial (after its round 1 is committed; modelled by an
    exception no handler catches) leaves the record of which sites' data trained it, so the
    same tuning rerun resumes that trial instead of refusing it as trained without one."""
    from gep_fed.federation.rundir import SITES

    class Killed(BaseException):
        pass

    handle, killed = clientapp.handle_train, []

    def killing(msg, context, *args):
        record = msg.content.config_records.get(wire.ROUND_CONFIG)
        if record is not None and record["round"] == 2 and not killed:
            killed.append(2)
            raise Killed()
        return handle(msg, context, *args)

    monkeypatch.setattr(clientapp, "handle_train", killing)
    config = two_step_sizes(tmp_path / "tune")
    with pytest.raises(Killed):
        tune(config, simulate_options={"engine": "in-process"})
    (trial,) = [p for p in (tmp_path / "tune" / "trials").iterdir() if p.is_dir()]
    assert (trial / "checkpoint.pt").exists() and (trial / SITES).exists()
    resumes_both_trials_once(config, tmp_path / "tune")


def test_a_simulated_site_refuses_a_round_of_no_planned_trial_and_notes_nothing(
    tmp_path, monkeypatch
):
    """A simulated search's site serves each round with its trial's settings, found by the
    round; a round outside every trial is refused as malformed before anything is built,
    and no row is written anywhere (there is no trial's folder to write it in)."""
    from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

    from gep_fed.flower.clientapp import SimulatedTrial, handle_train

    monkeypatch.chdir(tmp_path)  # nothing written here either (a default run directory)
    fed = FederationConfig(**{**BASE, "num_sites": 2, "run_dir": str(tmp_path / "runs")})
    settings = {"ledger-dir": str(tmp_path / "sites")}
    trials = [SimulatedTrial(1, 1, 2, fed, settings), SimulatedTrial(2, 3, 4, fed, settings)]
    from flwr.supercore.task_identity import TaskIdentity

    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0  # as a run's
    try:
        content = RecordDict({wire.ROUND_CONFIG: ConfigRecord({"round": 5})})
        msg = Message(content=content, message_type=MessageType.TRAIN, dst_node_id=1)
        node = {"partition-id": 0, "num-partitions": 2}
        reply = handle_train(msg, Context(1, 1, node, RecordDict(), {}), trials=trials)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    assert reply.has_error() and reply.error.reason == "malformed round"
    assert not list(tmp_path.iterdir())
    assert not any(key[:2] == (1, 1) for key in clientapp._SITES)


def test_a_search_whose_site_ledgers_are_elsewhere_reports_its_planned_epsilon_as_such(tmp_path):
    """Deployed sites keep their ledgers on their own disks: the summary and tune.md give
    the planned composition and say where the guarantee is recorded, never "each site's
    ledger" for a figure no ledger here gave."""
    from gep_fed.flower.tuning import TuneResult, render_markdown, result_lines

    result = TuneResult(
        out_dir=tmp_path,
        total_epsilon=2.5,
        delta=1e-5,
        plan=(1, 2),
        per_trial_epsilon=1.7,
        planned_epsilon_rdp=2.4999,
        trials=(),
        chosen=None,
        model_path=None,
        test_metrics={},
        site_epsilons={},
        stopped=None,
    )
    summary = "\n".join(result_lines(result))
    assert "epsilon of the whole tuning as planned" in summary and "2.4999 (RDP)" in summary
    assert "(each site's ledger:" not in summary
    assert "not here: the sites' ledgers are on their disks" in render_markdown(result)


def test_the_sites_data_is_checked_once_per_model_of_a_search(tmp_path, monkeypatch):
    """Candidates share the task and the sites' data (``FIXED_SETTINGS``): the check
    ``simulate`` makes before round 1 runs once per model, not once per trial."""
    from gep_fed.flower import simulation

    checked, check = [], simulation.check_simulated_sites
    monkeypatch.setattr(
        simulation,
        "check_simulated_sites",
        lambda fed, data: checked.append(fed.model) or check(fed, data),
    )
    fed = FederationConfig(**{**BASE, "num_sites": 2, "run_dir": str(tmp_path)})
    specs = [TrialSpec(n, replace(fed, run_name=f"trial-{n}")) for n in (1, 2, 3)]
    simulate_search(specs, lambda spec, sim: True, engine="in-process")
    assert checked == [fed.model]


@pytest.mark.slow  # four rehearsal runs and one trial, in process (~10 s)
def test_flwr_run_of_a_rehearsed_search_rehearses_at_the_server_and_runs_one_trial(
    tmp_path, capsys
):
    """Under ``flwr run`` (in process here), ``tune-rehearse`` rehearses both candidates in
    the ServerApp's own process (no site takes part) and only the chosen one's rounds reach
    the sites: each site's ledger holds one trial at the whole budget."""
    from gep_fed.flower import make_client_app, make_flwr_server_app
    from gep_fed.flower.in_process import run_in_process

    runs = tmp_path / "runs"
    record = search_run_config(candidates_file(tmp_path), runs)
    # the server cannot count the sites' examples: the run config declares them
    record = {**record, "tune-rehearse": 2, "total-examples": 1000}
    run_in_process(make_flwr_server_app(), make_client_app(), 2, run_config=record)
    printed = capsys.readouterr().out
    assert "rehearsal on the server's validation data" in printed, printed
    saved = json.loads((runs / "search" / "tune.json").read_text())
    assert len(saved["rehearsal"]["runs"]) == 4 and len(saved["trials"]) == 1
    assert saved["trials"][0]["candidate"] == saved["rehearsal"]["chosen"]
    assert saved["trials"][0]["status"] == "finished" and saved["per_trial_epsilon"] == 4.0
    for site in ("site-0", "site-1"):
        ledger = PrivacyLedger.load_keyed(runs / "search" / "sites" / site / "ledger.json")
        assert ledger.steps == 2 * 2 and 3.9 < ledger.epsilon() <= 4.0  # one trial's rounds
