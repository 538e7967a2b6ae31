"""The message layout between the federation server and its sites, and its validation.

Both sides import this module: record names, array names and order, dtypes, and the protocol
version live here once. It knows nothing about Flower: arrays travel as ``{name: array}``
mappings whose values expose ``dtype``, ``shape`` and ``numpy()`` (a Flower ``Array`` does;
``as_wire_array`` wraps a numpy array), so their declared dtype and shape are checked before
any payload is deserialised. Everything received is validated; problems raise ``WireError``
naming the sender and the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Protocol

import numpy as np
import torch

from gep_fed.groups import ParameterLayout
from gep_fed.mechanisms import ClippedSums
from gep_fed.subspace import AnchorSubspace

PROTOCOL_VERSION = 1

# Record names in a message's RecordDict.
GLOBAL_MODEL = "global-model"  # server -> site: model state, float32, keys = state_dict names
BASIS = "basis"  # server -> site: one (p_g, k_g) matrix per group, "basis.<index>"
ROUND_CONFIG = "round-config"  # server -> site: RoundConfig
CLIPPED_SUMS = "clipped-sums"  # site -> server (central): "embedding" (k,), "residual" (p,)
MODEL_DELTA = "model-delta"  # site -> server (client-side): noisy delta per parameter
REPLY_META = "reply-meta"  # site -> server: protocol, round, mode
REPLY_METRICS = "metrics"  # site -> server: counts of bytes, steps, epsilon (data-free)

MODES = ("central", "client")
BASIS_DTYPES = ("float32", "float16")
# Largest array a reply may declare, in elements; anything bigger is rejected unread.
MAX_ELEMENTS = 200_000_000


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
class RoundConfig:
    """What the server tells every site for one round (public information only).

    Attributes:
        round: the federated round (from 1).
        mode: "central" (site sends unnoised clipped sums to a trusted server) or "client"
            (site adds its own noise, takes ``local_steps`` steps, sends a noisy model delta).
        mechanism: "gep", "bgep", "gp" or "langevin".
        sample_rate: q, every site's Poisson sampling rate.
        noise_multiplier: sigma (client mode: applied by the site).
        clip_embedding, clip_residual, clip_norm: S1, S2 (GEP/B-GEP) and S (GP).
        local_steps, local_lr, local_momentum: the site's optimiser in client mode.
        basis_id: which basis the site must use; a site keeps the last one it received, so
            the server sends the basis only when ``basis_id`` changes.
        basis_dtype: "float32" or "float16" on the wire (the site uses what it received).
        layout: the parameter layout as JSON (names, shapes, groups).
        model_spec: the architecture and input normalisation as JSON (``ModelSpec``).
    """

    round: int
    mode: str
    mechanism: str
    sample_rate: float
    noise_multiplier: float
    clip_embedding: float
    clip_residual: float
    clip_norm: float
    local_steps: int
    local_lr: float
    local_momentum: float
    basis_id: int
    basis_dtype: str
    layout: str
    model_spec: str
    langevin_beta0: float = 0.0
    protocol: int = PROTOCOL_VERSION

    def to_record(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, record: Mapping, sender: str = "server") -> RoundConfig:
        values = dict(record)
        optional = {"protocol", "langevin_beta0"}
        missing = [f.name for f in fields(cls) if f.name not in values and f.name not in optional]
        if missing:
            raise WireError(sender, ROUND_CONFIG, f"missing keys {missing}")
        _check_protocol(sender, ROUND_CONFIG, values.get("protocol"))
        known = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in values.items() if k in known})
        if cfg.mode not in MODES:
            raise WireError(sender, "mode", f"must be one of {MODES}, got {cfg.mode!r}")
        if cfg.basis_dtype not in BASIS_DTYPES:
            raise WireError(sender, "basis_dtype", f"must be one of {BASIS_DTYPES}")
        if not (0 < cfg.sample_rate <= 1):
            raise WireError(sender, "sample_rate", f"must be in (0, 1], got {cfg.sample_rate}")
        if cfg.local_steps < 1:
            raise WireError(sender, "local_steps", f"must be >= 1, got {cfg.local_steps}")
        return cfg

    def parameter_layout(self) -> ParameterLayout:
        return ParameterLayout.from_dict(json.loads(self.layout))


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


def reply_meta(round_: int, mode: str) -> dict:
    return {"protocol": PROTOCOL_VERSION, "round": round_, "mode": mode}


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
    return AnchorSubspace(layout, tuple(bases))


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
