"""`flwr run .` on a Flower simulation SuperLink: the app as Flower's own CLI runs it."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import RunDirectory

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.slow  # `flwr run` on a simulation SuperLink


def test_flwr_run_trains_on_a_local_simulation_superlink(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tmp_path / "flwr"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "sim"\n\n[superlink.sim]\naddress = "127.0.0.1:{port}"\n'
        "insecure = true\n"
    )
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    log = (tmp_path / "superlink.log").open("w")  # closed in the finally below
    link = subprocess.Popen(
        [
            str(BIN / "flower-superlink"),
            "--simulation",
            "--insecure",
            "--disable-runtime-dependency-installation",
            "--port",
            str(port),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        for _ in range(60):
            if "Uvicorn running" in (tmp_path / "superlink.log").read_text():
                break
            time.sleep(1)
        run = subprocess.run(
            [
                str(BIN / "flwr"),
                "run",
                ".",
                "sim",
                "--stream",
                "--federation-config",
                "num-supernodes=3",
                "--run-config",
                f"rounds=2 local-steps=2 run-dir='{tmp_path / 'runs'}' run-name='r'",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        os.killpg(link.pid, signal.SIGKILL)
        link.wait(timeout=30)
        log.close()
    out = RunDirectory.open(tmp_path / "runs" / "r")
    assert [r["round"] for r in out.read_metrics()] == [1, 2]
    # the settings flwr run resolved are the library's (and gep-fed simulate's) for these inputs
    library = FederationConfig.for_task(
        rounds=2, local_steps=2, run_dir=str(tmp_path / "runs"), run_name="r"
    )
    resolved = out.read_json("config.json")
    assert {k: resolved[k] for k in library.to_record()} == library.to_record()
    for site in range(3):
        ledger = PrivacyLedger.load_keyed(out.path / "sites" / f"site-{site}" / "ledger.json")
        assert ledger.steps == 4
