"""End to end: the deployment guide's own commands, on loopback, with TLS and SuperNode
authentication: a real SuperLink, three SuperNodes, `flwr run` in central, client and
distributed mode."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import shared_file

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.federation.rundir import RunDirectory

ROOT = Path(__file__).parents[1]
GUIDE = ROOT / "docs" / "deployment.md"


def guide_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), flags=re.S)


def test_the_guide_documents_every_node_config_key():
    from gep_fed.federation.policy import NODE_CONFIG_KEYS

    rows = re.findall(r"^\| (.*?) \|", GUIDE.read_text(), flags=re.M)
    documented = set(re.findall(r"`([a-z-]+)`", " ".join(rows)))
    assert sorted(set(NODE_CONFIG_KEYS) - documented) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def federation_env(deploy: Path) -> dict:
    """The environment the guide's commands run in (as its block 0 would set it), or skip
    when the tools that make the test certificates and keys are missing."""
    for tool in ("openssl", "ssh-keygen"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            pytest.skip(f"{tool} is needed to make the test certificates and keys")
    data = shared_file("medmnist/pneumoniamnist.npz").parents[1]  # the hospitals' images
    return {
        "DATA": str(data),
        **os.environ,
        "DEPLOY": str(deploy),
        "PORT": str(free_port()),
        "FLWR_HOME": str(deploy / "flwr"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def run_bash(script: str, env: dict, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


SETUP = 6  # the guide's blocks up to and including the SuperNodes' start


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """The guide's federation, set up once by its own first blocks. The guide's runs, the
    fault scenario and the guide's stop block then use it, in that order (this file's)."""
    blocks = guide_blocks()
    assert len(blocks) > SETUP + 2 and "stop.sh" in blocks[-1]
    assert "start-supernode.sh" in blocks[SETUP - 1] and "flwr run" in blocks[SETUP]
    deploy = tmp_path_factory.mktemp("deployment") / "federation"
    env = federation_env(deploy)
    try:
        setup = run_bash("\n".join(blocks[:SETUP]), env, timeout=600)
        assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
        yield deploy, env
    finally:
        run_bash(blocks[0] + "\n" + blocks[-1], env, timeout=60)


@pytest.mark.slow
def test_deployment_guide_runs_a_tls_authenticated_federation(federation):
    deploy, env = federation
    blocks = guide_blocks()
    # with block 0 again: the settings a reader's shell keeps between the guide's blocks
    done = run_bash("\n".join(blocks[:1] + blocks[SETUP:-1]), env, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    central = RunDirectory.open(deploy / "runs" / "central")
    rows = central.read_metrics()
    assert [r["round"] for r in rows] == [1, 2] and all(r["sites_ok"] == 3 for r in rows)
    assert PrivacyLedger.load(central.ledger_path).steps == 2
    client = RunDirectory.open(deploy / "runs" / "client")
    assert [r["sites_ok"] for r in client.read_metrics()] == [3, 3]
    distributed = RunDirectory.open(deploy / "runs" / "distributed")
    assert [r["sites_ok"] for r in distributed.read_metrics()] == [3]
    coordinator = PrivacyLedger.load(distributed.ledger_path)
    assert [e.placement for e in coordinator.events] == ["distributed"]
    # the search: both candidates trained, one chosen on the coordinator's evaluation data
    search = json.loads((deploy / "runs" / "search" / "tune.json").read_text())
    assert [t["status"] for t in search["trials"]] == ["finished", "finished"]
    assert "chosen: candidate" in done.stdout
    for site in range(3):
        # each hospital's own ledger holds the four runs: 2 central rounds (noised by the
        # trusted coordinator), 2 x 3 client-side steps, 1 distributed round (its share
        # of the noise in the secure sum) and the search's two one-step trials, within its
        # budget of 8
        ledger = PrivacyLedger.load_keyed(deploy / "ledgers" / f"site-{site}.json")
        placements = [e.placement for e in ledger.events]
        assert ledger.owner == f"site-{site}" and ledger.steps == 2 + 2 * 3 + 1 + 2
        assert placements == (
            ["trusted-server"] * 2 + ["local"] * 6 + ["distributed"] + ["local"] * 2
        )
        assert ledger.epsilon() <= 8.0
        # the secure sum ran with the split each hospital's node config set, among the peers
        # it pinned (keys made by the guide's gep-fed site keygen)
        assert ledger.events[8].noise_shares == 3
        assert ledger.epsilon_if_shares_exposed() > ledger.epsilon()
    assert "epsilon" in done.stdout and "HMAC and high-water mark verified" in done.stdout
    assert "1 step(s) in secure sums" in done.stdout  # the guide's ledger show
    assert len((deploy / "secrets" / "secure-sum" / "peers.txt").read_text().splitlines()) == 3
    assert (
        "TLS" in GUIDE.read_text()
        and "--enable-supernode-auth" in (ROOT / "deploy" / "start-superlink.sh").read_text()
    )


def wait_for_round(run_dir: Path, rnd: int, timeout: float = 300) -> list[dict]:
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            rows = RunDirectory(run_dir).read_metrics()
            if rows and rows[-1]["round"] >= rnd:
                return rows
        time.sleep(1)
    raise AssertionError(f"round {rnd} did not finish in {timeout} s")


def stop_running_runs(env: dict) -> int:
    """``flwr stop`` every run the SuperLink still lists as running (as the guide says to
    do after the coordinator's ServerApp died); returns how many were stopped."""
    listed = run_bash("flwr ls hospitals --format json", env, timeout=60)
    assert listed.returncode == 0, listed.stderr[-2000:]
    running = [r for r in json.loads(listed.stdout)["runs"] if r["status"] == "running"]
    for run in running:
        stopped = run_bash(f"flwr stop {run['run-id']} hospitals", env, timeout=60)
        assert stopped.returncode == 0, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    return len(running)


def kill_group(pidfile: Path) -> None:
    pid = int(pidfile.read_text())
    subprocess.run(["kill", "-KILL", "--", f"-{pid}"], check=False)
    pidfile.unlink()


@pytest.mark.slow
def test_a_dead_supernode_and_a_restarted_server_lose_and_repeat_nothing(federation):
    deploy, env = federation
    run_dir = deploy / "runs" / "faults"
    # a small target: the sites' budgets of 8 already hold the guide's four runs. A round
    # takes ~10 s alone but over 25 s on CI's 2 loaded cores (a live site then misses it),
    # and round 2 waits the whole timeout for the dead site
    command = (
        "flwr run . hospitals --stream --run-config "
        "\"task='examples.hospital.task:ChestXrayFolders' "
        "data-dir='$DATA' mode='central' target-epsilon=1.0 rounds=3 "
        "total-examples=4708 min-sites=2 round-timeout=60.0 "
        f"run-dir='{deploy / 'runs'}' run-name='faults'\""
    )
    first = subprocess.Popen(
        ["bash", "-c", command],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_round(run_dir, 1)
    kill_group(deploy / "pids" / "site-2.pid")  # a hospital goes down mid-run
    wait_for_round(run_dir, 2)
    # the coordinator's ServerApp process dies
    group = int((deploy / "pids" / "superlink.pid").read_text())
    subprocess.run(["pkill", "-KILL", "-g", str(group), "-f", "flwr-serverapp"], check=False)
    first.kill()
    first.wait(timeout=30)
    # the operator stops the orphaned run, so the sites drop its pending round
    assert stop_running_runs(env) == 1
    again = run_bash(command, env, timeout=600)  # restart: resumes from the checkpoint
    assert again.returncode == 0, again.stderr[-3000:]
    rows = RunDirectory(run_dir).read_metrics()
    rounds = [r["round"] for r in rows]
    assert rounds == sorted(set(rounds)) and rounds[-1] == 3, rounds
    assert rows[0]["sites_ok"] == 3 and rows[-1]["sites_ok"] == 2, rows
    assert all(r["applied"] and r["sites_ok"] >= 2 for r in rows)
    ledger = PrivacyLedger.load(run_dir / "ledger.json")
    assert [e.round for e in ledger.events] == [1, 2, 3]  # nothing lost, nothing twice
    # a run that needs all three hospitals while one is down updates nothing: `flwr run`
    # exits 0 whatever the run did, so Flower's own record must say it failed, and why
    short = command.replace("rounds=3", "rounds=1").replace("min-sites=2", "min-sites=3")
    # (it waits the whole timeout for the dead site; whether the live ones make it in time
    # does not change the outcome, so the timeout is short)
    short = short.replace("run-name='faults'", "run-name='short'").replace(
        "round-timeout=60.0", "round-timeout=15.0"
    )
    assert run_bash(short, env, timeout=600).returncode == 0
    listed = run_bash("flwr ls hospitals --format json", env, timeout=60)
    failed = [r for r in json.loads(listed.stdout)["runs"] if r["status"] == "finished:failed"]
    assert len(failed) == 1 and "not updated in round(s) 1" in failed[0]["status-details"]
    short_run = RunDirectory(deploy / "runs" / "short")
    assert [r["applied"] for r in short_run.read_metrics()] == [False]
    assert PrivacyLedger.load(short_run.ledger_path).steps == 0


@pytest.mark.slow
def test_the_guides_last_block_stops_every_process_of_the_federation(federation):
    deploy, env = federation
    blocks = guide_blocks()
    stopped = run_bash(blocks[0] + "\n" + blocks[-1], env, timeout=60)
    assert stopped.returncode == 0, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    for pidfile in (deploy / "pids").glob("*.pid"):
        raise AssertionError(f"{pidfile} left behind: a process was not stopped")
    leftovers = subprocess.run(["pgrep", "-f", str(deploy)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", "processes of the federation still run"


@pytest.mark.parametrize(
    "script, command",
    [("start-superlink.sh", "flower-superlink"), ("start-supernode.sh", "flower-supernode")],
)
def test_every_flag_the_scripts_pass_exists_in_this_flower(script, command):
    """Several flags changed in recent Flower releases: check each against --help."""
    text = (ROOT / "deploy" / script).read_text()
    flags = set(re.findall(r"(--[a-z][a-z-]+)", text.split(command, 1)[1]))
    help_text = subprocess.run(
        [str(Path(sys.executable).parent / command), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert flags and all(flag in help_text for flag in flags), flags - set(
        re.findall(r"(--[a-z][a-z-]+)", help_text)
    )
