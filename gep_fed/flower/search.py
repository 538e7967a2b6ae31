"""A search's trials as one Flower run (``gep-fed tune``, issue 53).

The ServerApp runs the trials one after another over the same grid, each a ``GEPStrategy``
of its own settings with a run directory of its own. The sites check and record each trial
as they do any round: the trial's round config (contract, layout, its last planned round)
against their policy and their ledger, so a site refuses a trial its budget cannot finish,
before it spends anything on it. A trial's rounds continue the numbering of the trials
before it (``FederationServer.round_offset``): every site sees one run whose rounds keep
increasing, so its replay guard, its refusal of a declined plan and the secure sum's
signatures work across trials unchanged.

What decides the search (the plan, each trial's budget, the choice) is the caller's
(``gep_fed.flower.tuning``): it sees each trial as it ends (``on_trial``) and may stop the
search there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import SITES, RunDirectory
from gep_fed.flower.clientapp import SimulatedTrial, make_client_app
from gep_fed.flower.interrupt import (
    RunInterrupted,
    StopRequest,
    stop_on_flower_exit,
)
from gep_fed.flower.simulation import (
    SimulationResult,
    check_same_sites,
    checked_simulation,
    formed_sites,
    launch,
    quiet_flower,
    simulated_site_settings,
)
from gep_fed.flower.strategy import GEPStrategy
from gep_fed.validation import ConfigError


@dataclass(frozen=True)
class TrialSpec:
    """One trial of a search: its number in the plan (from 1), its settings (its own
    ``run_dir``/``run_name``), its simulated sites' own settings over
    ``simulated_site_settings`` (budget, ledger folder, held-out examples), and whether the
    sites score its final model (``RoundLoop.score_sites``); under ``flwr run``, a private
    selection's terms for the sites to record (``wire.SelectionTerms`` as JSON), else "";
    in a simulation, the record of which sites' data trains it (``sites.json``), written
    before it trains."""

    number: int
    fed: FederationConfig
    site_settings: Mapping[str, object] = field(default_factory=dict)
    score_sites: bool = False
    selection: str = ""
    sites: Mapping[str, object] | None = None


# Sees each trial as it ends; False stops the search there.
OnTrial = Callable[[TrialSpec, SimulationResult], bool]


class SearchInterrupted(RunInterrupted):
    """A stop request ended the search in trial ``trial`` after its round
    ``completed_round``."""

    def __init__(self, trial: int, completed_round: int, resume: str) -> None:
        self.trial = trial
        super().__init__(completed_round, resume)


def trial_rounds(specs: Sequence[TrialSpec]) -> list[tuple[int, int]]:
    """Each trial's rounds as the sites number them: ``(first, last)``, continuing the
    trials before it (a resumed trial keeps its whole range: the run is a new one)."""
    ranges, last = [], 0
    for spec in specs:
        ranges.append((last + 1, last + spec.fed.rounds))
        last += spec.fed.rounds
    return ranges


def run_trials(
    specs: Sequence[TrialSpec],
    on_trial: OnTrial,
    grid: Grid,
    context: Context,
    progress: bool = False,
    stop: StopRequest | None = None,
    committed: list[int] | None = None,
) -> None:
    """Run ``specs`` one after another over ``grid`` (a ServerApp's), calling ``on_trial``
    after each, until it returns False. ``committed[0]`` follows the trial's last applied
    round (for a second Ctrl-C's line).

    Raises:
        SearchInterrupted: a stop request (None: Flower's exit handlers) ended a trial.
    """
    request = stop if stop is not None else stop_on_flower_exit()
    committed = committed if committed is not None else [0]
    for spec, (first, _) in zip(specs, trial_rounds(specs), strict=True):
        result = _run_trial(spec, first - 1, grid, context, progress, request, committed)
        if not on_trial(spec, result):
            return


def make_search_server_app(
    specs: Sequence[TrialSpec],
    on_trial: OnTrial,
    outcome: dict,
    progress: bool = False,
    stop: StopRequest | None = None,
    committed: list[int] | None = None,
) -> ServerApp:
    """A ServerApp that runs ``specs`` (``run_trials``). ``outcome`` receives how it ended:
    ``interrupted`` (a ``SearchInterrupted``) or ``error`` (an exception raised by a trial
    or by ``on_trial``), else ``finished``."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            run_trials(specs, on_trial, grid, context, progress, stop, committed)
            outcome["finished"] = True
        except SearchInterrupted as stopped:
            outcome["interrupted"] = stopped
        except Exception as err:  # the caller raises it, with its own traceback
            outcome["error"] = err

    return server_app


def _run_trial(
    spec: TrialSpec,
    offset: int,
    grid: Grid,
    context: Context,
    progress: bool,
    request: StopRequest,
    committed: list[int],
) -> SimulationResult:
    began = time.perf_counter()
    fed = spec.fed
    committed[0] = RunDirectory(fed.run_directory("")).checkpoint_round()

    def stopping(record: dict) -> None:
        committed[0] = record["round"] if record.get("applied") else committed[0]
        if request.is_set():
            raise RunInterrupted(record["round"])

    strategy = GEPStrategy.from_config(
        fed,
        context.run_id,
        progress=progress,
        on_round=stopping,
        round_offset=offset,
        scored=spec.score_sites,
        selection=spec.selection,
    )
    run = strategy.server.run
    if spec.sites is not None:  # before anything trains, under the lock the server holds
        try:
            run.write_json(SITES, dict(spec.sites))
        except BaseException:
            strategy.server.close()
            raise
    resume = "rerun the same command"
    interrupted = strategy.run_to_outcome(grid, request, spec.score_sites, resume)
    if interrupted is not None:
        raise SearchInterrupted(spec.number, interrupted.completed_round, resume)
    return SimulationResult.of(run, strategy.stop_reason, began)


def simulate_search(
    specs: Sequence[TrialSpec],
    on_trial: OnTrial,
    *,
    progress: bool = False,
    cpus_per_site: float = 1.0,
    site_data: Mapping[str, str] | None = None,
    drop_bad_examples: bool = False,
    engine: str = "ray",
    stop: StopRequest | None = None,
) -> None:
    """Run a search's trials as one Flower simulation (one Simulation Engine, or this
    process: ``engine``, as ``simulate``'s), calling ``on_trial`` after each. ``stop``: a
    stop request of the caller's (a ServerApp's ``flwr stop``) beside the first Ctrl-C.

    Each trial's settings are checked first as ``simulate`` checks a run's (its sites'
    data, its privacy contract resolved). Every trial must have the same number of sites.

    Raises:
        SearchInterrupted: the first Ctrl-C stopped the search (which trial, after which
            round).
        ConfigError: a trial's settings or its sites' data (as ``simulate``).
        Exception: whatever a trial or ``on_trial`` raised.
    """
    if not specs:
        return
    checked, models = [], set()
    for spec in specs:  # candidates share the task and data: the sites' check is per model
        new_model = spec.fed.model not in models
        models.add(spec.fed.model)
        fed = checked_simulation(spec.fed, engine, site_data, drop_bad_examples, new_model)
        formed = formed_sites(fed, site_data)
        check_same_sites(fed, formed)
        fed.resolve()  # the privacy contract, sigma calibrated: an unreachable one stops here
        checked.append(replace(spec, fed=fed, sites=formed))
    num_sites = {spec.fed.num_sites for spec in checked}
    if len(num_sites) > 1:
        raise ConfigError(f"a search's trials must have the same number of sites: {num_sites}")
    trials = [
        SimulatedTrial(
            spec.number,
            first,
            last,
            spec.fed,
            {**simulated_site_settings(spec.fed, site_data), **spec.site_settings},
        )
        for spec, (first, last) in zip(checked, trial_rounds(checked), strict=True)
    ]
    outcome: dict = {}
    stop = stop if stop is not None else StopRequest()
    committed = [0]
    with quiet_flower(stop, committed, "rerun the same command"):
        server_app = make_search_server_app(checked, on_trial, outcome, progress, stop, committed)
        launch(server_app, make_client_app(trials=trials), num_sites.pop(), engine, cpus_per_site)
    if "error" in outcome:
        raise outcome["error"]
    if "interrupted" in outcome:
        raise outcome["interrupted"]
    if not outcome.get("finished"):
        raise RuntimeError("the search ended without finishing its server app (see the log)")
