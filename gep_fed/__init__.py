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

from gep_fed.lazy import lazy_exports

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


# Where each public name lives, imported on first use: a submodule (``gep_fed.accounting``,
# the CLI's ``ledger`` and ``site keygen``) is not made to load PyTorch or Flower by its package.
_PUBLIC = {
    "BudgetExceededError": "gep_fed.accounting.ledger",
    "ConfigError": "gep_fed.validation",
    "FederationConfig": "gep_fed.federation.config",
    "GEPConfig": "gep_fed.mechanisms.step_config",
    "GEPStep": "gep_fed.mechanisms.step",
    "ImpossibleTargetError": "gep_fed.accounting.events",
    "IncompatibleModelError": "gep_fed.mechanisms.per_example",
    "LedgerError": "gep_fed.accounting.ledger",
    "PrivacyContract": "gep_fed.mechanisms.contract",
    "PrivacyLedger": "gep_fed.accounting.ledger",
    "Task": "gep_fed.data.task",
    "calibrate_noise_multiplier": "gep_fed.mechanisms.mechanism",
    "private_step": "gep_fed.mechanisms.step",
    "simulate": "gep_fed.flower.simulation",
}


__getattr__ = lazy_exports(__name__, globals(), _PUBLIC)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
