"""A tuning's rehearsal: every candidate run on the server's validation data, fold by fold,
before any site trains (``gep_fed.federation.tuning.Rehearsal``).

The rehearsal's runs are one Flower simulation in this process (the server's own: under
``flwr run`` too, the real sites take no part), their simulated sites' ledgers in the
tuning's ``rehearsal/attempt-N`` folder, apart from the real sites'. A stopped rehearsal is
run again whole in the next attempt's folder (the earlier one is kept: nothing recorded is
removed). What it returns is the record ``tune.json`` keeps: each run's score and the choice,
which depends on no site's data.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from gep_fed.data.partition import fewest_examples
from gep_fed.data.rehearsal import rehearsal_task_name
from gep_fed.federation.rundir import rounds_not_applied
from gep_fed.federation.server import best_validation
from gep_fed.federation.tuning import REHEARSAL_EPSILON, TuneConfig
from gep_fed.flower import search  # a module: tests replace its simulate_search
from gep_fed.flower.interrupt import RunInterrupted, StopRequest
from gep_fed.flower.search import TrialSpec
from gep_fed.validation import ConfigError

FOLDER = "rehearsal"
LABEL = "the server's validation data: no site's data, no site's budget"


def _latest_attempt(folder: Path) -> int:
    """The highest N of ``folder``'s ``attempt-N`` folders (0: none)."""
    if not folder.is_dir():
        return 0
    numbers = [re.fullmatch(r"attempt-(\d+)", p.name) for p in folder.iterdir()]
    return max((int(m[1]) for m in numbers if m), default=0)


class RehearsalInterrupted(RunInterrupted):
    """A stop request ended the rehearsal in one of its runs (``where``)."""

    def __init__(self, where: str, completed_round: int) -> None:
        self.where = where
        super().__init__(completed_round)


def rehearse(
    config: TuneConfig,
    out: Path,
    sites_examples: int,
    say: Callable[[str], None],
    *,
    num_sites: int | None = None,
    progress: bool = False,
    stop: StopRequest | None = None,
) -> dict:
    """Run every candidate of ``config`` on each fold of the server's validation data (its
    ``Rehearsal``) where ``num_sites`` sites (None: the base's) hold ``sites_examples``, and
    choose the best mean score. ``num_sites`` given (a simulation's own data per site, never
    split by the base's partition): each fold is shared out IID. ``stop``: the caller's stop
    request (``flwr stop``).

    Returns:
        ``{"label", "folds", "sites", "sites_examples", "examples", "runs", "scores",
        "chosen"}``: the sites emulated, each fold's training size, each run's score, each
        candidate's mean (None where a fold failed) and the chosen candidate (1-based).

    Raises:
        ConfigError: a rehearsal cannot carry a candidate's noise, or no candidate scored.
        RehearsalInterrupted: a stop request (Ctrl-C) ended it.
    """
    rehearsal = config.rehearsal
    first = config.candidate_config(0)
    sites = num_sites or first.num_sites
    partition = "iid" if num_sites else first.partition
    examples = {
        fold: len(
            replace(first, task=rehearsal_task_name(first.task, fold, rehearsal.folds))
            .make_task()
            .train_dataset()
        )
        for fold in range(rehearsal.folds)
    }
    needed = fewest_examples(sites, partition)
    if min(examples.values()) < needed:
        raise ConfigError(
            f"a rehearsal trains on {min(examples.values())} of the server's validation "
            f"examples, too few to share by {sites} sites ({partition}: at least {needed}): "
            "rehearse on more folds (each trains on more of them), or give the server more "
            "validation data"
        )
    latest = _latest_attempt(out / FOLDER)
    folder = out / FOLDER / f"attempt-{latest + 1}"
    specs, where = [], {}
    for index in range(len(config.candidates)):
        real = config.candidate_config(index)
        real = replace(
            real, num_sites=sites, min_sites=min(real.min_sites, sites), partition=partition
        )
        for fold in range(rehearsal.folds):
            try:
                fed = rehearsal.emulation(real, fold, sites_examples, examples[fold])
            except ConfigError as err:
                raise ConfigError(f"candidate {index + 1}: {err}") from None
            fed = replace(
                fed, run_dir=str(folder), run_name=f"candidate-{index + 1:03d}-fold-{fold + 1}"
            )
            number = len(specs) + 1
            where[number] = (index + 1, fold + 1)
            budget = {"epsilon-budget": REHEARSAL_EPSILON, "delta": fed.delta}
            specs.append(TrialSpec(number, fed, budget))
    if latest:  # kept as they were: the server's own runs, none of a site's record
        say(
            f"tune: an earlier rehearsal (attempt-{latest}) left no recorded choice; rehearsing "
            "again"
        )
    say(
        f"tune: rehearsing {len(config.candidates)} candidate(s) on {rehearsal.folds} folds of "
        f"the server's validation data ({LABEL}), each as a federation of {sites} sites "
        f"holding {sites_examples} examples would run ({folder})"
    )
    runs: list[dict] = []

    def on_run(spec: TrialSpec, sim) -> bool:
        candidate, fold = where[spec.number]
        score, best_round = best_validation(sim.metrics)
        problem = sim.stop_reason or rounds_not_applied(sim.metrics) or None
        if problem is None and score is None:
            problem = "no validation score"
        runs.append(
            {
                "candidate": candidate,
                "fold": fold,
                "score": None if problem else score,
                "best_round": best_round,
                "sample_rate": spec.fed.sample_rate,
                "noise_multiplier": spec.fed.noise_multiplier,
                "mode": spec.fed.mode,
                "run_dir": str(sim.run_dir),
                "problem": problem,
            }
        )
        said = f"failed: {problem}" if problem else f"score {score:.4f} (round {best_round})"
        say(f"rehearsal: candidate {candidate}, fold {fold}/{rehearsal.folds}: {said}")
        return True

    try:
        search.simulate_search(specs, on_run, progress=progress, engine="in-process", stop=stop)
    except RunInterrupted as stopped:
        number = getattr(stopped, "trial", None) or specs[min(len(runs), len(specs) - 1)].number
        candidate, fold = where[number]
        raise RehearsalInterrupted(
            f"the rehearsal of candidate {candidate} on fold {fold}", stopped.completed_round
        ) from None
    scores = []
    for index in range(len(config.candidates)):
        mine = [r["score"] for r in runs if r["candidate"] == index + 1]
        complete = len(mine) == rehearsal.folds and None not in mine
        scores.append(statistics.fmean(mine) if complete else None)
    scored = [(s, i) for i, s in enumerate(scores) if s is not None]
    if not scored:
        problems = "; ".join(
            f"candidate {r['candidate']} fold {r['fold']}: {r['problem']}"
            for r in runs
            if r["problem"]
        )
        raise ConfigError(
            f"the rehearsal scored no candidate ({problems or 'no run ended'}): nothing was "
            "chosen, and no site trained"
        )
    chosen = max(scored, key=lambda pair: (pair[0], -pair[1]))[1]  # the first of ties
    tied = [i + 1 for s, i in scored if s == scores[chosen] and i != chosen]
    ties = f", tied with candidate(s) {tied}: the first declared" if tied else ""
    say(
        f"tune: the rehearsal chooses candidate {chosen + 1} (mean score "
        f"{scores[chosen]:.4f}{ties}); it alone runs at the sites, at the whole budget"
    )
    return {
        "label": LABEL,
        "folds": rehearsal.folds,
        "sites": sites,
        "sites_examples": sites_examples,
        "examples": [examples[f] for f in range(rehearsal.folds)],
        "runs": runs,
        "scores": scores,
        "chosen": chosen + 1,
    }
