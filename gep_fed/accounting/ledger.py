"""``PrivacyLedger``: the append-only record of every accounted release, with its budget.

Saved as JSON, written atomically (write, fsync, rename), so a crash leaves either the old or
the new file, and a damaged file is refused rather than read as "nothing spent". A site's
ledger carries an HMAC-SHA256 under a key file that only the site holds (created with the
ledger, permissions 0600): an edit made without the key is detected and refused. Without a
key (a server's own ledger, in-memory use) the file carries a plain SHA-256 checksum, which
catches damage but not a deliberate edit. What the HMAC does not stop: whoever holds the key
(the site's own administrator) can rewrite the history. Epsilon is always recomputed from the
events by ``dp-accounting``.

A keyed ledger also keeps a **high-water mark** beside its key (``<key>.mark``, under the same
key): the most steps and epsilon the ledger ever recorded. A copy of the ledger below its mark
(an old backup copied back) is refused, so restoring a backup can never roll the accounting
back; only the ledger file is ever restored, never the mark.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import math
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gep_fed.accounting.events import (
    RDP_ORDERS,
    PrivacyEvent,
    epsilon_pld,
    epsilon_rdp,
    rdp_curve,
)
from gep_fed.files import write_bytes_atomically
from gep_fed.validation import DELTA

FORMAT = "gep-fed-ledger/1"
MARK_FORMAT = "gep-fed-ledger-mark/1"
KEY_BYTES = 32
KEY_SUFFIX = ".key"
MARK_SUFFIX = ".mark"
# A ledger whose RDP epsilon falls this far (relative) below its mark is an older copy; the
# slack only absorbs recomputing the same events (dp-accounting is deterministic).
_MARK_EPSILON_TOLERANCE = 1e-9


class LedgerError(ValueError):
    """A ledger file is missing pieces, damaged, or does not match what the caller expects."""


class BudgetExceededError(RuntimeError):
    """Recording the requested releases would spend more than the privacy budget."""


class PrivacyLedger:
    """Every release one party made, composed into (epsilon, delta).

    Args:
        delta: the delta at which epsilon is reported and the budget enforced.
        budget_epsilon: refuse releases that would bring epsilon above this (None: no limit).
        owner: whose releases these are (a site id, or "federation" for central mode).
        path: where ``record`` saves after each event (None: in memory only).
        key: the site's HMAC key (``read_ledger_key``); None for an unkeyed ledger.
        mark_path: a keyed ledger's high-water mark (default: beside the default key,
            ``<path>.key.mark``); every save raises it, every load checks against it.
    """

    def __init__(
        self,
        delta: float,
        budget_epsilon: float | None = None,
        owner: str = "",
        path: str | Path | None = None,
        events: Sequence[PrivacyEvent] = (),
        key: bytes | None = None,
        mark_path: str | Path | None = None,
    ) -> None:
        DELTA.check("ledger delta", delta)
        if budget_epsilon is not None and not (budget_epsilon > 0):
            raise ValueError(f"budget_epsilon must be > 0, got {budget_epsilon}")
        self.delta = float(delta)
        self.budget_epsilon = None if budget_epsilon is None else float(budget_epsilon)
        self.owner = owner
        self.path = None if path is None else Path(path)
        self.key = key
        if mark_path is None and key is not None and self.path is not None:
            mark_path = default_mark_path(default_key_path(self.path))
        self.mark_path = None if mark_path is None else Path(mark_path)
        self._events: list[PrivacyEvent] = list(events)
        self._ceiling: np.ndarray | None = None  # bound_by's RDP curve
        self._also: PrivacyLedger | None = None  # bound_by's ledger recording the same
        # Digest of the file as this object last read or wrote it: a save over a file that
        # another process changed since then would lose that process's releases.
        self._disk_digest: str | None = None

    @property
    def events(self) -> tuple[PrivacyEvent, ...]:
        return tuple(self._events)

    @property
    def steps(self) -> int:
        return sum(e.steps for e in self._events)

    def epsilon(self, accountant: str = "rdp") -> float:
        """Epsilon spent so far at ``self.delta`` ("rdp" or "pld")."""
        return _EPSILON[accountant](self._events, self.delta)

    def epsilon_if_shares_exposed(self) -> float:
        """The RDP epsilon at ``self.delta`` if every distributed share of this party were
        seen alone (more colluders than it assumed): what its noise share alone guarantees.
        Equal to ``epsilon()`` for a ledger without distributed releases."""
        return epsilon_rdp([e.share_alone() for e in self._events], self.delta)

    def epsilon_after(self, new_events: Sequence[PrivacyEvent]) -> float:
        """The RDP epsilon if ``new_events`` were recorded too."""
        return epsilon_rdp([*self._events, *new_events], self.delta)

    def bound_by(self, ceiling: np.ndarray, also: PrivacyLedger) -> PrivacyLedger:
        """From now on, refuse releases that would bring this ledger's RDP curve above
        ``ceiling`` (at ``RDP_ORDERS``) at any order, and record every release in ``also``
        first, under its budget: one trial of a private selection, which the selection was
        accounted for as at most that curve, recorded in the site's own ledger too. Returns
        the ledger."""
        self._ceiling = np.asarray(ceiling, dtype=float)
        self._also = also
        return self

    def check_budget(self, new_events: Sequence[PrivacyEvent]) -> None:
        """Raise ``BudgetExceededError`` if ``new_events`` would overspend the budget (or
        rise above the curve of ``bound_by``, or overspend its other ledger's budget)."""
        if self._also is not None:
            self._also.check_budget(new_events)
        if self._ceiling is not None:
            above = rdp_curve([*self._events, *new_events]) > self._ceiling * (1 + 1e-9) + 1e-12
            if np.any(above):
                raise BudgetExceededError(
                    f"{self.owner or 'ledger'}: {sum(e.steps for e in new_events)} more step(s) "
                    f"would rise above the curve this ledger is bounded by (RDP order "
                    f"{RDP_ORDERS[int(np.argmax(above))]:g}): a private selection's trial that "
                    "releases more than its selection was accounted for"
                )
        if self.budget_epsilon is None:
            return
        after = self.epsilon_after(new_events)
        if after > self.budget_epsilon:
            spent = self.epsilon()
            raise BudgetExceededError(
                f"{self.owner or 'ledger'}: {sum(e.steps for e in new_events)} more step(s) "
                f"would bring epsilon to {after:.4g} > budget {self.budget_epsilon:g} "
                f"(delta={self.delta:g}); spent so far {spent:.4g} in {self.steps} step(s), "
                f"{max(0.0, self.budget_epsilon - spent):.4g} left"
            )

    def record(self, *events: PrivacyEvent, save: bool = True) -> None:
        """Check the budget, append ``events``, and save if the ledger has a path (unless
        ``save=False``: the caller then saves it, e.g. right after a checkpoint)."""
        self.check_budget(events)
        if self._also is not None:  # the site's own ledger first: it is what privacy rests on
            self._also.record(*events)
        self._events.extend(events)
        if save and self.path is not None:
            self.save()

    def recover(self, events: Sequence[PrivacyEvent]) -> None:
        """Append releases that already happened but were not saved (e.g. found in a
        checkpoint written just before a crash). ``events`` must extend this ledger's."""
        if tuple(events[: len(self._events)]) != self.events:
            raise LedgerError("recovered events do not extend this ledger's events")
        self._events.extend(events[len(self._events) :])
        if self.path is not None:
            self.save()

    # -- persistence ---------------------------------------------------------------------

    def _body(self) -> dict:
        return {
            "format": FORMAT,
            "owner": self.owner,
            "delta": self.delta,
            "budget_epsilon": self.budget_epsilon,
            "events": [e.to_dict() for e in self._events],
        }

    def to_json(self) -> str:
        body = self._body()
        if self.key is not None:
            body["hmac-sha256"] = _mac(self.key, body)
        else:
            body["sha256"] = _digest(body)
        return json.dumps(body, indent=1)

    @classmethod
    def from_json(
        cls, text: str, source: str = "ledger", key: bytes | None = None
    ) -> PrivacyLedger:
        """Parse and verify a ledger: its HMAC under ``key`` (a keyed ledger), else its
        checksum. Anything that does not verify is a ``LedgerError``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise LedgerError(
                f"{source} is not valid JSON ({err}); it may be truncated. It is left untouched: "
                "restore it from a backup, never start a fresh ledger for a party that already "
                "released"
            ) from err
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise LedgerError(f"{source} is not a {FORMAT} file")
        mac, digest = data.pop("hmac-sha256", None), data.pop("sha256", None)
        if key is not None:
            if mac is None:
                raise LedgerError(
                    f"{source} carries no HMAC under the site's key: it was written without "
                    "the key or replaced. It is left untouched; restore it from a backup"
                )
            if not hmac.compare_digest(str(mac), _mac(key, data)):
                raise LedgerError(
                    f"{source} fails its HMAC check: it was changed without the site's key, or "
                    "damaged. It is left untouched; restore it from a backup"
                )
        elif mac is not None:
            raise LedgerError(f"{source} is protected by a site key: open it with that key")
        elif digest != _digest(data):
            raise LedgerError(
                f"{source} fails its checksum: its contents were changed or damaged. It is left "
                "untouched; restore it from a backup"
            )
        try:
            events = [PrivacyEvent.from_dict(e) for e in data["events"]]
            return cls(data["delta"], data["budget_epsilon"], data["owner"], events=events, key=key)
        except (KeyError, TypeError, ValueError) as err:
            raise LedgerError(f"{source} has an invalid entry: {err}") from err

    def save(self, path: str | Path | None = None) -> Path:
        """Atomically write the ledger (temporary file, fsync, rename).

        Refuses (``LedgerError``) to overwrite this ledger's own file if another process
        changed it since this object read or wrote it: that would silently drop releases.
        """
        target = Path(path) if path is not None else self.path
        if target is None:
            raise ValueError("no path to save the ledger to")
        target.parent.mkdir(parents=True, exist_ok=True)
        text = self.to_json()
        with _locked(target):
            if target == self.path:
                current = _file_digest(target)
                if current is not None and current != self._disk_digest:
                    raise LedgerError(
                        f"ledger {target} was changed by another process since it was read; "
                        "not overwriting it (reopen it and record again)"
                    )
            write_bytes_atomically(target, text.encode())
            if target == self.path:
                self._disk_digest = hashlib.sha256(text.encode()).hexdigest()
                if self.key is not None and self.mark_path is not None:
                    self._raise_mark()
        return target

    def _raise_mark(self) -> None:
        """Write the high-water mark after the ledger itself: a crash in between leaves the
        mark behind the ledger (accepted), never ahead of it."""
        current = HighWaterMark(self.owner, self.steps, self.epsilon())
        previous = HighWaterMark.read(self.mark_path, self.key, missing_ok=True)
        if previous is not None:
            current = previous.raised_to(current)
        current.write(self.mark_path, self.key)

    def check_mark(self) -> None:
        """Refuse (``LedgerError``) a keyed ledger below its high-water mark, or one whose
        mark is missing: it is an older copy of the ledger, and opening it would forget
        releases the site already made. The file is left as it is."""
        if self.key is None or self.mark_path is None:
            return
        mark = HighWaterMark.read(self.mark_path, self.key)
        source = f"ledger {self.path}" if self.path else "ledger"
        if mark.owner != self.owner:
            raise LedgerError(
                f"{source} belongs to {self.owner!r} but its high-water mark {self.mark_path} "
                f"to {mark.owner!r}: they are not one ledger's files"
            )
        spent = self.epsilon()
        if self.steps < mark.steps or spent < mark.epsilon * (1 - _MARK_EPSILON_TOLERANCE):
            raise LedgerError(
                f"{source} records {self.steps} step(s), epsilon {spent:.4f}, but this site has "
                f"already recorded {mark.steps} step(s), epsilon {mark.epsilon:.4f} (high-water "
                f"mark {self.mark_path}): it is an older copy, e.g. restored from a backup. It "
                "is left untouched: put back the newest copy of the ledger (never an older "
                "one, and never an older mark)"
            )

    @classmethod
    def load(
        cls,
        path: str | Path,
        key: bytes | None = None,
        mark_path: str | Path | None = None,
        *,
        verify_mark: bool = True,
    ) -> PrivacyLedger:
        """Read and verify a ledger; a keyed one also against its high-water mark
        (``mark_path``, default beside the default key; ``verify_mark=False`` only to give a
        ledger kept before marks existed its first mark)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise LedgerError(f"cannot read ledger {path}: {err}") from err
        except UnicodeDecodeError as err:
            raise LedgerError(
                f"ledger {path} is not text ({err.reason} at byte {err.start}): it is damaged "
                "or another file. It is left untouched: restore it from a backup"
            ) from err
        ledger = cls.from_json(text, source=f"ledger {path}", key=key)
        ledger.path = path
        if key is not None:
            ledger.mark_path = Path(mark_path or default_mark_path(default_key_path(path)))
        if verify_mark:
            ledger.check_mark()
        ledger._disk_digest = hashlib.sha256(text.encode()).hexdigest()
        return ledger

    @classmethod
    def load_keyed(cls, path: str | Path, key_path: str | Path | None = None) -> PrivacyLedger:
        """A site's ledger, verified under its key file (default: ``<path>.key``) and against
        the high-water mark beside that key."""
        key_path = Path(key_path or default_key_path(path))
        return cls.load(path, read_ledger_key(key_path), default_mark_path(key_path))

    @classmethod
    def open(
        cls,
        path: str | Path,
        delta: float,
        budget_epsilon: float | None = None,
        owner: str = "",
        *,
        key: bytes | None = None,
        mark_path: str | Path | None = None,
        create: bool = False,
    ) -> PrivacyLedger:
        """Load the ledger at ``path``; with ``create``, start an empty one if none exists.

        Without ``create`` a missing file is an error: a party that already released must
        never restart its accounting from zero because its file went missing. A keyed ledger
        is created only where it has no high-water mark yet (a mark means it has a history).
        An existing file must have the same delta; its budget is replaced by
        ``budget_epsilon`` (the owner's current choice).
        """
        path = Path(path)
        if key is not None and mark_path is None:
            mark_path = default_mark_path(default_key_path(path))
        if not path.exists():
            if create and mark_path is not None and Path(mark_path).exists():
                raise LedgerError(
                    f"ledger {path} is missing but its high-water mark {mark_path} exists: this "
                    "site has a ledger history, so a new ledger would restart its accounting. "
                    "Restore the newest copy of the ledger from a backup"
                )
            if not create:
                raise LedgerError(
                    f"ledger {path} does not exist. Privacy accounting is never restarted "
                    "silently: restore the file from a backup, or, if this party has never "
                    "released anything from this data, create it once (`gep-fed ledger init`, "
                    "or node config new-ledger=true)"
                )
            ledger = cls(delta, budget_epsilon, owner, path, key=key, mark_path=mark_path)
            ledger.save()
            return ledger
        ledger = cls.load(path, key, mark_path)
        if not math.isclose(ledger.delta, delta, rel_tol=0, abs_tol=0):
            raise LedgerError(
                f"ledger {path} accounts at delta={ledger.delta:g}, but delta={delta:g} was "
                "requested; use the same delta for one party's whole history"
            )
        ledger.budget_epsilon = budget_epsilon
        return ledger

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(owner={self.owner!r}, steps={self.steps}, "
            f"epsilon={self.epsilon():.4g}, delta={self.delta:g}, budget={self.budget_epsilon})"
        )


_EPSILON = {"rdp": epsilon_rdp, "pld": epsilon_pld}


def _file_digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive advisory lock beside ``path`` (processes on one machine)."""
    with open(path.with_name(path.name + ".lock"), "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


@dataclass(frozen=True)
class HighWaterMark:
    """The most a keyed ledger ever recorded: steps and RDP epsilon at its delta.

    Kept in its own file beside the ledger's key, under an HMAC with that key (domain
    separated from the ledger's own), and only ever raised."""

    owner: str
    steps: int
    epsilon: float

    def raised_to(self, other: HighWaterMark) -> HighWaterMark:
        return HighWaterMark(
            self.owner, max(self.steps, other.steps), max(self.epsilon, other.epsilon)
        )

    def _body(self) -> dict:
        return {
            "format": MARK_FORMAT,
            "owner": self.owner,
            "steps": self.steps,
            "epsilon": self.epsilon,
        }

    def write(self, path: Path, key: bytes) -> None:
        body = self._body()
        body["hmac-sha256"] = _mac(key, body, domain=b"mark:")
        write_bytes_atomically(path, json.dumps(body, indent=1).encode())

    @classmethod
    def read(cls, path: Path, key: bytes, missing_ok: bool = False) -> HighWaterMark | None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            if missing_ok:
                return None
            raise LedgerError(
                f"the ledger's high-water mark {path} is missing: without it an older copy of "
                "the ledger cannot be told from the newest. Put the mark back, or, for a "
                "ledger kept before marks existed, check it is the newest copy and record its "
                "spending as the mark: gep-fed ledger mark <ledger>"
            ) from None
        except OSError as err:
            raise LedgerError(f"cannot read the ledger's high-water mark {path}: {err}") from err
        try:
            data = json.loads(text)
            mac = data.pop("hmac-sha256")
            ok = data.get("format") == MARK_FORMAT and hmac.compare_digest(
                str(mac), _mac(key, data, domain=b"mark:")
            )
            mark = cls(str(data["owner"]), int(data["steps"]), float(data["epsilon"]))
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise LedgerError(
                f"the ledger's high-water mark {path} fails its HMAC check: it was changed "
                "without the site's key, or damaged. It is left untouched"
            )
        return mark


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True).encode()


def _digest(body: dict) -> str:
    return hashlib.sha256(_canonical(body)).hexdigest()


def _mac(key: bytes, body: dict, domain: bytes = b"") -> str:
    return hmac.new(key, domain + _canonical(body), hashlib.sha256).hexdigest()


def default_key_path(ledger_path: str | Path) -> Path:
    """Where a ledger's key lives unless configured otherwise: beside it, ``<ledger>.key``."""
    return Path(str(ledger_path) + KEY_SUFFIX)


def selections_folder(ledger_path: str | Path) -> Path:
    """Where a site keeps its private selections' records and their trials' ledgers, beside
    its ledger (``gep_fed.federation.site_selection``)."""
    path = Path(ledger_path)
    return path.parent / f"{path.name}.selections"


def default_mark_path(key_path: str | Path) -> Path:
    """Where a keyed ledger's high-water mark lives: beside its key, ``<key>.mark``."""
    return Path(str(key_path) + MARK_SUFFIX)


def create_ledger_key(path: str | Path) -> bytes:
    """Write a new random HMAC key to ``path`` (owner read/write only); refuses to overwrite
    an existing key, which would orphan the ledger it protects."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = os.urandom(KEY_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise LedgerError(f"ledger key {path} already exists; not replacing it") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(key.hex() + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return key


def read_ledger_key(path: str | Path) -> bytes:
    """The HMAC key at ``path``; refuses a missing, malformed or group/world-readable key."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise LedgerError(
            f"ledger key {path} is missing: the ledger cannot be verified without it. "
            "Restore the key from the site's backup"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise LedgerError(f"cannot read ledger key {path}: {err}") from err
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise LedgerError(
            f"ledger key {path} is accessible to other users (mode {stat.S_IMODE(mode):o}); "
            f"make it private with: chmod 600 {path}"
        )
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise LedgerError(f"ledger key {path} is not a {KEY_BYTES}-byte hex key")
    return key
