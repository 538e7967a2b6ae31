"""The gep-fed command line, run as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gep_fed.cli.main import build_parser
from helpers import gep_fed_in_process

GEP_FED = Path(sys.executable).parent / "gep-fed"


def gep_fed(*args, check=True):
    proc = subprocess.run([str(GEP_FED), *args], capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_calibrate_prints_sigma_and_refuses_impossible_targets(capsys):
    code, out, _ = gep_fed_in_process(
        capsys, "calibrate", "--epsilon", "2", "--sample-rate", "0.01", "--steps", "1000"
    )
    assert code == 0 and "sigma =" in out
    spent = float(out.split("RDP ")[1].split(",")[0])
    assert 1.99 <= spent <= 2.0
    code, _, err = gep_fed_in_process(
        capsys, "calibrate", "--epsilon", "0.001", "--sample-rate", "1", "--steps", "10000"
    )
    assert code == 2 and "out of reach" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["simulate", "--mode", "trusted"], "mode must be one of"),
        (["simulate", "--sample-rate", "2"], "sample_rate must be a finite number in (0, 1]"),
        (["simulate", "--noise-multiplier", "lots"], "--noise-multiplier must be a number"),
        (["report", "/nonexistent/run"], "not a gep-fed run directory"),
        (["simulate", "--run-dir", __file__, "--engine", "in-process"], "Not a directory"),
        (["site", "check", "--node-config", "site-id=h1 delta="], "--node-config 'site-id=h1"),
        (
            ["simulate", "--site-data", "a=x", "--site-data", "b=y", "--num-sites", "5"],
            "--num-sites 5 with 2 --site-data sites",
        ),
        (["simulate", "--site-data", "a=x", "--min-sites", "2"], "--min-sites 2 with 1"),
        (
            ["simulate", "--mode", "central", "--local-steps", "5", "--local-lr", "0.1"],
            "local-steps, local-lr set(s) the sites' own steps, which central mode does not",
        ),
    ],
)
def test_bad_values_get_an_error_that_names_them(capsys, args, message):
    code, _, err = gep_fed_in_process(capsys, *args)
    assert code == 2 and message in err


def test_every_simulate_option_has_help_text():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["simulate"]
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 30
    assert all(a.help and not a.help.startswith(" (default") for a in options)


def test_site_check_help_lists_every_node_config_key():
    from gep_fed.federation.policy import NODE_CONFIG_KEYS

    parser = build_parser()
    site = next(a for a in parser._actions if a.dest == "command").choices["site"]
    check = next(a for a in site._actions if a.dest == "site_command").choices["check"]
    text = check.format_help()
    assert all(f"  {key}: " in text for key in NODE_CONFIG_KEYS)


@pytest.mark.slow
def test_langevin_simulation_shows_the_epsilon_the_sites_ledgers_hold(tmp_path):
    """Only the sites' ledgers know Langevin's spend (it depends on each site's size): the
    summary, the metrics (hence the bar and epsilon.png) and the report show the largest."""
    import json

    from gep_fed.accounting.ledger import PrivacyLedger

    proc = gep_fed(
        "simulate",
        "--mechanism",
        "langevin",
        "--model",
        "linear",
        "--rounds",
        "2",
        "--local-steps",
        "3",
        "--run-dir",
        str(tmp_path),
        "--engine",
        "in-process",
    )
    run_dir = Path(proc.stdout.split("run directory:")[1].split()[0])
    sites = [PrivacyLedger.load_keyed(p) for p in sorted(run_dir.glob("sites/*/ledger.json"))]
    largest = max(ledger.epsilon() for ledger in sites)
    assert len(sites) == 3 and largest > 0
    for ledger in sites:  # step 1 of the schedule draws from the prior: 2 x 3 - 1 steps
        assert ledger.steps == 5 and {e.mechanism for e in ledger.events} == {"langevin"}
    line = next(x for x in proc.stdout.splitlines() if "epsilon spent (largest site)" in x)
    assert f"{largest:.4f}" in line
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["sites_ok"] == 3 for m in metrics)
    assert metrics[-1]["epsilon"] == pytest.approx(largest)
    assert "only the sites' own ledgers hold it" in (run_dir / "report.md").read_text()


@pytest.mark.slow  # over ~3 s
def test_a_comparison_with_a_failed_run_marks_it_and_returns_its_failure(tmp_path):
    """A cell whose rounds updated nothing must not read as a result: the table marks it and
    lists why, and ``gep-fed compare`` exits 1 on the returned lines."""
    from gep_fed.accounting.ledger import PrivacyLedger, create_ledger_key, default_key_path
    from gep_fed.cli.compare import run_comparison
    from gep_fed.federation.config import FederationConfig
    from gep_fed.mechanisms.mechanism import GEP

    base = FederationConfig(
        rounds=1, local_steps=1, num_sites=2, min_sites=2, num_basis=30, num_public=300
    )
    # the second cell (GEP, client mode) meets a site whose budget is already spent
    spent = tmp_path / "c" / "runs" / "02-client-gep-eps2.0" / "sites" / "site-1" / "ledger.json"
    key = create_ledger_key(default_key_path(spent))
    PrivacyLedger(1e-5, None, "site-1", spent, key=key).record(GEP.event(1.0, 0.2, 95))
    table, failures = run_comparison(
        base,
        [2.0],
        tmp_path,
        central_reference=False,
        name="c",
        mechanisms=("gep",),
        modes=("client",),
        engine="in-process",
    )
    assert failures == [
        "GEP client, epsilon 2.0: the model was not updated in round(s) 1: too few valid "
        "replies (at most 1 in those rounds; refused: over budget (1))",
        "GEP client, epsilon 2.0: site-1: refused in every round (round(s) 1: over budget)",
    ]
    assert "| GEP client (FAILED: see below) |" in table
    assert all(f"- {line}" in table for line in failures)
    assert "| FedAvg (non-private, clipped) |" in table  # the other cell trained


@pytest.mark.parametrize("noise_seed", [None, 4])
def test_the_centralised_reference_samples_with_secret_coins_unless_its_noise_is_seeded(
    monkeypatch, noise_seed
):
    """Its table reports an epsilon that assumes secret Poisson sampling: the coins came from
    the run's public seed (0 by default) whatever the noise."""
    from types import SimpleNamespace

    from gep_fed.cli import compare
    from gep_fed.federation.config import FederationConfig

    seen = {}

    def capture(*args, generator=None, noise=None, **kwargs):
        seen.update(generator=generator, noise=noise)
        return SimpleNamespace(epsilon=1.0)

    monkeypatch.setattr(compare, "train_private", capture)
    base = FederationConfig(num_public=100, num_basis=8, noise_seed=noise_seed)
    compare.centralised(base, "gep", 2.0, 2)
    assert (seen["generator"] is None) == (noise_seed is None)
    assert seen["noise"].seeded == (noise_seed is not None)


def test_compare_gives_every_mode_the_same_private_steps_by_default():
    """Issue 22: at equal rounds client mode took local_steps times the steps of central
    mode (digits: 100 against 10), which read as if central mode were worse."""
    from gep_fed.cli.compare import matrix
    from gep_fed.federation.config import FederationConfig

    base = FederationConfig(rounds=10, local_steps=10)
    runs = matrix(base, [2.0])
    steps = {(label, fed.mode): fed.steps_per_party for label, fed in runs}
    private = {k: v for k, v in steps.items() if not k[0].startswith("FedAvg")}
    assert set(private.values()) == {100}
    by_rounds = matrix(base, [2.0], equal="rounds")
    assert {fed.rounds for _, fed in by_rounds} == {10}
    assert {fed.steps_per_party for _, fed in by_rounds if fed.mode == "central"} == {10}


def test_a_round_played_again_on_resume_is_reported_by_its_latest_attempt():
    """An unapplied round is not checkpointed, so a resumed run plays it again and the
    metrics hold both attempts: the summary, the report and the failure check read the
    later one, and an earlier round without update still fails the run."""
    from gep_fed.federation.report import best_model_line, replies_line
    from gep_fed.federation.rundir import rounds_not_applied

    def row(round_, applied, accuracy):
        return {
            "round": round_,
            "sites_ok": 2 if applied else 1,
            "sites_asked": 2,
            "applied": applied,
            "val_accuracy": accuracy,
            "test_accuracy": accuracy,
            "best_round": round_,
        }

    rows = [row(1, True, 0.5), row(2, False, 0.1), row(2, True, 0.7)]
    assert rounds_not_applied(rows) is None
    line = replies_line(rows)
    assert "every site in 2 round(s), from some in 0" in line and "updated in 2" in line
    assert "accuracy 0.7000): test accuracy 0.7000" in best_model_line(rows)
    missed = rounds_not_applied([row(1, False, 0.1), row(2, True, 0.7)])
    assert missed.startswith("the model was not updated in round(s) 1:")


def test_rounds_without_an_update_name_the_sites_refusals_by_reason():
    """A deployed site's refusal reaches the server as a fixed reason only: the failure line
    counts them, so "every site refused a candidate's model" reads as such."""
    from gep_fed.federation.rundir import rounds_not_applied

    refused = "site at node {}: field 'error': refused: malformed round"
    rows = [
        {
            "round": r,
            "sites_ok": 0,
            "applied": False,
            "rejected": [refused.format(n) for n in (7, 8)],
        }
        for r in (1, 2)
    ]
    rows[1]["rejected"].append("site at node 9: field 'error': refused: over budget")
    assert rounds_not_applied(rows) == (
        "the model was not updated in round(s) 1-2: too few valid replies (at most 0 in those "
        "rounds; refused: malformed round (4); refused: over budget (1))"
    )


@pytest.mark.slow  # a subprocess
def test_the_command_lines_help_imports_neither_dp_accounting_nor_opacus():
    import subprocess
    import sys

    code = (
        "import sys; from gep_fed.cli.main import main\n"
        "try: main(['--help'])\n"
        "except SystemExit: pass\n"
        "print(sorted(m for m in ('dp_accounting', 'opacus') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_every_public_name_of_a_package_resolves_to_its_module():
    import importlib

    for package in ("gep_fed", "gep_fed.federation", "gep_fed.flower"):
        module = importlib.import_module(package)
        assert sorted(module._PUBLIC) == sorted(module.__all__)
        for name in module.__all__:
            assert getattr(module, name).__name__ == name
        with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
            module.nothing  # noqa: B018


@pytest.mark.slow  # a subprocess
def test_a_sites_ledger_and_key_commands_load_neither_pytorch_nor_flower(tmp_path):
    """``gep-fed ledger init|show`` and ``site keygen`` (a hospital's setup, run by hand) read
    and write files only: they answer in a fraction of a second, without the library."""
    import subprocess
    import sys

    code = (
        "import sys; from gep_fed.cli.main import main\n"
        f"assert main(['site', 'keygen', r'{tmp_path / 'k.pem'}', '--name', 'h1']) == 0\n"
        f"assert main(['ledger', 'init', r'{tmp_path / 'l.json'}', '--owner', 'h1',"
        " '--delta', '1e-5']) == 0\n"
        f"assert main(['ledger', 'show', r'{tmp_path / 'l.json'}']) == 0\n"
        "print(sorted(m for m in ('torch', 'flwr') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "owner 'h1', 0 accounted step(s)" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_ctrl_c_stops_the_main_job_in_one_line_and_the_same_command_finishes_its_run_dir(
    tmp_path, capsys
):
    """The README's main job (its defaults, 3 rounds). Ctrl-C as a terminal sends it (SIGINT
    to the process group) once round 1 is recorded: the run stops within seconds, exit
    status 130, one line and no traceback; the same command then resumes after the committed
    round, says so on stdout, and finishes with the summary, a run directory and its report,
    and ledgers and checkpoint that hold every round once (each site's ledger what it
    answered). One run for both: each Flower simulation starts Ray."""
    import os
    import signal
    import time

    import torch

    from gep_fed.accounting.ledger import PrivacyLedger
    from gep_fed.federation.rundir import RunDirectory, latest_attempts

    args = [str(GEP_FED), "simulate", "--rounds", "3", "--run-dir", str(tmp_path)]
    args += ["--run-name", "r"]
    metrics = tmp_path / "r" / "metrics.jsonl"
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=60)
        waited = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out + err
    assert waited < 20, f"took {waited:.1f} s to stop"
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    (line,) = [x for x in err.splitlines() if x.startswith("interrupted")]
    stopped_after = int(line.split("after round ")[1].split(":")[0])
    assert line == f"interrupted after round {stopped_after}: rerun the same command to resume"
    run = RunDirectory(tmp_path / "r")
    assert torch.load(run.file("checkpoint.pt"), weights_only=True)["round"] == stopped_after

    again = gep_fed(*args[1:])
    assert f"resuming run {run.path} after round {stopped_after} of 3" in again.stdout
    assert [r["round"] for r in latest_attempts(run.read_metrics())] == [1, 2, 3]
    assert torch.load(run.file("checkpoint.pt"), weights_only=True)["round"] == 3
    # the server's ledger: each round's local steps, once
    local_steps = json.loads(run.file("config.json").read_text())["local-steps"]
    assert PrivacyLedger.load(run.ledger_path).steps == 3 * local_steps
    for site in ("site-0", "site-1", "site-2"):
        answered = (run.path / "sites" / site / "rounds.jsonl").read_text().splitlines()
        ledger = PrivacyLedger.load_keyed(run.path / "sites" / site / "ledger.json")
        assert ledger.steps == local_steps * len(answered) and len(answered) >= 3

    # the finished run: its summary, its run directory and the report it re-renders
    assert "test accuracy" in again.stdout and "epsilon spent (each site)" in again.stdout
    assert "wall time" in again.stdout
    assert Path(again.stdout.split("run directory:")[1].split()[0]) == run.path
    for name in (
        "config.json",
        "metrics.jsonl",
        "ledger.json",
        "model.pt",
        "report.md",
        "accuracy.png",
        "epsilon.png",
        "projection_error.png",
    ):
        assert (run.path / name).exists(), name
    report = (run.path / "report.md").read_text()
    assert "mode **client**, mechanism **gep**" in report and "site `site-0`" in report
    (run.path / "report.md").unlink()
    code, out, _ = gep_fed_in_process(capsys, "report", str(run.path))
    assert code == 0 and out.strip() == str(run.path / "report.md")
    assert (run.path / "report.md").read_text() == report


def test_the_help_shows_the_tasks_recommendation_as_the_default_where_a_task_sets_one(capsys):
    from gep_fed.cli.main import main
    from gep_fed.data.task import SMALL_DATA_RECIPE

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    rounds = text.rsplit("--rounds ROUNDS", 1)[1].split("--local-steps")[0]
    assert "default: the task's recommendation (" in rounds
    assert f"a task of your own {SMALL_DATA_RECIPE['rounds']}" in rounds
    assert rounds.rstrip().endswith("else 10)")  # digits, the default task, sets none
    seed = text.rsplit("--seed SEED", 1)[1].split("--noise-seed")[0]
    assert "recommendation" not in seed and "(default: 0)" in seed  # no task sets it


def test_show_settings_prints_a_tasks_resolved_settings_and_runs_nothing(capsys, tmp_path):
    from gep_fed.cli.main import main
    from gep_fed.data.task import SMALL_DATA_RECIPE

    args = ["simulate", "--task", "pneumonia", "--rounds", "7", "--run-dir", str(tmp_path)]
    assert main([*args, "--show-settings"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "settings of a run of task pneumonia (nothing is run):"
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows["rounds"] == ["7", "(option)"]
    assert rows["num-basis"] == [str(SMALL_DATA_RECIPE["num_basis"]), "(task", "pneumonia)"]
    assert rows["seed"] == ["0", "(default)"]
    assert list(tmp_path.iterdir()) == []
    # settings a run would refuse before its first round are refused here too (exit 0 before)
    assert main([*args, "--target-epsilon", "1e-6", "--show-settings"]) == 2
    assert "error:" in capsys.readouterr().err


def _run_directory(path, rows, config=None, **files):
    import json

    path.mkdir(parents=True)
    settings = {"task": "digits", "num-sites": 3, "partition": "iid", "dirichlet-alpha": 0.5}
    settings.update({"mode": "client", "mechanism": "gep", "target-epsilon": 8.0})
    (path / "config.json").write_text(json.dumps({**settings, **(config or {})}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, payload in files.items():
        (path / f"{name}.json").write_text(json.dumps(payload))
    return path


def _round(n, rounds):
    return {"round": n, "test_accuracy": 0.5, "epsilon": 8.0 * (n / rounds) ** 0.5, "applied": 1}


def test_a_long_runs_report_shows_one_round_in_n_and_says_where_every_round_is(tmp_path):
    from gep_fed.federation.report import MAX_TABLE_ROWS, render_report

    rows = [_round(n, 100) for n in range(1, 101)]
    report = render_report(_run_directory(tmp_path / "r", rows)).read_text()
    table = [line for line in report.splitlines() if line.startswith("| ") and "round" not in line]
    assert len(table) <= MAX_TABLE_ROWS
    assert table[-1].startswith("| 100 |")
    assert "One round in 5 and the last; every round is in `metrics.jsonl`." in report
    short = render_report(_run_directory(tmp_path / "s", rows[:3])).read_text()
    assert "One round in" not in short and "| 3 |" in short


def test_the_reports_headline_names_how_the_sites_got_their_data(tmp_path):
    from gep_fed.federation.report import render_report

    def headline(name, config=None, **files):
        path = _run_directory(tmp_path / name, [_round(1, 1)], config, **files)
        return render_report(path).read_text().splitlines()[2]

    own = headline("own", sites={"site-data": {"a": "/data/a", "b": "/data/b"}})
    assert "3 sites with their own data (`--site-data` a, b)" in own
    assert "IID shares of the task's pooled data" in headline("iid", sites={"shares": "iid"})
    skewed = headline("dir", {"partition": "dirichlet"}, sites={"shares": "dirichlet"})
    assert "Dirichlet label skew (alpha = 0.5)" in skewed


def test_the_epsilon_and_projection_plots_have_captions_saying_what_they_mean(tmp_path):
    from gep_fed.federation.report import render_report

    rows = [{**_round(n, 3), "anchor_projection_error": 0.3} for n in range(1, 4)]
    report = render_report(_run_directory(tmp_path / "r", rows)).read_text()
    assert "against the budget (dashed line)" in report
    assert "log(1/delta)" in report  # why one round already costs a large share
    assert "the share of the public anchors' gradient energy the subspace misses" in report


def test_a_run_refused_before_round_1_has_a_report_saying_so_and_no_nan(tmp_path):
    from gep_fed.federation.report import render_report, summary_lines

    reason = "10 more step(s) would bring epsilon to 84 > budget 0.5"
    outcome = {"stop_reason": f"stopped before round 1: {reason}", "interrupted": None}
    report = render_report(_run_directory(tmp_path / "r", [], outcome=outcome)).read_text()
    assert f"**refused before round 1: {reason}**" in report and "nan" not in report
    lines = summary_lines(None, [], outcome["stop_reason"], {}, tmp_path / "r", 1.0)
    assert lines == [f"refused before round 1: {reason}"]


def test_rerunning_a_finished_or_stopped_run_says_what_it_does(tmp_path):
    from gep_fed.federation.rundir import RunDirectory
    from gep_fed.flower.serverapp import resume_line

    run = RunDirectory(tmp_path / "r")
    assert resume_line(run, 0, 10) is None  # a new run
    assert resume_line(run, 4, 10) == f"resuming run {run.path} after round 4 of 10"
    finished = resume_line(run, 10, 10)
    assert finished.startswith(f"run {run.path} already finished its 10 round(s): nothing is")
