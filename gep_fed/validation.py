"""Declared ranges and the checks that use them: one declaration per range.

Each setting's range is declared once, as a ``Range`` next to the thing that owns the
setting, and every place that accepts the value (a configuration, the wire decoder, a site's
policy) checks it against that declaration, so the checks cannot drift apart. Errors name
the field, the value and the range, so a bad value is fixed where it was written (a CLI
option, a run config, a node config, a received round config).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


@dataclass(frozen=True)
class Range:
    """A closed or open interval of finite numbers (``integer``: of integers)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def contains(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def check(self, name: str, value: object) -> None:
        """Raise ``ConfigError`` naming ``name`` unless ``value`` is in this range."""
        if not self.contains(value):
            kind = "an integer" if self.integer else "a finite number"
            raise ConfigError(f"{name} must be {kind} in {self}, got {value!r}")

    def __str__(self) -> str:
        low = "(" if self.low_open else "["
        # an unbounded end is open: a finite number never reaches it
        high = ")" if self.high_open or math.isinf(self.high) else "]"
        low = "(" if math.isinf(self.low) else low
        return f"{low}{self.low:g}, {self.high:g}{high}"


def check_choice(name: str, value: object, allowed: Iterable[str]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {allowed}, got {value!r}")


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")


# Ranges shared by several owners' settings (each is still declared here only once).
POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
NOISE_MULTIPLIER = NON_NEGATIVE  # sigma; 0 is no noise (no privacy), never negative
AT_LEAST_ONE = Range(1, integer=True)
# A run's rounds: a site checks its budget against every round still to come, so the plan a
# server may announce is bounded.
ROUNDS = Range(1, 100_000, integer=True)
PROBABILITY = Range(0, 1, low_open=True)  # a Poisson rate q, a quantile
MOMENTUM = Range(0, 1, high_open=True)
# 0: off; the weight of the running average at each step (close to 1: a longer memory)
MODEL_AVERAGE_DECAY = Range(0, 1, high_open=True)
DELTA = Range(0, 0.1, low_open=True)
# A target epsilon: beyond 1,000 no guarantee is left to state, and calibrating to one takes
# minutes, then more memory than a machine has (the PLD's support grows as sigma shrinks).
TARGET_EPSILON = Range(0, 1000, low_open=True)
LEARNING_RATE = POSITIVE
# 0: no augmentation; K: each example's gradient is the mean over K augmented copies
AUGMENTATION_COPIES = Range(0, 64, integer=True)
# How a basis travels on the wire, and how it is stored there.
BASIS_DTYPES = ("float32", "float16")
BASIS_TRANSPORTS = ("basis", "rebuild")
