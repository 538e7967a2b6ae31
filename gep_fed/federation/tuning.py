"""A private selection's declaration and its budget (issue 53), without Flower.

A tuning declares candidates (each a mapping of ``FederationConfig`` fields over a base
configuration) and how many trials to run; ``gep_fed.flower.tuning`` runs them. This module
holds what is decided before any training: the candidates checked (``TuneConfig``), the
trials' plan, and the common per-trial budget ``e`` that the whole procedure allows.

A fixed number T of trials. The sequence of candidates is drawn before any training
(uniformly at random by the operating system's CSPRNG, or every candidate once in the
declared order when ``T`` equals their number): it depends on no data, so the releases of the
whole procedure are known in advance. ``e`` is calibrated so that the RDP composition of all
``T`` planned trials' releases (each trial's sigma calibrated to ``e`` over its own steps,
``FederationConfig.contract``) stays within the tuning's total. In client and distributed
mode the server sees every trial's releases, so against it a site's guarantee is that
composition, which its ledger records and enforces.

A random number of trials (``random_trials``, central mode only). The trusted server draws K
from a declared law (a truncated negative binomial, so K >= 1) by the OS CSPRNG and publishes
only the best trial's candidate, score and model. Papernot & Steinke's bound (dp-accounting's
``RepeatAndSelectDpEvent``) covers that publication as one event, whatever K turns out to be:
each trial is bounded by one release repeated (the largest q, the smallest noise and the most
steps of any candidate, checked to lie above every candidate's RDP curve), and ``e`` is
calibrated so that this selection stays within the total.

A rehearsal (``Rehearsal``) chooses before any site trains: every candidate runs on the
server's own validation data, cut into folds (``gep_fed.data.rehearsal``), with the noise its
real run would put on its update relative to the signal, and the best mean score picks the
one trial that then runs at the whole budget. The choice depends on no site's data, so the
sites' ledgers record that one run alone.
"""

from __future__ import annotations

import math
import random
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from gep_fed.accounting.events import (
    ImpossibleTargetError,
    PrivacyEvent,
    Selection,
    epsilon_rdp,
    rdp_curve,
)
from gep_fed.accounting.selection import (
    PoissonTrials,
    TrialDistribution,
    TruncatedNegativeBinomial,
    default_rng,
)
from gep_fed.data.rehearsal import rehearsal_task_name
from gep_fed.federation.config import LOCAL_SETTINGS, RUN_CONFIG_DEFAULT, FederationConfig
from gep_fed.federation.site_score import SiteScore
from gep_fed.validation import DELTA, TARGET_EPSILON, ConfigError, Range

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
# Simulated sites' keys the tuning sets itself: refused in ``TuneConfig.site_settings``.
_SITE_KEYS_OWNED = ("ledger-dir", "validation-fraction", "score-noise")


# A rehearsal's own epsilon (TARGET_EPSILON's ceiling): it spends no one's budget, since it
# trains on the server's validation data, but its simulated sites still check and record it.
REHEARSAL_EPSILON = 1000.0
REHEARSAL_FOLDS = Range(2, 20, integer=True)


@dataclass(frozen=True)
class Rehearsal:
    """Choose the candidate by rehearsing each on the server's validation data, which holds
    no site's data: the choice costs the sites nothing, and the one run it picks has the
    whole budget.

    Each candidate runs as a simulated federation of the tuning's sites (its mode: the noise
    on the model's update; distributed mode's shares as central noise), trained on all but
    one fold of the server's validation data and scored (balanced accuracy, else accuracy, at
    its best round) on the fold left out, once per fold; the best mean score wins (the first
    declared among ties). The emulation keeps the real run's noise relative to its signal:
    the same expected sample size where the folds hold it (``q' = q N / N'``, the same sigma),
    else every fold example in every step with sigma scaled by ``N' / (q N)``; N is the sites'
    declared total (``total_examples``) or the simulation's pooled size, N' the folds' size.

    Attributes:
        folds: how many folds the server's validation data is cut into (2 to 20); each
            candidate runs once per fold.
    """

    folds: int = 2

    def __post_init__(self) -> None:
        REHEARSAL_FOLDS.check("rehearsal folds", self.folds)

    def emulation(
        self, fed: FederationConfig, fold: int, sites_examples: int, examples: int
    ) -> FederationConfig:
        """Candidate ``fed`` (its real run's settings, its sites as they will run) rehearsed
        on fold ``fold``, trained on ``examples`` of the server's validation examples where
        the sites hold ``sites_examples``: its task the rehearsal's, its mode, sigma and q the
        emulation's (``Mode.rehearsed_as``).

        Raises:
            ConfigError: the rehearsal's own accounting would exceed ``REHEARSAL_EPSILON``
                (too few validation examples for the real run's noise), or bad sizes.
        """
        for name, value in (("the sites' examples", sites_examples), ("examples", examples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"a rehearsal needs {name} >= 1, got {value!r}")
        contract = fed.contract
        mode, noise = fed.noise_mode.rehearsed_as(fed)
        batch = contract.sample_rate * sites_examples
        sample_rate = min(1.0, batch / examples)
        sigma = noise * contract.noise_multiplier * sample_rate * examples / batch
        rehearsed = replace(
            fed,
            task=rehearsal_task_name(fed.task, fold, self.folds),
            mode=mode,
            noise_multiplier=sigma,
            sample_rate=sample_rate,
            target_epsilon=REHEARSAL_EPSILON,
            total_examples=None,
        )
        spent = epsilon_rdp(run_events(rehearsed), rehearsed.delta)
        if spent > REHEARSAL_EPSILON:
            raise ConfigError(
                f"the rehearsal of {examples} validation examples cannot carry the noise of "
                f"a run on {sites_examples} (sigma {sigma:.3g} at q {sample_rate:.3g} over "
                f"{rehearsed.steps_per_party} steps: its own accounting, epsilon "
                f"{spent:.4g} > {REHEARSAL_EPSILON:g}): give the server more validation "
                "data, or choose without a rehearsal"
            )
        return rehearsed


def run_events(fed: FederationConfig, dimension: int = 0) -> list[PrivacyEvent]:
    """What a run of ``fed`` releases, round by round, as the server's ledger records it
    (``dimension``: a distributed share's length)."""
    contract = fed.contract  # raises ImpossibleTargetError if out of reach
    return [
        event
        for r in range(1, fed.rounds + 1)
        for event in fed.noise_mode.server_events(contract, r, fed.local_steps, dimension)
    ]


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
        site_score: score each trial on the sites' held-out examples, by their noised
            per-class counts (``SiteScore``: one Gaussian release per site and trial, in the
            sites' ledgers and in the planned budget), instead of on the server's own
            validation data; for a task whose server has none. With ``random_trials``,
            each trial's score is part of the run the selection repeats
            (``Selection.score_noise_multiplier``). None: the server's validation data.
        rehearsal: choose before any site trains, by rehearsing every candidate on the
            server's validation data (``Rehearsal``), then run the chosen one alone at the
            whole budget: the sites' ledgers record one run. None: the trials choose.
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
    site_score: SiteScore | None = None
    rehearsal: Rehearsal | None = None

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
        if self.site_score is not None and not isinstance(self.site_score, SiteScore):
            raise ConfigError(f"site_score must be a SiteScore, got {self.site_score!r}")
        TARGET_EPSILON.check("target_epsilon", self.total_epsilon)
        DELTA.check("delta", self.total_delta)
        if self.base.noise_multiplier is not None:
            raise ConfigError(
                "tune calibrates every trial's sigma from its share of the budget: leave "
                "noise-multiplier at auto in the base settings"
            )
        if not isinstance(self.reference, bool):
            raise ConfigError(f"reference must be true or false, got {self.reference!r}")
        if self.rehearsal is not None:
            self._check_rehearsal()
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
        if isinstance(law, PoissonTrials):
            # the sites record the selection at the first round they are sent; at K = 0 none
            # is sent, so the selections they record would be those of K >= 1, a conditioning
            # that the Poisson bound (which counts K = 0 as publishing nothing) does not cover
            raise ConfigError(
                "a Poisson number of trials may draw K = 0, and then no site takes part, so "
                "the sites would record only selections of K >= 1, which the Poisson bound "
                "does not cover: use a truncated negative binomial (geometric or "
                "logarithmic), where K >= 1"
            )
        if not isinstance(law, TruncatedNegativeBinomial):
            raise ConfigError(f"random_trials must be a TruncatedNegativeBinomial, got {law!r}")
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

    def _check_rehearsal(self) -> None:
        if not isinstance(self.rehearsal, Rehearsal):
            raise ConfigError(f"rehearsal must be a Rehearsal, got {self.rehearsal!r}")
        given = [
            name
            for name, value in (
                ("trials (--trials, tune-trials)", self.trials),
                ("random trials (--random-trials, tune-random-trials)", self.random_trials),
                ("site validation (--site-validation, tune-site-validation)", self.site_score),
            )
            if value is not None
        ]
        if given:
            raise ConfigError(
                f"a rehearsal chooses on the server's validation data and runs one trial, the "
                f"chosen candidate's, at the whole budget: drop {' and '.join(given)}"
            )

    @property
    def selection(self) -> Selection | None:
        """The random number of trials as the sites' ledgers record it (None: a fixed T);
        with site scores, each trial's run ends with its score's release."""
        law = self.random_trials
        if law is None:
            return None
        shape = float(law.eta)
        score = self.site_score.event().accounting_noise_multiplier if self.site_score else None
        return Selection(float(law.mean), shape, score)

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
            # only when set: a tuning recorded before site scores resumes unchanged
            **({"site_score": self.site_score.to_dict()} if self.site_score else {}),
            **({"rehearsal": {"folds": self.rehearsal.folds}} if self.rehearsal else {}),
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
        base = self.base.to_record()
        if self.base.noise_mode.server_steps:  # its mode takes no site steps: not given by it
            for name in LOCAL_SETTINGS:
                base.pop(name.replace("_", "-"))
        record = {
            **base,
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
                f"candidate {index + 1}: tune does not run langevin yet (each step's noise is "
                "the site's own schedule's, so no common per-trial budget is calibrated)"
            )
        return fed

    def plan(self, rng: random.Random | None = None) -> tuple[int, ...]:
        """The trials' candidates (0-based), fixed before any training: every candidate once
        in the declared order when ``trials`` equals their number, else each drawn uniformly
        by ``rng`` (None: the OS CSPRNG; tests pass a seeded ``random.Random``); with
        ``random_trials``, K is drawn first, by the same generator."""
        if self.rehearsal is not None:
            raise ConfigError("a rehearsed tuning's one trial is its rehearsal's choice")
        n = len(self.candidates)
        rng = rng if rng is not None else default_rng()
        if self.random_trials is not None:
            return tuple(rng.randrange(n) for _ in range(self.random_trials.sample(rng)))
        if self.num_trials == n:
            return tuple(range(n))
        return tuple(rng.randrange(n) for _ in range(self.num_trials))


class TrialPlanner:
    """Each candidate's releases at a per-trial budget, as every party's ledger records them
    (the mode's events per round, ``Mode.server_events``), cached by (candidate, budget)."""

    def __init__(self, config: TuneConfig) -> None:
        self.config = config
        self._events: dict[tuple[int, float], tuple[float, list[PrivacyEvent]]] = {}
        self._dimension: dict[int, int] = {}
        self._selection: dict[float, PrivacyEvent] = {}
        # each site's score of a trial's model: one release, the same for every trial
        self._score = config.site_score.event() if config.site_score else None

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
        """(sigma, events) of one trial of candidate ``index`` at budget ``epsilon``: its
        rounds' releases, then each site's score of its model where the sites score."""
        sigma, rounds = self.rounds(index, epsilon)
        return sigma, rounds if self._score is None else [*rounds, self._score]

    def rounds(self, index: int, epsilon: float) -> tuple[float, list[PrivacyEvent]]:
        """(sigma, events) of one trial's rounds alone."""
        key = (index, epsilon)
        if key not in self._events:
            fed = self.config.candidate_config(index, epsilon)
            events = run_events(fed, self.dimension(index, fed))
            self._events[key] = (fed.contract.noise_multiplier, events)
        return self._events[key]

    def composed(self, plan: Sequence[int], epsilon: float) -> float:
        events = [e for index in plan for e in self.trial(index, epsilon)[1]]
        return epsilon_rdp(events, self.config.total_delta)

    def selection_event(self, epsilon: float) -> PrivacyEvent:
        """The whole random-K selection at per-trial budget ``epsilon``, as one event: a
        trial's rounds, whatever its candidate, are bounded by one release repeated (the
        largest q, the smallest noise multiplier, the most steps of any candidate's
        releases; RDP grows with each), checked to lie on or above every candidate's RDP
        curve, inside the tuning's ``Selection`` (which adds the sites' score of each trial,
        the same release for every candidate). A trial draws its candidate independently of
        the data, so its curve is at most the largest candidate's
        (``selection.random_search_rdp``)."""
        if epsilon not in self._selection:
            trials = [self.rounds(i, epsilon)[1] for i in range(len(self.config.candidates))]
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
    return calibrate_plan(TrialPlanner(config), plan, tol)


def calibrate_selection_epsilon(
    config: TuneConfig, tol: float = CALIBRATION_TOLERANCE
) -> tuple[float, float]:
    """A random-K tuning's per-trial budget e and its selection's RDP epsilon:
    ``total - tol <= selection <= total`` (``TrialPlanner.selection_event``).

    Raises:
        ImpossibleTargetError: the selection's floor (``log E[K]`` and ``log(1/gamma)``
            terms, which no noise removes) or the candidates' releases exceed the total at
            every budget tried: raise the total or ask for fewer trials on average.
    """
    planner = TrialPlanner(config)
    law = config.random_trials
    what = f"a random number of trials (mean {law.mean:.3g})"
    return _calibrate(planner.selected, config, config.total_epsilon / 2, tol, what, "on average")


def calibrate_plan(planner: TrialPlanner, plan: Sequence[int], tol: float) -> tuple[float, float]:
    total = planner.config.total_epsilon
    if len(plan) == 1 and planner.config.site_score is None:  # the whole budget, its sigma's
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


def law_text(selection: Mapping[str, object]) -> str:
    names = {0.0: "logarithmic", 1.0: "geometric"}
    eta = float(selection["eta"])
    law = names.get(eta, f"truncated negative binomial, eta {eta:g}")
    return f"{law}, mean {selection['mean']:.3g}"


# -- a search from its inputs: the CLI's options or a Flower run config ----------------------

# The laws of a random number of trials by name: a truncated negative binomial's eta
# (geometric 1, logarithmic 0). Not Poisson: its K = 0 reaches no site (``TuneConfig``).
TRIAL_LAWS = {"geometric": 1.0, "logarithmic": 0.0}

# A search under ``flwr run``: the run config's keys beside ``FederationConfig``'s, "default"
# meaning not given (tests/test_config.py pins them in the app's pyproject.toml). A run config
# that names a candidates file runs the search; every other key is ``gep-fed tune``'s option
# of the same name, and the run config's FederationConfig keys override the file's [base].
SEARCH_RUN_CONFIG = {
    "tune-candidates": RUN_CONFIG_DEFAULT,  # --candidates
    "tune-trials": RUN_CONFIG_DEFAULT,  # --trials
    # --random-trials and --trials-law (central mode)
    "tune-random-trials": RUN_CONFIG_DEFAULT,
    "tune-trials-law": RUN_CONFIG_DEFAULT,
    "tune-reference": RUN_CONFIG_DEFAULT,  # --reference
    "tune-site-validation": RUN_CONFIG_DEFAULT,  # --site-validation
    "tune-score-noise": RUN_CONFIG_DEFAULT,  # --score-noise
    "tune-rehearse": RUN_CONFIG_DEFAULT,  # --rehearse FOLDS
}


def trial_law(
    mean: float | None, law: str = "geometric", name: str = "random trials"
) -> TrialDistribution | None:
    """A random number of trials of mean ``mean`` under ``law`` (``TRIAL_LAWS``; None: a
    fixed number). ``name`` is the option's, for errors."""
    if mean is None:
        return None
    if isinstance(mean, bool) or not isinstance(mean, int | float):
        raise ConfigError(f"{name} must be a mean number of trials >= 1, got {mean!r}")
    if not (math.isfinite(mean) and mean >= 1):
        raise ConfigError(f"{name} must be a mean number of trials >= 1, got {mean:g}")
    if law not in TRIAL_LAWS:
        raise ConfigError(f"the law of {name} must be one of {sorted(TRIAL_LAWS)}, got {law!r}")
    return TruncatedNegativeBinomial.from_mean(TRIAL_LAWS[law], float(mean))


def site_score_of(
    fraction: float | None,
    noise: float | None,
    names: tuple[str, str] = ("site validation", "score noise"),
) -> SiteScore | None:
    """The sites' noised score from its two settings (None: neither given, the server's
    own validation data scores); ``names`` are the options', for errors."""
    given = (fraction is not None, noise is not None)
    if given == (False, False):
        return None
    if given != (True, True):
        raise ConfigError(f"{names[0]} and {names[1]} go together")
    return SiteScore(fraction, noise)


def search_base(table: Mapping[str, object], given: Mapping[str, object], where: str):
    """The settings every trial shares: the candidates file's [base] ``table`` under the
    settings ``given`` (the command line's or the run config's)."""
    from gep_fed.data.registry import task_file_name

    values = {**table, **given}
    if "task" in values and isinstance(values["task"], str):
        values["task"] = task_file_name(values["task"])
    try:
        return FederationConfig.from_record(values)
    except ConfigError as err:
        raise ConfigError(f"{where} [base]: {err}") from None


def split_run_config(record: Mapping[str, object]) -> tuple[dict, dict]:
    """A run config's ``FederationConfig`` keys and its search's (``SEARCH_RUN_CONFIG``
    keys with a value given)."""
    settings = {k: v for k, v in record.items() if k not in SEARCH_RUN_CONFIG}
    search = {k: v for k, v in record.items() if k in SEARCH_RUN_CONFIG and v != RUN_CONFIG_DEFAULT}
    return settings, search


def _typed(search: Mapping[str, object], key: str, kind: type, what: str):
    value = search.get(key)
    if value is None:
        return None
    if isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind):
        raise ConfigError(f"run config {key} must be {what}, got {value!r}")
    return value


def search_of_run_config(record: Mapping[str, object], run_id: int | str) -> TuneConfig | None:
    """The search a Flower run config asks for (None: a run of its own), its folder the run
    directory (``FederationConfig.run_directory``): rerun with the same run name, an
    interrupted search resumes there. The file's [base] may not name another task than the
    run config, which a deployed site compares with its own."""
    settings, search = split_run_config(record)
    if not search:
        return None
    path = search.get("tune-candidates")
    if path is None:
        raise ConfigError(f"run config {sorted(search)} need tune-candidates, a candidates file")
    if not isinstance(path, str):
        raise ConfigError(f"run config tune-candidates must be a file path, got {path!r}")
    if not Path(path).is_absolute() and not Path(path).exists():
        raise ConfigError(
            f"run config tune-candidates {path!r} is not found from {Path.cwd()}: give its "
            "absolute path (flwr run starts the ServerApp in its own copy of the app)"
        )
    table, candidates = candidates_from_toml(path)
    given = {k: v for k, v in settings.items() if v != RUN_CONFIG_DEFAULT}
    if "task" in table and "task" in given and table["task"] != given["task"]:
        raise ConfigError(
            f"{path} [base] names task {table['task']!r}, the run config task "
            f"{given['task']!r}: set the task in the run config (a deployed site compares "
            "the run config's task with its own)"
        )
    base = search_base(table, given, path)
    law = _typed(search, "tune-trials-law", str, "a law's name")
    if law is not None and "tune-random-trials" not in search:
        raise ConfigError("run config tune-trials-law needs tune-random-trials, their mean")
    return TuneConfig(
        base,
        candidates,
        trials=_typed(search, "tune-trials", int, "a number of trials"),
        random_trials=trial_law(
            search.get("tune-random-trials"), law or "geometric", "run config tune-random-trials"
        ),
        reference=bool(_typed(search, "tune-reference", bool, "true or false")),
        out_dir=base.run_directory(run_id),
        site_score=site_score_of(
            _typed(search, "tune-site-validation", int | float, "a fraction"),
            _typed(search, "tune-score-noise", int | float, "a standard deviation"),
            ("run config tune-site-validation", "tune-score-noise"),
        ),
        rehearsal=_rehearsal_of(search.get("tune-rehearse")),
    )


def _rehearsal_of(value: object) -> Rehearsal | None:
    """Run config ``tune-rehearse``: true (2 folds, as a bare ``--rehearse``), a number of
    folds, or false."""
    if value is None or value is False:
        return None
    if value is True:
        return Rehearsal()
    if isinstance(value, int):
        return Rehearsal(value)
    raise ConfigError(f"run config tune-rehearse must be true or a number of folds, got {value!r}")


def run_settings(record: Mapping[str, object]) -> FederationConfig:
    """What a Flower run config asks a run to train: a search's base (its candidates
    file's [base] under the run config) where it names a candidates file, else the run
    config's own settings. A simulated site under ``flwr run`` builds its task and data
    from it, as the server does."""
    settings, search = split_run_config(record)
    path = search.get("tune-candidates")
    if not isinstance(path, str):
        return FederationConfig.from_record(settings)
    table, _ = candidates_from_toml(path)
    given = {k: v for k, v in settings.items() if v != RUN_CONFIG_DEFAULT}
    return search_base(table, given, path)
