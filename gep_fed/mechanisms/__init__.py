"""The GEP mechanism and its parts: per-example gradients, parameter groups, the anchor
subspace, clipping and noise (GEP, B-GEP, GP), Poisson sampling, the training step, and
Langevin DP-SGD."""

from gep_fed.mechanisms.mechanism import (
    BGEP,
    GEP,
    GP,
    ClippedSums,
    Mechanism,
    calibrate_noise_multiplier,
    mechanism_class,
)

__all__ = [
    "BGEP",
    "GEP",
    "GP",
    "ClippedSums",
    "Mechanism",
    "calibrate_noise_multiplier",
    "mechanism_class",
]
