"""Private selection of a run's settings (issue 53, first version): ``tune``.

A tuning runs ``T`` trials, each a federated run of one declared candidate (a mapping of
``FederationConfig`` fields over a base configuration), and returns the candidate whose run
scores best on the server's own validation data, with its model and its test figures.

Accounting. The sequence of candidates is drawn before any training (uniformly at random
by the operating system's CSPRNG, or every candidate once in the declared order when ``T``
equals their number): it depends on no data, so the releases of the whole procedure are
known in advance. Every trial gets one common per-trial budget ``e``, calibrated so that the
RDP composition of all ``T`` planned trials' releases (each trial's sigma calibrated to ``e``
over its own steps, ``FederationConfig.contract``) stays within the tuning's total budget.

What the total covers. In client and distributed mode the server sees every trial's
releases, so against the server a site's guarantee is the *composition* of all the trials it
took part in: exactly what its ledger records and enforces. The simulated sites of every
trial keep their ledgers in one folder, each site's budget the tuning's total, so a site
refuses a trial that would take it beyond its budget ("over budget"); the tuning then
records that trial as refused, names the site, and stops with the trials done. The
selection score is computed by the server on its own validation data, which holds no site's
data: the score, the choice and the chosen model are post-processing of the releases, at no
further cost. Papernot & Steinke's tighter bound for a random number of trials
(``gep_fed.accounting.selection``) covers only what is published after the selection and
assumes the server follows the procedure: it applies where the server is trusted.

A random number of trials (``random_trials``, central mode only). The trusted server draws K
from a declared law (truncated negative binomial or Poisson) by the OS CSPRNG, runs K trials
of candidates drawn uniformly, and publishes only the best trial's candidate, score and model.
Papernot & Steinke's bound (dp-accounting's ``RepeatAndSelectDpEvent``) then covers that
publication as one event, whatever K turns out to be: each trial is bounded by one release
repeated (the largest q, the smallest noise and the most steps of any candidate, checked to
lie above every candidate's RDP curve), and every site's ledger records the selection once,
before the first trial, refusing it where it exceeds the site's budget. Each trial then runs
with ledgers of its own, which the sites check every round at the per-trial budget. The list
of trials, their scores and K itself are the trusted server's record: publishing them is
outside the guarantee (``tune.md`` says so where it lists them).

A non-private reference (``reference=True``) runs every candidate once at the whole budget,
each with fresh ledgers of its own, and picks the best on validation: what a non-private
selection would have reported, labelled OUTSIDE THE GUARANTEE wherever it appears.
"""

from __future__ import annotations

import json
import math
import random
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from gep_fed.accounting.events import (
    ImpossibleTargetError,
    PrivacyEvent,
    Selection,
    epsilon_rdp,
    rdp_curve,
)
from gep_fed.accounting.ledger import (
    BudgetExceededError,
    PrivacyLedger,
    create_ledger_key,
    default_key_path,
    read_ledger_key,
)
from gep_fed.accounting.selection import (
    PoissonTrials,
    TrialDistribution,
    TruncatedNegativeBinomial,
    default_rng,
)
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.policy import simulated_site_name
from gep_fed.federation.rundir import (
    BEST_MODEL,
    MODEL,
    SITE_ROUNDS,
    round_spans,
    rounds_not_applied,
)
from gep_fed.federation.server import validation_score
from gep_fed.files import write_bytes_atomically
from gep_fed.flower.interrupt import RunInterrupted
from gep_fed.validation import DELTA, POSITIVE, ConfigError

TUNE_FORMAT = "gep-fed-tune/1"
TUNE_JSON = "tune.json"
TUNE_MD = "tune.md"
OUTSIDE = "OUTSIDE THE GUARANTEE"
# The composition of the planned trials lands this far below the total, at most.
CALIBRATION_TOLERANCE = 1e-3

# Settings every trial shares: they decide who the sites are and what they hold, who is
# trusted, or the budget, so a candidate cannot change them (each with the reason).
FIXED_SETTINGS = {
    "task": "the sites' data and the server's validation data are the task's",
    "data_dir": "the sites' data must be the same in every trial",
    "medmnist_path": "the sites' data must be the same in every trial",
    "num_sites": "the sites must be the same in every trial (each keeps one ledger)",
    "partition": "the sites' data must be the same in every trial",
    "dirichlet_alpha": "the sites' data must be the same in every trial",
    "seed": "it decides the sites' partitions, which must be the same in every trial",
    "total_examples": "the declared size of the sites' data is the same in every trial",
    "mode": "who is trusted is the tuning's choice (--mode), not a candidate's",
    "target_epsilon": "the tuning calibrates every trial's budget from its total",
    "delta": "the tuning's delta is every trial's",
    "noise_multiplier": "the tuning calibrates every trial's sigma from its budget",
    "noise_seed": "a fixed noise seed is the base configuration's (tests only)",
    "release_site_metrics": "what leaves a site is the site's choice, the same in every trial",
    "run_dir": "the tuning places every trial's run directory",
    "run_name": "the tuning names every trial's run directory",
}
# Keys a simulated site's own settings may override (``TuneConfig.site_settings``).
_SITE_KEYS_OWNED = ("ledger-dir",)


def _snake(key: object) -> str:
    return str(key).replace("-", "_")


@dataclass(frozen=True)
class TuneConfig:
    """A private selection among declared candidates.

    Attributes:
        base: the settings every trial shares (task, sites, mode, device...). Its
            ``target_epsilon`` and ``delta`` are the tuning's total unless given below; its
            ``noise_multiplier`` must be None (each trial's sigma is calibrated).
        candidates: each a mapping of ``FederationConfig`` fields (snake_case or kebab-case)
            over ``base``: the model, the mechanism (gep, bgep, gp), the step sizes, the clip
            norms, q, the rounds, the local steps... Data-independent by construction: they
            are declared before anything runs. A field in ``FIXED_SETTINGS`` is refused.
        trials: T, the number of trials (None: one per candidate, in the declared order;
            otherwise each trial's candidate is drawn uniformly by the OS CSPRNG). Each
            trial costs privacy: the total budget is shared by all T.
        random_trials: instead of T, the law of a random number of trials K
            (``TruncatedNegativeBinomial`` of eta >= 0, or ``PoissonTrials``), drawn by the
            OS CSPRNG and kept secret; only the best trial is published, accounted by
            Papernot & Steinke's bound. Central mode only: elsewhere the server sees every
            trial's releases, and only their composition holds against it.
        target_epsilon: the total epsilon of the whole procedure: every site's ledger
            records all the trials it took part in, and no site spends more than this over
            the tuning (None: ``base.target_epsilon``).
        delta: the delta of that total (None: ``base.delta``).
        reference: also run every candidate once at the whole budget (fresh ledgers of its
            own) and pick the best on validation: a non-private selection, reported as
            OUTSIDE THE GUARANTEE (it spends up to one total budget per candidate).
        out_dir: the tuning's directory (``tune.json``, ``tune.md``, the trials' runs and
            the sites' shared ledgers); empty: ``base.run_dir/tune-<time>``. It must not
            hold an earlier tuning.
        site_settings: the simulated sites' own settings (node-config keys) over the
            tuning's (its total as each site's ``epsilon-budget``, its ``delta``); e.g. a
            site's lower budget. ``ledger-dir`` is the tuning's.
    """

    base: FederationConfig
    candidates: Sequence[Mapping[str, object]]
    trials: int | None = None
    random_trials: TrialDistribution | None = None
    target_epsilon: float | None = None
    delta: float | None = None
    reference: bool = False
    out_dir: str = ""
    site_settings: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.base, FederationConfig):
            raise ConfigError(f"base must be a FederationConfig, got {type(self.base).__name__}")
        if isinstance(self.candidates, Mapping) or not isinstance(self.candidates, Sequence):
            raise ConfigError("candidates must be a list of mappings of settings")
        if not self.candidates:
            raise ConfigError("tune needs at least one candidate")
        normalised = tuple(self._normalised(i, c) for i, c in enumerate(self.candidates, 1))
        object.__setattr__(self, "candidates", normalised)
        if self.trials is not None and (
            isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1
        ):
            raise ConfigError(f"trials must be an integer >= 1, got {self.trials!r}")
        if self.random_trials is not None:
            self._check_random_trials()
        POSITIVE.check("target_epsilon", self.total_epsilon)
        if not math.isfinite(self.total_epsilon):
            raise ConfigError(f"target_epsilon must be finite, got {self.total_epsilon}")
        DELTA.check("delta", self.total_delta)
        if self.base.noise_multiplier is not None:
            raise ConfigError(
                "tune calibrates every trial's sigma from its share of the budget: leave "
                "noise-multiplier at auto in the base settings"
            )
        if not isinstance(self.reference, bool):
            raise ConfigError(f"reference must be true or false, got {self.reference!r}")
        from gep_fed.federation.policy import NODE_CONFIG_KEYS, SIMULATION_KEYS

        known = NODE_CONFIG_KEYS.keys() | SIMULATION_KEYS.keys()
        for key in self.site_settings:
            if key not in known or key in _SITE_KEYS_OWNED:
                raise ConfigError(
                    f"site setting {key!r} cannot be set for a tuning's simulated sites; "
                    f"known node-config keys: {sorted(known - set(_SITE_KEYS_OWNED))}"
                )
        for index in range(len(self.candidates)):
            self.candidate_config(index)  # every bad value named now, before anything runs

    def _check_random_trials(self) -> None:
        law = self.random_trials
        if not isinstance(law, TruncatedNegativeBinomial | PoissonTrials):
            raise ConfigError(
                f"random_trials must be a TruncatedNegativeBinomial or PoissonTrials, got {law!r}"
            )
        if self.trials is not None:
            raise ConfigError("give either trials (a fixed T) or random_trials, not both")
        if isinstance(law, TruncatedNegativeBinomial) and law.eta < 0:
            raise ConfigError(
                f"a random number of trials needs a TNB of eta >= 0 (dp-accounting's "
                f"accounting), got eta={law.eta}"
            )
        mode = self.base.noise_mode
        if mode.site_placement != "trusted-server":
            raise ConfigError(
                f"a random number of trials bounds only what is published after the "
                f"selection, but in {mode.name} mode the server sees every trial's releases, "
                "so only their composition holds against it: give a fixed number of trials, "
                "or tune in central mode (a server the sites trust)"
            )

    @property
    def selection(self) -> Selection | None:
        """The random number of trials as the sites' ledgers record it (None: a fixed T)."""
        law = self.random_trials
        if law is None:
            return None
        shape = math.inf if isinstance(law, PoissonTrials) else float(law.eta)
        return Selection(float(law.mean), shape)

    def record(self) -> dict[str, object]:
        """Everything that decides the tuning, as ``tune.json`` keeps it (a resume must
        match it; ``out_dir`` aside)."""
        return {
            "base": self.base.to_record(),
            "candidates": [dict(c) for c in self.candidates],
            "trials": self.trials,
            "random_trials": None if self.random_trials is None else self.random_trials.to_dict(),
            "target_epsilon": self.total_epsilon,
            "delta": self.total_delta,
            "reference": self.reference,
            "site_settings": dict(self.site_settings),
        }

    def selection_record(self) -> dict[str, object] | None:
        """The random number of trials' law as ``tune.json`` records it (None: a fixed T)."""
        if self.random_trials is None:
            return None
        return {**self.random_trials.to_dict(), **self.selection.to_dict()}

    @staticmethod
    def _normalised(index: int, candidate: object) -> dict[str, object]:
        if not isinstance(candidate, Mapping):
            raise ConfigError(f"candidate {index} must be a table of settings, got {candidate!r}")
        known = {f.name for f in fields(FederationConfig)}
        out: dict[str, object] = {}
        for key, value in candidate.items():
            name = _snake(key)
            if name not in known:
                raise ConfigError(
                    f"candidate {index}: unknown setting {key!r}; known: "
                    f"{sorted(k.replace('_', '-') for k in known - FIXED_SETTINGS.keys())}"
                )
            if name in FIXED_SETTINGS:
                raise ConfigError(
                    f"candidate {index}: {key!r} cannot differ between candidates: "
                    f"{FIXED_SETTINGS[name]}"
                )
            if name in out:
                raise ConfigError(f"candidate {index}: {key!r} is given twice")
            out[name] = value
        return out

    @property
    def total_epsilon(self) -> float:
        return self.base.target_epsilon if self.target_epsilon is None else self.target_epsilon

    @property
    def total_delta(self) -> float:
        return self.base.delta if self.delta is None else self.delta

    @property
    def num_trials(self) -> int:
        return len(self.candidates) if self.trials is None else self.trials

    def candidate_config(self, index: int, epsilon: float | None = None) -> FederationConfig:
        """Candidate ``index`` (0-based) over the base, at per-trial budget ``epsilon``
        (None: the whole total); a bad value is a ``ConfigError`` naming the candidate."""
        record = {
            **self.base.to_record(),
            **{k.replace("_", "-"): v for k, v in self.candidates[index].items()},
            "target-epsilon": float(self.total_epsilon if epsilon is None else epsilon),
            "delta": float(self.total_delta),
        }
        try:
            fed = FederationConfig.from_record(record)
        except (ConfigError, TypeError, ValueError) as err:
            raise ConfigError(f"candidate {index + 1}: {err}") from None
        if fed.mechanism == "langevin":
            raise ConfigError(
                f"candidate {index + 1}: tune does not run langevin yet (its releases depend "
                "on each site's data size, so no common per-trial budget can be planned)"
            )
        return fed

    def plan(self, rng: random.Random | None = None) -> tuple[int, ...]:
        """The trials' candidates (0-based), fixed before any training: every candidate once
        in the declared order when ``trials`` equals their number, else each drawn uniformly
        by ``rng`` (None: the OS CSPRNG; tests pass a seeded ``random.Random``); with
        ``random_trials``, K is drawn first, by the same generator."""
        n = len(self.candidates)
        rng = rng if rng is not None else default_rng()
        if self.random_trials is not None:
            return tuple(rng.randrange(n) for _ in range(self.random_trials.sample(rng)))
        if self.num_trials == n:
            return tuple(range(n))
        return tuple(rng.randrange(n) for _ in range(self.num_trials))


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

    @property
    def epsilon_rdp(self) -> float:
        """The epsilon of the whole procedure: the largest of the sites' ledgers (RDP); the
        planned figure where no ledger was found. A fixed T: against the server, every trial
        composed. A random K: what the trusted server publishes (the selection)."""
        values = [s["epsilon_rdp"] for s in self.site_epsilons.values()]
        return max(values) if values else self.planned_epsilon_rdp

    @property
    def epsilon_pld(self) -> float:
        """As ``epsilon_rdp``, by privacy loss distributions (NaN for distributed noise or
        when no ledger was found)."""
        values = [s["epsilon_pld"] for s in self.site_epsilons.values()]
        return max(values) if values else math.nan


# -- accounting ----------------------------------------------------------------------------


class _Planner:
    """Each candidate's releases at a per-trial budget, as every party's ledger records them
    (the mode's events per round, ``Mode.server_events``), cached by (candidate, budget)."""

    def __init__(self, config: TuneConfig) -> None:
        self.config = config
        self._events: dict[tuple[int, float], tuple[float, list[PrivacyEvent]]] = {}
        self._dimension: dict[int, int] = {}
        self._selection: dict[float, PrivacyEvent] = {}

    def dimension(self, index: int, fed: FederationConfig) -> int:
        """A distributed share's length (the configured k: an upper bound of the basis's,
        so the planned figure errs high); 0 outside distributed mode."""
        if not fed.noise_mode.secure_sum:
            return 0
        if index not in self._dimension:
            model = fed.make_task().build_model()
            size = sum(p.numel() for p in model.parameters() if p.requires_grad)
            contract = fed.contract
            k = fed.num_basis if contract.mechanism_type.uses_subspace else None
            self._dimension[index] = contract.quantized_dimension(k, size)
        return self._dimension[index]

    def trial(self, index: int, epsilon: float) -> tuple[float, list[PrivacyEvent]]:
        """(sigma, events) of one trial of candidate ``index`` at budget ``epsilon``."""
        key = (index, epsilon)
        if key not in self._events:
            fed = self.config.candidate_config(index, epsilon)
            contract = fed.contract  # raises ImpossibleTargetError if out of reach
            dimension = self.dimension(index, fed)
            events = [
                event
                for r in range(1, fed.rounds + 1)
                for event in fed.noise_mode.server_events(contract, r, fed.local_steps, dimension)
            ]
            self._events[key] = (contract.noise_multiplier, events)
        return self._events[key]

    def composed(self, plan: Sequence[int], epsilon: float) -> float:
        events = [e for index in plan for e in self.trial(index, epsilon)[1]]
        return epsilon_rdp(events, self.config.total_delta)

    def selection_event(self, epsilon: float) -> PrivacyEvent:
        """The whole random-K selection at per-trial budget ``epsilon``, as one event: a
        trial of any candidate is bounded by one release repeated (the largest q, the
        smallest noise multiplier, the most steps of any candidate's releases; RDP grows with
        each), checked to lie on or above every candidate's RDP curve, inside the tuning's
        ``Selection``. A trial draws its candidate independently of the data, so its curve is
        at most the largest candidate's (``selection.random_search_rdp``)."""
        if epsilon not in self._selection:
            trials = [self.trial(i, epsilon)[1] for i in range(len(self.config.candidates))]
            releases = [e for events in trials for e in events]
            worst = min(releases, key=lambda e: e.accounting_noise_multiplier)
            bound = PrivacyEvent.gaussian(
                worst.mechanism,
                worst.noise_multiplier,
                max(e.sample_rate for e in releases),
                max(sum(e.steps for e in events) for events in trials),
                worst.accounting_noise_multiplier,
                placement=worst.placement,
            )
            ceiling = rdp_curve([bound])
            for index, events in enumerate(trials, 1):
                if np.any(rdp_curve(events) > ceiling * (1 + 1e-9) + 1e-12):
                    raise ConfigError(
                        f"candidate {index}'s releases are not bounded by the repeated release "
                        "of the largest q, the smallest noise and the most steps: give a "
                        "fixed number of trials instead"
                    )
            self._selection[epsilon] = replace(bound, selection=self.config.selection)
        return self._selection[epsilon]

    def selected(self, epsilon: float) -> float:
        return epsilon_rdp([self.selection_event(epsilon)], self.config.total_delta)


def calibrate_trial_epsilon(
    config: TuneConfig, plan: Sequence[int], tol: float = CALIBRATION_TOLERANCE
) -> tuple[float, float]:
    """The common per-trial budget e of ``plan``'s trials and their composed RDP epsilon:
    ``total - tol <= composition <= total`` (each trial's sigma calibrated to e over its own
    steps; Illinois regula falsi on e, whose composition grows with it).

    Raises:
        ImpossibleTargetError: even a tiny per-trial budget cannot be met, or the trials'
            composition exceeds the total at every budget tried: raise the total or run
            fewer trials.
    """
    if not plan:
        raise ConfigError("a tuning plans at least one trial")
    return _calibrate_plan(_Planner(config), plan, tol)


def calibrate_selection_epsilon(
    config: TuneConfig, tol: float = CALIBRATION_TOLERANCE
) -> tuple[float, float]:
    """A random-K tuning's per-trial budget e and its selection's RDP epsilon:
    ``total - tol <= selection <= total`` (``_Planner.selection_event``).

    Raises:
        ImpossibleTargetError: the selection's floor (``log E[K]`` and ``log(1/gamma)``
            terms, which no noise removes) or the candidates' releases exceed the total at
            every budget tried: raise the total or ask for fewer trials on average.
    """
    planner = _Planner(config)
    law = config.random_trials
    what = f"a random number of trials (mean {law.mean:.3g})"
    return _calibrate(planner.selected, config, config.total_epsilon / 2, tol, what, "on average")


def _calibrate_plan(planner: _Planner, plan: Sequence[int], tol: float) -> tuple[float, float]:
    total = planner.config.total_epsilon
    if len(plan) == 1:  # one trial: the whole budget (its sigma is calibrated to it)
        return total, planner.composed(plan, total)
    return _calibrate(
        lambda e: planner.composed(plan, e),
        planner.config,
        total / len(plan),
        tol,
        f"{len(plan)} trials",
        "",
    )


def _calibrate(
    spent: Callable[[float], float],
    config: TuneConfig,
    start: float,
    tol: float,
    what: str,
    fewer: str,
) -> tuple[float, float]:
    """The largest per-trial budget e (to ``tol``) whose ``spent(e)`` is within the total,
    from ``start`` down by fours until one is, then up by regula falsi."""
    total = config.total_epsilon

    def composed(e: float) -> float:
        try:
            return spent(e)
        except ImpossibleTargetError:
            return math.inf

    lo = start
    f_lo = composed(lo)
    while f_lo > total:
        lo /= 4
        if lo < 1e-6 * total:
            raise ImpossibleTargetError(
                f"{what} cannot share epsilon={total:g} at delta={config.total_delta:g}: "
                f"even a per-trial budget of {lo * 4:.3g} composes to more (or cannot be "
                f"calibrated). Raise the total or run fewer trials{' ' + fewer if fewer else ''}"
            )
        f_lo = composed(lo)
    # Regula falsi on f(e) - total with the Illinois rule (a stale end's weight halves);
    # until an infeasible e is seen, extrapolate from the origin (f grows at least linearly).
    hi, w_lo, w_hi = total, f_lo - total, None
    side = 0
    for _ in range(200):
        if total - f_lo <= tol or hi - lo <= 1e-12 * hi:
            break
        if w_hi is None:
            e = lo * total / f_lo * (1 + tol / total)
        else:
            e = lo + (hi - lo) * (-w_lo) / (w_hi - w_lo)
        if not (lo < e < hi):
            e = (lo + hi) / 2
        f_e = composed(e)
        if f_e <= total:
            lo, f_lo, w_lo = e, f_e, f_e - total
            if side == -1 and w_hi is not None:
                w_hi /= 2
            side = -1
        else:
            hi, w_hi = e, min(f_e, 2 * total) - total
            if side == 1:
                w_lo /= 2
            side = 1
    return lo, spent(lo)


# -- the search ----------------------------------------------------------------------------


def candidates_from_toml(path: str | Path) -> tuple[dict[str, object], list[dict[str, object]]]:
    """A candidates file: ``[[candidate]]`` tables of ``FederationConfig`` keys (kebab- or
    snake-case, as the run config uses) and an optional ``[base]`` table of the settings
    every trial shares. Returns (base, candidates); values are checked by ``TuneConfig``."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as err:
        raise ConfigError(f"cannot read the candidates file {path}: {err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None
    unknown = sorted(set(data) - {"base", "candidate"})
    if unknown:
        raise ConfigError(
            f"{path}: unknown table(s) {unknown}; a candidates file holds [[candidate]] "
            "tables and an optional [base] table"
        )
    base, candidates = data.get("base", {}), data.get("candidate", [])
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: [base] must be a table of settings")
    if not isinstance(candidates, list) or not candidates:
        raise ConfigError(f"{path}: declares no [[candidate]] table")
    return dict(base), [dict(c) if isinstance(c, dict) else c for c in candidates]


def _site_rows(folder: Path) -> dict[str, int]:
    """How many round rows each simulated site of ``folder`` has written so far."""

    return {
        p.parent.name: len([line for line in p.read_text().splitlines() if line.strip()])
        for p in sorted(folder.glob(f"*/{SITE_ROUNDS}"))
    }


def _rows_since(folder: Path, before: Mapping[str, int]) -> dict[str, list[dict]]:

    out = {}
    for path in sorted(folder.glob(f"*/{SITE_ROUNDS}")):
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        out[path.parent.name] = [json.loads(x) for x in lines[before.get(path.parent.name, 0) :]]
    return out


def _best(metrics: Sequence[Mapping]) -> tuple[float | None, int | None]:
    """The best validation score of a run and its round (the first of equal ones), as
    ``FederationServer.keep_if_best`` keeps its model: balanced accuracy, else accuracy."""
    best: tuple[float | None, int | None] = (None, None)
    for row in metrics:
        score = validation_score({k[4:]: v for k, v in row.items() if k.startswith("val_")})
        if score is not None and (best[0] is None or score > best[0]):
            best = (score, row["round"])
    return best


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
    if fed.make_task().validation_dataset() is None:
        raise ConfigError(
            f"task {fed.task!r} has no validation data (Task.validation_dataset): tune "
            "selects on the server's own validation data, and tune never selects on the test "
            "split"
        )


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


def _run_trial(
    fed: FederationConfig,
    site_settings: Mapping[str, object] | None,
    simulate_options: Mapping[str, object],
):
    from gep_fed.flower import simulation

    options = {"progress": False, **simulate_options}
    if site_settings is None:
        return simulation.simulate(fed, **options)
    return simulation.simulate(fed, site_settings=site_settings, **options)


def tune(
    config: TuneConfig,
    *,
    rng: random.Random | None = None,
    log: Callable[[str], None] | None = None,
    simulate_options: Mapping[str, object] | None = None,
) -> TuneResult:
    """Run the tuning: plan the trials, calibrate their common budget, run each as a
    federated simulation (``gep_fed.flower.simulation.simulate``) whose sites keep one ledger
    each across all trials (a random K: the selection recorded once in each site's ledger,
    and each trial's own ledgers), and choose the best on the server's validation data.

    Args:
        config: the candidates, the number of trials and the total budget (``TuneConfig``).
        rng: draws the number of trials and the trials' candidates when they are drawn
            (None: the OS CSPRNG; a seeded one is for tests). It decides which candidates
            run, never any noise.
        log: called with one line per trial and per decision (None: silent).
        simulate_options: passed to ``simulate`` (e.g. ``progress``, ``engine``).

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
    _check_validation(config)
    out = Path(
        config.out_dir or Path(config.base.run_dir) / f"tune-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    saved = _resumable(out, config)
    out.mkdir(parents=True, exist_ok=True)
    sites_dir, trials_dir = out / "sites", out / "trials"
    planner = _Planner(config)
    selection = config.selection_record()
    if saved is not None:  # the plan, the budget and the trials done, as recorded
        plan = tuple(c - 1 for c in saved["plan"])
        epsilon, planned = saved["per_trial_epsilon"], saved["planned_epsilon_rdp"]
        trials = [Trial(**t) for t in saved["trials"]]
        stopped = saved["stopped"]
        say(f"tune: resuming {out} after {len(trials)} of its {len(plan)} trial(s)")
    else:
        plan, epsilon, planned, stopped = _plan(config, planner, rng, out, sites_dir, options, say)
        trials = []
    site_settings = _trial_site_settings(config, sites_dir, epsilon)
    _write(_result(config, out, plan, epsilon, planned, trials, stopped, sites_dir))
    # the plan is on disk before any trial: a resume runs the same one
    for n, index in enumerate(plan, 1):
        if n <= len(trials) or stopped:
            continue
        sigma = planner.trial(index, epsilon)[0]
        fed = replace(
            config.candidate_config(index, epsilon),
            run_dir=str(trials_dir),
            run_name=f"trial-{n:03d}",
        )
        settings = config.candidates[index]
        ledgers = sites_dir if selection is None else Path(fed.run_directory("")) / "sites"
        before = _site_rows(ledgers)
        try:
            sim = _run_trial(fed, site_settings, options)
        except RunInterrupted as stop:
            raise TuneInterrupted(n, len(plan), stop.completed_round, out) from None
        rows = _rows_since(ledgers, before)
        over = {
            s: [r["round"] for r in rs if r["outcome"] == "over budget"] for s, rs in rows.items()
        }
        refused = {s: f"over budget in round(s) {round_spans(r)}" for s, r in over.items() if r}
        score, best_round = _best(sim.metrics)
        problems = [
            f"{site}: {r['outcome']}" + (f" ({r['cause']})" if r.get("cause") else "")
            for site, rs in rows.items()
            for r in rs
            if r["outcome"] not in ("accepted", "over budget")
        ]
        not_applied = rounds_not_applied(sim.metrics)
        if refused:
            status, problem = "refused", None
        elif sim.stop_reason or not_applied or problems or score is None:
            status = "failed"
            problem = sim.stop_reason or not_applied or (problems[0] if problems else None)
            problem = problem or "no validation score"
        else:
            status, problem = "finished", None
        trial = Trial(
            n,
            index + 1,
            dict(settings),
            epsilon,
            sigma,
            status,
            score,
            best_round,
            str(sim.run_dir),
            refused,
            problem,
        )
        trials.append(trial)
        head = f"trial {n}/{len(plan)}: candidate {index + 1} ({_settings_text(settings)})"
        if status == "refused":
            who = "; ".join(f"{s} ({why})" for s, why in refused.items())
            stopped = f"trial {n} (candidate {index + 1}) refused by {who}: the search stopped"
            say(f"{head}: REFUSED by {who}; the search stops with the trials done")
        elif status == "failed":
            say(f"{head}: FAILED: {problem}")
        else:
            say(f"{head}: validation score {score:.4f} (round {best_round})")
        _write(_result(config, out, plan, epsilon, planned, trials, stopped, sites_dir))
    reference = _reference(config, out, say, options) if config.reference else None
    result = _result(config, out, plan, epsilon, planned, trials, stopped, sites_dir, reference)
    result = replace(result, complete=True)
    _write(result)
    return result


class TuneInterrupted(RunInterrupted):
    """A tuning stopped inside a trial (Ctrl-C): the same settings and folder resume it."""

    def __init__(self, trial: int, trials: int, completed_round: int, out: Path) -> None:
        self.trial, self.trials, self.out = trial, trials, out
        super().__init__(completed_round)

    def line(self) -> str:
        return (
            f"tune interrupted in trial {self.trial} of {self.trials} (after its round "
            f"{self.completed_round}): rerun the same command with --out {self.out} to resume"
        )


def _resumable(out: Path, config: TuneConfig) -> dict | None:
    """The unfinished tuning of these same settings that ``out`` holds (None: none there)."""
    path = out / TUNE_JSON
    if not path.exists():
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


def _trial_site_settings(config: TuneConfig, sites_dir: Path, epsilon: float) -> dict[str, object]:
    """The simulated sites' settings in every trial. A fixed T: one ledger each across all
    trials, in the tuning's folder, the total as their budget. A random K: each trial within
    its own budget, in ledgers of its own (the trial's run directory)."""
    if config.random_trials is None:
        return {
            "epsilon-budget": config.total_epsilon,
            "delta": config.total_delta,
            **config.site_settings,
            "ledger-dir": str(sites_dir),
        }
    return {"delta": config.total_delta, **config.site_settings, "epsilon-budget": epsilon}


def _plan(config, planner, rng, out, sites_dir, options, say):
    """A fresh tuning's (plan, per-trial epsilon, planned epsilon, why it stopped at once):
    the trials drawn and their common budget calibrated; a random K's selection recorded in
    every site's ledger (a refusal stops the tuning before any trial)."""
    plan = config.plan(rng)
    if config.random_trials is None:
        epsilon, planned = _calibrate_plan(planner, plan, CALIBRATION_TOLERANCE)
        say(
            f"tune: {len(plan)} trial(s) of {len(config.candidates)} candidate(s), each at "
            f"epsilon {epsilon:.4f}; together {planned:.4f} <= {config.total_epsilon:g} "
            f"(RDP, delta={config.total_delta:g}) at every site"
        )
        return plan, epsilon, planned, None
    epsilon, planned = calibrate_selection_epsilon(config)
    say(
        f"tune: a random number of trials ({_law_text(config.selection_record())}) of "
        f"{len(config.candidates)} candidate(s), each at epsilon {epsilon:.4f}; the "
        f"selection {planned:.4f} <= {config.total_epsilon:g} (RDP, Papernot & Steinke, "
        f"delta={config.total_delta:g}) at every site. The trials and their number are "
        "the trusted server's record: publishing them is outside the guarantee"
    )
    stopped = None
    refused = _record_selection(config, planner.selection_event(epsilon), sites_dir, options)
    if refused:
        who = "; ".join(f"{s} ({why})" for s, why in refused.items())
        stopped = f"the selection was refused before any trial by {who}"
        say(f"tune: REFUSED: {stopped}")
        plan = ()
    elif not plan:  # Poisson's K = 0: the selection publishes nothing, by design
        stopped = "no trial was drawn (K = 0): the selection publishes nothing"
    say(f"tune: {len(plan)} trial(s) drawn")
    return plan, epsilon, planned, stopped


def _law_text(selection: Mapping[str, object]) -> str:
    if selection["distribution"] == "poisson":
        return f"Poisson, mean {selection['mean']:.3g}"
    names = {0.0: "logarithmic", 1.0: "geometric"}
    eta = float(selection["eta"])
    law = names.get(eta, f"truncated negative binomial, eta {eta:g}")
    return f"{law}, mean {selection['mean']:.3g}"


def _record_selection(
    config: TuneConfig, event: PrivacyEvent, sites_dir: Path, options: Mapping[str, object]
) -> dict[str, str]:
    """Record the whole selection in every simulated site's ledger (keyed, as a site keeps
    it), before any trial: {site: why} for each site whose budget refuses it."""
    site_data = options.get("site_data") or None
    count = len(site_data) if site_data else config.base.num_sites
    budget = config.site_settings.get("epsilon-budget", config.total_epsilon)
    delta = config.site_settings.get("delta", config.total_delta)
    refused = {}
    for i in range(count):
        name = simulated_site_name({"site-data": site_data, "partition-id": i})
        path = sites_dir / name / "ledger.json"
        key_file = default_key_path(path)
        key = read_ledger_key(key_file) if key_file.exists() else create_ledger_key(key_file)
        ledger = PrivacyLedger.open(path, delta, budget, name, key=key, create=True)
        try:
            ledger.record(replace(event, party=name))
        except BudgetExceededError as err:
            refused[name] = f"over budget: {err}"
    return refused


def _result(config, out, plan, epsilon, planned, trials, stopped, sites_dir, reference=None):
    finished = [t for t in trials if t.status == "finished"]
    chosen = max(finished, key=lambda t: t.validation_score, default=None)  # first of ties
    model, test = None, {}
    if chosen is not None:
        run_dir = Path(chosen.run_dir)
        model = _model_file(run_dir)
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
    )


def _reference(config: TuneConfig, out: Path, say, options) -> dict:
    """Every candidate once at the whole budget, fresh ledgers each: the best on validation
    is what a non-private selection would report (OUTSIDE THE GUARANTEE)."""
    runs = []
    for index, settings in enumerate(config.candidates):
        fed = replace(
            config.candidate_config(index),
            run_dir=str(out / "reference"),
            run_name=f"candidate-{index + 1:03d}",
        )
        sim = _run_trial(fed, None, options)
        score, best_round = _best(sim.metrics)
        ok = not (sim.stop_reason or rounds_not_applied(sim.metrics)) and score is not None
        runs.append(
            {
                "candidate": index + 1,
                "settings": dict(settings),
                "validation_score": score,
                "best_round": best_round,
                "run_dir": str(sim.run_dir),
                "finished": ok,
                "_metrics": sim.metrics,
            }
        )
        say(
            f"reference ({OUTSIDE}): candidate {index + 1} at the whole budget: "
            + (f"validation score {score:.4f}" if ok else "failed")
        )
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
            "covers": _COVERS_SELECTION
            if result.selection
            else "each site's ledger: the composition of every trial it took part in "
            "(the guarantee against the server, which saw every trial's releases)",
        },
        "selection": None if result.selection is None else dict(result.selection),
        "sites": {k: dict(v) for k, v in result.site_epsilons.items()},
        "stopped": result.stopped,
        "reference": None if result.reference is None else dict(result.reference),
    }


_COVERS_SELECTION = (
    "what the trusted server publishes: the chosen candidate, its validation score and its "
    "model (Papernot & Steinke's bound for a random number of trials). The trials and their "
    f"number are the server's record, {OUTSIDE} if published"
)


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
        return str(int(value))
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _metrics_text(metrics: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {_fmt(v)}" for k, v in metrics.items()) or "n/a"


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
            f"A random number of trials ({_law_text(result.selection)}), each at epsilon "
            f"{result.per_trial_epsilon:.4f}; the selection's RDP epsilon "
            f"{result.planned_epsilon_rdp:.4f} <= the total {result.total_epsilon:g} "
            f"(delta {result.delta:g}).",
            "",
            f"**The trusted server's record, {OUTSIDE} if published.** The bound covers the "
            "chosen candidate, its score and its model only: this list, its scores and even "
            f"its length ({len(result.plan)} trial(s) drawn) are not covered.",
            "",
        ]
    lines += [
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
            f"{t.noise_multiplier:.4g} | {status} | {_fmt(t.validation_score)} | "
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
    if result.selection is None:
        lines += [
            f"Against the server, which saw every trial's releases, each site's guarantee is "
            f"the composition of every trial it took part in, as its ledger records it: "
            f"epsilon {_fmt(result.epsilon_rdp)} (RDP), {_fmt(result.epsilon_pld)} (PLD), "
            f"delta {result.delta:g}. The choice, its score and its model are post-processing "
            "(the score is the server's own validation data): they cost nothing more. The "
            "tighter bound for a random number of trials (Papernot & Steinke) needs a server "
            "the sites trust (central mode).",
            "",
        ]
    else:
        lines += [
            f"Each site's ledger records the selection once, before the first trial: epsilon "
            f"{_fmt(result.epsilon_rdp)} (RDP; PLD has none for a selection), delta "
            f"{result.delta:g}, covering {_COVERS_SELECTION}. Each trial's own ledgers (in its run "
            "directory) hold what that trial alone spent.",
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


def _write(result: TuneResult) -> None:
    payload = json.dumps(result_dict(result), indent=1, default=str) + "\n"
    write_bytes_atomically(result.out_dir / TUNE_JSON, payload.encode())
    write_bytes_atomically(result.out_dir / TUNE_MD, render_markdown(result).encode())
