"""Distributed mode's secure sum on Flower's Message API: the server's two stages.

The protocol is ``gep_fed.federation.secure_sum`` (pairwise masks over every pair of the
round's sites, agreement keys signed by pinned site keys, no dropout recovery). Each stage is
a train message whose ``SECURE_SUM`` config record names it:

1. ``advertise``: every site answers with its signed agreement key for the round;
2. ``collect``: every site that advertised gets the round's train content and the list of
   signed keys, and answers with its masked share (``MASKED_SHARE``, uint32).

The server adds the masked shares; the masks cancel only when every listed site's share is
in the sum, so a round with a silent or rejected site is abandoned (nothing is revealed:
there is no unmask stage).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from gep_fed.federation import wire
from gep_fed.federation.secure_sum import SignedKey, unmasked_sum

log = logging.getLogger("gep_fed.server")

SECURE_SUM = "secure-sum"  # the config record of a secure-sum stage (and of its reply)
MASKED_SHARE = "masked-share"  # the collect stage's array record
ADVERTISE, COLLECT = "advertise", "collect"


@dataclass
class SecureSumResult:
    """A secure sum's outcome. ``modular_sum`` is None when the round was abandoned."""

    modular_sum: np.ndarray | None
    survivors: list[int]
    replies: dict[int, Message]
    failures: list[str] = field(default_factory=list)


def stage_record(stage: str, round_: int, keys: list[SignedKey] | None = None) -> ConfigRecord:
    record = ConfigRecord({"stage": stage, "round": round_})
    if keys is not None:
        record["keys"] = [b"".join(k.as_list()) for k in keys]
    return record


def read_keys(record: ConfigRecord) -> list[SignedKey]:
    """The collect stage's signed keys (``ValueError`` when malformed)."""
    raw = record.get("keys")
    if not (isinstance(raw, list) and all(isinstance(b, bytes) and len(b) == 128 for b in raw)):
        raise ValueError("the collect stage's keys must be 128-byte signed keys")
    return [SignedKey(b[:32], b[32:64], b[64:]) for b in raw]


def masked_share(reply: Message) -> np.ndarray:
    """A collect reply's masked share as int64 (``ValueError`` naming what is malformed)."""
    record = reply.content.array_records.get(MASKED_SHARE)
    if record is None or list(record) != [MASKED_SHARE]:
        raise ValueError(f"{MASKED_SHARE} must hold one array")
    array = record[MASKED_SHARE]
    if array.dtype != "uint32" or len(array.shape) != 1:
        raise ValueError(f"{MASKED_SHARE} must be a vector of uint32 (got {array.dtype})")
    return array.numpy().astype(np.int64)


class SecureSum:
    """One secure sum of the sites' shares (the server's side).

    Args:
        grid: the Grid to the sites.
        round_: the round the sites' signatures name (with the messages' run id).
        bits: the shares' modulus ``2**bits`` (divides ``2**32``).
        needed: abandon before the collect stage when fewer sites advertise a valid key.
        timeout: seconds per stage.
    """

    def __init__(
        self,
        grid: Grid,
        round_: int,
        bits: int,
        needed: int,
        *,
        timeout: float | None = None,
    ) -> None:
        self.grid, self.round = grid, round_
        self.bits, self.needed, self.timeout = bits, needed, timeout
        self.failures: list[str] = []

    def run(
        self,
        train_contents: Mapping[int, RecordDict],
        accept: Callable[[int, Message], str | None],
    ) -> SecureSumResult:
        """Sum the shares the sites compute from ``train_contents`` (node -> the round's
        train content). ``accept(node, reply)`` checks a collect reply's metadata and
        returns why it is rejected (None: accepted); a rejected reply abandons the round."""
        keys = self.advertise(sorted(train_contents))
        if len(keys) < self.needed:
            self.failures.append(
                f"{len(keys)} sites advertised a key, {self.needed} needed: round abandoned"
            )
            return SecureSumResult(None, sorted(keys), {}, self.failures)
        replies = self.collect(keys, train_contents)
        vectors = {}
        for node in keys:
            why = self._answered(node, replies.get(node), COLLECT)
            if why is None:
                why = accept(node, replies[node])
            if why is None:
                try:
                    vectors[node] = masked_share(replies[node])
                except ValueError as err:
                    why = str(err)
            if why is not None:
                self.failures.append(f"site at node {node}: {why}")
        survivors = sorted(vectors)
        if len(vectors) < len(keys):
            self.failures.append(
                f"{len(keys) - len(vectors)} of the {len(keys)} sites' shares are missing: "
                "their masks cannot cancel, round abandoned with nothing revealed"
            )
            return SecureSumResult(None, survivors, {}, self.failures)
        if len({v.shape for v in vectors.values()}) != 1:
            self.failures.append("the sites' masked shares differ in length: round abandoned")
            return SecureSumResult(None, survivors, {}, self.failures)
        total = unmasked_sum([vectors[n] for n in survivors])
        if total is None:
            self.failures.append("the masks did not cancel (the sites' lists differ): abandoned")
            return SecureSumResult(None, survivors, {}, self.failures)
        # 2**bits divides 2**32, so the sum modulo 2**32 reduces to the sum modulo 2**bits
        return SecureSumResult(total % (1 << self.bits), survivors, replies, self.failures)

    def advertise(self, nodes: list[int]) -> dict[int, SignedKey]:
        """Stage 1: each site's signed agreement key (those that verify)."""
        record = {n: RecordDict({SECURE_SUM: stage_record(ADVERTISE, self.round)}) for n in nodes}
        replies = self._send(record)
        keys: dict[int, SignedKey] = {}
        for node in nodes:
            reply = replies.get(node)
            why = self._answered(node, reply, ADVERTISE)
            if why is None:
                raw = reply.content.config_records[SECURE_SUM].get("signed-key")
                key = None
                if isinstance(raw, bytes) and len(raw) == 128:
                    key = SignedKey(raw[:32], raw[32:64], raw[64:])
                if key is None or not key.verified(reply.metadata.run_id, self.round):
                    why = "its signed key is malformed or not signed for this round"
                elif any(k.site_key == key.site_key for k in keys.values()):
                    why = "its site key is another node's"
            if why is not None:
                self.failures.append(f"site at node {node}: {why}")
            else:
                keys[node] = key
        return keys

    def collect(
        self, keys: Mapping[int, SignedKey], train_contents: Mapping[int, RecordDict]
    ) -> dict[int, Message]:
        """Stage 2: the round's train content and every listed key, to every listed site."""
        listed = [keys[n] for n in sorted(keys)]
        contents = {}
        for node in keys:
            content = train_contents[node]
            content.config_records[SECURE_SUM] = stage_record(COLLECT, self.round, listed)
            contents[node] = content
        return self._send(contents)

    def _answered(self, node: int, reply: Message | None, stage: str) -> str | None:
        """Why a stage's reply is unusable (None: it has the stage's record)."""
        if reply is None:
            return f"no {stage} reply"
        if reply.has_error():  # a refusal's fixed text, never the reply's own
            return f"{stage}: {wire.describe_error(reply.error.code, None)}"
        if stage == ADVERTISE and SECURE_SUM not in reply.content.config_records:
            return f"{stage} reply without {SECURE_SUM}"
        return None

    def _send(self, contents: Mapping[int, RecordDict]) -> dict[int, Message]:
        messages = [
            Message(
                content=content,
                dst_node_id=node,
                message_type=MessageType.TRAIN,
                group_id=str(self.round),
            )
            for node, content in contents.items()
        ]
        replies: dict[int, Message] = {}
        for reply in self.grid.send_and_receive(messages=messages, timeout=self.timeout):
            node = reply.metadata.src_node_id
            if node in contents and node not in replies:
                replies[node] = reply
        return replies
