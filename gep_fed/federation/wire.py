"""The message layout between the federation server and its sites, and its validation.

Both sides import this module: record names, array names and order, dtypes, and the protocol
version live here once. It knows nothing about Flower: arrays travel as ``{name: array}``
mappings whose values expose ``dtype``, ``shape`` and ``numpy()`` (a Flower ``Array`` does;
``as_wire_array`` wraps a numpy array), so their declared dtype and shape are checked before
any payload is deserialised. Everything received is validated; problems raise ``WireError``
naming the sender and the field.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Protocol

import numpy as np
import torch

from gep_fed.accounting.events import PrivacyEvent
from gep_fed.federation.modes import MODE_NAMES, Mode, mode_named
from gep_fed.mechanisms.anchors import AnchorSet
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.mechanism import ClippedSums, Mechanism
from gep_fed.mechanisms.subspace import AnchorSubspace
from gep_fed.validation import (
    AT_LEAST_ONE,
    AUGMENTATION_COPIES,
    BASIS_DTYPES,
    LEARNING_RATE,
    MOMENTUM,
    ROUNDS,
    ConfigError,
)

# 2: the round config carries the privacy contract as "privacy.*" keys; refusals are codes.
# 3: no model spec in the round config (the run's task builds the model at both ends).
# 4: the round config carries augmentation_copies.
# 5: the round config carries last_round (a site refuses a run it cannot finish).
# 6: the round config carries scored (a site plans the score it will be asked for).
# 7: the round config carries selection (a random number of trials, recorded by the site).
# 8: a distributed round's keys are signed over the digest of its settings, and its vectors
#    are masked modulo the shares' own 2**bits (secure sum v2).
# 9: a client-mode round carries site_examples, the public size each site normalises by.
PROTOCOL_VERSION = 9

# Record names in a message's RecordDict.
GLOBAL_MODEL = "global-model"  # server -> site: model state, float32, keys = state_dict names
BASIS = "basis"  # server -> site: one (p_g, k_g) matrix per group, "basis.<index>"
ROUND_CONFIG = "round-config"  # server -> site: RoundConfig
CLIPPED_SUMS = "clipped-sums"  # site -> server (central): "embedding" (k,), "residual" (p,)
MODEL_DELTA = "model-delta"  # site -> server (client-side): noisy delta per parameter
REPLY_META = "reply-meta"  # site -> server: protocol, round, mode
REPLY_METRICS = "metrics"  # site -> server: counts of bytes, steps, epsilon (data-free)
# A score of the served model on the sites' held-out examples (a query, after the rounds):
SCORE_REQUEST = "score-request"  # server -> site: protocol, classes (with GLOBAL_MODEL)
SITE_SCORE = "site-score"  # site -> server: "counts", (2, classes) float64, noised by the site
MAX_SCORE_CLASSES = 100_000

# Largest array a reply may declare, in elements; anything bigger is rejected unread.
MAX_ELEMENTS = 200_000_000
# A received basis further than this from orthonormal (max_g ||B_g^T B_g - I||_F) is refused.
# Clipping stays correct for any basis (the residual bound includes this error), but a basis
# this far off is not one the server computed honestly; float16 transport stays far below.
MAX_BASIS_ORTHONORMALITY_ERROR = 0.05

# Why a site refused a round: a fixed vocabulary, so a refusal carries no data-dependent text.
# Sent as a Flower ``Error(code, reason)``; the server records only codes it knows.
REFUSALS = {
    "malformed round": 601,
    "mode not allowed": 602,
    "over budget": 603,
    "replayed round": 604,
    "site error": 605,
    "too few sites": 606,
    "over compute limit": 607,
    # distributed mode: a listed key that no pinned peer signed for this round
    "unpinned peer": 608,
    # distributed mode: the round splits the noise into other than the site's noise-shares
    "other noise split": 609,
    # a score query to a site whose node config releases no score (no score-noise)
    "release not allowed": 610,
}


class RoundRefused(Exception):
    """A site declines a round; ``reason`` is one of ``REFUSALS`` (nothing data-dependent)."""

    def __init__(self, reason: str) -> None:
        if reason not in REFUSALS:
            raise ValueError(f"unknown refusal {reason!r}; known: {sorted(REFUSALS)}")
        super().__init__(reason)
        self.reason = reason
        self.code = REFUSALS[reason]


# Flower's own error codes (flwr.common.constant.ErrorCode), described without their text,
# which may hold an exception message from the site.
_FLOWER_ERRORS = {
    0: "unknown error",
    1: "the site could not load its ClientApp",
    2: "the site's ClientApp raised an exception",
    3: "message unavailable",
    4: "reply unavailable",
    5: "node unavailable",
    6: "a mod's precondition failed",
    7: "invalid app bundle",
    8: "the site's ClientApp crashed",
}


def describe_error(code: int, reason: str | None) -> str:
    """A site's error reply as the server may record it: a refusal code's fixed text, or a
    fixed description of Flower's code; never the free text of the reply."""
    for text, known in REFUSALS.items():
        if code == known:
            return f"refused: {text}"
    return f"{_FLOWER_ERRORS.get(code, 'error')} (code {code}; any text withheld)"


class WireError(ValueError):
    """A message from ``sender`` is malformed in ``field``."""

    def __init__(self, sender: str, field: str, problem: str) -> None:
        super().__init__(f"{sender}: field {field!r}: {problem}")
        self.sender, self.field, self.problem = sender, field, problem


class WireArray(Protocol):
    dtype: str
    shape: list[int] | tuple[int, ...]

    def numpy(self) -> np.ndarray: ...


@dataclass(frozen=True)
class _NumpyWire:
    array: np.ndarray

    @property
    def dtype(self) -> str:
        return str(self.array.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def numpy(self) -> np.ndarray:
        return self.array


def as_wire_array(array: np.ndarray) -> WireArray:
    """Wrap a numpy array so the decoders can read it like a received array."""
    return _NumpyWire(np.asarray(array))


@dataclass(frozen=True)
class SelectionTerms:
    """A round's private selection with a random number of trials (Papernot & Steinke, ICLR
    2022), as the trusted server of central mode declares it: the site records every trial's
    releases in its own ledger, against its own budget, and keeps each trial's rounds in a
    ledger of that trial's own too, under the selection's bound of one trial.

    Attributes:
        search: the search's id, 32 hex digits, kept across a resumed search (the folder of
            its trials' ledgers at a site).
        trial: the trial's number in the search (from 1).
        event: the whole selection (``PrivacyEvent`` with ``selection`` set): one trial's
            releases bounded by one release repeated, inside the law of the number of trials.
    """

    search: str
    trial: int
    event: PrivacyEvent

    def to_json(self) -> str:
        record = {"search": self.search, "trial": self.trial, "event": self.event.to_dict()}
        return json.dumps(record, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SelectionTerms:
        """Decode and validate; anything wrong is a ``ValueError`` naming it."""
        values = json.loads(text)
        if not isinstance(values, dict) or set(values) != {"search", "trial", "event"}:
            raise ValueError(f"keys must be search, trial and event, got {text[:200]!r}")
        search, trial = values["search"], values["trial"]
        if not (isinstance(search, str) and re.fullmatch("[0-9a-f]{32}", search)):
            raise ValueError(f"search must be 32 hex digits, got {search!r}")
        if isinstance(trial, bool) or not isinstance(trial, int) or not 1 <= trial <= 100_000:
            raise ValueError(f"trial must be an int from 1 to 100,000, got {trial!r}")
        if not isinstance(values["event"], dict):
            raise ValueError(f"event must be a privacy event's record, got {values['event']!r}")
        event = PrivacyEvent.from_dict(values["event"])
        if event.selection is None or event.round is not None:
            raise ValueError("event must be a whole selection's (selection set, no round)")
        return cls(search, trial, event)


@dataclass(frozen=True)
class RoundConfig:
    """What the server asks of every site for one round (public information only).

    A site checks all of it against its own policy and ledger before computing anything.

    Attributes:
        round: the federated round (from 1; strictly increasing within a run).
        last_round: the run's last planned round (``round`` to 100,000 rounds ahead): a site
            refuses, before recording anything, a run whose remaining rounds its budget
            cannot hold.
        mode: "central" (site sends unnoised clipped sums to a trusted server), "client"
            (site adds its own noise, takes ``local_steps`` steps, sends a noisy model delta)
            or "distributed" (site sends its quantised noised share, masked for the secure sum).
        privacy: the privacy contract (mechanism, sigma, q, clip norms): what the site clips,
            noises and accounts, and what the server's own mechanism is built from.
        local_steps, local_lr, local_momentum: the site's optimiser in client mode.
        augmentation_copies: K, each example's gradient is the mean over K augmented copies
            (the site's own task's augmentation), clipped once; 0: none. It sets the
            site's compute, not its privacy: the sensitivity is one clip bound either way.
        basis_id: which basis the site must use (-1: none); a site keeps the last one it
            received, so the server sends the basis only when ``basis_id`` changes.
        basis_dtype: "float32" or "float16" on the wire (the site uses what it received).
        layout: the parameter layout as JSON (names, shapes, groups); the site checks its
            own model (built by the run's task) against it.
        scored: after the last round the server will ask the site to score the run's final
            model (``gep-fed tune --site-validation``): a site that releases scores plans
            that release with the run's rounds, so a run whose score its budget cannot hold
            is refused from its first round, before anything is spent on it.
        selection: "" outside a private selection with a random number of trials (central
            mode, ``gep-fed tune --random-trials`` under ``flwr run``); else its terms as
            JSON (``SelectionTerms``): the search's id, the trial, and the selection's event,
            which the site records in its ledger once per search and under whose bound it
            keeps each trial's rounds, in a ledger of that trial's own.
        server_noise_seeded: the server's own noise (central mode) is fixed by a seed, for
            tests and benchmarks: whoever knows the seed can remove it, so a site without a
            seed of its own (every deployed site) refuses the round.
        site_examples: client mode: n, the declared number of examples per site (the
            declared N over the sites), by which every site normalises its noisy sums (its
            expected batch is q n) and Langevin's schedule runs. A public number: a site's own
            count would set the scale of its update's noise and tell whether one example
            was added. 0 in the other modes, where the server normalises.
    """

    round: int
    last_round: int
    mode: str
    privacy: PrivacyContract
    local_steps: int
    local_lr: float
    local_momentum: float
    augmentation_copies: int
    basis_id: int
    basis_dtype: str
    layout: str
    scored: bool = False
    selection: str = ""
    server_noise_seeded: bool = False
    site_examples: int = 0
    protocol: int = PROTOCOL_VERSION

    @property
    def noise_mode(self) -> Mode:
        """The round's noise placement (validated when decoded)."""
        return mode_named(self.mode)

    @cached_property
    def selection_terms(self) -> SelectionTerms | None:
        """The round's private selection (validated when decoded); None outside one."""
        return SelectionTerms.from_json(self.selection) if self.selection else None

    @cached_property
    def mechanism(self) -> Mechanism:
        """The round's mechanism, built once from its contract (what the site clips and
        noises with)."""
        return self.privacy.build_mechanism()

    def to_record(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "privacy"}
        return {**out, **self.privacy.to_record()}

    def digest(self) -> bytes:
        """SHA-256 of this config's record in canonical JSON: what a distributed round's
        signatures and masks are bound to (``gep_fed.federation.secure_sum.RoundBinding``),
        so that the sites summed together were all sent the same settings."""
        text = json.dumps(self.to_record(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).digest()

    @classmethod
    def from_record(cls, record: Mapping, sender: str = "server") -> RoundConfig:
        """Decode and validate every field; anything wrong is a ``WireError`` naming it."""
        values = dict(record)
        _check_protocol(sender, ROUND_CONFIG, values.get("protocol"))
        try:
            privacy = PrivacyContract.from_record(values)
        except ConfigError as err:
            raise WireError(sender, f"{ROUND_CONFIG}.privacy", str(err)) from None
        plain = {f.name for f in fields(cls)} - {"privacy"}
        missing = sorted(plain - set(values))
        if missing:
            raise WireError(sender, ROUND_CONFIG, f"missing keys {missing}")
        unknown = sorted(k for k in values if k not in plain and not k.startswith("privacy."))
        if unknown:
            raise WireError(sender, ROUND_CONFIG, f"unexpected keys {unknown}")
        for name, kind in _ROUND_TYPES.items():
            value = values[name]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                values[name] = value = float(value)
            if isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind):
                raise WireError(sender, name, f"must be {kind.__name__}, got {value!r}")
        cfg = cls(privacy=privacy, **{k: values[k] for k in plain})
        # the same declared ranges as the run's configuration (FederationConfig)
        checks = {
            "round": AT_LEAST_ONE.contains(cfg.round),
            "last_round": ROUNDS.contains(cfg.last_round - cfg.round + 1),
            "mode": cfg.mode in MODE_NAMES,
            "local_steps": AT_LEAST_ONE.contains(cfg.local_steps),
            "local_lr": LEARNING_RATE.contains(cfg.local_lr),
            "local_momentum": MOMENTUM.contains(cfg.local_momentum),
            "augmentation_copies": AUGMENTATION_COPIES.contains(cfg.augmentation_copies),
            "basis_id": cfg.basis_id >= -1,
            "basis_dtype": cfg.basis_dtype in BASIS_DTYPES,
            # a client-mode site normalises by it; elsewhere the server does
            "site_examples": AT_LEAST_ONE.contains(cfg.site_examples)
            if cfg.mode == "client"
            else cfg.site_examples == 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise WireError(sender, name, f"out of range: {getattr(cfg, name)!r}")
        if privacy.mechanism_type.uses_subspace != (cfg.basis_id >= 0):
            raise WireError(sender, "basis_id", "does not match the mechanism")
        try:
            cfg.selection_terms  # noqa: B018 (decoded once, here)
        except (ValueError, KeyError, TypeError) as err:
            raise WireError(sender, "selection", f"cannot be decoded: {err}") from None
        try:
            cfg.parameter_layout()
        except (ValueError, KeyError, TypeError) as err:
            raise WireError(sender, "layout", f"cannot be decoded: {err}") from None
        return cfg

    def parameter_layout(self) -> ParameterLayout:
        return ParameterLayout.from_dict(json.loads(self.layout))


_ROUND_TYPES = {
    "round": int,
    "last_round": int,
    "mode": str,
    "local_steps": int,
    "local_lr": float,
    "local_momentum": float,
    "augmentation_copies": int,
    "basis_id": int,
    "basis_dtype": str,
    "layout": str,
    "scored": bool,
    "selection": str,
    "server_noise_seeded": bool,
    "site_examples": int,
}


def _check_protocol(sender: str, field: str, version: object) -> None:
    if version != PROTOCOL_VERSION:
        raise WireError(
            sender,
            f"{field}.protocol",
            f"protocol version {version!r}, this side speaks {PROTOCOL_VERSION}",
        )


def _read_array(
    sender: str,
    field: str,
    arrays: Mapping[str, WireArray],
    name: str,
    shape: tuple[int, ...],
    dtypes: tuple[str, ...] = ("float32",),
) -> np.ndarray:
    """Check an array's declared dtype and shape, then read it and check it is finite."""
    where = f"{field}.{name}"
    if name not in arrays:
        raise WireError(sender, where, "missing")
    arr = arrays[name]
    declared = tuple(int(d) for d in arr.shape)
    if math.prod(declared) > MAX_ELEMENTS:
        raise WireError(sender, where, f"declares {math.prod(declared)} elements (oversized)")
    if declared != tuple(shape):
        raise WireError(sender, where, f"shape {declared}, expected {tuple(shape)}")
    if str(arr.dtype) not in dtypes:
        raise WireError(sender, where, f"dtype {arr.dtype}, expected one of {dtypes}")
    try:
        value = np.asarray(arr.numpy())
    except Exception as err:  # a payload that does not deserialise
        raise WireError(sender, where, f"payload cannot be read: {err}") from err
    if value.shape != tuple(shape) or str(value.dtype) not in dtypes:
        raise WireError(sender, where, f"payload is {value.dtype}{value.shape}, not as declared")
    if not np.isfinite(value).all():
        raise WireError(sender, where, "contains NaN or inf")
    return value


def _no_extra(sender: str, field: str, arrays: Mapping, expected: set[str]) -> None:
    extra = sorted(set(arrays) - expected)
    if extra:
        raise WireError(sender, field, f"unexpected arrays {extra}")


def check_reply_meta(meta: Mapping, sender: str, round_: int, mode: str) -> None:
    """Validate a reply's protocol version, round and mode."""
    _check_protocol(sender, REPLY_META, meta.get("protocol"))
    if meta.get("round") != round_:
        raise WireError(sender, f"{REPLY_META}.round", f"{meta.get('round')!r}, expected {round_}")
    if meta.get("mode") != mode:
        raise WireError(sender, f"{REPLY_META}.mode", f"{meta.get('mode')!r}, expected {mode!r}")


# The metrics a reply may carry: data-free, and the training loss a site releases by its own
# node config (``release-metrics``), named as outside the guarantee.
SITE_EPSILON, BASIS_ID, LOCAL_STEPS = "site-epsilon", "basis-id", "local-steps"
BASIS_BYTES_RECEIVED = "basis-bytes-received"
UNPROTECTED_LOSS = "train-loss-OUTSIDE-PRIVACY-GUARANTEE"
REPLY_METRIC_KEYS = frozenset(
    {SITE_EPSILON, BASIS_ID, LOCAL_STEPS, BASIS_BYTES_RECEIVED, UNPROTECTED_LOSS}
)


def check_reply_metrics(metrics: Mapping, sender: str, latest_basis: int) -> None:
    """Validate a reply's metrics: known keys, each a finite number (the epsilon may be
    infinite: a site that accepts rounds without noise), the epsilon >= 0, the counts
    integers >= 0 and the basis one the server has sent (-1: none). A site's reply with
    others is rejected by name before anything of it is used."""
    unknown = sorted(set(metrics) - REPLY_METRIC_KEYS)
    if unknown:
        raise WireError(sender, REPLY_METRICS, f"unknown key(s) {unknown}")
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise WireError(sender, f"{REPLY_METRICS}.{key}", "not a number")
        if math.isnan(value) or (math.isinf(value) and key != SITE_EPSILON):
            raise WireError(sender, f"{REPLY_METRICS}.{key}", "not finite")
    if metrics.get(SITE_EPSILON, 0) < 0:
        raise WireError(sender, f"{REPLY_METRICS}.{SITE_EPSILON}", "negative")
    for key in (BASIS_ID, LOCAL_STEPS, BASIS_BYTES_RECEIVED):
        value = metrics.get(key, 0)
        low = -1 if key == BASIS_ID else 0
        if value != int(value) or value < low:
            raise WireError(sender, f"{REPLY_METRICS}.{key}", f"not an integer >= {low}")
    if metrics.get(BASIS_ID, -1) > latest_basis:
        raise WireError(sender, f"{REPLY_METRICS}.{BASIS_ID}", "a basis the server never sent")


def reply_meta(round_: int, mode: str) -> dict:
    return {"protocol": PROTOCOL_VERSION, "round": round_, "mode": mode}


# -- the sites' validation score ---------------------------------------------------------------


def score_request(classes: int) -> dict:
    """The query's config: the protocol and the classes the served model scores (public)."""
    return {"protocol": PROTOCOL_VERSION, "classes": classes}


def check_score_request(record: Mapping, sender: str = "server") -> int:
    """A score query's number of classes, validated."""
    _check_protocol(sender, SCORE_REQUEST, record.get("protocol"))
    classes = record.get("classes")
    if isinstance(classes, bool) or not isinstance(classes, int):
        raise WireError(sender, f"{SCORE_REQUEST}.classes", f"{classes!r} is not an integer")
    if not 2 <= classes <= MAX_SCORE_CLASSES:
        raise WireError(sender, f"{SCORE_REQUEST}.classes", f"{classes} not in [2, 100000]")
    return classes


def encode_counts(counts: np.ndarray) -> dict[str, np.ndarray]:
    return {"counts": np.asarray(counts, dtype=np.float64)}


def decode_counts(arrays: Mapping[str, WireArray], sender: str, classes: int) -> np.ndarray:
    """A site's noised (2, classes) counts: exactly that array, finite."""
    counts = _read_array(sender, SITE_SCORE, arrays, "counts", (2, classes), ("float64",))
    _no_extra(sender, SITE_SCORE, arrays, {"counts"})
    return counts


# -- basis ---------------------------------------------------------------------------------


def encode_basis(subspace: AnchorSubspace, dtype: str = "float32") -> dict[str, np.ndarray]:
    np_dtype = np.dtype(dtype)
    return {
        f"basis.{i}": b.detach().cpu().numpy().astype(np_dtype)
        for i, b in enumerate(subspace.bases)
    }


def basis_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())


def decode_basis(
    arrays: Mapping[str, WireArray], layout: ParameterLayout, dtype: str, sender: str = "server"
) -> AnchorSubspace:
    """The received basis as float32 tensors: the site projects on exactly what it received
    (with float16 transport, the float16 values), so ``g = lift(embed(g)) + residual`` holds."""
    bases = []
    for i, group in enumerate(layout.groups):
        name = f"basis.{i}"
        if name not in arrays:
            raise WireError(sender, f"{BASIS}.{name}", "missing")
        k = int(arrays[name].shape[1]) if len(arrays[name].shape) == 2 else -1
        if not (1 <= k <= group.size):
            raise WireError(sender, f"{BASIS}.{name}", f"bad shape {tuple(arrays[name].shape)}")
        value = _read_array(sender, BASIS, arrays, name, (group.size, k), (dtype,))
        bases.append(torch.from_numpy(value.astype(np.float32)))
    _no_extra(sender, BASIS, arrays, {f"basis.{i}" for i in range(len(layout.groups))})
    return checked_basis(AnchorSubspace(layout, tuple(bases)), sender)


def checked_basis(subspace: AnchorSubspace, sender: str = "server") -> AnchorSubspace:
    """``subspace``, refused when further from orthonormal than an honest server's basis."""
    if not subspace.orthonormality_error <= MAX_BASIS_ORTHONORMALITY_ERROR:
        raise WireError(
            sender,
            BASIS,
            f"not orthonormal (error {subspace.orthonormality_error:.3g} > "
            f"{MAX_BASIS_ORTHONORMALITY_ERROR})",
        )
    return subspace


# With ``basis_transport = "rebuild"`` the BASIS record carries the anchors and the basis'
# coefficients in their gradients instead of the bases (``anchors.inputs``, ``anchors.labels``,
# ``coefficients.<group>``); the site rebuilds the bases (``rebuild_anchor_subspace``).
ANCHOR_INPUT_DTYPES = ("float32", "int64")


def encode_anchors(anchors: AnchorSet) -> dict[str, np.ndarray]:
    labels = anchors.labels.detach().cpu()
    out = {
        "anchors.inputs": anchors.inputs.detach().cpu().numpy(),
        "anchors.labels": labels.numpy().astype(
            np.float32 if labels.is_floating_point() else np.int64
        ),
    }
    for i, c in enumerate(anchors.coefficients):
        out[f"coefficients.{i}"] = c.detach().cpu().numpy().astype(np.float32)
    return out


def is_anchor_record(arrays: Mapping) -> bool:
    """Whether a BASIS record carries anchors and coefficients (to rebuild) or bases."""
    return "anchors.inputs" in arrays


# Bytes per element of the dtypes an anchor record may declare (any other is refused when
# read; counted at 8 bytes until then).
_ITEM_BYTES = {"float32": 4, "int64": 8}


@dataclass(frozen=True)
class RebuildCost:
    """What rebuilding the bases from an anchor record costs a site, from shapes alone (a
    site's policy bounds it: ``SitePolicy.admit_rebuild``).

    Attributes:
        work: multiply-adds of the bases ``B_g = G_g^T C_g``: ``m * sum_g p_g k_g`` for ``m``
            anchors and ``k_g`` columns in a group of ``p_g`` parameters (at least ``m * p``).
            The anchors' ``m`` backward passes come on top; their inputs are in the record,
            so ``bytes`` bounds ``m``.
        bytes: the record's arrays plus the rebuilt float32 bases (``4 * sum_g p_g k_g``):
            what the site holds for the rebuild, beyond one ``max-chunk`` of gradients.
    """

    work: int
    bytes: int

    @classmethod
    def of(
        cls, layout: ParameterLayout, num_anchors: int, columns: Sequence[int], record_bytes: int
    ) -> RebuildCost:
        basis = sum(g.size * k for g, k in zip(layout.groups, columns, strict=True))
        return cls(num_anchors * basis, record_bytes + 4 * basis)

    @classmethod
    def of_anchors(cls, anchors: AnchorSet, layout: ParameterLayout) -> RebuildCost:
        """The cost of rebuilding from ``anchors`` (their shapes; nothing is read)."""
        arrays = (anchors.inputs, anchors.labels, *anchors.coefficients)
        record = sum(a.numel() * a.element_size() for a in arrays)
        columns = [c.shape[1] for c in anchors.coefficients]
        return cls.of(layout, anchors.inputs.shape[0], columns, record)


def decode_anchors(
    arrays: Mapping[str, WireArray],
    layout: ParameterLayout,
    sender: str = "server",
    admit: Callable[[RebuildCost], None] | None = None,
) -> AnchorSet:
    """The anchors (inputs, labels) and each group's ``(m, k_g)`` coefficients, checked:
    ``1 <= k_g <= min(m, p_g)``, every array finite and of a declared shape. Every declared
    shape is checked before any array is read; ``admit`` (a site's
    ``SitePolicy.admit_rebuild``) then sees the rebuild's cost from those shapes and may
    refuse it (``RoundRefused``) before anything is read or allocated."""

    def declared(name: str) -> tuple[int, ...]:
        if name not in arrays:
            raise WireError(sender, f"{BASIS}.{name}", "missing")
        return tuple(int(d) for d in arrays[name].shape)

    shape = declared("anchors.inputs")
    if len(shape) < 2 or shape[0] < 1:
        raise WireError(sender, f"{BASIS}.anchors.inputs", f"bad shape {shape}")
    m = shape[0]
    label_shape = declared("anchors.labels")
    if label_shape[:1] != (m,) or len(label_shape) > 2:
        raise WireError(
            sender, f"{BASIS}.anchors.labels", f"bad shape {label_shape} for {m} anchors"
        )
    coefficient_shapes = []
    for i, group in enumerate(layout.groups):
        name = f"coefficients.{i}"
        cshape = declared(name)
        if len(cshape) != 2 or cshape[0] != m or not (1 <= cshape[1] <= min(m, group.size)):
            raise WireError(sender, f"{BASIS}.{name}", f"bad shape {cshape} for {m} anchors")
        coefficient_shapes.append(cshape)
    expected = {"anchors.inputs", "anchors.labels"} | {
        f"coefficients.{i}" for i in range(len(layout.groups))
    }
    _no_extra(sender, BASIS, arrays, expected)
    if admit is not None:
        record = sum(
            math.prod(declared(name)) * _ITEM_BYTES.get(str(arrays[name].dtype), 8)
            for name in expected
        )
        admit(RebuildCost.of(layout, m, [k for _, k in coefficient_shapes], record))
    inputs = _read_array(sender, BASIS, arrays, "anchors.inputs", shape, ANCHOR_INPUT_DTYPES)
    labels = _read_array(
        sender,
        BASIS,
        arrays,
        "anchors.labels",
        label_shape,
        ("int64",) if len(label_shape) == 1 else ("float32",),
    )
    coefficients = tuple(
        torch.from_numpy(_read_array(sender, BASIS, arrays, f"coefficients.{i}", cshape))
        for i, cshape in enumerate(coefficient_shapes)
    )
    return AnchorSet(torch.from_numpy(inputs), torch.from_numpy(labels), coefficients)


# -- central mode: clipped sums --------------------------------------------------------------


def encode_sums(sums: ClippedSums) -> dict[str, np.ndarray]:
    out = {}
    if sums.embedding is not None:
        out["embedding"] = sums.embedding.detach().cpu().float().numpy()
    if sums.residual is not None:
        out["residual"] = sums.residual.detach().cpu().float().numpy()
    return out


def decode_sums(
    arrays: Mapping[str, WireArray],
    sender: str,
    embedding_dim: int | None,
    residual_dim: int | None,
) -> ClippedSums:
    """Validated clipped sums: exactly the arrays the mechanism releases, of the right size."""
    expected = set()
    emb = res = None
    if embedding_dim is not None:
        expected.add("embedding")
        emb = torch.from_numpy(
            _read_array(sender, CLIPPED_SUMS, arrays, "embedding", (embedding_dim,))
        )
    if residual_dim is not None:
        expected.add("residual")
        res = torch.from_numpy(
            _read_array(sender, CLIPPED_SUMS, arrays, "residual", (residual_dim,))
        )
    _no_extra(sender, CLIPPED_SUMS, arrays, expected)
    return ClippedSums(emb, res, noised=False)


# -- client-side mode: noisy model deltas ----------------------------------------------------


def encode_delta(layout: ParameterLayout, delta: torch.Tensor) -> dict[str, np.ndarray]:
    return {
        name: value.detach().cpu().float().numpy()
        for name, value in layout.unflatten(delta).items()
    }


def decode_delta(
    arrays: Mapping[str, WireArray], layout: ParameterLayout, sender: str
) -> torch.Tensor:
    parts = [
        torch.from_numpy(_read_array(sender, MODEL_DELTA, arrays, name, shape)).reshape(-1)
        for name, shape in zip(layout.names, layout.shapes, strict=True)
    ]
    _no_extra(sender, MODEL_DELTA, arrays, set(layout.names))
    return torch.cat(parts)


# -- model state -------------------------------------------------------------------------------


def encode_state(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in state.items()}


def decode_state(
    arrays: Mapping[str, WireArray], reference: Mapping[str, torch.Tensor], sender: str = "server"
) -> dict[str, torch.Tensor]:
    """A model state with exactly ``reference``'s names, shapes and dtypes."""
    out = {}
    for name, ref in reference.items():
        dtype = str(ref.dtype).removeprefix("torch.")
        value = _read_array(sender, GLOBAL_MODEL, arrays, name, tuple(ref.shape), (dtype,))
        out[name] = torch.from_numpy(value.copy())
    _no_extra(sender, GLOBAL_MODEL, arrays, set(reference))
    return out
