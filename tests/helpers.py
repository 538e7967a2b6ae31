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


def stop_local_superlinks(port: int) -> dict[int, str]:
    """Stop the SuperLink(s) `flwr run` started on ``port`` (Linux: read from /proc), with
    the processes of their session; returns their ids and command lines."""
    stopped = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if any(w.endswith("flower-superlink") for w in words[:2]) and str(port) in words:
            pid = int(entry.name)
            try:
                os.killpg(os.getpgid(pid), signal.SIGTERM)
            except ProcessLookupError:
                continue
            stopped[pid] = " ".join(words).strip()
    return stopped
