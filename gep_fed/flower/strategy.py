"""``GEPStrategy``: a Flower Message-API strategy around ``gep_fed.federation.FederationServer``.

Each round: stop if the round would exceed the budget; compute the anchor subspace (when due)
and send weights, basis and round config to every site; validate every reply (a bad one is
rejected, named in the log and in the round's metrics, and the round goes on with the
others); aggregate with central noise or average the sites' noisy deltas; evaluate on the
server's data; record the round in the ledger, checkpoint, and append the round's metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from tqdm.auto import tqdm

from gep_fed.accounting.ledger import BudgetExceededError
from gep_fed.federation import wire
from gep_fed.federation.server import FederationServer

log = logging.getLogger("gep_fed.server")


def _arrays(values: dict) -> ArrayRecord:
    return ArrayRecord({name: Array(value) for name, value in values.items()})


class GEPStrategy(Strategy):
    """Federated GEP / B-GEP / GP in central or client-side mode.

    Args:
        server: the federation's state (model, anchors, ledger, run directory).
        progress: show a progress bar over rounds.
        on_round: called with each round's metrics record (e.g. for a CLI).
    """

    def __init__(
        self,
        server: FederationServer,
        progress: bool = True,
        on_round: Callable[[dict], None] | None = None,
    ) -> None:
        self.server = server
        self.cfg = server.cfg
        self.progress = progress
        self.on_round = on_round
        self._basis_held: dict[int, int] = {}  # node id -> basis id it acknowledged
        self._round_info: dict = {}
        self.stop_reason: str | None = None

    def summary(self) -> None:
        cfg = self.cfg
        log.info(
            "GEPStrategy: mode=%s mechanism=%s sigma=%.4f q=%g rounds=%d budget=(%g, %g) run=%s",
            cfg.mode,
            cfg.mechanism,
            self.server.sigma,
            cfg.sample_rate,
            cfg.rounds,
            cfg.target_epsilon,
            cfg.delta,
            self.server.run.path,
        )

    # -- training ----------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        plan = self.server.plan_round(server_round)
        nodes = sorted(grid.get_node_ids())
        self._round_info = {
            "anchor_seconds": plan.anchor_seconds,
            "anchor_projection_error": plan.anchor_projection_error,
            "sites_asked": len(nodes),
        }
        state = _arrays(plan.state)
        round_config = ConfigRecord(plan.config.to_record())
        basis = _arrays(plan.basis) if plan.basis is not None else None
        sent_bytes = []
        messages = []
        for node in nodes:
            content = {wire.GLOBAL_MODEL: state, wire.ROUND_CONFIG: round_config}
            needs_basis = basis is not None and self._basis_held.get(node) != plan.config.basis_id
            if needs_basis:
                content[wire.BASIS] = basis
            sent_bytes.append(self.server.basis_nbytes if needs_basis else 0)
            messages.append(
                Message(
                    content=RecordDict(content), message_type=MessageType.TRAIN, dst_node_id=node
                )
            )
        self._round_info["basis_bytes_per_site"] = sent_bytes
        return messages

    def _validate(self, server_round: int, msg: Message, seen: set[int]):
        """The reply's payload, or raise ``WireError`` naming the site and the field."""
        node = msg.metadata.src_node_id
        sender = f"site at node {node}"
        if node in seen:
            raise wire.WireError(sender, "reply", "duplicate reply for this round")
        seen.add(node)
        if msg.has_error():  # recorded as a fixed text: a reply's free text is never kept
            raise wire.WireError(sender, "error", wire.describe_error(msg.error.code, None))
        content = msg.content
        if wire.REPLY_META not in content.config_records:
            raise wire.WireError(sender, wire.REPLY_META, "missing")
        wire.check_reply_meta(
            content.config_records[wire.REPLY_META], sender, server_round, self.cfg.mode
        )
        metrics = dict(content.metric_records.get(wire.REPLY_METRICS, {}))
        if self.cfg.mode == "central":
            if wire.CLIPPED_SUMS not in content.array_records:
                raise wire.WireError(sender, wire.CLIPPED_SUMS, "missing")
            mech = self.server.mechanism
            sums = wire.decode_sums(
                content.array_records[wire.CLIPPED_SUMS],
                sender,
                self.server.subspace.num_basis if mech.uses_subspace else None,
                None if mech.name == "bgep" else self.server.layout.size,
            )
            self.server.check_plausible(sums, sender)
            payload = sums
        else:
            if wire.MODEL_DELTA not in content.array_records:
                raise wire.WireError(sender, wire.MODEL_DELTA, "missing")
            payload = wire.decode_delta(
                content.array_records[wire.MODEL_DELTA], self.server.layout, sender
            )
        return node, payload, metrics

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        accepted, rejected, site_metrics, seen = [], [], [], set()
        for msg in replies:
            try:
                node, payload, metrics = self._validate(server_round, msg, seen)
            except wire.WireError as err:
                log.warning("round %d: rejected reply: %s", server_round, err)
                rejected.append(str(err))
                continue
            accepted.append(payload)
            site_metrics.append(metrics)
            if metrics.get("basis-id", -1) >= 0:
                self._basis_held[node] = int(metrics["basis-id"])
        info = self._round_info
        info.update({"sites_ok": len(accepted), "rejected": rejected})
        if len(accepted) < self.cfg.min_sites:
            info["applied"] = False
            log.warning(
                "round %d: %d valid repl%s, fewer than min_sites=%d: the global model is not "
                "updated and nothing is accounted for this round",
                server_round,
                len(accepted),
                "y" if len(accepted) == 1 else "ies",
                self.cfg.min_sites,
            )
            return None, None
        if self.cfg.mode == "central":
            self.server.apply_central(server_round, accepted)
        else:
            self.server.apply_client(server_round, accepted)
            reported = [m["site-epsilon"] for m in site_metrics if "site-epsilon" in m]
            if reported:
                info["site_epsilon_max"] = max(reported)
        unprotected = [m[k] for m in site_metrics for k in m if "OUTSIDE-PRIVACY" in k]
        if unprotected:
            info["site_train_loss_OUTSIDE_PRIVACY_GUARANTEE"] = unprotected
        info["applied"] = True
        return None, MetricRecord({"sites-ok": len(accepted)})

    # -- no federated evaluation: a site's accuracy on its own data would be a release --

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        return None

    # -- the loop --------------------------------------------------------------------------

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn=None,
    ) -> Result:
        """Run (or resume) the federation for the configured number of rounds."""
        num_rounds = num_rounds or self.cfg.rounds
        timeout = timeout or self.cfg.round_timeout
        self.summary()
        first = self.server.resume() + 1
        if first > 1:
            log.info("resuming after round %d from %s", first - 1, self.server.run.path)
        result = Result()
        site_epsilon = None  # the largest epsilon the sites' own ledgers reported so far
        bar = tqdm(
            range(first, num_rounds + 1),
            initial=first - 1,
            total=num_rounds,
            desc=f"{self.cfg.mode} {self.cfg.mechanism}",
            unit="round",
            disable=not self.progress,
        )
        for rnd in bar:
            try:
                self.server.check_budget(rnd)
            except BudgetExceededError as err:
                self.stop_reason = f"stopped before round {rnd}: {err}"
                log.warning(self.stop_reason)
                break
            began = time.perf_counter()
            replies = grid.send_and_receive(
                messages=self.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid),
                timeout=timeout,
            )
            self.aggregate_train(rnd, replies)
            evaluation = self.server.evaluate()
            if "site_epsilon_max" in self._round_info:
                site_epsilon = self._round_info["site_epsilon_max"]
            record = {
                "round": rnd,
                **{f"test_{k}": v for k, v in evaluation.items()},
                "epsilon": self.server.epsilon_spent(site_epsilon),
                "delta": self.cfg.delta,
                "round_seconds": time.perf_counter() - began,
                **self._round_info,
            }
            self.server.run.append_metrics(record)
            result.evaluate_metrics_serverapp[rnd] = MetricRecord(
                {
                    k: v
                    for k, v in record.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)
                }
            )
            bar.set_postfix(acc=f"{evaluation['accuracy']:.3f}", eps=f"{record['epsilon']:.2f}")
            if self.on_round:
                self.on_round(record)
        self.server.save_model()
        return result
