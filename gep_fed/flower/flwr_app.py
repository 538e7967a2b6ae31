"""The ServerApp ``flwr run`` runs (``server/app.py``): a search where the run config names
a candidates file (``tune-candidates``: ``gep-fed tune`` over the run's grid, its trials one
after another), else one run (``make_server_app``)."""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from gep_fed.federation.tuning import TuneConfig, search_of_run_config
from gep_fed.flower import search
from gep_fed.flower.interrupt import stop_on_flower_exit
from gep_fed.flower.serverapp import RunFailedError, make_server_app
from gep_fed.flower.tuning import TuneInterrupted, failure_line, result_lines, tune

log = logging.getLogger("gep_fed.server")


def make_flwr_server_app() -> ServerApp:
    """The ServerApp for the run config of the run it serves: a search when it names a
    candidates file (``search_of_run_config``), else one run."""
    one_run = make_server_app()
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        config = search_of_run_config(context.run_config, context.run_id)
        if config is None:
            one_run(grid, context)
        else:
            run_search(config, grid, context)

    return server_app


def run_search(config: TuneConfig, grid: Grid, context: Context) -> None:
    """A search over this run's grid (``tune``), its summary printed as ``gep-fed tune``
    prints it. A run where no trial finished, or that a stop request (``flwr stop``) ended,
    logs one ``FAILED:`` line and raises ``RunFailedError`` (Flower records it as failed);
    rerun with the same run name, an interrupted search resumes."""
    request = stop_on_flower_exit()

    def run_trials(specs, on_trial) -> None:
        search.run_trials(specs, on_trial, grid, context, stop=request)

    try:
        result = tune(config, log=print, run_trials=run_trials, stop=request)
    except TuneInterrupted as stopped:
        log.error("FAILED: %s", stopped.line())
        raise RunFailedError(stopped.line()) from None
    print("\n".join(["", *result_lines(result)]))
    failed = failure_line(result)
    if failed is not None:
        log.error(failed)
        raise RunFailedError(failed)
