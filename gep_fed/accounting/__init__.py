"""Privacy accounting: events composed by ``dp-accounting``, the ledger, the empirical audit."""

from gep_fed.accounting.events import (
    RDP_ORDERS,
    ImpossibleTargetError,
    PrivacyEvent,
    calibrate,
    compose,
    epsilon_pld,
    epsilon_rdp,
)

__all__ = [
    "RDP_ORDERS",
    "ImpossibleTargetError",
    "PrivacyEvent",
    "calibrate",
    "compose",
    "epsilon_pld",
    "epsilon_rdp",
]
