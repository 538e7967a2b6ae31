"""Small builders shared by the tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from gep_fed.flower.in_process import InProcessGrid
from gep_fed.mechanisms.groups import ParameterGroup, ParameterLayout
from gep_fed.mechanisms.subspace import AnchorSubspace


def flat_layout(*sizes: int) -> ParameterLayout:
    """A layout of one parameter per group, with the given sizes."""
    names = tuple(f"p{i}" for i in range(len(sizes)))
    groups, pos = [], 0
    for name, size in zip(names, sizes, strict=True):
        groups.append(ParameterGroup(name, (name,), pos, pos + size))
        pos += size
    return ParameterLayout(names, tuple((s,) for s in sizes), tuple(groups))


def random_subspace(layout: ParameterLayout, dims, generator=None) -> AnchorSubspace:
    bases = tuple(
        torch.linalg.qr(torch.randn(g.size, k, generator=generator)).Q
        for g, k in zip(layout.groups, dims, strict=True)
    )
    return AnchorSubspace(layout, bases)


BIN = Path(sys.executable).parent


@contextmanager
def simulation_superlink(tmp_path: Path):
    """A SuperLink with the simulation runtime on a free port; yields the CLI's environment."""
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
    log_path = tmp_path / "superlink.log"
    with log_path.open("w") as log:
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
                if "Uvicorn running" in log_path.read_text():
                    break
                time.sleep(1)
            yield env
        finally:
            os.killpg(link.pid, signal.SIGKILL)
            link.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes() -> dict[int, tuple[int, list[str]]]:
    """Every process's (parent pid, command line), read from /proc (Linux)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        table[int(entry.name)] = (parent, [a.decode(errors="replace") for a in argv])
    return table


def stop_local_superlinks(port: int) -> dict[int, str]:
    """Stop the SuperLink(s) `flwr run` started on ``port`` (Linux: read from /proc) and
    everything they started: their sessions, and the detached SuperExec and simulation
    processes that name them (or each other) as ``--parent-pid`` or parent. Returns the
    SuperLinks' ids and command lines."""
    table = _processes()
    links = {
        pid: " ".join(words).strip()
        for pid, (_, words) in table.items()
        if any(w.endswith("flower-superlink") for w in words[:2]) and str(port) in words
    }
    doomed, grown = set(links), True
    while grown:  # descendants, by parent or by the --parent-pid a detached child is given
        grown = False
        for pid, (parent, words) in table.items():
            named = words[words.index("--parent-pid") + 1] if "--parent-pid" in words[:-1] else ""
            if pid not in doomed and (parent in doomed or named in {str(d) for d in doomed}):
                doomed.add(pid)
                grown = True
    own = os.getpgid(0)
    for pid in doomed:
        try:
            group = os.getpgid(pid)
            if group == own:  # never the test run's own group: that process alone
                os.kill(pid, signal.SIGTERM)
            else:
                os.killpg(group, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            continue
    return links


class LocalGrid(InProcessGrid):
    """The in-process engine's Grid (every site's real ClientApp, called in this process) for
    ``fed``'s simulated sites, with a test's hooks: ``silent(round, node, stage)`` True drops
    that message (the site never answers it); ``tamper(node, stage, content)`` rewrites a
    message's content before the site gets it (a deviating server). ``settings``: the
    simulated sites' own settings (default: the simulation's). Every message delivered is
    kept in ``sent`` (node, secure-sum stage, message), every reply in ``received``."""

    def __init__(self, fed, silent=None, tamper=None, settings=None) -> None:
        from flwr.supercore.run import Run
        from flwr.supercore.task_identity import TaskIdentity

        from gep_fed.flower.clientapp import make_client_app
        from gep_fed.flower.in_process import site_contexts
        from gep_fed.flower.simulation import simulated_site_settings

        run_id = TaskIdentity.run_id
        app = make_client_app(fed, settings or simulated_site_settings(fed))
        super().__init__(app, site_contexts(fed.num_sites, run_id), Run.create_empty(run_id))
        self.silent = silent or (lambda rnd, node, stage: False)
        self.tamper = tamper
        self.received, self.sent, self.stages = [], [], []

    def _answer(self, msg, node):
        from gep_fed.federation.secure_sum import SECURE_SUM

        stage = msg.content.config_records.get(SECURE_SUM, {}).get("stage")
        rnd = int(msg.metadata.group_id or 0)
        self.stages.append((rnd, stage))
        if self.silent(rnd, node, stage):
            return None
        if self.tamper is not None:
            self.tamper(node, stage, msg.content)
        self.sent.append((node, stage, msg))
        reply = super()._answer(msg, node)
        self.received.append(reply)
        return reply

    def app(self, msg, context):
        """The sites' ClientApp, called directly (a message sent again)."""
        return self.client_app(msg, context)


def tiny_federation(run_dir, built_task, **settings):
    """A ``FederationServer`` for ``settings`` over ``built_task``, its run directory
    made, the declared N the task's pooled size: the small federation the library-side tests
    drive by hand, site by site."""
    from gep_fed.federation.config import FederationConfig
    from gep_fed.federation.rundir import RunDirectory
    from gep_fed.federation.server import FederationServer

    fed = FederationConfig(**{"run_name": "r", **settings, "run_dir": str(run_dir)})
    run = RunDirectory(fed.run_directory(0))
    run.path.mkdir(parents=True, exist_ok=True)
    return FederationServer(fed, built_task, run, total_examples=len(built_task.train_dataset()))


def gep_fed_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """``gep-fed ARGS`` through the console script's own ``main``, in this process (tests that
    need the installed command itself run it as a subprocess): exit status, stdout, stderr."""
    from gep_fed.cli.main import main

    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's refusals
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err
