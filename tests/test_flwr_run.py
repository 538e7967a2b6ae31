"""`flwr run .` on a Flower simulation SuperLink: the app as Flower's own CLI runs it."""

import os
import re
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import RunDirectory
from helpers import BIN, free_port, stop_local_superlinks

ROOT = Path(__file__).parents[1]

pytestmark = pytest.mark.slow  # `flwr run` on a simulation SuperLink


def test_every_dependency_is_left_out_of_flowers_runtime_installation():
    """Flower's SuperLink runs `uv sync` on the app's pyproject.toml before the app starts;
    with every dependency and extra excluded it installs nothing and needs no index."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = config["project"]
    extras = project["optional-dependencies"].values()
    wanted = project["dependencies"] + [dep for deps in extras for dep in deps]
    names = {re.split(r"[\s\[<>=!~;@]", dep, maxsplit=1)[0].lower() for dep in wanted}
    assert names == set(config["tool"]["uv"]["exclude-dependencies"])


def readme_flwr_run(tmp_path: Path) -> tuple[str, str, int, dict]:
    """The README, its `flwr run` command, the local SuperLink's port, and an environment
    where no package index is reachable, uv's cache is empty and Flower's home is new."""
    readme = (ROOT / "README.md").read_text()
    (command,) = re.findall(r"^(PATH=\S+ flwr run \. .*)$", readme, flags=re.M)
    port = free_port()
    unreachable = "http://127.0.0.1:9/simple"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "UV_", "PIP_"))}
    env.update(
        FLWR_HOME=str(tmp_path / "flwr"),
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(port),
        FLWR_LOCAL_CONTROL_API_PORT=str(free_port()),
        UV_OFFLINE="1",
        UV_INDEX_URL=unreachable,
        UV_DEFAULT_INDEX=unreachable,
        PIP_INDEX_URL=unreachable,
        UV_CACHE_DIR=str(tmp_path / "uv-cache"),
        RAY_USAGE_STATS_ENABLED="0",
    )
    return readme, command, port, env


def test_the_readmes_flwr_run_finishes_offline_and_prints_the_summary(tmp_path):
    """The README's `flwr run` command, as written (a short run config appended), with no
    package index reachable and an empty uv cache: Flower starts its own local SuperLink
    (with runtime installation on, its default), installs nothing, and the ServerApp prints
    the summary `gep-fed simulate` prints and writes report.md, with the settings the library
    resolves for the same inputs; the README's command to stop that SuperLink matches it."""
    readme, command, port, env = readme_flwr_run(tmp_path)
    runs = tmp_path / "runs"
    short = f" --run-config \"rounds=2 local-steps=2 run-dir='{runs}' run-name='r'\""
    began = time.monotonic()
    try:
        run = subprocess.run(
            ["bash", "-c", command + short],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        stopped = stop_local_superlinks(port)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert stopped, "flwr run started no local SuperLink of its own"
    # the README's way to stop it matches it (here it is stopped by its id)
    (pattern,) = re.findall(r"`pkill -f '([^']+)'`", " ".join(readme.split()))
    assert all(pattern in line for line in stopped.values()), stopped
    assert "uv sync failed" not in out and "Installed: [" not in out
    for line in ("test accuracy", "epsilon spent (each site)", "site-0 (its own ledger)"):
        assert line in run.stdout, run.stdout[-3000:]
    assert f"run directory: {runs / 'r'}" in run.stdout
    for name in ("report.md", "accuracy.png", "epsilon.png"):
        assert (runs / "r" / name).exists(), name
    out = RunDirectory.open(runs / "r")
    assert [r["round"] for r in out.read_metrics()] == [1, 2]
    # the settings flwr run resolved are the library's (and gep-fed simulate's) for these inputs
    library = FederationConfig.for_task(rounds=2, local_steps=2, run_dir=str(runs), run_name="r")
    resolved = out.read_json("config.json")
    assert {k: resolved[k] for k in library.to_record()} == library.to_record()
    for site in range(3):
        ledger = PrivacyLedger.load_keyed(out.path / "sites" / f"site-{site}" / "ledger.json")
        assert ledger.steps == 4
    print(f"README flwr run, offline: {time.monotonic() - began:.1f} s")


def default_sigint() -> None:
    """In the child, before exec: SIGINT at its default, as a terminal starts a command. A
    test worker may run with SIGINT ignored (inherited by its children, and then Python
    installs no KeyboardInterrupt: the CLI would never see the Ctrl-C)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_flwr_stop_ends_a_run_between_rounds_and_it_resumes_from_there(tmp_path):
    """Ctrl-C in `flwr run --stream` leaves the stream at once and the run goes on, as the
    README says; `flwr stop` then ends it between rounds (Flower's exit handlers ask the
    ServerApp to stop): the run directory says after which round, and its checkpoint holds
    exactly the rounds it recorded."""
    import json
    import signal

    import torch

    _, command, port, env = readme_flwr_run(tmp_path)
    runs = tmp_path / "runs"
    # 500 rounds: the run must still be going when Ctrl-C and `flwr ls` come (50 rounds of
    # one step once finished first on a quiet machine)
    longer = f" --run-config \"rounds=500 local-steps=1 run-dir='{runs}' run-name='r'\""
    flwr = f"PATH={BIN}:$PATH flwr"
    metrics = runs / "r" / "metrics.jsonl"
    log = tmp_path / "stream.log"  # a file, not a pipe: nothing the CLI leaves behind holds it
    stream = None
    try:
        with open(log, "w") as sink:
            stream = subprocess.Popen(
                ["bash", "-c", command + longer],
                cwd=ROOT,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=default_sigint,
            )
        while not (metrics.exists() and metrics.read_text().strip()):
            assert stream.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        os.killpg(stream.pid, signal.SIGINT)  # Ctrl-C
        stream.wait(timeout=30)
        out = log.read_text()
        assert "Traceback" not in out, out[-3000:]

        def runs_listed() -> list[dict]:
            listed = subprocess.run(
                ["bash", "-c", f"{flwr} ls --format json"], env=env, capture_output=True, text=True
            )
            return json.loads(listed.stdout)["runs"]

        (running,) = runs_listed()
        assert running["status"] == "running"
        subprocess.run(["bash", "-c", f"{flwr} stop {running['run-id']}"], env=env, check=True)
        outcome = runs / "r" / "outcome.json"
        deadline = time.monotonic() + 60
        while not outcome.exists() or runs_listed()[0]["status"] == "running":
            assert time.monotonic() < deadline, "the ServerApp did not stop"
            time.sleep(0.5)
        (stopped,) = runs_listed()
    finally:
        if stream is not None and stream.poll() is None:
            os.killpg(stream.pid, signal.SIGKILL)
        stop_local_superlinks(port)
    assert stopped["status"] == "finished:stopped"
    line = json.loads(outcome.read_text())["interrupted"]
    done = torch.load(runs / "r" / "checkpoint.pt", weights_only=True)["round"]
    assert line == f"interrupted after round {done}: rerun the same command to resume"
    assert done == len(metrics.read_text().splitlines()) < 500
