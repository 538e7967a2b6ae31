"""``GEPStrategy``: a Flower Message-API strategy around ``gep_fed.federation.FederationServer``.

Each round: stop if the round would exceed the budget; compute the anchor subspace (when due)
and send weights, basis and round config to every site; validate every reply (a bad one is
rejected, named in the log and in the round's metrics, and the round goes on with the
others); aggregate with central noise, average the sites' noisy deltas, or (distributed)
run the secure sum of the sites' noised shares and decode it; evaluate on the
server's data (and with the caller's ``evaluate_fn``); record the round in the ledger,
checkpoint, and append the round's metrics.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
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
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import CONFIG, RunDirectory
from gep_fed.federation.server import FederationServer
from gep_fed.flower.secure_sum import SecureSum

log = logging.getLogger("gep_fed.server")

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]

# The fingerprint of the initial model a run started from: a resume must start from the same.
INITIAL_MODEL = "initial-model.json"
INITIAL_SHA256 = "initial-arrays-sha256"  # null: the task's model, seeded by the run's seed

TRAIN_CONFIG_REFUSED = (
    "GEPStrategy builds every round's config from its FederationConfig "
    "(gep_fed.federation.wire.RoundConfig), and each site checks it against its own policy "
    "and refuses keys it does not know, so no setting reaches a site any other way. Set "
    "training options on the FederationConfig (e.g. local_steps, local_lr)"
)
EVALUATE_CONFIG_REFUSED = (
    "GEPStrategy runs no federated evaluation: a site's metrics on its own data would be a "
    "release outside the privacy guarantee. Evaluate on the server with evaluate_fn"
)


def _arrays(values: dict) -> ArrayRecord:
    return ArrayRecord({name: Array(value) for name, value in values.items()})


def _refuse_config(name: str, config: ConfigRecord | None, why: str) -> None:
    if config:
        raise ValueError(f"{name} {sorted(config)} is not accepted: {why}")


def _fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of a state dict's names, dtypes, shapes and values."""
    digest = hashlib.sha256()
    for name in sorted(state):
        value = state[name].detach().cpu().contiguous().numpy()
        digest.update(f"{name}\0{value.dtype.str}\0{value.shape}\0".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def _merge(record: dict, extra: MetricRecord | None) -> MetricRecord:
    """Add ``evaluate_fn``'s metrics to the round's ``record`` (a key GEP records itself is
    refused) and return the round's ``MetricRecord``: GEP's numeric metrics and all of
    ``evaluate_fn``'s."""
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(record))
    if clash:
        raise ValueError(
            f"evaluate_fn returned {clash} in round {record['round']}: GEPStrategy records "
            "these keys itself; rename them"
        )
    record.update(extra)
    numeric = {
        k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    return MetricRecord({**numeric, **extra})


def content_bytes(message: Message) -> int:
    """The payload bytes of a message: its arrays and the byte strings of its configs."""
    if not message.has_content():
        return 0
    content = message.content
    total = sum(len(a.data) for r in content.array_records.values() for a in r.values())
    for record in content.config_records.values():
        for value in record.values():
            for item in value if isinstance(value, list) else [value]:
                total += len(item) if isinstance(item, bytes | str) else 0
    return total


class MeteredGrid:
    """A Grid that counts the payload bytes it sends and receives (the cost of a mode)."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.sent = self.received = 0

    def get_node_ids(self):
        return self.grid.get_node_ids()

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent += sum(content_bytes(m) for m in messages)
        replies = list(self.grid.send_and_receive(messages=messages, timeout=timeout))
        self.received += sum(content_bytes(m) for m in replies)
        return replies


def _describe(fingerprint: str | None) -> str:
    return "the task's seeded model" if fingerprint is None else f"arrays {fingerprint[:12]}"


class GEPStrategy(Strategy):
    """Federated GEP / B-GEP / GP in central or client-side mode.

    Build it with ``GEPStrategy.from_config``; ``start`` runs it as Flower runs its own
    strategies and returns a ``Result`` holding the final global model.

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

    @classmethod
    def from_config(
        cls,
        fed: FederationConfig,
        run_id: int | str,
        *,
        progress: bool = True,
        on_round: Callable[[dict], None] | None = None,
    ) -> GEPStrategy:
        """The strategy for ``fed``: its run directory (new, or resumed if it has a
        checkpoint and was started with the same settings), the task's public anchors and
        server test set, and the federation server with its noise and ledger.

        Args:
            fed: the run's settings. Its privacy settings (mechanism, sigma or the budget it
                is calibrated from, q, clip norms) reach the sites only in each round's
                config, which every site checks against its own policy before computing.
            run_id: names the run directory when ``fed.run_name`` is empty (a ServerApp
                passes ``context.run_id``).
            progress, on_round: as for ``GEPStrategy``.

        Raises:
            ValueError: the run directory was started with different settings.

        In your own Flower app, pair it with ``gep_fed.flower.make_client_app``::

            # server_app.py
            app = ServerApp()

            @app.main()
            def main(grid: Grid, context: Context) -> None:
                fed = FederationConfig.from_record(context.run_config)
                strategy = GEPStrategy.from_config(fed, context.run_id)
                result = strategy.start(
                    grid,
                    initial_arrays=ArrayRecord(public_model.state_dict()),  # optional
                    evaluate_fn=evaluate,  # optional: (round, arrays) -> MetricRecord
                )
                torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")

            # client_app.py: a site; its privacy policy and ledger come from its node config
            app = make_client_app()
        """
        run = RunDirectory(fed.run_directory(run_id))
        fresh = not run.path.exists()
        run.path.mkdir(parents=True, exist_ok=True)
        try:
            task = fed.make_task()
            total = fed.total_examples
            if total is None and fed.noise_mode.server_steps:  # a simulation: the pooled data
                total = len(task.train_dataset())
                log.info("total-examples not declared: the simulation's pooled size N=%d", total)
            server = FederationServer(fed, task, run, total)
        except BaseException:
            if fresh:  # a run that never started leaves no empty run directory behind
                shutil.rmtree(run.path, ignore_errors=True)
            raise
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
                f"{run.path} was started with a different configuration ({changed}); resume it "
                "with the same settings or start a new run"
            )
        run.write_json(CONFIG, resolved)
        return cls(server, progress=progress, on_round=on_round)

    def summary(self) -> None:
        """Log the run's mode, mechanism, noise, sampling, budget and run directory."""
        cfg = self.cfg
        log.info(
            "GEPStrategy: mode=%s mechanism=%s sigma=%.4f q=%g rounds=%d budget=(%g, %g) run=%s",
            cfg.mode,
            cfg.mechanism,
            self.server.contract.noise_multiplier,
            cfg.sample_rate,
            cfg.rounds,
            cfg.target_epsilon,
            cfg.delta,
            self.server.run.path,
        )

    # -- the global model --------------------------------------------------------------

    def global_arrays(self) -> ArrayRecord:
        """The global model: the server's state dict as an ``ArrayRecord``."""
        return _arrays(wire.encode_state(self.server.model.state_dict()))

    def check_arrays(self, arrays: ArrayRecord) -> dict[str, torch.Tensor]:
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

    def restore(self, initial_arrays: ArrayRecord | None) -> int:
        """Set the global model before the first round; returns the last completed round.

        A new run starts from ``initial_arrays`` (None: the task's model, seeded by the run's
        ``seed``) and records their fingerprint in the run directory. A run directory with a
        checkpoint resumes from it, and only with the initial model it was started from.

        Privacy: the guarantee covers what the sites release. The initial weights must not
        depend on the sites' private data (random, or trained on public data only).

        Raises:
            ValueError: ``initial_arrays`` do not fit the task's model, or differ from those
                the run directory was started from.
        """
        state = None if initial_arrays is None else self.check_arrays(initial_arrays)
        fingerprint = None if state is None else _fingerprint(state)
        done = self.server.resume()
        run = self.server.run
        if done == 0:
            if state is not None:
                self.server.model.load_state_dict(state)
            run.write_json(INITIAL_MODEL, {INITIAL_SHA256: fingerprint})
            return 0
        started = None  # older run directories record none: they began with the task's model
        if run.file(INITIAL_MODEL).exists():
            started = run.read_json(INITIAL_MODEL)[INITIAL_SHA256]
        if started != fingerprint:
            raise ValueError(
                f"{run.path} was started from {_describe(started)}, not from "
                f"{_describe(fingerprint)}; resume it with the same initial_arrays or start "
                "a new run"
            )
        log.info("resuming after round %d from %s", done, run.path)
        return done

    # -- training ----------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The round's messages to every node: the global model, the round config and, to a
        node that does not hold it yet, the anchor basis.

        ``arrays`` must be the server's global model (``global_arrays``), as ``start`` passes
        it: the server steps that model with its own optimiser and checkpoints it, so other
        weights cannot be sent. ``config`` must be empty (see ``start``)."""
        _refuse_config("the train config", config, TRAIN_CONFIG_REFUSED)
        current = wire.encode_state(self.server.model.state_dict())
        same = arrays.keys() == current.keys() and all(
            np.array_equal(arrays[name].numpy(), value) for name, value in current.items()
        )
        if not same:
            raise ValueError(
                "configure_train was given arrays that are not the server's global model; "
                "start a run from other weights with start(initial_arrays=...)"
            )
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
        if self.cfg.noise_mode.server_steps:
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
        """Validate the replies and, with at least ``min_sites`` valid ones, step the global
        model (central noise once on the sum, or the mean of the sites' noisy deltas) and
        account the round.

        Returns the new global model and data-free train metrics (``sites-ok``,
        ``sites-rejected``, the largest ``site-epsilon-max`` the sites' ledgers reported), or
        ``(None, None)`` when too few replies were valid: then the model is unchanged and
        nothing is accounted."""
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
        train_metrics = {"sites-ok": len(accepted), "sites-rejected": len(rejected)}
        if self.cfg.noise_mode.server_steps:
            self.server.apply_central(server_round, accepted)
        else:
            self.server.apply_client(server_round, accepted)
            reported = [m["site-epsilon"] for m in site_metrics if "site-epsilon" in m]
            if reported:
                info["site_epsilon_max"] = train_metrics["site-epsilon-max"] = max(reported)
        unprotected = [m[k] for m in site_metrics for k in m if "OUTSIDE-PRIVACY" in k]
        if unprotected:
            info["site_train_loss_OUTSIDE_PRIVACY_GUARANTEE"] = unprotected
        info["applied"] = True
        return self.global_arrays(), MetricRecord(train_metrics)

    def _share_problem(self, server_round: int, node: int, msg: Message) -> str | None:
        """Why a site's collect-stage reply is rejected (its masked share is then left out
        of the sum like a dropped site's), or None."""
        meta = msg.content.config_records.get(wire.REPLY_META)
        sender = f"site at node {node}"
        try:
            if meta is None:
                raise wire.WireError(sender, wire.REPLY_META, "missing")
            wire.check_reply_meta(meta, sender, server_round, self.cfg.mode)
        except wire.WireError as err:
            return str(err)
        return None

    def secure_train(
        self, server_round: int, messages: Iterable[Message], grid: Grid, timeout: float | None
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Distributed mode's round: the secure sum of the sites' noised shares
        (``gep_fed.flower.secure_sum``), decoded and stepped like central mode. With fewer
        than ``noise_shares`` (or ``min_sites``) sites advertising a key, or any listed site's
        share missing, the round is abandoned: nothing is revealed, the model is unchanged
        and the server accounts nothing."""
        server = self.server
        needed = max(self.cfg.shares_needed, self.cfg.min_sites)
        result = SecureSum(
            grid, server_round, server.contract.quantization_bits, needed, timeout=timeout
        ).run(
            {m.metadata.dst_node_id: m.content for m in messages},
            lambda node, msg: self._share_problem(server_round, node, msg),
        )
        for failure in result.failures:
            log.warning("round %d: %s", server_round, failure)
        info = self._round_info
        info["rejected"] = result.failures
        metrics = {
            n: dict(r.content.metric_records.get(wire.REPLY_METRICS, {}))
            for n, r in result.replies.items()
        }
        for node, m in metrics.items():
            if m.get("basis-id", -1) >= 0:
                self._basis_held[node] = int(m["basis-id"])
        total = result.modular_sum
        if total is not None and total.shape != (server.quantized_dimension,):
            info["rejected"] = [*result.failures, f"the secure sum has shape {total.shape}"]
            total = None
        if total is None:
            info.update(sites_ok=0, applied=False)
            log.warning(
                "round %d: the secure sum was abandoned (%d sites' shares arrived, at least %d "
                "needed and every listed site's): nothing is revealed or accounted",
                server_round,
                len(result.survivors),
                needed,
            )
            return None, None
        server.apply_distributed(server_round, total)
        info.update(sites_ok=len(result.survivors), applied=True)
        reported = [m["site-epsilon"] for m in metrics.values() if "site-epsilon" in m]
        if reported:
            info["site_epsilon_max"] = max(reported)
        train = {"sites-ok": len(result.survivors), "sites-rejected": len(result.failures)}
        return self.global_arrays(), MetricRecord(train)

    # -- no federated evaluation: a site's accuracy on its own data would be a release --

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No messages: GEP evaluates on the server only."""
        _refuse_config("the evaluate config", config, EVALUATE_CONFIG_REFUSED)
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Nothing to aggregate (see ``configure_evaluate``)."""
        return None

    # -- the loop --------------------------------------------------------------------------

    def round_record(self, server_round: int, began: float, site_epsilon: float | None) -> dict:
        """The round's metrics: the task's metrics on the server's evaluation data, the
        privacy spent so far, the seconds since ``began`` (``time.perf_counter``), and what
        the round sent, received and rejected."""
        evaluation = self.server.evaluate()
        validation = self.server.validate()
        kept = {}
        if validation is not None:  # the best round so far, on the task's validation set
            self.server.keep_if_best(server_round, validation)
            kept = {f"val_{k}": v for k, v in validation.items()}
            kept["best_round"] = self.server.best[0] if self.server.best else None
        return {
            "round": server_round,
            **{f"test_{k}": v for k, v in evaluation.items()},
            **kept,
            "epsilon": self.server.epsilon_spent(site_epsilon),
            "delta": self.cfg.delta,
            "round_seconds": time.perf_counter() - began,
            **self._round_info,
        }

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> Result:
        """Run (or resume) the federation.

        Args:
            grid: the Grid to the nodes running ``gep_fed.flower.make_client_app``.
            initial_arrays: the initial global model, with exactly the task model's keys,
                shapes and dtypes (None: the task's model, seeded by the run's ``seed``).
                They must not depend on the sites' private data. A resumed run continues
                from its checkpoint, and only if these equal those it started from.
            num_rounds: the last round (None: the config's ``rounds``). The run stops
                earlier, before any round that would exceed the privacy budget.
            timeout: seconds to wait for the sites' replies per round (None: the config's
                ``round_timeout``).
            train_config, evaluate_config: must be empty: the round config comes from the
                ``FederationConfig`` alone, and there is no federated evaluation.
            evaluate_fn: ``(round, arrays) -> MetricRecord | None``, called as Flower's
                strategies call it: with the initial (or resumed) global model, then after
                every round with the new one. Its metrics join the round's metrics (the run
                directory's and ``Result.evaluate_metrics_serverapp``); a key GEP records
                itself is refused. It sees only the global model, which post-processes the
                sites' private releases (no further cost to their budgets); what it computes
                from the server's own data is not covered by the guarantee.

        Returns:
            Flower's ``Result``: ``arrays`` the final global model, ``train_metrics_clientapp``
            each applied round's train metrics (``aggregate_train``),
            ``evaluate_metrics_serverapp`` each round's numeric metrics.

        Raises:
            ValueError: ``initial_arrays`` do not fit, a config is not empty, or
                ``evaluate_fn`` returned a key GEP records itself.
        """
        _refuse_config("train_config", train_config, TRAIN_CONFIG_REFUSED)
        _refuse_config("evaluate_config", evaluate_config, EVALUATE_CONFIG_REFUSED)
        num_rounds = num_rounds or self.cfg.rounds
        timeout = timeout or self.cfg.round_timeout
        self.summary()
        first = self.restore(initial_arrays) + 1
        arrays = self.global_arrays()
        result = Result()
        if evaluate_fn is not None:
            extra = evaluate_fn(first - 1, arrays)
            if extra is not None:
                result.evaluate_metrics_serverapp[first - 1] = extra
        site_epsilon = None  # the largest epsilon the sites' own ledgers reported so far
        bar = tqdm(
            range(first, num_rounds + 1),
            initial=first - 1,
            total=num_rounds,
            desc=f"{self.cfg.mode} {self.cfg.mechanism}",
            unit="round",
            disable=not self.progress,
        )
        grid = MeteredGrid(grid)
        for rnd in bar:
            try:
                self.server.check_budget(rnd)
            except BudgetExceededError as err:
                self.stop_reason = f"stopped before round {rnd}: {err}"
                log.warning(self.stop_reason)
                break
            began, counted = time.perf_counter(), (grid.sent, grid.received)
            messages = self.configure_train(rnd, arrays, ConfigRecord(), grid)
            if self.cfg.noise_mode.secure_sum:
                new_arrays, train_metrics = self.secure_train(rnd, messages, grid, timeout)
            else:
                replies = grid.send_and_receive(messages=messages, timeout=timeout)
                new_arrays, train_metrics = self.aggregate_train(rnd, replies)
            if new_arrays is not None:
                arrays = new_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[rnd] = train_metrics
            self._round_info["bytes_sent"] = grid.sent - counted[0]
            self._round_info["bytes_received"] = grid.received - counted[1]
            site_epsilon = self._round_info.get("site_epsilon_max", site_epsilon)
            record = self.round_record(rnd, began, site_epsilon)
            extra = evaluate_fn(rnd, arrays) if evaluate_fn is not None else None
            result.evaluate_metrics_serverapp[rnd] = _merge(record, extra)
            self.server.run.append_metrics(record)
            bar.set_postfix(acc=f"{record['test_accuracy']:.3f}", eps=f"{record['epsilon']:.2f}")
            if self.on_round:
                self.on_round(record)
        self.server.save_model()
        result.arrays = arrays
        return result
