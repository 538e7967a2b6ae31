"""Distributed mode's secure sum in Flower's records.

The protocol is ``gep_fed.federation.secure_sum``; the server's stages (advertise keys,
collect masked shares, add them up) are ``gep_fed.federation.rounds.SecureSumRound``'s,
over any grid. Each stage is a train message whose ``SECURE_SUM`` config record names it;
a collect reply carries its masked share in the ``MASKED_SHARE`` array record (uint32).
"""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord, Message

from gep_fed.federation.secure_sum import (
    ADVERTISE,
    COLLECT,
    MASKED_SHARE,
    SECURE_SUM,
    SignedKey,
    read_keys,
    read_masked_share,
    stage_config,
)

__all__ = [
    "ADVERTISE",
    "COLLECT",
    "MASKED_SHARE",
    "SECURE_SUM",
    "masked_share",
    "read_keys",
    "stage_record",
]


def stage_record(stage: str, round_: int, keys: list[SignedKey] | None = None) -> ConfigRecord:
    """A stage's config record (``gep_fed.federation.secure_sum.stage_config``)."""
    return ConfigRecord(stage_config(stage, round_, keys))


def masked_share(reply: Message) -> np.ndarray:
    """A collect reply's masked share as int64 (``ValueError`` naming what is malformed)."""
    return read_masked_share(reply.content.array_records.get(MASKED_SHARE))
