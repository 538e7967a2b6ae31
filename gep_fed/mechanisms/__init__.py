"""The GEP mechanism and its parts: the privacy contract, per-example gradients, parameter
groups, the anchor subspace, clipping and noise (GEP, B-GEP, GP) with proven float bounds,
Poisson sampling, the training step (optionally averaging each example over augmented copies),
release observers, and Langevin DP-SGD."""

from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.groups import ParameterGroup, ParameterLayout
from gep_fed.mechanisms.mechanism import (
    BGEP,
    GEP,
    GP,
    ClippedSums,
    Mechanism,
    calibrate_noise_multiplier,
    mechanism_class,
)
from gep_fed.mechanisms.multiplicity import AugmentationMultiplicity
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.per_example import batchnorm_to_groupnorm, per_example_gradients
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.mechanisms.step import GEPStep, private_step
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.mechanisms.subspace import AnchorSubspace

__all__ = [
    "BGEP",
    "GEP",
    "GP",
    "AnchorSubspace",
    "AugmentationMultiplicity",
    "ClippedSums",
    "GEPConfig",
    "GEPStep",
    "Mechanism",
    "NoiseSource",
    "ParameterGroup",
    "ParameterLayout",
    "PoissonSampler",
    "PrivacyContract",
    "batchnorm_to_groupnorm",
    "calibrate_noise_multiplier",
    "mechanism_class",
    "per_example_gradients",
    "private_step",
]
