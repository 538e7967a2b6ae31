"""The run directory: resolved configuration, per-round metrics, ledger, checkpoints, model.

Files are written atomically (temporary file, fsync, rename) and metrics are appended line by
line, so a crash never leaves a half-written record and never removes an earlier one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
import weakref
from collections import Counter
from pathlib import Path
from typing import ClassVar

import torch

from gep_fed.files import write_atomically, write_bytes_atomically

log = logging.getLogger("gep_fed.server")

CONFIG = "config.json"
METRICS = "metrics.jsonl"
LEDGER = "ledger.json"
CHECKPOINT = "checkpoint.pt"
MODEL = "model.pt"
BEST_MODEL = "best_model.pt"  # the best round on the task's validation set, if it has one
REPORT = "report.md"
# How the run ended, beside its metrics (a run refused before round 1 has only this).
OUTCOME = "outcome.json"
# How a simulation's sites got their data: ``{"site-data": {name: path}}`` (``--site-data``)
# or ``{"shares": partition}`` (shares of the task's pooled data).
SITES = "sites.json"
# A simulated site's rounds and their outcomes, in its folder (``sites/<site>/``).
SITE_ROUNDS = "rounds.jsonl"
# The sites' noised score of the final model, where the run asked for one.
SITE_SCORE = "site_score.json"
# Held (flock) by the process running the directory, so that no second one runs it at once.
LOCK = "run.lock"


class RunDirectoryError(ValueError):
    """The run directory is missing, not a run directory, or damaged."""


def round_spans(rounds: list) -> str:
    """``[1, 2, 3, 5]`` as ``1-3, 5``."""
    values = sorted(r for r in rounds if isinstance(r, int))
    out, start = [], None
    for i, r in enumerate(values):
        if start is None:
            start = r
        if i + 1 == len(values) or values[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out) or "?"


# A committed round whose metrics row was never written (the run stopped in between).
LOST_ROUND = "applied and accounted, but the run stopped before this round's metrics were written"


def latest_attempts(metrics: list[dict]) -> list[dict]:
    """Each round's last row, in round order. A round that did not update the model is not
    checkpointed, so a resumed run plays it again and the metrics hold both attempts: the
    later one is the round's outcome."""
    return sorted({r["round"]: r for r in metrics}.values(), key=lambda r: r["round"])


def rounds_not_applied(metrics: list[dict]) -> str | None:
    """One line naming the rounds whose replies did not update the global model (fewer valid
    ones than ``min_sites``, or an abandoned secure sum), or None when every round did
    (in its latest attempt, see ``latest_attempts``)."""
    missed = [r for r in latest_attempts(metrics) if not r.get("applied", bool(r.get("sites_ok")))]
    if not missed:
        return None
    most = max(r.get("sites_ok", 0) for r in missed)
    # the sites' refusals, by their fixed reason (all a server learns of a deployed site's)
    reasons = Counter(
        line.rsplit("refused: ", 1)[1]
        for r in missed
        for line in r.get("rejected") or []
        if isinstance(line, str) and "refused: " in line
    )
    refusals = "".join(f"; refused: {why} ({n})" for why, n in sorted(reasons.items()))
    return (
        f"the model was not updated in round(s) {round_spans([r['round'] for r in missed])}: "
        f"too few valid replies (at most {most} in those rounds{refusals})"
    )


class _Flock:
    """The open ``run.lock`` holding the flock; closed (and the lock freed) when the last
    ``RunLock`` on it lets go or is dropped."""

    def __init__(self, path: Path) -> None:
        self.handle = open(path, "a")  # noqa: SIM115 (kept open: the lock lives with it)
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.close()
            raise RunDirectoryError(
                f"{path.parent} is being run by another process (its {LOCK} is held): wait "
                "for that run to end, or give this one another run name"
            ) from None

    def __del__(self) -> None:
        self.handle.close()


class RunLock:
    """An exclusive lock (flock) on a run directory's ``run.lock`` until ``close`` (or the
    end of a ``with`` block, or until it is dropped; the operating system releases it when the
    process ends, however it ends). Held again by the same process, it nests: the simulation
    holds it while the ServerApp, and the strategy within it, hold it too, and it is free once
    all have let go."""

    _held: ClassVar[weakref.WeakValueDictionary] = weakref.WeakValueDictionary()

    def __init__(self, path: Path) -> None:
        path = path.resolve()
        flock = self._held.get(path)
        if flock is None:
            flock = self._held[path] = _Flock(path)
        self._flock: _Flock | None = flock

    def close(self) -> None:
        self._flock = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RunDirectory:
    """One run's outputs under ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, base: str | Path, label: str) -> RunDirectory:
        """A new, empty directory ``base/<time>-<label>`` (never reuses an existing one)."""
        base = Path(base)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for i in range(1000):
            path = base / (f"{stamp}-{label}" + (f"-{i}" if i else ""))
            try:
                path.mkdir(parents=True, exist_ok=False)
                return cls(path)
            except FileExistsError:
                continue
        raise RunDirectoryError(f"could not create a fresh run directory under {base}")

    @classmethod
    def open(cls, path: str | Path) -> RunDirectory:
        run = cls(path)
        if not (run.path / CONFIG).exists():
            raise RunDirectoryError(f"{run.path} is not a gep-fed run directory (no {CONFIG})")
        return run

    def lock(self) -> RunLock:
        """Hold this directory for this process (``RunLock``): a second process running the
        same directory at once would overwrite the first one's checkpoint and metrics, so it
        is refused by name (``RunDirectoryError``)."""
        return RunLock(self.file(LOCK))

    def config_digest(self) -> str | None:
        """SHA-256 of this run's resolved settings (``config.json``; None: not written yet):
        a checkpoint carries it, so one from another run is never resumed."""
        if not self.file(CONFIG).exists():
            return None
        canonical = json.dumps(self.read_json(CONFIG), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()  # the settings, not their layout

    def checkpoint_round(self) -> int:
        """The last round this directory's checkpoint holds (0: none), read without loading
        its tensors."""
        path = self.file(CHECKPOINT)
        if not path.exists():
            return 0
        try:
            return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["round"])
        except Exception:  # the strategy's own resume names an unreadable checkpoint
            return 0

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def ledger_path(self) -> Path:
        return self.file(LEDGER)

    def write_json(self, name: str, payload: dict) -> Path:
        path = self.file(name)
        write_bytes_atomically(path, (json.dumps(payload, indent=1, default=str) + "\n").encode())
        return path

    def read_json(self, name: str) -> dict:
        path = self.file(name)
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise RunDirectoryError(f"cannot read {path}: {err}") from err

    def append_metrics(self, record: dict) -> None:
        with open(self.file(METRICS), "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, default=float) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def set_aside_torn_metrics(self) -> str | None:
        """A last metrics line without its newline (the run stopped while writing it) is
        moved to ``metrics.jsonl.torn``, kept, so that the next row does not join it; returns
        the text set aside, or None."""
        path = self.file(METRICS)
        if not path.exists():
            return None
        data = path.read_bytes()
        if not data or data.endswith(b"\n"):
            return None
        cut = data.rfind(b"\n") + 1
        with open(self.file(METRICS + ".torn"), "ab") as torn:
            torn.write(data[cut:] + b"\n")
            torn.flush()
            os.fsync(torn.fileno())
        with open(path, "r+b") as fh:
            fh.truncate(cut)
            os.fsync(fh.fileno())
        return data[cut:].decode("utf-8", "replace")

    def note_lost_rounds(self, committed: int) -> list[int]:
        """Rounds 1 to ``committed`` that the checkpoint holds as applied but the metrics do
        not (the run stopped between a round's commit and its metrics row): each gets a row
        that says so, so a resumed run's record neither skips nor invents them. Returns
        those rounds."""
        recorded = {r["round"] for r in self.read_metrics() if r.get("applied")}
        lost = [r for r in range(1, committed + 1) if r not in recorded]
        for rnd in lost:
            self.append_metrics({"round": rnd, "applied": True, "metrics_lost": LOST_ROUND})
        return lost

    def read_metrics(self) -> list[dict]:
        path = self.file(METRICS)
        if not path.exists():
            return []
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise RunDirectoryError(f"{path} line {n} is not JSON: {err}") from err
        return rows

    def save_torch(self, name: str, payload: dict) -> Path:
        return write_atomically(self.file(name), lambda fh: torch.save(payload, fh))

    def load_torch(self, name: str) -> dict | None:
        path = self.file(name)
        if not path.exists():
            return None
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # PyTorch's own text runs to many lines: its first says it
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise RunDirectoryError(
                f"checkpoint {path} cannot be read ({first}): restore it from a backup, or "
                "start a new run (another run name)"
            ) from err


def site_line(rows: list[dict]) -> str:
    """A site's refusals in one line: rounds, reason and cause, the most frequent first."""
    refused = {}
    for r in rows:
        if r["outcome"] != "accepted":
            key = (r["outcome"], r.get("cause") or "")
            refused.setdefault(key, []).append(r["round"])
    if not refused:
        return f"accepted in {len(rows)} round(s)"
    parts = []
    for (reason, cause), rounds in sorted(refused.items(), key=lambda kv: -len(kv[1])):
        parts.append(f"round(s) {round_spans(rounds)}: {reason}" + (f": {cause}" if cause else ""))
    accepted = len(rows) - sum(len(v) for v in refused.values())
    return "; ".join(parts) + (f"; accepted in {accepted} round(s)" if accepted else "")


def read_site_rounds(run_dir: Path) -> dict[str, list[dict]]:
    """Every simulated site's rounds, from its folder of the run directory."""
    out = {}
    for path in sorted((Path(run_dir) / "sites").glob(f"*/{SITE_ROUNDS}")):
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # torn by a crash while it was written: kept there
                log.warning(
                    "%s: line %d is torn (a crash while writing it); left out", path, number
                )
        out[path.parent.name] = sorted(rows, key=lambda r: r.get("round") or 0)
    return out
