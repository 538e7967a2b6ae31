"""`flwr run .` on a Flower simulation SuperLink: the app as Flower's own CLI runs it."""

import subprocess
from pathlib import Path

import pytest

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import RunDirectory
from helpers import BIN, simulation_superlink

ROOT = Path(__file__).parents[1]

pytestmark = pytest.mark.slow  # `flwr run` on a simulation SuperLink


def test_flwr_run_trains_on_a_local_simulation_superlink(tmp_path):
    with simulation_superlink(tmp_path) as env:
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
