"""The round loop of a federation, over any grid (no Flower).

A grid (``RoundGrid``) sends each site its request and returns the sites' replies, as plain
records (``Envelope``: array, config and metric records by name, in order). Flower's Grid is
one (``gep_fed.flower.grid.FlowerGrid``, which ``GEPStrategy`` uses); an in-process one
that calls the sites directly is another.

One round, step by step (each a method of ``RoundLoop``, to override one at a time):

1. ``within_budget``: stop before a round that would exceed the privacy budget;
2. ``configure_round``: the anchor subspace (when due), and the global model, the round
   config and (to a site that does not hold it) the basis for every site;
3. ``train_round``: send and collect. Central and client mode: one exchange, then
   ``aggregate``: ``validate_reply`` each reply (a bad one is rejected, named in the log and
   in the round's record, and the round goes on with the others) and step the model
   (central noise once on the sum, or the mean of the sites' noisy deltas). Distributed
   mode: ``secure_aggregate``, the secure sum's named stages (``SecureSumRound``: advertise
   keys, collect masked shares, add them up), decoded and stepped like central mode;
4. ``round_record``: evaluate on the server's data, keep the best model, the privacy
   spent and what the round sent, received and rejected;
5. ``run``: append the record to the run directory (the server committed the round's
   checkpoint and ledger when it stepped) and report it.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from gep_fed.accounting.ledger import BudgetExceededError
from gep_fed.federation import wire
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import CONFIG, LOST_ROUND, SITE_SCORE, RunDirectory
from gep_fed.federation.secure_sum import (
    ADVERTISE,
    COLLECT,
    MASKED_SHARE,
    SECURE_SUM,
    RoundBinding,
    SignedKey,
    read_masked_share,
    read_signed_key,
    stage_config,
    unmasked_sum,
)
from gep_fed.federation.server import FederationServer
from gep_fed.federation.site_score import model_classes, score_from_counts
from gep_fed.validation import ConfigError

log = logging.getLogger("gep_fed.server")

# The fingerprint of the initial model a run started from: a resume must start from the same.
INITIAL_MODEL = "initial-model.json"
INITIAL_SHA256 = "initial-arrays-sha256"  # null: the task's model, seeded by the run's seed


# -- what a grid carries ---------------------------------------------------------------------


class Arrays(dict):
    """An array record: name -> array (numpy to send; a ``wire.WireArray`` received)."""


class Config(dict):
    """A config record: name -> int, float, str, bytes, bool or a list of one of them."""


class Metrics(dict):
    """A metric record: name -> int or float."""


@dataclass
class Envelope:
    """A message's records by name, in the order they travel."""

    records: dict[str, Arrays | Config | Metrics] = field(default_factory=dict)

    def _get(self, name: str, kind: type):
        record = self.records.get(name)
        return record if isinstance(record, kind) else None

    def arrays(self, name: str) -> Arrays | None:
        return self._get(name, Arrays)

    def config(self, name: str) -> Config | None:
        return self._get(name, Config)

    def metrics(self, name: str) -> Metrics | None:
        return self._get(name, Metrics)


@dataclass(frozen=True)
class Request:
    """What the server sends one site: a round (a train message), or a query (a score)."""

    node: int
    content: Envelope
    kind: str = "train"


@dataclass(frozen=True)
class Reply:
    """A site's reply: its content, or an error code (a refusal's, or the transport's)."""

    node: int
    content: Envelope | None = None
    error: int | None = None
    run_id: int = 0


class RoundGrid(Protocol):
    """The sites, as the round loop sees them."""

    sent: int  # payload bytes sent so far
    received: int  # payload bytes received so far

    def node_ids(self) -> list[int]: ...

    def exchange(
        self, requests: Sequence[Request], *, group_id: str | None, timeout: float | None
    ) -> list[Reply]:
        """Send every request; return the replies that came (any order; a silent site's
        missing, a site's twice if it answered twice). ``group_id``: the messages' group
        (the round of a secure-sum stage; None for a plain round)."""
        ...


# -- the secure sum's stages ---------------------------------------------------------------


@dataclass
class SecureSumResult:
    """A secure sum's outcome. ``modular_sum`` is None when the round was abandoned."""

    modular_sum: np.ndarray | None
    survivors: list[int]
    replies: dict[int, Reply]
    failures: list[str] = field(default_factory=list)


class SecureSumRound:
    """One secure sum of the sites' shares, the server's side, in named stages.

    The protocol is ``gep_fed.federation.secure_sum`` (pairwise masks over every pair of the
    round's sites, agreement keys signed by pinned site keys, no dropout recovery). The
    first two steps are train messages whose ``SECURE_SUM`` config record names the stage;
    the last two are the server's own (there is no unmask stage: no site is ever asked for a
    secret):

    1. ``advertise_keys``: every site answers with its signed agreement key for the round;
    2. ``collect_masked_shares``: every site that advertised gets the round's train content
       and the list of signed keys, and answers with its masked share (uint32);
    3. ``accepted_shares``: each listed site's reply checked and its share read;
    4. ``sum_shares``: the masked shares added; the masks cancel only when every listed
       site's share is in the sum, so a round with a silent or rejected site is abandoned
       with nothing revealed.

    Args:
        grid: the sites.
        round_: the round the sites' signatures name (with the replies' run id).
        bits: the shares' modulus ``2**bits`` (divides ``2**32``).
        needed: abandon before the collect stage when fewer sites advertise a valid key.
        timeout: seconds per stage.
    """

    def __init__(
        self, grid: RoundGrid, round_: int, bits: int, needed: int, *, timeout: float | None
    ) -> None:
        self.grid, self.round = grid, round_
        self.bits, self.needed, self.timeout = bits, needed, timeout
        self.failures: list[str] = []

    def run(
        self,
        requests: Sequence[Request],
        accept: Callable[[int, Reply], str | None],
    ) -> SecureSumResult:
        """Sum the shares the sites compute from ``requests`` (the round's train content
        per site). ``accept(node, reply)`` checks a collect reply's metadata and returns why
        it is rejected (None: accepted); a rejected reply abandons the round."""
        contents = {r.node: r.content for r in requests}
        settings = {
            node: wire.RoundConfig.from_record(content.config(wire.ROUND_CONFIG)).digest()
            for node, content in contents.items()
        }
        keys = self.advertise_keys(settings)
        if len(keys) < self.needed:
            self.failures.append(
                f"{len(keys)} sites advertised a key, {self.needed} needed: round abandoned"
            )
            return SecureSumResult(None, sorted(keys), {}, self.failures)
        replies = self.collect_masked_shares(keys, contents)
        shares = self.accepted_shares(keys, replies, accept)
        total = self.sum_shares(keys, shares)
        return SecureSumResult(
            total, sorted(shares), {} if total is None else replies, self.failures
        )

    def advertise_keys(self, settings: Mapping[int, bytes]) -> dict[int, SignedKey]:
        """Stage 1: each site's signed agreement key (those that verify), bound to the
        digest of the round config it will be sent (``settings``, by node)."""
        stage = [
            Request(n, Envelope({SECURE_SUM: Config(stage_config(ADVERTISE, self.round, None, d))}))
            for n, d in sorted(settings.items())
        ]
        replies = self._exchange(stage)
        keys: dict[int, SignedKey] = {}
        for node in sorted(settings):
            reply = replies.get(node)
            why = self._answered(node, reply, ADVERTISE)
            if why is None:
                key = read_signed_key(reply.content.config(SECURE_SUM))
                binding = RoundBinding(reply.run_id, self.round, settings[node])
                if key is None or not key.verified(binding):
                    why = "its signed key is malformed or not signed for this round"
                elif any(k.site_key == key.site_key for k in keys.values()):
                    why = "its site key is another node's"
            if why is not None:
                self.failures.append(f"site at node {node}: {why}")
            else:
                keys[node] = key
        return keys

    def collect_masked_shares(
        self, keys: Mapping[int, SignedKey], contents: Mapping[int, Envelope]
    ) -> dict[int, Reply]:
        """Stage 2: the round's train content and every listed key, to every listed site."""
        listed = [keys[n] for n in sorted(keys)]
        stage = []
        for node in keys:
            content = contents[node]
            content.records[SECURE_SUM] = Config(stage_config(COLLECT, self.round, listed))
            stage.append(Request(node, content))
        return self._exchange(stage)

    def accepted_shares(
        self,
        keys: Mapping[int, SignedKey],
        replies: Mapping[int, Reply],
        accept: Callable[[int, Reply], str | None],
    ) -> dict[int, np.ndarray]:
        """Stage 3: each listed site's masked share, where its reply is accepted."""
        shares = {}
        for node in keys:
            why = self._answered(node, replies.get(node), COLLECT)
            if why is None:
                why = accept(node, replies[node])
            if why is None:
                try:
                    shares[node] = read_masked_share(replies[node].content.arrays(MASKED_SHARE))
                except ValueError as err:
                    why = str(err)
            if why is not None:
                self.failures.append(f"site at node {node}: {why}")
        return shares

    def sum_shares(
        self, keys: Mapping[int, SignedKey], shares: Mapping[int, np.ndarray]
    ) -> np.ndarray | None:
        """Stage 4: the sum of the shares modulo ``2**bits``, or None (the round abandoned,
        nothing revealed) unless every listed site's share is there and the masks cancel."""
        if len(shares) < len(keys):
            self.failures.append(
                f"{len(keys) - len(shares)} of the {len(keys)} sites' shares are missing: "
                "their masks cannot cancel, round abandoned with nothing revealed"
            )
            return None
        if len({v.shape for v in shares.values()}) != 1:
            self.failures.append("the sites' masked shares differ in length: round abandoned")
            return None
        total = unmasked_sum([shares[n] for n in sorted(shares)], self.bits)
        if total is None:
            self.failures.append("the masks did not cancel (the sites' lists differ): abandoned")
            return None
        return total

    def _answered(self, node: int, reply: Reply | None, stage: str) -> str | None:
        """Why a stage's reply is unusable (None: it has the stage's record)."""
        if reply is None:
            return f"no {stage} reply"
        if reply.error is not None:  # a refusal's fixed text, never the reply's own
            return f"{stage}: {wire.describe_error(reply.error, None)}"
        if stage == ADVERTISE and reply.content.config(SECURE_SUM) is None:
            return f"{stage} reply without {SECURE_SUM}"
        return None

    def _exchange(self, requests: list[Request]) -> dict[int, Reply]:
        """The first reply of each node asked."""
        asked = {r.node for r in requests}
        replies: dict[int, Reply] = {}
        for reply in self.grid.exchange(requests, group_id=str(self.round), timeout=self.timeout):
            if reply.node in asked and reply.node not in replies:
                replies[reply.node] = reply
        return replies


# -- the run ---------------------------------------------------------------------------------


def open_server(
    fed: FederationConfig,
    run_id: int | str,
    round_offset: int = 0,
    scored: bool = False,
    selection: str = "",
) -> FederationServer:
    """The federation server for ``fed``: its run directory (new, or resumed if it has a
    checkpoint and was started with the same settings), the task's public anchors and server
    test set, its noise and ledger. ``run_id`` names the run directory when ``fed.run_name``
    is empty; ``round_offset``, ``scored`` and ``selection`` are ``FederationServer``'s. Raises
    ``ValueError`` when the run directory was started with other settings."""
    run = RunDirectory(fed.run_directory(run_id))
    fresh = not run.path.exists()
    run.path.mkdir(parents=True, exist_ok=True)
    lock = run.lock()  # held until the run ends (FederationServer.close)
    try:
        task = fed.make_task()
        total = fed.total_examples
        if total is None:  # a simulation of shares: the pooled data
            try:
                total = len(task.train_dataset())
            except NotImplementedError:
                raise ConfigError(
                    "total-examples is not declared and the task has no pooled data to count: "
                    "declare total-examples, N, the size of the sites' data (each mode "
                    "normalises by it)"
                ) from None
            log.info("total-examples not declared: the task's pooled size N=%d", total)
        server = FederationServer(
            fed, task, run, total, round_offset=round_offset, scored=scored, selection=selection
        )
        previous = run.read_json(CONFIG) if run.file(CONFIG).exists() else None
        resolved = {
            **fed.to_record(),
            "resolved-noise-multiplier": server.contract.noise_multiplier,
            "resolved-total-examples": total,
            "noise": repr(server.noise),
        }
        if previous is not None and previous != resolved:
            changed = sorted(k for k in resolved if previous.get(k) != resolved[k])
            raise ValueError(
                f"{run.path} was started with a different configuration ({changed}); resume "
                "it with the same settings or start a new run"
            )
        run.write_json(CONFIG, resolved)
    except BaseException:
        lock.close()
        if fresh:  # a run that never started leaves no empty run directory behind
            shutil.rmtree(run.path, ignore_errors=True)
        raise
    server.run_lock = lock
    return server


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of a state dict's names, dtypes, shapes and values."""
    digest = hashlib.sha256()
    for name in sorted(state):
        value = state[name].detach().cpu().contiguous().numpy()
        digest.update(f"{name}\0{value.dtype.str}\0{value.shape}\0".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def _describe(fingerprint: str | None) -> str:
    return "the task's seeded model" if fingerprint is None else f"arrays {fingerprint[:12]}"


def _metrics(reply: Reply) -> dict:
    """A reply's data-free metrics."""
    return dict(reply.content.metrics(wire.REPLY_METRICS) or {})


def _largest_epsilon(site_metrics) -> float | None:
    """The largest epsilon the sites' own ledgers reported (None: none did)."""
    reported = [m[wire.SITE_EPSILON] for m in site_metrics if wire.SITE_EPSILON in m]
    return max(reported) if reported else None


# The keys of a round's record (``RoundLoop.round_record``): these names, and every key with
# one of these prefixes (the task's metrics, the sites' and the anchors' figures).
ROUND_RECORD_NAMES = frozenset(
    {"round", "epsilon", "delta", "round_seconds", "best_round", "sites_ok", "sites_asked"}
    | {"applied", "rejected", "bytes_sent", "bytes_received"}
)
ROUND_RECORD_PREFIXES = ("test_", "val_", "site_", "anchor_", "basis_")


def recorded_by_the_loop(key: str) -> bool:
    """Whether the round loop writes ``key`` in a round's record itself."""
    return key in ROUND_RECORD_NAMES or key.startswith(ROUND_RECORD_PREFIXES)


# What the loop hands its caller after each round: (round, its record, the applied round's
# train metrics or None). The caller may add keys to the record before it is written.
AfterRound = Callable[[int, dict, dict | None], None]


class RoundLoop:
    """The rounds of a federation, step by step (see the module's docstring).

    Args:
        server: the federation's state (model, anchors, ledger, run directory).
        progress: show a progress bar over rounds.
        on_round: called with each round's record, once it is written (e.g. for a CLI).
    """

    def __init__(
        self,
        server: FederationServer,
        progress: bool = True,
        on_round: Callable[[dict], None] | None = None,
    ) -> None:
        self.server = server
        self.cfg = server.cfg
        self.mode = server.cfg.noise_mode
        self.progress = progress
        self.on_round = on_round
        self.basis_held: dict[int, int] = {}  # node id -> basis id it acknowledged
        self.info: dict = {}  # the round's record so far, filled by its steps
        self.stop_reason: str | None = None

    # -- the global model ------------------------------------------------------------------

    def check_arrays(self, arrays: Mapping[str, wire.WireArray]) -> dict[str, torch.Tensor]:
        """``arrays`` as a state dict of the task's model, or ``ValueError`` naming every key
        that is missing or unexpected, every shape or dtype that differs and every
        non-finite value."""
        reference = self.server.model.state_dict()
        problems = [f"missing {name!r}" for name in reference if name not in arrays]
        problems += [f"unexpected {name!r}" for name in arrays if name not in reference]
        state = {}
        for name, ref in reference.items():
            if name not in arrays:
                continue
            array, dtype = arrays[name], str(ref.dtype).removeprefix("torch.")
            if (array.dtype, tuple(array.shape)) != (dtype, tuple(ref.shape)):
                problems.append(
                    f"{name!r} is {array.dtype} {list(array.shape)}, the model's is "
                    f"{dtype} {list(ref.shape)}"
                )
                continue
            value = np.array(array.numpy())
            if not np.isfinite(value).all():
                problems.append(f"{name!r} holds NaN or inf")
                continue
            state[name] = torch.from_numpy(value)
        if problems:
            raise ValueError(
                f"the arrays do not fit the model of task {self.cfg.task!r} (model "
                f"{self.cfg.model!r}): " + "; ".join(problems)
            )
        return state

    def set_aside_torn_metrics(self) -> None:
        """A torn last metrics line (a crash while writing it) kept apart, said once."""
        if self.server.run.set_aside_torn_metrics() is not None:
            log.warning("the metrics file ended in a torn line, kept in metrics.jsonl.torn")

    def restore(self, initial: Mapping[str, wire.WireArray] | None) -> int:
        """Set the global model before the first round; returns the last completed round.

        A new run starts from ``initial`` (None: the task's model, seeded by the run's
        ``seed``) and records their fingerprint in the run directory. A run directory with a
        checkpoint resumes from it, and only with the initial model it was started from.

        Raises:
            ValueError: ``initial`` does not fit the task's model, or differs from the
                arrays the run directory was started from.
        """
        state = None if initial is None else self.check_arrays(initial)
        started_from = None if state is None else fingerprint(state)
        self.set_aside_torn_metrics()  # before the resume reads the metrics' applied rounds
        done = self.server.resume()
        run = self.server.run
        if done == 0:
            if state is not None:
                self.server.model.load_state_dict(state)
            run.write_json(INITIAL_MODEL, {INITIAL_SHA256: started_from})
            return 0
        started = None  # older run directories record none: they began with the task's model
        if run.file(INITIAL_MODEL).exists():
            started = run.read_json(INITIAL_MODEL)[INITIAL_SHA256]
        if started != started_from:
            raise ValueError(
                f"{run.path} was started from {_describe(started)}, not from "
                f"{_describe(started_from)}; resume it with the same initial_arrays or start "
                "a new run"
            )
        log.info("resuming after round %d from %s", done, run.path)
        return done

    # -- one round's steps -----------------------------------------------------------------

    def within_budget(self, rnd: int) -> bool:
        """Whether round ``rnd`` fits the budget; if not, ``stop_reason`` says why."""
        try:
            self.server.check_budget(rnd)
        except BudgetExceededError as err:
            self.stop_reason = f"stopped before round {rnd}: {err}"
            log.warning(self.stop_reason)
            return False
        return True

    def configure_round(self, rnd: int, nodes: Sequence[int]) -> list[Request]:
        """The round's requests to every node: the global model, the round config and, to a
        node that does not hold it yet, the anchor basis."""
        plan = self.server.plan_round(rnd)
        nodes = sorted(nodes)
        self.info = {
            "anchor_seconds": plan.anchor_seconds,
            "anchor_projection_error": plan.anchor_projection_error,
            "basis_directions": plan.basis_directions,
            "sites_asked": len(nodes),
        }
        sent_bytes, requests = [], []
        for node in nodes:
            records = {
                wire.GLOBAL_MODEL: Arrays(plan.state),
                wire.ROUND_CONFIG: Config(plan.config.to_record()),
            }
            basis_id = plan.config.basis_id
            needs_basis = plan.basis is not None and self.basis_held.get(node) != basis_id
            if needs_basis:
                records[wire.BASIS] = Arrays(plan.basis)
            sent_bytes.append(self.server.basis_nbytes if needs_basis else 0)
            requests.append(Request(node, Envelope(records)))
        self.info["basis_bytes_per_site"] = sent_bytes
        return requests

    def train_round(
        self, rnd: int, requests: list[Request], grid: RoundGrid, timeout: float | None
    ) -> dict | None:
        """Send the round, collect the replies and step the model by the round's mode;
        returns the applied round's train metrics (None: the model is unchanged)."""
        if self.mode.secure_sum:
            return self.secure_aggregate(rnd, requests, grid, timeout)
        return self.aggregate(rnd, grid.exchange(requests, group_id=None, timeout=timeout))

    def validate_reply(self, rnd: int, reply: Reply, seen: set[int]):
        """The reply's (node, payload, metrics), or raise ``WireError`` naming the site and
        the field."""
        node = reply.node
        sender = f"site at node {node}"
        if node in seen:
            raise wire.WireError(sender, "reply", "duplicate reply for this round")
        seen.add(node)
        if reply.error is not None:  # recorded as a fixed text: a reply's free text never is
            raise wire.WireError(sender, "error", wire.describe_error(reply.error, None))
        content = reply.content
        meta = content.config(wire.REPLY_META)
        if meta is None:
            raise wire.WireError(sender, wire.REPLY_META, "missing")
        wire.check_reply_meta(meta, sender, self.server.wire_round(rnd), self.cfg.mode)
        payload_name = wire.CLIPPED_SUMS if self.mode.server_steps else wire.MODEL_DELTA
        extra = sorted(set(content.records) - {wire.REPLY_META, wire.REPLY_METRICS, payload_name})
        if extra:  # (clipped sums in a client-mode reply: never kept, but never silent)
            raise wire.WireError(sender, "reply", f"records this mode does not send: {extra}")
        metrics = _metrics(reply)
        wire.check_reply_metrics(metrics, sender, self.server.basis_id)
        if self.mode.server_steps:
            sums = content.arrays(wire.CLIPPED_SUMS)
            if sums is None:
                raise wire.WireError(sender, wire.CLIPPED_SUMS, "missing")
            mech = self.server.mechanism
            payload = wire.decode_sums(
                sums,
                sender,
                self.server.subspace.num_basis if mech.uses_subspace else None,
                None if mech.name == "bgep" else self.server.layout.size,
            )
            self.server.check_plausible(payload, sender)
        else:
            delta = content.arrays(wire.MODEL_DELTA)
            if delta is None:
                raise wire.WireError(sender, wire.MODEL_DELTA, "missing")
            payload = wire.decode_delta(delta, self.server.layout, sender)
            self.server.check_plausible_delta(payload, sender)
        return node, payload, metrics

    def valid_replies(self, rnd: int, replies: Sequence[Reply]) -> list[tuple[int, object, dict]]:
        """Each reply's (node, payload, metrics) where ``validate_reply`` accepts it; a
        rejected one is named in the log and in the round's ``rejected``, and the round goes
        on with the others."""
        valid, rejected, seen = [], [], set()
        for reply in replies:
            try:
                valid.append(self.validate_reply(rnd, reply, seen))
            except wire.WireError as err:
                log.warning("round %d: rejected reply: %s", rnd, err)
                rejected.append(str(err))
        for node, _, metrics in valid:
            self._note_basis(node, metrics)
        self.info.update({"sites_ok": len(valid), "rejected": rejected})
        return valid

    def enough_sites(self, rnd: int, valid: int) -> bool:
        """Whether ``valid`` replies reach ``min_sites``; if not, the round is not applied."""
        if valid >= self.cfg.min_sites:
            return True
        self.info["applied"] = False
        released = valid and not self.mode.server_steps  # client mode: the sites' own noise
        log.warning(
            "round %d: %d valid repl%s, fewer than min_sites=%d: the global model is not "
            "updated and the server accounts nothing for this round%s",
            rnd,
            valid,
            "y" if valid == 1 else "ies",
            self.cfg.min_sites,
            " (the sites that replied recorded their releases in their own ledgers)"
            if released
            else "",
        )
        return False

    def apply(self, rnd: int, payloads: list) -> None:
        """Step the global model and account the round, by the round's mode: central noise
        once on the sum of the clipped sums, or the mean of the sites' noisy deltas."""
        if self.mode.server_steps:
            self.server.apply_central(rnd, payloads)
        else:
            self.server.apply_client(rnd, payloads)

    def aggregate(self, rnd: int, replies: Sequence[Reply]) -> dict | None:
        """Central and client mode: validate the replies and, with at least ``min_sites``
        valid ones, step the global model and account the round.

        Returns data-free train metrics (``sites-ok``, ``sites-rejected``, the largest
        ``site-epsilon-max`` the sites' ledgers reported), or None when too few replies were
        valid: then the model is unchanged and the server accounts nothing (in client mode
        the sites that replied have recorded their releases: the largest epsilon they report
        is kept in the round's record even then)."""
        valid = self.valid_replies(rnd, replies)
        site_metrics = [metrics for *_, metrics in valid]
        reported = None if self.mode.server_steps else _largest_epsilon(site_metrics)
        if reported is not None:  # each site's own ledger is the authority
            self.info["site_epsilon_max"] = reported
        if not self.enough_sites(rnd, len(valid)):
            return None
        self.apply(rnd, [payload for _, payload, _ in valid])
        train = {"sites-ok": len(valid), "sites-rejected": len(self.info["rejected"])}
        if reported is not None:
            train["site-epsilon-max"] = reported
        unprotected = [m[k] for m in site_metrics for k in m if "OUTSIDE-PRIVACY" in k]
        if unprotected:
            self.info["site_train_loss_OUTSIDE_PRIVACY_GUARANTEE"] = unprotected
        self.info["applied"] = True
        return train

    def share_problem(self, rnd: int, node: int, reply: Reply) -> str | None:
        """Why a site's collect-stage reply is rejected (its masked share is then left out
        of the sum like a dropped site's), or None."""
        meta = reply.content.config(wire.REPLY_META)
        sender = f"site at node {node}"
        try:
            if meta is None:
                raise wire.WireError(sender, wire.REPLY_META, "missing")
            wire.check_reply_meta(meta, sender, self.server.wire_round(rnd), self.cfg.mode)
            wire.check_reply_metrics(_metrics(reply), sender, self.server.basis_id)
            share = (reply.content.arrays(MASKED_SHARE) or {}).get(MASKED_SHARE)
            expected = (self.server.quantized_dimension + 1,)  # the count, then the share
            if share is not None and tuple(share.shape) != expected:
                # named here: in the sum, shares of other lengths only say that they differ
                raise wire.WireError(
                    sender, MASKED_SHARE, f"shape {tuple(share.shape)}, not {expected}"
                )
        except wire.WireError as err:  # the secure sum names the site itself
            return f"field {err.field!r}: {err.problem}"
        return None

    @property
    def shares_needed(self) -> int:
        """The fewest sites whose keys let a secure sum go on (noise shares, min_sites)."""
        return max(self.cfg.shares_needed, self.cfg.min_sites)

    def secure_sum(
        self, rnd: int, requests: list[Request], grid: RoundGrid, timeout: float | None
    ) -> SecureSumResult:
        """The round's secure sum (``SecureSumRound``), its failures logged and kept as the
        round's ``rejected``, the basis of each site that contributed noted."""
        bits = self.server.contract.quantization_bits
        numbered = self.server.wire_round(rnd)  # the round the sites sign and mask
        result = SecureSumRound(grid, numbered, bits, self.shares_needed, timeout=timeout).run(
            requests, lambda node, reply: self.share_problem(rnd, node, reply)
        )
        for failure in result.failures:
            log.warning("round %d: %s", rnd, failure)
        self.info["rejected"] = result.failures
        for node, reply in result.replies.items():
            self._note_basis(node, _metrics(reply))
        return result

    def decodable_sum(self, result: SecureSumResult) -> np.ndarray | None:
        """The secure sum, if it has the length of the round's shares (else None, named)."""
        total = result.modular_sum
        if total is not None and total.shape != (self.server.quantized_dimension,):
            self.info["rejected"] = [*result.failures, f"the secure sum has shape {total.shape}"]
            return None
        return total

    def secure_aggregate(
        self, rnd: int, requests: list[Request], grid: RoundGrid, timeout: float | None
    ) -> dict | None:
        """Distributed mode: the secure sum of the sites' noised shares, decoded and stepped
        like central mode. With fewer than ``noise_shares`` (or ``min_sites``) sites
        advertising a key, or any listed site's share missing, the round is abandoned:
        nothing is revealed, the model is unchanged and the server accounts nothing."""
        result = self.secure_sum(rnd, requests, grid, timeout)
        total = self.decodable_sum(result)
        if total is None:
            self.info.update(sites_ok=0, applied=False)
            log.warning(
                "round %d: the secure sum was abandoned (%d sites' shares arrived, at least %d "
                "needed and every listed site's): nothing is revealed or accounted",
                rnd,
                len(result.survivors),
                self.shares_needed,
            )
            return None
        self.server.apply_distributed(rnd, total)
        self.info.update(sites_ok=len(result.survivors), applied=True)
        reported = _largest_epsilon(_metrics(r) for r in result.replies.values())
        if reported is not None:
            self.info["site_epsilon_max"] = reported
        return {"sites-ok": len(result.survivors), "sites-rejected": len(result.failures)}

    def _note_basis(self, node: int, metrics: Mapping) -> None:
        """A site that used the round's basis holds it: later rounds send it none."""
        if metrics.get(wire.BASIS_ID, -1) >= 0:
            self.basis_held[node] = int(metrics[wire.BASIS_ID])

    def round_record(self, rnd: int, began: float, site_epsilon: float | None) -> dict:
        """The round's metrics: the task's metrics on the server's evaluation data, the
        privacy spent so far, the seconds since ``began`` (``time.perf_counter``), and what
        the round sent, received and rejected."""
        evaluation = self.server.evaluate()
        validation = self.server.validate()
        kept = {}
        if validation is not None:  # the best round so far, on the task's validation set
            self.server.keep_if_best(rnd, validation)
            kept = {f"val_{k}": v for k, v in validation.items()}
            kept["best_round"] = self.server.best[0] if self.server.best else None
        return {
            "round": rnd,
            **{f"test_{k}": v for k, v in evaluation.items()},
            **kept,
            "epsilon": self.server.epsilon_spent(site_epsilon),
            "delta": self.cfg.delta,
            "round_seconds": time.perf_counter() - began,
            **self.info,
        }

    # -- after the rounds: the sites' score ---------------------------------------------------

    def score_sites(self, grid: RoundGrid, timeout: float | None = None) -> dict:
        """Ask every site to score the served model on the examples it holds out: each
        that agrees (its node config's ``score-noise``) records one Gaussian release in its
        ledger and replies with its noised per-class counts (``site_score``); their sum gives
        accuracy and balanced accuracy (post-processing). Returns and writes to the run
        directory (``SITE_SCORE``) the metrics as ``site_val_*``, the sites that replied,
        and the refusals by fixed reason."""
        model = self.server.served_model
        classes = model_classes(model, self.server.public[0][0].to(self.server.device))
        state = wire.encode_state(model.state_dict())
        records = {
            wire.GLOBAL_MODEL: Arrays(state),
            wire.SCORE_REQUEST: Config(wire.score_request(classes)),
        }
        requests = [Request(n, Envelope(records), "query") for n in sorted(grid.node_ids())]
        total, rejected, seen, ok = None, [], set(), 0
        for reply in grid.exchange(requests, group_id=None, timeout=timeout):
            sender = f"site at node {reply.node}"
            try:
                if reply.node in seen:
                    raise wire.WireError(sender, "reply", "duplicate reply")
                seen.add(reply.node)
                if reply.error is not None:
                    raise wire.WireError(sender, "error", wire.describe_error(reply.error, None))
                arrays = reply.content.arrays(wire.SITE_SCORE)
                if arrays is None:
                    raise wire.WireError(sender, wire.SITE_SCORE, "missing")
                counts = wire.decode_counts(arrays, sender, classes)
            except wire.WireError as err:
                log.warning("score: rejected reply: %s", err)
                rejected.append(str(err))
                continue
            total, ok = (counts if total is None else total + counts), ok + 1
        metrics = {} if total is None else score_from_counts(total)
        record = {
            **{f"site_val_{k}": v for k, v in metrics.items()},
            "counts": None if total is None else total.tolist(),  # the sum of the releases
            "sites_ok": ok,
            "rejected": rejected,
        }
        self.server.run.write_json(SITE_SCORE, record)
        return record

    # -- the loop ----------------------------------------------------------------------------

    def run(
        self,
        grid: RoundGrid,
        first: int,
        last: int,
        timeout: float | None = None,
        after_round: AfterRound | None = None,
    ) -> None:
        """Rounds ``first`` to ``last`` (fewer when the budget ends the run first), then
        save the model. ``after_round`` sees each round's record before it is written."""
        self.set_aside_torn_metrics()
        for lost in self.server.run.note_lost_rounds(first - 1):
            log.warning("round %d: %s", lost, LOST_ROUND)
        site_epsilon = None  # the largest epsilon the sites' own ledgers reported so far
        bar = tqdm(
            range(first, last + 1),
            initial=first - 1,
            total=last,
            desc=f"{self.cfg.mode} {self.cfg.mechanism}",
            unit="round",
            disable=not self.progress,
        )
        for rnd in bar:
            if not self.within_budget(rnd):
                break
            began, counted = time.perf_counter(), (grid.sent, grid.received)
            requests = self.configure_round(rnd, grid.node_ids())
            train = self.train_round(rnd, requests, grid, timeout)
            self.info["bytes_sent"] = grid.sent - counted[0]
            self.info["bytes_received"] = grid.received - counted[1]
            site_epsilon = self.info.get("site_epsilon_max", site_epsilon)
            record = self.round_record(rnd, began, site_epsilon)
            if after_round is not None:
                after_round(rnd, record, train)
            self.server.run.append_metrics(record)
            bar.set_postfix(acc=f"{record['test_accuracy']:.3f}", eps=f"{record['epsilon']:.2f}")
            if self.on_round:
                self.on_round(record)
        self.server.save_model()
