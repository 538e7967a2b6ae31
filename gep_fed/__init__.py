"""gep-fed: federated training with Gradient Embedding Perturbation differential privacy.

The names here are the public surface; each subpackage has its own for its concern:
``gep_fed.mechanisms`` (GEP, B-GEP, GP, the anchor subspace, Langevin), ``gep_fed.accounting``
(events, the ledger), ``gep_fed.data`` (tasks, data sets, models), ``gep_fed.federation``
(the wire, a site's policy, the server's rounds) and ``gep_fed.flower`` (the Flower adapter).

- One machine: ``private_step`` (a ``GEPStep`` and its sampler from a target epsilon), or
  ``GEPStep`` with a ``GEPConfig`` holding a ``PrivacyContract``.
- A federation: a ``FederationConfig`` (``FederationConfig.for_task``) and ``simulate``, or the
  Flower apps of ``gep_fed.flower``; a hospital's own ``Task``.
"""

from gep_fed.accounting.events import ImpossibleTargetError
from gep_fed.accounting.ledger import BudgetExceededError, LedgerError, PrivacyLedger
from gep_fed.data.task import Task
from gep_fed.federation.config import FederationConfig
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.mechanism import calibrate_noise_multiplier
from gep_fed.mechanisms.per_example import IncompatibleModelError
from gep_fed.mechanisms.step import GEPStep, private_step
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.validation import ConfigError

__all__ = [
    "BudgetExceededError",
    "ConfigError",
    "FederationConfig",
    "GEPConfig",
    "GEPStep",
    "ImpossibleTargetError",
    "IncompatibleModelError",
    "LedgerError",
    "PrivacyContract",
    "PrivacyLedger",
    "Task",
    "calibrate_noise_multiplier",
    "private_step",
    "simulate",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # ``simulate`` needs Flower (and Ray); importing gep_fed alone does not.
    if name == "simulate":
        from gep_fed.flower.simulation import simulate

        return simulate
    raise AttributeError(f"module 'gep_fed' has no attribute {name!r}")
