"""gep-fed: federated training with Gradient Embedding Perturbation differential privacy.

The library layer: plain PyTorch, numpy and dp-accounting, no Flower. See ``GEPStep`` for the
single-machine API and ``gep_fed.mechanisms.mechanism`` for the three separable calls (clipped sums,
add noise, reconstruct) that the federated modes distribute.
"""

from gep_fed.accounting.events import ImpossibleTargetError, PrivacyEvent, epsilon_pld, epsilon_rdp
from gep_fed.accounting.ledger import BudgetExceededError, LedgerError, PrivacyLedger
from gep_fed.config import ConfigError, GEPConfig, PrivacyContract
from gep_fed.data.models import MLP, MnistCNN, resnet20_gn
from gep_fed.mechanisms.anchors import AnchorResult, compute_anchor_subspace
from gep_fed.mechanisms.groups import ParameterGroup, ParameterLayout
from gep_fed.mechanisms.mechanism import (
    BGEP,
    GEP,
    GP,
    ClippedSums,
    Mechanism,
    calibrate_noise_multiplier,
)
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.per_example import (
    IncompatibleModelError,
    batchnorm_to_groupnorm,
    per_example_gradients,
    validate_model,
)
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.mechanisms.step import GEPStep, write_gradient
from gep_fed.mechanisms.subspace import AnchorSubspace, power_method_subspace

__all__ = [
    "BGEP",
    "GEP",
    "GP",
    "MLP",
    "AnchorResult",
    "AnchorSubspace",
    "BudgetExceededError",
    "ClippedSums",
    "ConfigError",
    "GEPConfig",
    "GEPStep",
    "ImpossibleTargetError",
    "IncompatibleModelError",
    "LedgerError",
    "Mechanism",
    "MnistCNN",
    "NoiseSource",
    "ParameterGroup",
    "ParameterLayout",
    "PoissonSampler",
    "PrivacyContract",
    "PrivacyEvent",
    "PrivacyLedger",
    "batchnorm_to_groupnorm",
    "calibrate_noise_multiplier",
    "compute_anchor_subspace",
    "epsilon_pld",
    "epsilon_rdp",
    "per_example_gradients",
    "power_method_subspace",
    "resnet20_gn",
    "validate_model",
    "write_gradient",
]
__version__ = "0.1.0"
