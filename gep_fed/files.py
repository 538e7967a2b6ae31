"""Files written whole or not at all, durably, by any number of processes at once.

Ledgers, run files, checkpoints and feature caches are all written this way: into a
temporary file with a name no other writer uses, in the target's folder; flushed and fsynced;
renamed over the target; then the folder is fsynced, since the rename lives in the folder and a
power loss could otherwise undo it. Readers see the old file or the new one, never a part.
Writers of the same path race only on the rename, and the last one wins whole, so two
processes that compute the same cache at once both succeed.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomically(path: str | Path, write: Callable[[BinaryIO], object]) -> Path:
    """Write ``path`` through ``write(file)`` (a binary file object) atomically and durably."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            try:
                write(fh)
            except RuntimeError as err:  # torch.save's own error for a full disk
                raise OSError(f"cannot write {path}: {err}") from err
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return path


def write_bytes_atomically(path: str | Path, data: bytes) -> Path:
    return write_atomically(path, lambda fh: fh.write(data))


def fsync_directory(folder: Path) -> None:
    """Make the renames in ``folder`` durable (POSIX: a rename lives in the directory)."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
