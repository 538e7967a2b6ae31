"""Flower ServerApp: reads the run config, builds the strategy, runs it."""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from gep_fed.federation.config import FederationConfig
from gep_fed.flower.strategy import GEPStrategy

log = logging.getLogger("gep_fed.server")


def make_server_app(
    fed: FederationConfig | None = None, progress: bool = True, on_round=None, on_done=None
) -> ServerApp:
    """A ServerApp for ``fed``, or (None) for the run config of the run it serves.
    ``on_done`` receives the finished strategy (its server, stop reason)."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        config = fed if fed is not None else FederationConfig.from_record(context.run_config)
        strategy = GEPStrategy.from_config(
            config, context.run_id, progress=progress, on_round=on_round
        )
        strategy.start(grid)
        if strategy.stop_reason:
            log.warning(strategy.stop_reason)
        if on_done is not None:
            on_done(strategy)

    return server_app
