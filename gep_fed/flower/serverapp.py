"""Flower ServerApp: reads the run config, builds the strategy, runs it."""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import rounds_not_applied
from gep_fed.flower.strategy import GEPStrategy

log = logging.getLogger("gep_fed.server")


class RunFailedError(RuntimeError):
    """The run stopped before its last round, or some rounds did not update the model; what
    it did record (metrics, ledger, checkpoint) stays, and the run resumes from it."""


def make_server_app(
    fed: FederationConfig | None = None, progress: bool = True, on_round=None, on_done=None
) -> ServerApp:
    """A ServerApp for ``fed``, or (None) for the run config of the run it serves.
    ``on_done`` receives the finished strategy (its server, stop reason) and reports how the
    run ended; without it, a run that stopped early or left rounds without an update logs one
    ``FAILED:`` line per problem and raises ``RunFailedError``, so that Flower records the run
    as failed (``flwr ls``), as ``gep-fed simulate`` exits non-zero for the same run."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        config = fed if fed is not None else FederationConfig.from_record(context.run_config)
        strategy = GEPStrategy.from_config(
            config, context.run_id, progress=progress, on_round=on_round
        )
        strategy.start(grid)
        if on_done is not None:
            on_done(strategy)
            return
        not_applied = rounds_not_applied(strategy.server.run.read_metrics())
        problems = [p for p in (strategy.stop_reason, not_applied) if p]
        for line in problems:
            log.error("FAILED: %s", line)
        if problems:
            raise RunFailedError("; ".join(problems))

    return server_app
