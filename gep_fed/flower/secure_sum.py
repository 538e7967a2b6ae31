"""Flower's SecAgg+ for distributed mode: the server's stages on the Message API, the sites'
checks around Flower's own ``secaggplus_mod``.

``SecureSum`` runs the four stages of Flower's ``SecAggPlusWorkflow`` (setup, share keys,
collect masked vectors, unmask) with its configuration keys, messages and primitives (Shamir
``combine_shares``, ``generate_shared_key``, ``pseudo_rand_gen``), on a ``Grid`` instead of a
legacy ``LegacyContext``, so that ``GEPStrategy`` can sum the sites' shares. The sites answer
with Flower's ``secaggplus_mod`` unchanged. Settings the sites require (``SiteGuard``):

- a complete neighbour graph (every site shares keys with every other: ``share_num`` equals
  ``sample_num``), so a site's unmask request lists every survivor, of at least three sites
  (Flower's ``pseudo_rand_gen`` seeds NumPy's MT19937 with the 32-byte seed folded to 32
  bits: with two sites a 2**32 search would find the one pairwise mask of a share);
- the mod's own quantisation left as the identity plus an offset on a site's share (clipping
  range ``2**bits``, target range ``2**(bits + 1)``, weight 1), and a modulus that holds the
  sum of every site's offset share without wrapping;
- a reconstruction threshold above the colluders the site assumes;
- at unmask, at least ``noise_shares + max_colluding_sites`` survivors (else the site declines,
  and the server cannot strip the noise of sites it claims dropped).

A site that fails before its masked vector is in the sum is dropped (its pairwise masks are
removed from the sum with its key shares); one that fails after it is recovered with its mask
seed's shares. A round with too few survivors or shares is abandoned: nothing is unmasked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import cast

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.serverapp import Grid
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from gep_fed.federation.wire import describe_error
from gep_fed.mechanisms.distributed_noise import SECURE_SUM_BITS

log = logging.getLogger("gep_fed.server")

MOD_RANGE = 1 << SECURE_SUM_BITS
# The record a site keeps between the collect and unmask stages of a round.
ROUND_NOISE_KEY = "distributed-round"


def secagg_settings(bits: int, sample_num: int, threshold: int) -> dict:
    """The setup stage's configuration for shares in ``[0, 2**bits)``."""
    return {
        Key.STAGE: Stage.SETUP,
        Key.SAMPLE_NUMBER: sample_num,
        Key.SHARE_NUMBER: sample_num,
        Key.THRESHOLD: threshold,
        Key.CLIPPING_RANGE: float(1 << bits),
        Key.TARGET_RANGE: 1 << (bits + 1),
        Key.MOD_RANGE: MOD_RANGE,
        Key.MAX_WEIGHT: 1.0,
    }


def default_threshold(num_sites: int) -> int:
    """Shamir's threshold: a majority of the sites (at least 2)."""
    return max(2, num_sites // 2 + 1)


@dataclass
class SecureSumResult:
    """A secure sum's outcome. ``modular_sum`` is None when the round was abandoned."""

    modular_sum: np.ndarray | None
    survivors: list[int]
    replies: dict[int, Message]
    failures: list[str] = field(default_factory=list)


class SecureSum:
    """One secure sum of the sites' shares over Flower's SecAgg+ (the server's side).

    Args:
        grid: the Grid to the sites.
        bits: each share's range ``[0, 2**bits)``.
        min_survivors: abandon the round when fewer sites' shares would be in the sum.
        threshold: Shamir's reconstruction threshold (default: a majority).
        timeout: seconds per stage.
        group_id: the round's group id on the wire.
    """

    def __init__(
        self,
        grid: Grid,
        bits: int,
        min_survivors: int,
        *,
        threshold: int | None = None,
        timeout: float | None = None,
        group_id: str = "",
    ) -> None:
        self.grid, self.bits, self.min_survivors = grid, bits, min_survivors
        self.threshold = threshold
        self.timeout, self.group_id = timeout, group_id

    def _send(self, contents: Mapping[int, RecordDict]) -> dict[int, Message]:
        messages = [
            Message(
                content=content,
                dst_node_id=node,
                message_type=MessageType.TRAIN,
                group_id=self.group_id,
            )
            for node, content in contents.items()
        ]
        replies: dict[int, Message] = {}
        for reply in self.grid.send_and_receive(messages=messages, timeout=self.timeout):
            node = reply.metadata.src_node_id
            if node in contents and node not in replies:
                replies[node] = reply
        return replies

    def run(
        self,
        train_contents: Mapping[int, RecordDict],
        accept: Callable[[int, Message], str | None],
    ) -> SecureSumResult:
        """Sum the shares the sites compute from ``train_contents`` (node -> the round's
        train content). ``accept(node, reply)`` checks a site's collect-stage reply and
        returns why it is rejected (None: accepted); a rejected site is dropped."""
        failures: list[str] = []
        nodes = sorted(train_contents)
        threshold = self.threshold or default_threshold(len(nodes))

        def answered(replies: dict[int, Message], stage: str) -> dict[int, ConfigRecord]:
            good = {}
            for node in replies.keys() | set(asked):
                reply = replies.get(node)
                if reply is None:
                    failures.append(f"site at node {node}: no {stage} reply")
                    continue
                if reply.has_error():  # a refusal's fixed text, never the reply's own
                    why = describe_error(reply.error.code, None)
                    failures.append(f"site at node {node}: {stage}: {why}")
                    continue
                record = reply.content.config_records.get(RECORD_KEY_CONFIGS)
                if record is None:
                    failures.append(
                        f"site at node {node}: {stage} reply without {RECORD_KEY_CONFIGS}"
                    )
                    continue
                good[node] = record
            return good

        # Stage 0: setup; each site answers with its two public keys.
        settings = secagg_settings(self.bits, len(nodes), threshold)
        asked = nodes
        setup = answered(
            self._send(
                {n: RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(settings)}) for n in nodes}
            ),
            Stage.SETUP,
        )
        keys = {}
        for node, record in setup.items():
            pk1, pk2 = record.get(Key.PUBLIC_KEY_1), record.get(Key.PUBLIC_KEY_2)
            if isinstance(pk1, bytes) and isinstance(pk2, bytes):
                keys[node] = [pk1, pk2]
            else:
                failures.append(f"site at node {node}: malformed public keys")
        if len(keys) < max(threshold, self.min_survivors):
            return SecureSumResult(None, sorted(keys), {}, failures)

        # Stage 1: share keys; each site answers with its encrypted shares for the others.
        asked = sorted(keys)
        contents = {}
        for node in asked:
            record = ConfigRecord({str(n): keys[n] for n in asked})
            record[Key.STAGE] = Stage.SHARE_KEYS
            contents[node] = RecordDict({RECORD_KEY_CONFIGS: record})
        shared = answered(self._send(contents), Stage.SHARE_KEYS)
        sent = {n: _pairs(r, Key.DESTINATION_LIST, Key.CIPHERTEXT_LIST) for n, r in shared.items()}
        failures += [
            f"site at node {n}: malformed key shares" for n, p in sent.items() if p is None
        ]
        keyed = sorted(n for n, p in sent.items() if p is not None)  # the others are dropped
        forward: dict[int, tuple[list[int], list[bytes]]] = {n: ([], []) for n in keyed}
        for node in keyed:
            for dst, ctxt in sent[node]:
                if dst in forward:
                    forward[dst][0].append(node)
                    forward[dst][1].append(ctxt)
        if len(keyed) < max(threshold, self.min_survivors):
            return SecureSumResult(None, keyed, {}, failures)

        # Stage 2: collect masked vectors; the sites also get the round's train content.
        asked = keyed
        contents = {}
        for node in keyed:
            content = train_contents[node]
            srcs, ctxts = forward[node]
            content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(
                {
                    Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                    Key.CIPHERTEXT_LIST: ctxts,
                    Key.SOURCE_LIST: srcs,
                }
            )
            contents[node] = content
        replies = self._send(contents)
        collected = answered(replies, Stage.COLLECT_MASKED_VECTORS)
        masked: dict[int, list[np.ndarray]] = {}
        for node, record in collected.items():
            try:
                why = accept(node, replies[node])
                arrays = None if why else _masked_arrays(record.get(Key.MASKED_PARAMETERS))
            except ValueError as err:
                why = str(err)
            if why is not None:
                failures.append(f"site at node {node}: {why}")
                continue
            masked[node] = arrays
        survivors = sorted(masked)
        if len(survivors) < max(threshold, self.min_survivors):
            return SecureSumResult(None, survivors, {}, failures)
        if len({v[1].shape for v in masked.values()}) != 1:
            failures.append("the sites' masked vectors differ in length")
            return SecureSumResult(None, survivors, {}, failures)
        total = [sum(v[i].astype(np.int64) for v in masked.values()) % MOD_RANGE for i in range(2)]

        # Stage 3: unmask; each survivor returns its shares of the survivors' mask seeds and
        # of the dropped sites' first secret keys.
        dead = sorted(set(keyed) - set(survivors))
        asked = survivors
        unmask = {
            Key.STAGE: Stage.UNMASK,
            Key.ACTIVE_NODE_ID_LIST: survivors,
            Key.DEAD_NODE_ID_LIST: dead,
        }
        answers = answered(
            self._send(
                {n: RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(unmask)}) for n in survivors}
            ),
            Stage.UNMASK,
        )
        shares: dict[int, list[bytes]] = {n: [] for n in keyed}
        for node, record in answers.items():
            held = _pairs(record, Key.NODE_ID_LIST, Key.SHARE_LIST)
            if held is None:
                failures.append(f"site at node {node}: malformed unmask shares")
                continue
            for owner, share in held:
                if owner in shares and isinstance(share, bytes):
                    shares[owner].append(share)
        short = [n for n, s in shares.items() if len(s) < threshold]
        if short:
            failures.append(f"too few shares to unmask nodes {short}: round abandoned")
            return SecureSumResult(None, survivors, {}, failures)
        shape = [a.shape for a in total]
        for node, node_shares in shares.items():
            secret = combine_shares(node_shares)
            if node in survivors:  # remove the survivor's own mask
                for i, mask in enumerate(pseudo_rand_gen(secret, MOD_RANGE, shape)):
                    total[i] = total[i] - mask
                continue
            for other in keyed:  # a dropped site's pairwise masks with every other site
                if other == node:
                    continue
                shared_key = generate_shared_key(
                    bytes_to_private_key(secret), bytes_to_public_key(keys[other][0])
                )
                sign = 1 if node > other else -1
                for i, mask in enumerate(pseudo_rand_gen(shared_key, MOD_RANGE, shape)):
                    total[i] = total[i] + sign * mask
        weight, vector = (t % MOD_RANGE for t in total)
        offset = 1 << (self.bits + 1)
        if int(weight.reshape(-1)[0]) != len(survivors) * offset % MOD_RANGE:
            failures.append("the unmasked weight does not match the survivors: round abandoned")
            return SecureSumResult(None, survivors, {}, failures)
        return SecureSumResult(vector % (1 << self.bits), survivors, replies, failures)

    def _masked_problem(self, value: object) -> str | None:
        """Why a masked vector is malformed (None: it is two integer arrays in range)."""
        try:
            _masked_arrays(value)
        except ValueError as err:
            return str(err)
        return None


def _masked_arrays(value: object) -> list[np.ndarray]:
    """A reply's masked vector as its two arrays (weight, vector), or ``ValueError`` naming
    what is malformed."""
    if not (
        isinstance(value, list) and len(value) == 2 and all(isinstance(b, bytes) for b in value)
    ):
        raise ValueError(f"{Key.MASKED_PARAMETERS} must be two arrays")
    try:
        arrays = [bytes_to_ndarray(b) for b in value]
    except ValueError:
        raise ValueError(f"{Key.MASKED_PARAMETERS} cannot be read as arrays") from None
    if arrays[0].shape != (1,) or arrays[1].ndim != 1:
        raise ValueError(f"{Key.MASKED_PARAMETERS} has shapes {[a.shape for a in arrays]}")
    for a in arrays:
        if a.dtype.kind not in "iu" or (a.size and (a.min() < 0 or a.max() >= MOD_RANGE)):
            raise ValueError(f"{Key.MASKED_PARAMETERS} must hold integers in [0, 2**32)")
    return arrays


def _pairs(record: ConfigRecord, first: str, second: str) -> list[tuple] | None:
    """Two equally long lists of a reply, paired (None: missing or malformed)."""
    a, b = record.get(first), record.get(second)
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)):
        return None
    return list(zip(a, b, strict=True))


# -- the site's side -----------------------------------------------------------------------


class SecureSumDeclined(Exception):
    """A site declines a stage of the secure sum; ``reason`` is a ``wire.REFUSALS`` key."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class SiteGuard:
    """What a site requires of the secure sum before Flower's ``secaggplus_mod`` answers.

    Args:
        max_colluding_sites: from the site's policy.
        accepts_distributed: the site's policy accepts distributed rounds (else it refuses
            the secure sum at its first stage).
    """

    max_colluding_sites: int
    accepts_distributed: bool = True

    def check(self, stage: str, configs: ConfigRecord, state: RecordDict) -> None:
        """Raise ``SecureSumDeclined`` when a stage's request is one the site refuses."""
        if not self.accepts_distributed:
            raise SecureSumDeclined("mode not allowed")
        if stage == Stage.SETUP:
            self._check_setup(configs)
        elif stage == Stage.UNMASK:
            round_noise = state.config_records.get(ROUND_NOISE_KEY)
            if round_noise is None:
                raise SecureSumDeclined("malformed round")
            active = configs.get(Key.ACTIVE_NODE_ID_LIST)
            dead = configs.get(Key.DEAD_NODE_ID_LIST)
            if not (isinstance(active, list) and isinstance(dead, list)) or set(active) & set(dead):
                raise SecureSumDeclined("malformed round")
            needed = int(round_noise["noise-shares"]) + self.max_colluding_sites
            if len(set(active)) < needed:
                raise SecureSumDeclined("too few sites")

    def _check_setup(self, configs: ConfigRecord) -> None:
        sample, shares = configs.get(Key.SAMPLE_NUMBER), configs.get(Key.SHARE_NUMBER)
        threshold = configs.get(Key.THRESHOLD)
        clip, target = configs.get(Key.CLIPPING_RANGE), configs.get(Key.TARGET_RANGE)
        mod, weight = configs.get(Key.MOD_RANGE), configs.get(Key.MAX_WEIGHT)
        ints = (sample, shares, threshold, target, mod)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
            raise SecureSumDeclined("malformed round")
        # Flower folds each mask seed to 32 bits: with two sites one 2**32 search would strip
        # the only pairwise mask of a share, so a sum needs at least three.
        complete = shares == sample and sample >= 3
        safe_threshold = 2 <= threshold <= sample and threshold > self.max_colluding_sites
        identity = (
            isinstance(clip, float)
            and clip >= 1
            and int(clip) == clip
            and int(clip) & (int(clip) - 1) == 0
            and target == 2 * int(clip)
            and weight == 1.0
        )
        fits = mod == MOD_RANGE and identity and sample * target < mod
        if not (complete and safe_threshold and identity and fits):
            raise SecureSumDeclined("malformed round")


def check_round_settings(state: RecordDict, bits: int, noise_shares: int) -> None:
    """At the collect stage: the secure sum's setup must quantise for this round's contract
    (``2**bits``) and the round's noise shares are kept for the unmask check."""
    held = state.config_records.get(RECORD_KEY_STATE, {})
    if held.get("clipping_range") != float(1 << bits) or held.get("target_range") != 1 << (
        bits + 1
    ):
        raise SecureSumDeclined("malformed round")
    state.config_records[ROUND_NOISE_KEY] = ConfigRecord({"noise-shares": noise_shares})


def secure_sum_mod(
    guard_for: Callable[[Context], SiteGuard],
    refuse: Callable[[Message, Context, str, str], Message],
):
    """A ClientApp mod: a train message of the secure sum is checked by the site's guard
    and answered by Flower's ``secaggplus_mod``; any other message goes to the app. A
    declined stage or a failure is a refusal with a fixed reason, never an exception text:
    ``refuse(msg, context, reason, cause)`` builds it (the cause, naming the stage, is for
    the site's own records)."""

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS) if msg.has_content() else None
        if msg.metadata.message_type != MessageType.TRAIN or configs is None:
            return call_next(msg, context)

        def app(inner: Message, ctx: Context) -> Message:
            reply = call_next(inner, ctx)
            if reply.has_error():
                raise _Refusal(reply)
            return reply

        stage = configs.get(Key.STAGE)
        try:
            guard_for(context).check(cast(str, stage), configs, context.state)
            with _quiet_flower():
                return secaggplus_mod(msg, context, app)
        except _Refusal as refusal:
            return refusal.reply
        except SecureSumDeclined as declined:
            log.warning("secure sum stage %s declined: %s", stage, declined.reason)
            return refuse(msg, context, declined.reason, f"secure sum stage {stage}: declined")
        except Exception as err:
            log.exception("secure sum stage %s failed at this site", stage)
            cause = f"secure sum stage {stage}: {type(err).__name__}: {err}"
            return refuse(msg, context, "malformed round", cause)

    return mod


@contextmanager
def _quiet_flower():
    """Flower's mod logs every stage at DEBUG, which simulation workers print: keep INFO."""
    flower = logging.getLogger("flwr")
    level = flower.level
    flower.setLevel(max(level, logging.INFO))
    try:
        yield
    finally:
        flower.setLevel(level)


class _Refusal(Exception):
    def __init__(self, reply: Message) -> None:
        super().__init__("refused")
        self.reply = reply
