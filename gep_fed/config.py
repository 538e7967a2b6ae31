"""Typed, validated configuration of a private step.

Errors name the field, the value and the allowed range, so a bad value is fixed where it was
written (CLI option, ``pyproject.toml`` run config or node config).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

MECHANISMS = ("gep", "bgep", "gp")
ANCHOR_LABELS = ("random", "true")


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


@dataclass(frozen=True)
class GEPConfig:
    """One private gradient step.

    Attributes:
        mechanism: "gep" (embedding and residual, unbiased), "bgep" (embedding only, biased,
            k numbers per release) or "gp" (plain DP-SGD).
        noise_multiplier: sigma. Each released vector gets Gaussian noise of standard
            deviation ``sigma`` times its clip norm; larger means more private. GEP is
            accounted as ``sigma / sqrt(2)`` because it releases two vectors.
        sample_rate: q, each private example's independent chance to be in a step's batch
            (Poisson sampling); smaller amplifies privacy.
        num_basis: k, the anchor-subspace dimension, shared across parameter groups in
            proportion to sqrt(group size). No privacy meaning (public data only).
        num_anchors: m, public examples whose gradients span the subspace (None: all given).
        power_iterations: t, passes of the power method per subspace computation.
        anchor_labels: "random" (fresh random labels at every computation, the paper's
            choice) or "true" (the public data's own labels).
        clip_embedding: S1, bound on each example's embedding norm (GEP, B-GEP).
        clip_residual: S2, bound on each example's residual norm (GEP).
        clip_norm: S, bound on each example's gradient norm (GP).
        clip_quantile: if set, S1 and S2 are re-derived at each subspace computation as this
            quantile of the *public* anchors' embedding and residual norms (privacy-free:
            public data at already-private parameters); ``clip_embedding`` and
            ``clip_residual`` are then ignored.
        basis_refresh: recompute the subspace every this many steps (1: every step).
        max_chunk: at most this many examples are differentiated at once (memory bound).
        groups: ``{group: [parameter-name patterns]}``; None for the layer-aware default.
        anchor_cache_mb: keep anchor gradients in memory between power iterations when they
            fit in this many MiB, else recompute them per pass.
    """

    mechanism: str = "gep"
    noise_multiplier: float = 1.0
    sample_rate: float = 0.01
    num_basis: int = 200
    num_anchors: int | None = None
    power_iterations: int = 1
    anchor_labels: str = "random"
    clip_embedding: float = 1.0
    clip_residual: float = 0.2
    clip_norm: float = 1.0
    clip_quantile: float | None = None
    basis_refresh: int = 1
    max_chunk: int = 128
    groups: Mapping[str, Sequence[str]] | None = field(default=None, hash=False)
    anchor_cache_mb: int = 1024

    def __post_init__(self) -> None:
        _choice("mechanism", self.mechanism, MECHANISMS)
        _choice("anchor_labels", self.anchor_labels, ANCHOR_LABELS)
        _number("noise_multiplier", self.noise_multiplier, low=0, low_open=False)
        _number("sample_rate", self.sample_rate, low=0, high=1)
        for name in ("clip_embedding", "clip_residual", "clip_norm"):
            _number(name, getattr(self, name), low=0)
        if self.clip_quantile is not None:
            _number("clip_quantile", self.clip_quantile, low=0, high=1)
        for name in ("num_basis", "power_iterations", "basis_refresh", "max_chunk"):
            _integer(name, getattr(self, name), low=1)
        if self.num_anchors is not None:
            _integer("num_anchors", self.num_anchors, low=1)
        _integer("anchor_cache_mb", self.anchor_cache_mb, low=0)
        if self.groups is not None and (
            not isinstance(self.groups, Mapping)
            or not all(
                isinstance(v, Sequence) and not isinstance(v, str) for v in self.groups.values()
            )
        ):
            raise ConfigError("groups must map group names to lists of parameter-name patterns")

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> GEPConfig:
        """Build from a flat mapping (e.g. a Flower run config), naming unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown GEPConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


def _choice(name: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _number(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = True,
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ConfigError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ConfigError(f"{name} must be <= {high}, got {value!r}")


def _integer(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
