"""Privacy accounting: events composed by ``dp-accounting``, and the ledger."""

from gep_fed.accounting.events import (
    RDP_ORDERS,
    ImpossibleTargetError,
    PrivacyEvent,
    Selection,
    calibrate,
    compose,
    epsilon_pld,
    epsilon_rdp,
)

__all__ = [
    "RDP_ORDERS",
    "ImpossibleTargetError",
    "PrivacyEvent",
    "Selection",
    "calibrate",
    "compose",
    "epsilon_pld",
    "epsilon_rdp",
]
