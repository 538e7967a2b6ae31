"""Flower ServerApp: reads the run config, builds the federation server, runs the strategy."""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from gep_fed.config import FederationConfig
from gep_fed.federation.rundir import CONFIG, RunDirectory
from gep_fed.federation.server import FederationServer
from gep_fed.flower.strategy import GEPStrategy

log = logging.getLogger("gep_fed.server")


def build_strategy(
    fed: FederationConfig, run_id: int | str, progress: bool = True, on_round=None
) -> GEPStrategy:
    """The strategy for ``fed``: run directory (new, or resumed if it has a checkpoint),
    task data (public anchors and the server's test set), federation server."""
    run = RunDirectory(fed.run_directory(run_id))
    run.path.mkdir(parents=True, exist_ok=True)
    task = fed.make_task()
    total = fed.total_examples
    if total is None and fed.mode == "central":  # a simulation: the pooled data is the union
        total = len(task.train_dataset())
        log.info("total-examples not declared: using the simulation's pooled size N=%d", total)
    server = FederationServer(fed, task, run, total)
    previous = run.read_json(CONFIG) if run.file(CONFIG).exists() else None
    resolved = {
        **fed.to_record(),
        "resolved-noise-multiplier": server.sigma,
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
    return GEPStrategy(server, progress=progress, on_round=on_round)


def make_server_app(
    fed: FederationConfig | None = None, progress: bool = True, on_round=None, on_done=None
) -> ServerApp:
    """A ServerApp for ``fed``, or (None) for the run config of the run it serves.
    ``on_done`` receives the finished strategy (its server, stop reason)."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        config = fed if fed is not None else FederationConfig.from_record(context.run_config)
        strategy = build_strategy(config, context.run_id, progress, on_round)
        strategy.start(grid)
        if strategy.stop_reason:
            log.warning(strategy.stop_reason)
        if on_done is not None:
            on_done(strategy)

    return server_app


