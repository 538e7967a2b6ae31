"""A site's pin of the Flower app bundle (FAB) it reviewed, and the check that refuses others.

A SuperNode runs whatever bundle the SuperLink sends it, so a coordinator could ship a ClientApp
that reads the site's data and sends it back. The site therefore reviews the bundle once and
pins its SHA-256; ``gep_fed.flower.pinned_clientapp`` refuses every other bundle before any
of its code is imported.

The pin is the SHA-256 of the bundle file's bytes, because that is how Flower itself names a
bundle all the way through: ``flwr build`` and ``flwr run`` build it the same way
(``flwr.cli.build.build_fab_from_disk``, deterministic: sorted files, fixed dates) and send
``sha256(bytes)`` as its hash; the SuperLink and the SuperNode store it only under
``sha256(content)`` (``store_fab`` rejects any other); and the ClientApp process receives exactly
those bytes. So a site computes its pin from the reviewed ``.fab`` file alone, with any SHA-256
tool (``sha256sum app.fab``), or with::

    python -m gep_fed.flower.app_pin app.fab            # a bundle file
    python -m gep_fed.flower.app_pin path/to/project    # what `flwr run path/to/project` sends
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from collections.abc import Iterable
from pathlib import Path

_SHA256 = re.compile(r"[0-9a-f]{64}")


class UnpinnedAppError(Exception):
    """A bundle the site did not pin: it must not be installed, imported or run."""


def fab_pin(fab: bytes | str | Path) -> str:
    """The pin of a bundle: SHA-256 (hex) of its bytes, given as bytes or a ``.fab`` file, or
    of the bundle Flower's ``flwr run``/``flwr build`` make from a project folder."""
    if isinstance(fab, bytes):
        return hashlib.sha256(fab).hexdigest()
    path = Path(fab).expanduser()
    if path.is_dir():
        # Flower's own builder, so the pin is what `flwr run <folder>` submits.
        from flwr.cli.build import build_fab_from_disk

        return hashlib.sha256(build_fab_from_disk(path)).hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def parse_pins(pins: str | Iterable[str]) -> frozenset[str]:
    """Pinned hashes from ``"h1,h2"`` (commas or spaces) or a list. At least one is required,
    and each must be a full SHA-256: a short or mistyped pin must not match by accident."""
    items = re.split(r"[,\s]+", pins) if isinstance(pins, str) else list(pins)
    parsed = frozenset(p.strip().lower() for p in items if p.strip())
    bad = sorted(p for p in parsed if not _SHA256.fullmatch(p))
    if bad:
        raise ValueError(f"not a SHA-256 hex digest (64 hex characters): {', '.join(bad)}")
    if not parsed:
        raise ValueError("no pinned app bundle: give the SHA-256 of the bundle the site reviewed")
    return parsed


def check_hash(fab_hash: str, pins: Iterable[str]) -> str:
    """Raise ``UnpinnedAppError`` unless ``fab_hash`` is pinned; the error names both."""
    pinned = frozenset(pins)
    if fab_hash not in pinned:
        raise UnpinnedAppError(
            f"app bundle {fab_hash or '(no hash)'} is not the one this site reviewed "
            f"(pinned: {', '.join(sorted(pinned))}); refused before any of its code was loaded"
        )
    return fab_hash


def check_fab(content: bytes, pins: Iterable[str]) -> str:
    """Raise ``UnpinnedAppError`` unless the bundle ``content`` is pinned; returns its hash."""
    return check_hash(fab_pin(content), pins)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m gep_fed.flower.app_pin",
        description="Print the pin (SHA-256) of each reviewed app bundle: a .fab file, or a "
        "project folder (the bundle `flwr run <folder>` would send).",
    )
    ap.add_argument("bundles", nargs="+", metavar="FAB_OR_FOLDER")
    args = ap.parse_args(argv)
    for bundle in args.bundles:
        if not Path(bundle).exists():
            print(f"no such file or folder: {bundle}", file=sys.stderr)
            return 2
        print(fab_pin(bundle))
    return 0


if __name__ == "__main__":
    sys.exit(main())
