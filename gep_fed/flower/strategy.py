"""``GEPStrategy``: a Flower Message-API strategy, a thin adapter over the round loop.

The rounds themselves (budget, round config, validation, aggregation by mode, the secure
sum's stages, evaluation, the run directory) are ``gep_fed.federation.rounds.RoundLoop``'s,
which runs over any grid. This adapter gives it Flower's Grid (``gep_fed.flower.grid``), and
speaks Flower's ``Strategy`` contract: ``configure_train`` and ``aggregate_train`` in
Messages, ``start`` with initial arrays and an ``evaluate_fn``, returning a ``Result``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from gep_fed.federation import wire
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rounds import (
    INITIAL_MODEL,
    INITIAL_SHA256,
    ROUND_RECORD_PREFIXES,
    RoundLoop,
    open_server,
    recorded_by_the_loop,
)
from gep_fed.federation.rundir import OUTCOME, SITE_SCORE
from gep_fed.federation.server import FederationServer
from gep_fed.flower.grid import FlowerGrid, MeteredGrid, content_bytes, message, reply
from gep_fed.flower.interrupt import RunInterrupted, StoppableGrid, StopRequest

log = logging.getLogger("gep_fed.server")

__all__ = [
    "INITIAL_MODEL",
    "INITIAL_SHA256",
    "GEPStrategy",
    "MeteredGrid",
    "content_bytes",
]

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]

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


def _refuse_config(name: str, config: ConfigRecord | None, why: str) -> None:
    if config:
        raise ValueError(f"{name} {sorted(config)} is not accepted: {why}")


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


class GEPStrategy(Strategy):
    """Federated GEP / B-GEP / GP in central, client-side or distributed mode.

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
        self.loop = RoundLoop(server, progress=progress, on_round=on_round)
        self.server = server
        self.cfg = server.cfg

    @property
    def stop_reason(self) -> str | None:
        return self.loop.stop_reason

    @property
    def _round_info(self) -> dict:
        return self.loop.info

    @_round_info.setter
    def _round_info(self, info: dict) -> None:
        self.loop.info = info

    @classmethod
    def from_config(
        cls,
        fed: FederationConfig,
        run_id: int | str,
        *,
        progress: bool = True,
        on_round: Callable[[dict], None] | None = None,
        round_offset: int = 0,
        scored: bool = False,
        selection: str = "",
    ) -> GEPStrategy:
        """The strategy for ``fed``: its run directory (new, or resumed if it has a
        checkpoint and was started with the same settings), the task's public anchors and
        server test set, and the federation server with its noise and ledger
        (``gep_fed.federation.rounds.open_server``).

        Args:
            fed: the run's settings. Its privacy settings (mechanism, sigma or the budget it
                is calibrated from, q, clip norms) reach the sites only in each round's
                config, which every site checks against its own policy before computing.
            run_id: names the run directory when ``fed.run_name`` is empty (a ServerApp
                passes ``context.run_id``).
            progress, on_round: as for ``GEPStrategy``.
            round_offset: added to the round numbers the sites see (a search's trial in a
                Flower run shared with earlier trials: ``gep_fed.flower.search``).
            scored: the run will ask its sites for a score after its last round
                (``RoundLoop.score_sites``): the round configs say so, and a site plans it.
            selection: the trial's terms in a private selection with a random number of
                trials (``wire.SelectionTerms`` as JSON): each site records the trial's
                releases, and the trial in a ledger of its own too (central mode only).

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
        server = open_server(fed, run_id, round_offset, scored, selection)
        try:
            return cls(server, progress=progress, on_round=on_round)
        except BaseException:
            server.close()  # the run directory's lock is not kept by a strategy never made
            raise

    def record_outcome(self, interrupted: str | None = None) -> None:
        """Write how the run ended to its run directory (``OUTCOME``): why it stopped early,
        the line of the stop request that ``interrupted`` it, its last completed round."""
        self.server.run.write_json(
            OUTCOME,
            {
                "stop_reason": self.stop_reason,
                "interrupted": interrupted,
                "completed_rounds": self.server.completed_rounds,
            },
        )

    def run_to_outcome(
        self, grid: Grid, request: StopRequest, score_sites: bool, resume: str
    ) -> RunInterrupted | None:
        """The run from its next round to its recorded outcome, holding its directory's lock
        throughout and freeing it at the end: ``start`` (stopped by ``request``), then, if it
        finished, the sites' score of its final model where asked and not asked before, then
        ``record_outcome``. Returns what stopped it (``resume``: how to go on), else None."""
        try:
            run = self.server.run
            with run.lock():  # held (again) through the score and the outcome
                interrupted = None
                try:
                    self.start(StoppableGrid(grid, request))
                except RunInterrupted:
                    interrupted = RunInterrupted(self.server.completed_rounds, resume)
                scored = run.file(SITE_SCORE).exists()  # a finished run rerun: asked once
                if score_sites and not interrupted and self.server.completed_rounds and not scored:
                    self.loop.score_sites(FlowerGrid(grid), self.cfg.round_timeout)
                self.record_outcome(interrupted.line() if interrupted else None)
                return interrupted
        finally:
            self.server.close()  # the run directory is free for the next process

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
        state = wire.encode_state(self.server.model.state_dict())
        return ArrayRecord({name: Array(value) for name, value in state.items()})

    def check_arrays(self, arrays: ArrayRecord) -> dict[str, torch.Tensor]:
        """``arrays`` as a state dict of the task's model (``RoundLoop.check_arrays``)."""
        return self.loop.check_arrays(arrays)

    def restore(self, initial_arrays: ArrayRecord | None) -> int:
        """Set the global model before the first round; returns the last completed round
        (``RoundLoop.restore``).

        Privacy: the guarantee covers what the sites release. The initial weights must not
        depend on the sites' private data (random, or trained on public data only)."""
        return self.loop.restore(initial_arrays)

    # -- training: Flower's Strategy calls over the loop's steps -------------------------

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
        return [message(r) for r in self.loop.configure_round(server_round, grid.get_node_ids())]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate the replies and, with at least ``min_sites`` valid ones, step the global
        model and account the round (``RoundLoop.aggregate``).

        Returns the new global model and data-free train metrics, or ``(None, None)`` when
        too few replies were valid: then the model is unchanged and nothing is accounted."""
        train = self.loop.aggregate(server_round, [reply(m) for m in replies])
        if train is None:
            return None, None
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
        """Run (or resume) the federation (``RoundLoop.run`` over Flower's Grid).

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
            ValueError: ``initial_arrays`` do not fit, a config is not empty,
                ``num_rounds`` is outside 1 to the config's ``rounds``, or ``evaluate_fn``
                returned a key GEP records itself.
        """
        _refuse_config("train_config", train_config, TRAIN_CONFIG_REFUSED)
        _refuse_config("evaluate_config", evaluate_config, EVALUATE_CONFIG_REFUSED)
        if num_rounds is not None and not (
            isinstance(num_rounds, int) and 1 <= num_rounds <= self.cfg.rounds
        ):
            # the sites' plans and the calibrated sigma are for the config's rounds
            raise ValueError(
                f"num_rounds must be an integer from 1 to the config's rounds "
                f"({self.cfg.rounds}), got {num_rounds!r}"
            )
        num_rounds = num_rounds or self.cfg.rounds
        timeout = timeout or self.cfg.round_timeout
        try:
            self.summary()
            first = self.restore(initial_arrays) + 1
            result = Result()
            if evaluate_fn is not None:
                extra = evaluate_fn(first - 1, self.global_arrays())
                if extra is not None:
                    # before any round: a clash found after a round was committed lost its record
                    clash = sorted(k for k in extra if recorded_by_the_loop(k))
                    if clash:
                        raise ValueError(
                            f"evaluate_fn returned {clash}: GEPStrategy records these keys "
                            f"(and {', '.join(p + '*' for p in ROUND_RECORD_PREFIXES)}) itself; "
                            "rename them"
                        )
                    result.evaluate_metrics_serverapp[first - 1] = extra

            def after_round(rnd: int, record: dict, train: dict | None) -> None:
                if train is not None:
                    result.train_metrics_clientapp[rnd] = MetricRecord(train)
                extra = evaluate_fn(rnd, self.global_arrays()) if evaluate_fn is not None else None
                result.evaluate_metrics_serverapp[rnd] = _merge(record, extra)

            self.loop.run(FlowerGrid(grid), first, num_rounds, timeout, after_round)
            result.arrays = self.global_arrays()
            return result
        finally:
            self.server.close()  # another process may now run this directory
