"""Flower ServerApp: reads the run config, builds the strategy, runs it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import (
    RunDirectory,
    read_site_rounds,
    rounds_not_applied,
)
from gep_fed.federation.tuning import run_settings, split_run_config
from gep_fed.flower.interrupt import (
    RunInterrupted,
    StopRequest,
    stop_on_flower_exit,
)
from gep_fed.flower.strategy import GEPStrategy
from gep_fed.validation import ConfigError

log = logging.getLogger("gep_fed.server")


class RunFailedError(RuntimeError):
    """The run stopped before its last round, or some rounds did not update the model; what
    it did record (metrics, ledger, checkpoint) stays, and the run resumes from it."""


@dataclass(frozen=True)
class RunOutcome:
    """How a ServerApp's run ended: its strategy (server, run directory, stop reason) and
    ``interrupted`` when a stop request ended it between rounds."""

    strategy: GEPStrategy
    interrupted: RunInterrupted | None = None


def resume_line(run: RunDirectory, done: int, rounds: int) -> str | None:
    """What a rerun of an existing run directory does, in one line (None: a new run)."""
    if done == 0:
        return None
    if done >= rounds:
        return (
            f"run {run.path} already finished its {rounds} round(s): nothing is trained; "
            "its result follows (use another run name for a new run)"
        )
    return f"resuming run {run.path} after round {done} of {rounds}"


def make_server_app(
    fed: FederationConfig | None = None,
    progress: bool = True,
    on_round=None,
    on_done=None,
    stop: StopRequest | None = None,
    score_sites: bool = False,
) -> ServerApp:
    """A ServerApp for ``fed``, or (None) for the run config of the run it serves.

    ``on_done`` receives the ``RunOutcome`` (the finished or interrupted strategy) and
    reports how the run ended. Without it (``flwr run``), the ServerApp prints the summary
    ``gep-fed simulate`` prints and writes ``report.md`` with its plots; then a run that
    stopped early, was interrupted or left rounds without an update logs one ``FAILED:``
    line per problem and raises ``RunFailedError``, so that Flower records the run as failed
    (``flwr ls``), as ``gep-fed simulate`` exits non-zero for the same run.

    ``stop``: a stop request (the first Ctrl-C of ``gep-fed simulate``) that ends the run
    between rounds (``gep_fed.flower.interrupt``). Without one, Flower's exit handlers
    (``flwr stop``, SIGTERM to the run's process) request the stop.

    ``score_sites``: after the last round, ask the sites to score the served model on the
    examples they hold out (``RoundLoop.score_sites``; ``gep-fed tune --site-validation``)."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        began = time.perf_counter()
        request = stop if stop is not None else stop_on_flower_exit()
        if fed is None and split_run_config(context.run_config)[1]:
            raise ConfigError(
                "this run config names a search (tune-*): serve it with "
                "gep_fed.flower.make_flwr_server_app, as server/app.py does"
            )
        config = fed if fed is not None else run_settings(context.run_config)
        config.resolve()  # the privacy contract, sigma calibrated, before the first round
        run = RunDirectory(config.run_directory(context.run_id))
        done = run.checkpoint_round()
        strategy = GEPStrategy.from_config(
            config,
            context.run_id,
            progress=progress,
            on_round=_stopping(on_round, request),
            scored=score_sites,
        )
        line = resume_line(run, done, config.rounds)
        if line:
            print(line, flush=True)
        resume = "rerun the same command"
        if not config.run_name:
            resume += f" with run-name {run.path.name!r}"
        interrupted = strategy.run_to_outcome(grid, request, score_sites, resume)
        outcome = RunOutcome(strategy, interrupted)
        if on_done is not None:
            on_done(outcome)
            return
        _print_result(config, strategy, time.perf_counter() - began)
        not_applied = rounds_not_applied(strategy.server.run.read_metrics())
        problems = [p for p in (strategy.stop_reason, not_applied) if p]
        if interrupted is not None:
            problems.insert(0, interrupted.line())
        for line in problems:
            log.error("FAILED: %s", line)
        if problems:
            raise RunFailedError("; ".join(problems))

    return server_app


def _stopping(on_round, request: StopRequest):
    """``on_round``, then stop the run if a stop was requested during the round."""

    def call(record: dict) -> None:
        if on_round is not None:
            on_round(record)
        if request.is_set():
            raise RunInterrupted(record["round"])

    return call


def _print_result(config: FederationConfig, strategy: GEPStrategy, wall: float) -> None:
    """``flwr run``'s end: the summary ``gep-fed simulate`` prints, ``report.md``."""
    from gep_fed.federation.report import render_report, summary_lines

    run = strategy.server.run
    report = render_report(run.path)
    rows = run.read_metrics()
    lines = summary_lines(
        config, rows, strategy.stop_reason, read_site_rounds(run.path), run.path, wall
    )
    # under flwr run, a relative run-dir is the local SuperLink's folder: print where it is
    where = [f"run directory: {run.path.resolve()}", f"report:        {report.resolve()}"]
    print("\n".join(["", *lines, *where]))
