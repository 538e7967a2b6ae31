"""``tune``: a private selection's trials run as one federated simulation (issue 53).

The declaration and its budget are ``gep_fed.federation.tuning``'s (``TuneConfig``, the
plan, the per-trial budget). Here the trials run one after another in one Flower run
(``gep_fed.flower.search``: the sites check and record each trial as they do any round),
and the candidate whose run scores best on the server's own validation data is returned,
with its model and its test figures.

What the sites record. A fixed number of trials: the simulated sites of every trial keep their
ledgers in one folder, each site's budget the tuning's total, so a site refuses a trial that
would take it beyond its budget ("over budget"); the tuning then records that trial as refused,
names the site, and stops with the trials done. A random number of trials (central mode): every
round config carries the selection's terms; each site records every trial's releases in its
ledger as above (the server and the other sites see every trial's rounds), and each trial in a
ledger of the trial's own too, under the selection's bound of one trial
(``gep_fed.federation.site_selection``, the same in simulation and under ``flwr run``), so that
the selection's tighter figure holds for the published choice alone; the list of trials, their
scores and K itself are the trusted server's record, and publishing them is outside that figure
(``tune.md`` says so where it lists them). The selection score is computed by the server on its
own validation data, which holds no site's data: the score, the choice and the chosen model are
post-processing. Where the server has none, the simulated sites score each trial's final model
on examples they hold out, by noised per-class counts recorded in their ledgers
(``TuneConfig.site_score``, ``gep_fed.federation.site_score``).

The plan is written to ``tune.json`` before the first trial: an interrupted tuning
(``TuneInterrupted``) resumes from the trial it stopped in, with the same plan.

A non-private reference (``reference=True``) runs every candidate once at the whole budget
(one Flower run of its own), each with fresh ledgers of its own, and picks the best on
validation: what a non-private selection would have reported, labelled OUTSIDE THE
GUARANTEE wherever it appears.
"""

from __future__ import annotations

import json
import math
import random
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.policy import SiteConfig
from gep_fed.federation.rundir import (
    BEST_MODEL,
    MODEL,
    SITE_ROUNDS,
    SITE_SCORE,
    round_spans,
    rounds_not_applied,
)
from gep_fed.federation.server import best_validation, validation_score
from gep_fed.federation.tuning import (
    CALIBRATION_TOLERANCE,
    TrialPlanner,
    TuneConfig,
    calibrate_plan,
    calibrate_selection_epsilon,
    law_text,
)
from gep_fed.federation.wire import SelectionTerms
from gep_fed.files import write_bytes_atomically
from gep_fed.flower import search  # a module: tests replace its simulate_search
from gep_fed.flower.interrupt import RunInterrupted, StopRequest
from gep_fed.flower.rehearsal import FOLDER as REHEARSAL_FOLDER
from gep_fed.flower.rehearsal import RehearsalInterrupted, rehearse
from gep_fed.flower.search import TrialSpec
from gep_fed.validation import ConfigError

if TYPE_CHECKING:
    from gep_fed.flower.simulation import SimulationResult

# Runs a search's trials one after another, calling back after each (``gep_fed.flower.search``).
RunTrials = Callable[[Sequence[TrialSpec], "search.OnTrial"], None]

TUNE_FORMAT = "gep-fed-tune/1"
TUNE_JSON = "tune.json"
TUNE_MD = "tune.md"
# A random K's search id, kept with its plan: the sites record its selection once per id.
SEARCH_ID = "search-id"
OUTSIDE = "OUTSIDE THE GUARANTEE"


@dataclass(frozen=True)
class Trial:
    """One trial: its candidate (1-based, as declared), the per-trial budget and sigma it ran
    with, what became of it ("finished", "refused" by a site's budget, "failed"), and its
    best validation score (balanced accuracy, else accuracy) with the round it came from."""

    trial: int
    candidate: int
    settings: Mapping[str, object]
    epsilon: float
    noise_multiplier: float
    status: str = "planned"
    validation_score: float | None = None
    best_round: int | None = None
    run_dir: str = ""
    refused_by: Mapping[str, str] = field(default_factory=dict)
    problem: str | None = None
    # The sites' noised score: how far its noise alone moves it (one std, from the counts).
    score_noise: float | None = None


@dataclass(frozen=True)
class TuneResult:
    """A finished tuning.

    Attributes:
        out_dir: the tuning's directory (``tune.json``, ``tune.md``).
        plan: each trial's candidate (1-based), fixed before training.
        per_trial_epsilon: e, every trial's own budget.
        planned_epsilon_rdp: the RDP composition of all planned trials (<= the total).
        trials: every trial run (or refused), in order.
        chosen: the finished trial with the best validation score (None: none finished).
        model_path: the chosen trial's model (its best round on validation).
        test_metrics: the chosen model's metrics on the server's test data (never used to
            select anything).
        site_epsilons: each simulated site's ledger after the tuning: ``{site: {"steps",
            "epsilon_rdp", "epsilon_pld", "budget"}}``.
        stopped: why the search stopped early (a site refused a trial), or None.
        reference: the non-private reference (``reference=True``), labelled OUTSIDE THE
            GUARANTEE, or None.
        selection: the random number of trials' law (``TuneConfig.random_trials``) as
            ``{"distribution", "mean", "shape", ...}``; None for a fixed T.
        complete: the tuning ran to its end (False while it runs, or once interrupted: the
            same settings and folder then resume it).
        rehearsal: the rehearsal on the server's validation data that chose the one trial
            (``gep_fed.flower.rehearsal.rehearse``'s record), or None.
        settings: the ``TuneConfig`` it ran (``TuneConfig.record``): a resume must match.
    """

    out_dir: Path
    total_epsilon: float
    delta: float
    plan: tuple[int, ...]
    per_trial_epsilon: float
    planned_epsilon_rdp: float
    trials: tuple[Trial, ...]
    chosen: Trial | None
    model_path: Path | None
    test_metrics: Mapping[str, float]
    site_epsilons: Mapping[str, Mapping[str, float]]
    stopped: str | None
    reference: Mapping[str, object] | None = None
    selection: Mapping[str, object] | None = None
    complete: bool = False
    settings: Mapping[str, object] = field(default_factory=dict)
    rehearsal: Mapping[str, object] | None = None

    @property
    def epsilon_rdp(self) -> float:
        """The epsilon of the whole procedure: the largest of the sites' ledgers (RDP), every
        trial a site took part in composed (the guarantee against the server and the other
        sites, who see every trial's rounds); the planned figure where no ledger was found. A
        random K's figure for the published choice alone is ``planned_epsilon_rdp``."""
        values = [s["epsilon_rdp"] for s in self.site_epsilons.values()]
        return max(values) if values else self.planned_epsilon_rdp

    @property
    def epsilon_pld(self) -> float:
        """As ``epsilon_rdp``, by privacy loss distributions (NaN for distributed noise or
        when no ledger was found)."""
        values = [s["epsilon_pld"] for s in self.site_epsilons.values()]
        return max(values) if values else math.nan


# -- the search ----------------------------------------------------------------------------


def _site_rows(folder: Path) -> dict[str, int]:
    """How many round rows each simulated site of ``folder`` has written so far."""

    return {
        p.parent.name: len([line for line in p.read_text().splitlines() if line.strip()])
        for p in sorted(folder.glob(f"*/{SITE_ROUNDS}"))
    }


def _rows_since(folder: Path, before: Mapping[str, int], first: int = 1) -> dict[str, list[dict]]:
    """Each site's rows of ``rounds.jsonl`` after its first ``before`` ones, each round as
    the trial numbers it: a site that served the trial as a round of a longer run (under
    ``flwr run``) recorded it from ``first``."""
    out = {}
    for path in sorted(folder.glob(f"*/{SITE_ROUNDS}")):
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        rows = [json.loads(x) for x in lines[before.get(path.parent.name, 0) :]]
        out[path.parent.name] = [_trial_round(row, first) for row in rows]
    return out


def _trial_round(row: dict, first: int) -> dict:
    round_ = row.get("round")
    if "trial" in row or not isinstance(round_, int) or round_ < first:
        return row
    return {**row, "round": round_ - first + 1}


def _test_metrics(metrics: Sequence[Mapping], round_: int | None) -> dict[str, float]:
    rows = [r for r in metrics if r.get("round") == round_] or list(metrics[-1:])
    return {k[5:]: v for k, v in rows[-1].items() if k.startswith("test_")} if rows else {}


def _model_file(run_dir: Path) -> Path | None:
    for name in (BEST_MODEL, MODEL):
        if (run_dir / name).exists():
            return run_dir / name
    return None


def _check_validation(config: TuneConfig) -> None:
    fed = config.candidate_config(0)
    task = fed.make_task()
    if config.site_score is not None:
        if task.kind not in ("multiclass", "binary"):
            raise ConfigError(
                f"task {fed.task!r} is {task.kind}: the sites' scores count classes, so "
                "--site-validation needs a multiclass or binary task"
            )
        return
    if task.validation_dataset() is None:
        raise ConfigError(
            f"task {fed.task!r} has no validation data (Task.validation_dataset): tune "
            "selects on the server's own validation data, or on the sites' held-out examples "
            "by their noised counts (--site-validation FRACTION --score-noise STD); it never "
            "selects on the test split"
        )


def _simulated_sites(
    fed: FederationConfig, site_settings: Mapping[str, object], options: Mapping[str, object]
) -> list[SiteConfig]:
    """The simulated sites of a trial, as each one configures itself."""
    from gep_fed.flower.simulation import simulated_site_settings

    site_data = options.get("site_data") or None
    settings = {**simulated_site_settings(fed, site_data), **site_settings}
    count = len(site_data) if site_data else fed.num_sites
    return [
        SiteConfig.from_node_config(
            {"partition-id": i, "num-partitions": count}, settings, fed.run_directory("")
        )
        for i in range(count)
    ]


def _trained_examples(
    fed: FederationConfig, site_settings: Mapping[str, object], options: Mapping[str, object]
) -> int:
    """N of central mode's estimate when the sites hold examples out: the expected size of
    their training parts (N is treated as public; the coins are the sites' secret), so the
    estimate stays unbiased."""
    from gep_fed.federation.site import site_dataset

    task = fed.make_task()
    sites = _simulated_sites(fed, site_settings, options)
    total = sum(
        len(site_dataset(task, site, fed.num_sites, fed.partition, fed.dirichlet_alpha, fed.seed))
        for site in sites
    )
    return round(total * (1 - sites[0].validation_fraction))


def _site_score_of(run_dir: Path, noise_std: float) -> tuple[float | None, float | None]:
    """The sites' noised score of a run's final model (``RoundLoop.score_sites``) and how
    far their noise alone moves it (``score_spread``); (None, None) where none was given."""
    from gep_fed.federation.site_score import score_spread

    path = run_dir / SITE_SCORE
    record = json.loads(path.read_text()) if path.exists() else {}
    metrics = {k.removeprefix("site_val_"): v for k, v in record.items() if k[:9] == "site_val_"}
    score = validation_score(metrics)
    if score is None:
        return None, None
    return score, score_spread(np.asarray(record["counts"]), noise_std, record["sites_ok"])


def _site_epsilons(folder: Path) -> dict[str, dict[str, float]]:
    out = {}
    for path in sorted(folder.glob("*/ledger.json")):
        ledger = PrivacyLedger.load_keyed(path)
        out[path.parent.name] = {
            "steps": ledger.steps,
            "epsilon_rdp": ledger.epsilon("rdp"),
            "epsilon_pld": ledger.epsilon("pld"),
            "budget": ledger.budget_epsilon,
        }
    return out


def _settings_text(settings: Mapping[str, object]) -> str:
    return ", ".join(f"{k.replace('_', '-')}={v}" for k, v in settings.items()) or "(the base)"


def _stopped_in(stop: RunInterrupted, specs: Sequence[TrialSpec], ended: int) -> int:
    """The number of the trial a stop request ended: as the search names it, else the
    first of ``specs`` that had not ended (``ended`` of them had)."""
    trial = getattr(stop, "trial", None)
    return trial if trial is not None else specs[min(ended, len(specs) - 1)].number


def tune(
    config: TuneConfig,
    *,
    rng: random.Random | None = None,
    log: Callable[[str], None] | None = None,
    simulate_options: Mapping[str, object] | None = None,
    run_trials: RunTrials | None = None,
    stop: StopRequest | None = None,
) -> TuneResult:
    """Run the tuning: plan the trials, calibrate their common budget, run them one after
    another in one Flower simulation (``gep_fed.flower.search.simulate_search``) whose sites
    keep one ledger each across all trials (a random K: the selection recorded once in each
    site's ledger, and each trial's own ledgers), and choose the best on the server's
    validation data.

    Args:
        config: the candidates, the number of trials and the total budget (``TuneConfig``).
        rng: draws the number of trials and the trials' candidates when they are drawn
            (None: the OS CSPRNG; a seeded one is for tests). It decides which candidates
            run, never any noise.
        log: called with one line per trial and per decision (None: silent).
        simulate_options: passed to ``search.simulate_search`` (e.g. ``progress``,
            ``engine``, ``site_data``).
        run_trials: runs the trials instead, one after another, calling back after each
            (``search.run_trials`` over a ServerApp's grid: ``flwr run``); None: one
            simulation (``search.simulate_search`` with ``simulate_options``).
        stop: a stop request of the caller's (a ServerApp's ``flwr stop``) that also ends a
            rehearsal (``TuneConfig.rehearsal``), which runs in this process.

    Returns:
        A ``TuneResult``; ``tune.json`` and ``tune.md`` are in its ``out_dir``.

    Raises:
        ConfigError: the task has no validation data, a candidate is bad, or ``out_dir``
            holds an earlier tuning.
        ImpossibleTargetError: the planned trials (or the selection) cannot share the total
            budget.
    """
    say = log or (lambda line: None)
    options = dict(simulate_options or {})
    simulated = run_trials is None
    if run_trials is None:

        def run_trials(specs: Sequence[TrialSpec], on_trial: search.OnTrial) -> None:
            search.simulate_search(specs, on_trial, **options)

    _check_validation(config)
    out = Path(
        config.out_dir or Path(config.base.run_dir) / f"tune-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    saved = _resumable(out, config)
    out.mkdir(parents=True, exist_ok=True)
    sites_dir, trials_dir = out / "sites", out / "trials"
    planner = TrialPlanner(config)
    if saved is not None:  # the plan, the budget and the trials done, as recorded
        plan = tuple(c - 1 for c in saved["plan"])
        epsilon, planned = saved["per_trial_epsilon"], saved["planned_epsilon_rdp"]
        trials = [Trial(**t) for t in saved["trials"]]
        stopped, rehearsal = saved["stopped"], saved.get("rehearsal")
        say(f"tune: resuming {out} after {len(trials)} of its {len(plan)} trial(s)")
    else:
        rehearsal = None
        if config.rehearsal is not None:
            rehearsal = _rehearsal(config, out, say, options, simulated, stop)
        plan, epsilon, planned, stopped = _plan(config, rng, say, rehearsal)
        trials = []
    # a random K: the sites record its selection themselves, from the round configs
    terms = None if config.random_trials is None else _selection_terms(out, planner, epsilon)
    site_settings = _site_settings(config, sites_dir)
    trained = None
    base = config.candidate_config(0)
    if config.site_score and base.noise_mode.server_steps and base.total_examples is None:
        trained = _trained_examples(base, site_settings, options)
    _write(
        _result(
            config, out, plan, epsilon, planned, trials, stopped, sites_dir, rehearsal=rehearsal
        )
    )
    # the plan is on disk before any trial: a resume runs the same one
    specs = []
    for n, index in enumerate(plan, 1):
        if n <= len(trials) or stopped:
            continue
        fed = replace(
            config.candidate_config(index, epsilon),
            run_dir=str(trials_dir),
            run_name=f"trial-{n:03d}",
        )
        if trained is not None:
            fed = replace(fed, total_examples=trained)
        selection = "" if terms is None else replace(terms, trial=n).to_json()
        specs.append(TrialSpec(n, fed, site_settings, config.site_score is not None, selection))

    before = [_site_rows(sites_dir)] if specs else []
    # a trial's first round as the sites number it (a site that knows no trials records it)
    ranges = search.trial_rounds(specs)
    firsts = {spec.number: first for spec, (first, _) in zip(specs, ranges, strict=True)}

    def on_trial(spec: TrialSpec, sim: SimulationResult) -> bool:
        nonlocal stopped
        index = plan[spec.number - 1]
        sigma = planner.trial(index, epsilon)[0]
        rows = _rows_since(sites_dir, before[0], firsts[spec.number])
        trial = _judged(config, spec.number, index, epsilon, sigma, sim, rows)
        trials.append(trial)
        stopped = _announce(trial, len(plan), say)
        _write(
            _result(
                config, out, plan, epsilon, planned, trials, stopped, sites_dir, rehearsal=rehearsal
            )
        )
        before[0] = _site_rows(sites_dir)  # the next trial's rows are those after this one's
        return stopped is None

    ended = len(trials)
    try:
        run_trials(specs, on_trial)
    except RunInterrupted as stop:
        where = f"trial {_stopped_in(stop, specs, len(trials) - ended)} of {len(plan)}"
        raise TuneInterrupted(where, stop.completed_round, out) from None
    reference = _reference(config, out, say, options, run_trials) if config.reference else None
    result = _result(
        config, out, plan, epsilon, planned, trials, stopped, sites_dir, reference, rehearsal
    )
    result = replace(result, complete=True)
    _write(result)
    return result


def _judged(
    config: TuneConfig,
    n: int,
    index: int,
    epsilon: float,
    sigma: float,
    sim: SimulationResult,
    rows: Mapping[str, list[dict]],
) -> Trial:
    """Trial ``n`` (candidate ``index``) as it ended: refused where a site's ledger refused a
    round or its score, failed where the run stopped, left rounds unapplied, a site failed or
    no score came back, else finished with its score (the server's validation at its best
    round, or the sites' noised counts of its final model)."""
    over = {
        s: [r["round"] for r in rs if r["outcome"] == "over budget" and "stage" not in r]
        for s, rs in rows.items()
    }
    refused = {s: f"over budget in round(s) {round_spans(r)}" for s, r in over.items() if r}
    for site, rs in rows.items():  # a score beyond the budget: after the rounds it allowed
        if any(r.get("stage") == "score" and r["outcome"] == "over budget" for r in rs):
            refused.setdefault(site, "over budget for its score")
    score, best_round = best_validation(sim.metrics)
    spread = None
    problems = [
        f"{site}: {r['outcome']}" + (f" ({r['cause']})" if r.get("cause") else "")
        for site, rs in rows.items()
        for r in rs
        if r["outcome"] not in ("accepted", "over budget")
    ]
    not_applied = rounds_not_applied(sim.metrics)
    if config.site_score is not None:  # the final model, by the sites' noised counts
        score, spread = _site_score_of(Path(sim.run_dir), config.site_score.noise_std)
        best_round = sim.metrics[-1]["round"] if score is not None else None
    if refused:
        status, problem = "refused", None
    elif sim.stop_reason or not_applied or problems or score is None:
        status = "failed"
        problem = sim.stop_reason or not_applied or (problems[0] if problems else None)
        problem = problem or "no validation score"
    else:
        status, problem = "finished", None
    settings = dict(config.candidates[index])
    return Trial(
        n,
        index + 1,
        settings,
        epsilon,
        sigma,
        status,
        score,
        best_round,
        str(sim.run_dir),
        refused,
        problem,
        spread,
    )


def _announce(trial: Trial, planned: int, say: Callable[[str], None]) -> str | None:
    """One line on how the trial ended; returns why the search stops (a refusal), else None."""
    head = (
        f"trial {trial.trial}/{planned}: candidate {trial.candidate} "
        f"({_settings_text(trial.settings)})"
    )
    if trial.status == "refused":
        who = "; ".join(f"{s} ({why})" for s, why in trial.refused_by.items())
        say(f"{head}: REFUSED by {who}; the search stops with the trials done")
        return (
            f"trial {trial.trial} (candidate {trial.candidate}) refused by {who}: the search "
            "stopped"
        )
    if trial.status == "failed":
        say(f"{head}: FAILED: {trial.problem}")
    else:
        spread = trial.score_noise
        noise = f" +- {spread:.2f} from the sites' noise" if spread is not None else ""
        score, best = trial.validation_score, trial.best_round
        say(f"{head}: validation score {score:.4f}{noise} (round {best})")
    return None


class TuneInterrupted(RunInterrupted):
    """A tuning stopped inside one of its runs (Ctrl-C): the same settings and folder resume
    it. ``where``: that run ("trial 2 of 5", "the reference's candidate 1 of 3"); ``then``:
    what the rerun does (a rehearsal runs again whole)."""

    def __init__(self, where: str, completed_round: int, out: Path, then: str = "resume") -> None:
        self.where, self.out, self.then = where, out, then
        super().__init__(completed_round)

    def line(self) -> str:
        return (
            f"tune interrupted in {self.where} (after its round {self.completed_round}): "
            f"rerun the same command with --out {self.out} to {self.then}"
        )


def _resumable(out: Path, config: TuneConfig) -> dict | None:
    """The unfinished tuning of these same settings that ``out`` holds (None: none there)."""
    path = out / TUNE_JSON
    if not path.exists():
        # its own search id, its simulated sites' ledgers and an interrupted rehearsal may
        # precede its record
        own = {SEARCH_ID, "sites", REHEARSAL_FOLDER}
        others = sorted(p.name for p in out.iterdir() if p.name not in own) if out.is_dir() else []
        if others:  # another run's folder: its ledgers would count as this tuning's spending
            raise ConfigError(
                f"{out} is not empty ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
                f" and holds no tuning ({TUNE_JSON}): choose another folder"
            )
        if out.exists() and not out.is_dir():
            raise ConfigError(f"{out} is a file, not a folder: choose another --out")
        for name in ("sites", REHEARSAL_FOLDER):  # where the tuning keeps its own folders
            if (out / name).exists() and not (out / name).is_dir():
                raise ConfigError(f"{out / name} is a file, not a folder: choose another --out")
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} cannot be read ({err}); choose another folder") from None
    if saved.get("complete", True):
        raise ConfigError(f"{out} holds an earlier tuning ({TUNE_JSON}); choose another folder")
    mine = json.loads(json.dumps(config.record(), default=str))
    theirs = saved.get("settings") or {}
    if mine != theirs:
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        raise ConfigError(
            f"{out} holds an unfinished tuning of other settings ({', '.join(differ)} "
            "differ): rerun it with its own settings to resume it, or choose another folder"
        )
    return saved


def _site_settings(config: TuneConfig, sites_dir: Path) -> dict[str, object]:
    """The simulated sites' settings in every trial: one ledger each across all trials, in
    the tuning's folder, the total as their budget (a random K's trials in ledgers of their
    own beside it: ``gep_fed.federation.site_selection``)."""
    held_out = config.site_score.site_settings() if config.site_score else {}
    law = config.random_trials  # the simulated sites opt in to the selection they run
    return {
        "epsilon-budget": config.total_epsilon,
        "delta": config.total_delta,
        **({} if law is None else {"max-selection-mean": float(law.mean)}),
        **config.site_settings,
        "ledger-dir": str(sites_dir),
        **held_out,
    }


def _selection_terms(out: Path, planner: TrialPlanner, epsilon: float) -> SelectionTerms:
    """A random K's terms for the sites to record (trial 1's; each trial sets its own):
    the selection's event and the search's id, drawn once by the OS's CSPRNG and kept in
    ``out`` (a resumed search is the same one: the sites record it once)."""
    path = out / SEARCH_ID
    if not path.exists():
        write_bytes_atomically(path, secrets.token_hex(16).encode())
    return SelectionTerms(path.read_text().strip(), 1, planner.selection_event(epsilon))


def _rehearsal(
    config: TuneConfig,
    out: Path,
    say,
    options: Mapping[str, object],
    simulated: bool,
    stop: StopRequest | None,
) -> dict:
    """The rehearsal's record (``rehearse``), for the sites as the trials will run them:
    their number (a simulation's ``site_data``: one per entry) and their total size, the one
    its noise is emulated for: declared (``total_examples``), else, in a simulation this
    process runs, the simulated sites' own count. Under ``flwr run`` the server cannot count
    the sites' examples, so it must be declared."""
    base = config.candidate_config(0)
    sites_examples = base.total_examples
    if sites_examples is None and not simulated:
        raise ConfigError(
            "a rehearsal emulates the noise of a run on the sites' examples: declare their "
            "total in the run config (total-examples), which the server cannot count"
        )
    if sites_examples is None:
        sites_examples = _trained_examples(base, _site_settings(config, out / "sites"), options)
    site_data = options.get("site_data")
    try:
        return rehearse(
            config,
            out,
            sites_examples,
            say,
            num_sites=len(site_data) if site_data else None,
            progress=bool(options.get("progress")),
            stop=stop,
        )
    except RehearsalInterrupted as stopped:
        again = "rehearse again (a rehearsal is the server's own: no site spent anything)"
        raise TuneInterrupted(stopped.where, stopped.completed_round, out, again) from None


def _plan(config: TuneConfig, rng: random.Random | None, say, rehearsal=None) -> tuple:
    """A fresh tuning's (plan, per-trial epsilon, planned epsilon, why it stopped at once):
    the trials drawn (or the rehearsal's choice) and their common budget calibrated."""
    if rehearsal is not None:
        plan = (rehearsal["chosen"] - 1,)
        epsilon, planned = calibrate_plan(TrialPlanner(config), plan, CALIBRATION_TOLERANCE)
        say(
            f"tune: 1 trial, candidate {plan[0] + 1} (the rehearsal's choice), at epsilon "
            f"{epsilon:.4f} <= {config.total_epsilon:g} (RDP, delta={config.total_delta:g}) at "
            "every site"
        )
        return plan, epsilon, planned, None
    plan = config.plan(rng)
    if config.random_trials is None:
        epsilon, planned = calibrate_plan(TrialPlanner(config), plan, CALIBRATION_TOLERANCE)
        say(
            f"tune: {len(plan)} trial(s) of {len(config.candidates)} candidate(s), each at "
            f"epsilon {epsilon:.4f}; together {planned:.4f} <= {config.total_epsilon:g} "
            f"(RDP, delta={config.total_delta:g}) at every site"
        )
        return plan, epsilon, planned, None
    epsilon, planned = calibrate_selection_epsilon(config)
    say(
        f"tune: a random number of trials ({law_text(config.selection_record())}) of "
        f"{len(config.candidates)} candidate(s), each at epsilon {epsilon:.4f}; the "
        f"selection {planned:.4f} <= {config.total_epsilon:g} for the published choice alone "
        f"(RDP, Papernot & Steinke, delta={config.total_delta:g}). Each site records every "
        "trial it takes part in, against its own budget (the server and the other sites see "
        "them all). The trials and their number are the trusted server's record: publishing "
        "them is outside the selection's figure"
    )
    say(f"tune: {len(plan)} trial(s) drawn")
    return plan, epsilon, planned, None


def _result(
    config, out, plan, epsilon, planned, trials, stopped, sites_dir, reference=None, rehearsal=None
):
    finished = [t for t in trials if t.status == "finished"]
    chosen = max(finished, key=lambda t: t.validation_score, default=None)  # first of ties
    model, test = None, {}
    if chosen is not None:
        run_dir = Path(chosen.run_dir)
        # the sites scored the final model; the server's validation, its best round's
        model = run_dir / MODEL if config.site_score is not None else _model_file(run_dir)
        from gep_fed.federation.rundir import RunDirectory

        test = _test_metrics(RunDirectory(run_dir).read_metrics(), chosen.best_round)
    return TuneResult(
        out,
        config.total_epsilon,
        config.total_delta,
        tuple(i + 1 for i in plan),
        epsilon,
        planned,
        tuple(trials),
        chosen,
        model,
        test,
        _site_epsilons(sites_dir) if sites_dir.exists() else {},
        stopped,
        reference,
        config.selection_record(),
        settings=config.record(),
        rehearsal=rehearsal,
    )


def _reference(config: TuneConfig, out: Path, say, options, run_trials: RunTrials) -> dict:
    """Every candidate once at the whole budget, fresh ledgers each: the best on validation
    is what a non-private selection would report (OUTSIDE THE GUARANTEE)."""
    specs = []
    for index in range(len(config.candidates)):
        fed = replace(
            config.candidate_config(index),
            run_dir=str(out / "reference"),
            run_name=f"candidate-{index + 1:03d}",
        )
        held_out = {}
        if config.site_score is not None:  # scored as the trials are, within the whole budget
            whole = calibrate_plan(TrialPlanner(config), [index], CALIBRATION_TOLERANCE)[0]
            fed = replace(fed, target_epsilon=whole)
            held_out = {
                **config.site_score.site_settings(),
                "epsilon-budget": config.total_epsilon,
            }
            if fed.noise_mode.server_steps and fed.total_examples is None:
                fed = replace(fed, total_examples=_trained_examples(fed, held_out, options))
        specs.append(TrialSpec(index + 1, fed, held_out, config.site_score is not None))
    runs = []

    def on_trial(spec: TrialSpec, sim: SimulationResult) -> bool:
        score, best_round = best_validation(sim.metrics)
        ok = not (sim.stop_reason or rounds_not_applied(sim.metrics))
        if spec.score_sites:
            score = _site_score_of(Path(sim.run_dir), config.site_score.noise_std)[0]
            best_round = sim.metrics[-1]["round"] if score is not None else None
        ok = ok and score is not None
        runs.append(
            {
                "candidate": spec.number,
                "settings": dict(config.candidates[spec.number - 1]),
                "validation_score": score,
                "best_round": best_round,
                "run_dir": str(sim.run_dir),
                "finished": ok,
                "_metrics": sim.metrics,
            }
        )
        say(
            f"reference ({OUTSIDE}): candidate {spec.number} at the whole budget: "
            + (f"validation score {score:.4f}" if ok else "failed")
        )
        return True

    try:
        run_trials(specs, on_trial)
    except RunInterrupted as stop:
        where = f"the reference's candidate {_stopped_in(stop, specs, len(runs))}"
        raise TuneInterrupted(
            f"{where} of {len(config.candidates)}", stop.completed_round, out
        ) from None
    finished = [r for r in runs if r["finished"]]
    best = max(finished, key=lambda r: r["validation_score"], default=None)
    chosen = None
    if best is not None:
        chosen = {
            "candidate": best["candidate"],
            "validation_score": best["validation_score"],
            "test": _test_metrics(best["_metrics"], best["best_round"]),
            "run_dir": best["run_dir"],
        }
    for r in runs:
        del r["_metrics"]
    return {
        "label": OUTSIDE,
        "why": "every candidate spent the whole budget and the best was chosen on "
        "validation: the selection's own privacy cost is not accounted",
        "runs": runs,
        "chosen": chosen,
    }


# -- outputs -------------------------------------------------------------------------------


def result_dict(result: TuneResult) -> dict:
    """``tune.json``'s contents."""
    return {
        "format": TUNE_FORMAT,
        "complete": result.complete,
        "settings": result.settings,
        "total_epsilon": result.total_epsilon,
        "delta": result.delta,
        "plan": list(result.plan),
        "per_trial_epsilon": result.per_trial_epsilon,
        "planned_epsilon_rdp": result.planned_epsilon_rdp,
        "trials": [asdict(t) for t in result.trials],
        "chosen": None
        if result.chosen is None
        else {
            "trial": result.chosen.trial,
            "candidate": result.chosen.candidate,
            "settings": dict(result.chosen.settings),
            "validation_score": result.chosen.validation_score,
            "best_round": result.chosen.best_round,
            "model": None if result.model_path is None else str(result.model_path),
            "test": dict(result.test_metrics),
        },
        "procedure_epsilon": {
            "rdp": result.epsilon_rdp,
            "pld": None if math.isnan(result.epsilon_pld) else result.epsilon_pld,
            "delta": result.delta,
            "covers": "each site's ledger: the composition of every trial it took part in "
            "(the guarantee against the server, which saw every trial's releases, and against "
            "the other sites, which saw every trial's rounds)",
            "published_choice_rdp": result.planned_epsilon_rdp
            if result.selection and not _published_choice_void(result)
            else None,
            "published_choice_covers": (_published_choice_void(result) or _COVERS_SELECTION)
            if result.selection
            else None,
        },
        "selection": None if result.selection is None else dict(result.selection),
        "sites": {k: dict(v) for k, v in result.site_epsilons.items()},
        "stopped": result.stopped,
        "reference": None if result.reference is None else dict(result.reference),
        "rehearsal": None if result.rehearsal is None else dict(result.rehearsal),
    }


def _published_choice_void(result: TuneResult) -> str | None:
    """Why a random K's figure for the published choice does not hold (None: it holds, or
    there is no random K): it assumes K runs of one trial, none refused or cut short."""
    if not result.selection:
        return None
    if result.stopped or any(t.status == "refused" for t in result.trials):
        return (
            "the published choice's figure does not hold: a trial was refused or the search "
            "stopped early, so the trials were not K runs of one trial (the sites' ledgers hold)"
        )
    return None


_COVERS_SELECTION = (
    "what the trusted server publishes, for those who see only that: the chosen candidate, "
    "its validation score and its model (Papernot & Steinke's bound for a random number of "
    f"trials). The trials and their number are the server's record, {OUTSIDE} if published"
)


def result_lines(result: TuneResult) -> list[str]:
    """A finished tuning in a few lines, as ``gep-fed tune`` and ``flwr run`` print it."""
    lines = [f"stopped early: {result.stopped}"] if result.stopped else []
    if result.rehearsal is not None:
        scores = ", ".join(f"{i} {_fmt(s)}" for i, s in enumerate(result.rehearsal["scores"], 1))
        lines.append(
            f"rehearsal on {result.rehearsal['label']}: mean score by candidate {scores}; "
            f"chosen {result.rehearsal['chosen']}"
        )
    if result.chosen is not None:
        c = result.chosen
        test = ", ".join(f"{k} {v:.4g}" for k, v in result.test_metrics.items())
        settings = ", ".join(f"{k.replace('_', '-')}={v}" for k, v in c.settings.items())
        # with a random K, the trial's number tells K >= it: the server's record, uncovered
        trial = (
            f"trial {c.trial} ({OUTSIDE} if published)" if result.selection else f"trial {c.trial}"
        )
        lines += [
            f"chosen: candidate {c.candidate} ({settings or 'the base'}), "
            f"validation score {c.validation_score:.4f} (round {c.best_round}); {trial}",
            f"its test metrics (never used to choose): {test}",
            f"model: {result.model_path}",
        ]
    covers = "every trial it took part in, the guarantee against the server" + (
        " and the other sites" if result.selection else ""
    )
    if result.site_epsilons:
        lines.append(
            f"epsilon of the whole tuning (each site's ledger: {covers}): "
            f"{_epsilon_text(result.epsilon_rdp)} (RDP), {_epsilon_text(result.epsilon_pld)} "
            f"(PLD), delta {result.delta:g}"
        )
    elif result.selection:  # deployed sites; the composition is known only once K is
        lines.append(
            f"epsilon of the whole tuning: each site's own ledger records {covers} (the sites' "
            "ledgers are not here)"
        )
    else:  # deployed sites: their ledgers are on their own disks
        lines.append(
            f"epsilon of the whole tuning as planned (each site's own ledger records {covers}; "
            f"the sites' ledgers are not here): {_epsilon_text(result.epsilon_rdp)} (RDP), "
            f"delta {result.delta:g}"
        )
    if _published_choice_void(result):
        lines.append(_published_choice_void(result))
    elif result.selection:
        lines.append(
            f"epsilon of the published choice alone (Papernot & Steinke, for those who see only "
            f"the chosen model): {_epsilon_text(result.planned_epsilon_rdp)} (RDP), delta "
            f"{result.delta:g}"
        )
    reference = (result.reference or {}).get("chosen")
    if reference is not None:
        test = ", ".join(f"{k} {v:.4g}" for k, v in reference["test"].items())
        lines.append(
            f"non-private reference, {OUTSIDE}: candidate {reference['candidate']}, "
            f"validation {reference['validation_score']:.4f}; test: {test}"
        )
    lines += [
        f"tuning directory: {result.out_dir}",
        f"report:           {result.out_dir / TUNE_MD}",
    ]
    return lines


def _epsilon_text(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.4f}"


def failure_line(result: TuneResult) -> str | None:
    """The one line that says a tuning failed (no trial finished), or None."""
    if result.chosen is not None:
        return None
    return f"FAILED: no trial finished: {result.stopped or 'every trial failed (see tune.md)'}"


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
        return str(int(value))
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _metrics_text(metrics: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {_fmt(v)}" for k, v in metrics.items()) or "n/a"


def _score_text(trial: Trial) -> str:
    """A trial's score, with how far the sites' noise alone moves it where they scored."""
    if trial.score_noise is None or trial.validation_score is None:
        return _fmt(trial.validation_score)
    return f"{_fmt(trial.validation_score)} +- {trial.score_noise:.2f}"


def _score_source(site_score: Mapping[str, float] | None) -> str:
    """Where the validation scores come from, in one line of ``tune.md``."""
    if site_score is None:
        return (
            "Validation score: balanced accuracy (else accuracy) on the server's own "
            "validation data, which holds no site's data, at each trial's best round."
        )
    return (
        "Validation score: balanced accuracy of each trial's final model from the sites' "
        f"noised per-class counts on the {site_score['fraction']:g} of their examples they "
        f"hold out (noise std {site_score['noise_std']:g} per count; one Gaussian release "
        "per site and trial, in its ledger (a random number of trials: the trial's own, and "
        "each run of the selection ends with it) and in the epsilon below). The +- is about one "
        "standard deviation of what that noise alone moves the score by, read from the noised "
        "counts: trials closer than it are not told apart; hold out more, or ask for less "
        "noise (more budget per score), to tell them apart."
    )


def _score_cost(site_score: Mapping[str, float] | None) -> str:
    if site_score is None:
        return "the score is the server's own validation data"
    return "the scores come from the sites' noised counts, already in their ledgers"


def render_markdown(result: TuneResult) -> str:
    """``tune.md``: every trial, the chosen one, the epsilon of the whole procedure, and the
    non-private reference labelled outside the guarantee."""
    lines = ["# Private selection (gep-fed tune)", ""]
    if not result.complete:
        lines += [
            "**Not finished**: running, or interrupted (the same settings and folder, "
            f"`--out {result.out_dir}`, resume it).",
            "",
        ]
    if result.selection is None:
        lines += [
            f"{len(result.plan)} trial(s) planned (candidates "
            f"{', '.join(map(str, result.plan))}), each at epsilon "
            f"{result.per_trial_epsilon:.4f}; their RDP composition "
            f"{result.planned_epsilon_rdp:.4f} <= the total {result.total_epsilon:g} "
            f"(delta {result.delta:g}).",
            "",
        ]
    else:
        lines += [
            f"A random number of trials ({law_text(result.selection)}), each at epsilon "
            f"{result.per_trial_epsilon:.4f}; the selection's RDP epsilon "
            f"{result.planned_epsilon_rdp:.4f} <= the total {result.total_epsilon:g} "
            f"(delta {result.delta:g}).",
            "",
            f"**The trusted server's record, {OUTSIDE} if published.** The bound covers the "
            "chosen candidate, its score and its model only: this list, its scores and even "
            f"its length ({len(result.plan)} trial(s) drawn) are not covered.",
            "",
        ]
    lines += _rehearsal_lines(result)
    lines += [
        _score_source(result.settings.get("site_score")),
        "",
        "| trial | candidate | settings | sigma | status | validation score | best round |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in result.trials:
        status = t.status
        if t.refused_by:
            status += ": " + "; ".join(f"{s} {why}" for s, why in t.refused_by.items())
        elif t.problem:
            status += f": {t.problem}"
        lines.append(
            f"| {t.trial} | {t.candidate} | {_settings_text(t.settings)} | "
            f"{t.noise_multiplier:.4g} | {status} | {_score_text(t)} | "
            f"{_fmt(t.best_round)} |"
        )
    lines.append("")
    if result.stopped:
        lines += [f"**Stopped early**: {result.stopped}.", ""]
    if result.chosen is None:
        lines += ["**No trial finished**: nothing was chosen.", ""]
    else:
        c = result.chosen
        test = _metrics_text(result.test_metrics)
        lines += [
            f"**Chosen**: trial {c.trial}, candidate {c.candidate} "
            f"({_settings_text(c.settings)}), validation score {_fmt(c.validation_score)} "
            f"(round {c.best_round}); model `{result.model_path}`.",
            "",
            f"Its test metrics (the server's test split, never used to choose): {test}.",
            "",
        ]
    lines += ["## Epsilon of the whole procedure", ""]
    if result.site_epsilons:
        recorded = (
            f"as its ledger records it: epsilon {_fmt(result.epsilon_rdp)} (RDP), "
            f"{_fmt(result.epsilon_pld)} (PLD)"
        )
    else:  # a random K's composition is known only once K is
        recorded = "which its own ledger records (not here: the sites' ledgers are on their disks)"
        if result.selection is None:
            recorded += f"; as planned, epsilon {_fmt(result.epsilon_rdp)} (RDP)"
    lines += [
        f"Against the server, which saw every trial's releases, each site's guarantee is "
        f"the composition of every trial it took part in, {recorded}, "
        f"delta {result.delta:g}. The choice, its score and its model are post-processing "
        f"({_score_cost(result.settings.get('site_score'))}): they cost nothing more.",
        "",
    ]
    if result.selection is None:
        lines += [
            "The tighter bound for a random number of trials (Papernot & Steinke) needs a "
            "server the sites trust (central mode), and holds for the published choice alone.",
            "",
        ]
    elif _published_choice_void(result):
        lines += [f"**{_published_choice_void(result).capitalize()}.**", ""]
    else:
        lines += [
            f"The published choice alone: epsilon {_fmt(result.planned_epsilon_rdp)} (RDP, "
            f"the selection's bound; PLD has none), delta {result.delta:g}, covering "
            f"{_COVERS_SELECTION}. The other sites see every trial's rounds, so a site's own "
            "guarantee is its ledger's. Beside it, each trial's own ledger "
            "(`<ledger>.selections/<search id>/`) holds what that trial alone spent, under the "
            "selection's bound of one trial, which the published figure assumes.",
            "",
        ]
    if result.site_epsilons:
        lines += [
            "| site | steps | epsilon (RDP) | epsilon (PLD) | budget |",
            "|---|---|---|---|---|",
        ]
        for site, s in result.site_epsilons.items():
            lines.append(
                f"| {site} | {s['steps']} | {_fmt(s['epsilon_rdp'])} | "
                f"{_fmt(s['epsilon_pld'])} | {_fmt(s['budget'])} |"
            )
        lines.append("")
    if result.reference is not None:
        ref = result.reference
        lines += [
            f"## Non-private reference ({OUTSIDE})",
            "",
            "Each candidate ran once at the whole budget, with fresh ledgers of its own, and "
            "the best on validation was chosen: the selection's own cost is not accounted, so "
            f"nothing in this section is covered by the privacy guarantee ({OUTSIDE}).",
            "",
            "| candidate | validation score | finished |",
            "|---|---|---|",
        ]
        for r in ref["runs"]:
            lines.append(f"| {r['candidate']} | {_fmt(r['validation_score'])} | {r['finished']} |")
        lines += [
            "",
            "| selection | candidate | validation score | test metrics |",
            "|---|---|---|---|",
        ]
        if result.chosen is not None:
            lines.append(
                f"| private (this tuning) | {result.chosen.candidate} | "
                f"{_fmt(result.chosen.validation_score)} | {_metrics_text(result.test_metrics)} |"
            )
        if ref["chosen"] is not None:
            ch = ref["chosen"]
            lines.append(
                f"| non-private, {OUTSIDE} | {ch['candidate']} | "
                f"{_fmt(ch['validation_score'])} | {_metrics_text(ch['test'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def _rehearsal_lines(result: TuneResult) -> list[str]:
    """``tune.md``'s account of the rehearsal that chose the one trial (none without one)."""
    record = result.rehearsal
    if record is None:
        return []
    candidates = result.settings.get("candidates") or []
    lines = [
        f"## Rehearsal on {record['label']}",
        "",
        f"Before any site trained, every candidate ran on {record['folds']} folds of the "
        f"server's validation data ({', '.join(map(str, record['examples']))} training "
        f"examples per fold), with the noise its real run on the sites' "
        f"{record['sites_examples']} examples would put on its update relative to the signal, "
        "scored on the fold left out. The best mean score chose the one trial below: the "
        "choice depends on no site's data, so it costs the sites nothing.",
        "",
        "| candidate | settings | fold scores | mean score |",
        "|---|---|---|---|",
    ]
    for index, mean in enumerate(record["scores"], 1):
        folds = [r for r in record["runs"] if r["candidate"] == index]
        scores = ", ".join(
            _fmt(r["score"]) if r["problem"] is None else f"failed ({r['problem']})" for r in folds
        )
        settings = _settings_text(candidates[index - 1]) if index <= len(candidates) else ""
        mark = " (chosen)" if index == record["chosen"] else ""
        lines.append(f"| {index}{mark} | {settings} | {scores} | {_fmt(mean)} |")
    return [*lines, ""]


def _write(result: TuneResult) -> None:
    payload = json.dumps(result_dict(result), indent=1, default=str) + "\n"
    write_bytes_atomically(result.out_dir / TUNE_JSON, payload.encode())
    write_bytes_atomically(result.out_dir / TUNE_MD, render_markdown(result).encode())
