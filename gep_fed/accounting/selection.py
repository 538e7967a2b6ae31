"""Private hyperparameter selection: a random number of trials, accounted by RDP.

A selection runs ``K`` independent trials of one randomized algorithm ``Q`` and releases
only the best trial's output (its candidate and score); ``K`` is itself random, drawn from a
distribution ``D`` that is public. Papernot & Steinke ("Hyperparameter tuning with Renyi
differential privacy", ICLR 2022, arXiv:2110.03620v2) bound the RDP of that selection from
``Q``'s RDP curve:

* ``K`` truncated negative binomial ``TNB(eta, gamma)`` (Theorem 2): for any ``lambda > 1``
  and any ``lambda_hat >= 1``,
  ``eps'(lambda) = eps(lambda) + (1 + eta) (1 - 1/lambda_hat) eps(lambda_hat)
  + (1 + eta) log(1/gamma) / lambda_hat + log(E[K]) / (lambda - 1)``.
* ``K`` Poisson ``(mu)`` (Theorem 6; ``K = 0`` releases nothing): if ``Q`` is
  ``(eps_hat, delta_hat)``-DP with ``e^eps_hat <= 1 + 1/(lambda - 1)``,
  ``eps'(lambda) = eps(lambda) + mu delta_hat + log(mu) / (lambda - 1)``.

The formulas are those dp-accounting implements for its ``RepeatAndSelectDpEvent``
(``_compute_rdp_repeat_and_select``, which cites the same theorems), with two additions: the
TNB bound also tries ``lambda_hat = 1`` (the ``eps(lambda_hat)`` term vanishes, leaving
``(1 + eta) log(1/gamma)``: the tighter one for a trial whose RDP is large), and the Poisson
bound also takes the envelope over higher orders. Poisson needs ``mu >= 1``, as dp-accounting
requires: below it the formula fails (a test shows a counterexample). The tests compare the
two implementations, the paper's closed forms (Corollaries 3 and 4), and the exact Renyi
divergence of a small discrete mechanism's selection (brute force), where the bound is within
1 % of the truth for a trial whose best output flips between neighbours.

A trial that draws its candidate at random (random search over the declared candidates) is
one mechanism whose output law is a mixture over candidates with data-independent weights; its
RDP at each order is at most the largest candidate's (``exp((a-1) D_a)`` is jointly convex),
so the trial's curve is the pointwise maximum over the candidates' curves
(``random_search_rdp``). A trial's events must include what releasing its score costs (a
private validation), since the selection releases the best score.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gep_fed.accounting.events import (
    MAX_NOISE_MULTIPLIER,
    MIN_NOISE_MULTIPLIER,
    RDP_ORDERS,
    ImpossibleTargetError,
    PrivacyEvent,
    _dp,
    rdp_curve,
)
from gep_fed.validation import DELTA


def default_rng() -> random.SystemRandom:
    """The operating system's CSPRNG (``os.urandom``). The number of trials is part of the
    privacy guarantee: a seeded or guessable generator would let an observer learn ``K``,
    and the bound assumes ``K`` is secret and fresh. Tests pass their own ``random.Random``."""
    return random.SystemRandom()


class TrialDistribution:
    """The law of ``K``, the number of trials. Public: only its draw is secret."""

    #: the smallest possible K (1 for TNB, 0 for Poisson, where K = 0 releases nothing)
    min_trials: int = 1

    @property
    def mean(self) -> float:
        raise NotImplementedError

    def log_pmf(self, k: int) -> float:
        raise NotImplementedError

    def pmf(self, k: int) -> float:
        """P[K = k]."""
        if not (isinstance(k, int | np.integer) and k >= self.min_trials):
            return 0.0
        return math.exp(self.log_pmf(int(k)))

    def pmf_array(self, k_max: int) -> np.ndarray:
        """P[K = k] for k = 0..k_max (for brute-force checks and reports)."""
        return np.array([self.pmf(k) for k in range(k_max + 1)])

    def sample(self, rng: random.Random | None = None) -> int:
        """Draw K. ``rng`` is for tests only: real use leaves it ``None`` (the OS CSPRNG)."""
        raise NotImplementedError

    def to_dict(self) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class TruncatedNegativeBinomial(TrialDistribution):
    """``TNB(eta, gamma)`` (Papernot & Steinke, Definition 1): for k >= 1,
    ``P[K=k] = (1-gamma)^k / (gamma^-eta - 1) * prod_{l=0}^{k-1} (l + eta) / (l + 1)``;
    ``eta = 0`` is the logarithmic law ``(1-gamma)^k / (k log(1/gamma))``, ``eta = 1`` the
    geometric ``gamma (1-gamma)^(k-1)``.

    Attributes:
        eta: the shape, > -1. Smaller eta costs less privacy (the ``(1 + eta)`` factor) but has
            a heavier tail (more trials needed for the same chance of a good one).
        gamma: the stopping probability, in (0, 1]; smaller gamma means more trials on average
            and a larger ``log(1/gamma)`` term. ``gamma = 1`` is one trial, exactly.
    """

    eta: float
    gamma: float

    def __post_init__(self) -> None:
        if not (isinstance(self.eta, int | float) and math.isfinite(self.eta) and self.eta > -1):
            raise ValueError(f"eta must be a finite number > -1, got {self.eta!r}")
        if not (isinstance(self.gamma, int | float) and 0 < self.gamma <= 1):
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma!r}")

    @classmethod
    def from_mean(cls, eta: float, mean: float) -> TruncatedNegativeBinomial:
        """The TNB of shape ``eta`` whose E[K] is ``mean`` (>= 1), by bisection on gamma. The
        mean falls as gamma grows, and the gamma returned errs low (a mean >= the request):
        the tuner then gets at least the trials it asked for."""
        if not (math.isfinite(mean) and mean >= 1):
            raise ValueError(f"the mean number of trials must be a finite number >= 1, got {mean}")
        if mean == 1:
            return cls(eta, 1.0)
        low, high = 0.0, 1.0  # mean(low) = inf > mean >= mean(high) = 1
        for _ in range(200):
            mid = (low + high) / 2
            if cls(eta, mid).mean > mean:
                low = mid
            else:
                high = mid
            if high - low <= 1e-15 * high:
                break
        gamma = low if low > 0 else high
        return cls(eta, gamma)

    @property
    def _log_norm(self) -> float:
        """``log(eta / (gamma^-eta - 1))``, positive inside for every eta > -1 (both factors
        change sign together), with its limit ``-log log(1/gamma)`` at eta = 0; computed so
        that neither eta near 0 nor a tiny gamma loses it (expm1, and no overflow)."""
        big_l = -math.log(self.gamma)
        x = self.eta * big_l
        if self.eta == 0:
            return -math.log(big_l)
        if x > 0:  # log(expm1(x)) = x + log(1 - e^-x)
            return math.log(self.eta) - x - math.log(-math.expm1(-x))
        return math.log(-self.eta) - math.log(-math.expm1(x))

    @property
    def mean(self) -> float:
        """``E[K] = eta (1-gamma) / (gamma (1 - gamma^eta))``; ``(1/gamma - 1) / log(1/gamma)``
        at eta = 0; 1 at gamma = 1."""
        if self.gamma == 1:
            return 1.0
        # = (1 - gamma) gamma^-(1+eta) eta / (gamma^-eta - 1)
        big_l = -math.log(self.gamma)
        return math.exp(math.log1p(-self.gamma) + (1 + self.eta) * big_l + self._log_norm)

    def log_pmf(self, k: int) -> float:
        if k < 1:
            return -math.inf
        if self.gamma == 1:
            return 0.0 if k == 1 else -math.inf
        # prod_{l=0}^{k-1} (l+eta)/(l+1) = eta/k * Gamma(k+eta) / (Gamma(1+eta) Gamma(k)), whose
        # factor eta goes into _log_norm: every term below is the log of a positive number.
        return (
            k * math.log1p(-self.gamma)
            + self._log_norm
            - math.log(k)
            + math.lgamma(k + self.eta)
            - math.lgamma(1 + self.eta)
            - math.lgamma(k)
        )

    def sample(self, rng: random.Random | None = None) -> int:
        """Inverse-CDF sampling from one uniform draw, walking the pmf by its ratio
        ``P[k+1] / P[k] = (1-gamma) (k+eta) / (k+1)`` in log space (P[1] may underflow)."""
        rng = rng if rng is not None else default_rng()
        if self.gamma == 1:
            return 1
        u = rng.random()
        k, log_p = 1, self.log_pmf(1)
        log_q = math.log1p(-self.gamma)
        while True:
            p = math.exp(log_p)
            if u < p:
                return k
            u -= p
            ratio = log_q + math.log((k + self.eta) / (k + 1))
            # Past the mode the pmf only falls: once it underflows, what is left of u is
            # rounding error (the tail mass is below 1e-300), so stop here.
            if ratio < 0 and p == 0:
                return k
            log_p += ratio
            k += 1

    def to_dict(self) -> dict:
        return {"distribution": "truncated-negative-binomial", "eta": self.eta, "gamma": self.gamma}


@dataclass(frozen=True)
class PoissonTrials(TrialDistribution):
    """``K ~ Poisson(mu)``; K = 0 releases nothing (the selection outputs "no result").

    Attributes:
        mu: the mean number of trials, >= 1 (as dp-accounting requires: below 1 the
            ``log(mu) / (lambda - 1)`` term goes negative and the bound fails; the tests show
            a counterexample at mu = 0.5). Its privacy cost rests on the trial's
            approximate-DP delta at a small epsilon (Theorem 6), so it suits trials that are
            each very private; otherwise prefer a TNB.
    """

    mu: float
    min_trials = 0

    # Poisson(mu) is a sum of Poisson(mu / n): the sampler walks chunks of mean at most this,
    # so e^-chunk never underflows.
    _CHUNK = 500.0

    def __post_init__(self) -> None:
        if not (isinstance(self.mu, int | float) and math.isfinite(self.mu) and self.mu >= 1):
            raise ValueError(
                f"mu must be a finite number >= 1 (Theorem 6's bound fails below), got {self.mu!r}"
            )

    @property
    def mean(self) -> float:
        return float(self.mu)

    def log_pmf(self, k: int) -> float:
        if k < 0:
            return -math.inf
        return -self.mu + k * math.log(self.mu) - math.lgamma(k + 1)

    def sample(self, rng: random.Random | None = None) -> int:
        """Inverse-CDF sampling (one uniform per chunk of mean <= 500)."""
        rng = rng if rng is not None else default_rng()
        chunks = math.ceil(self.mu / self._CHUNK)
        m = self.mu / chunks
        total = 0
        for _ in range(chunks):
            u, k, p = rng.random(), 0, math.exp(-m)
            while u >= p and p > 0:  # p == 0 only far in the tail: u is rounding error there
                u -= p
                k += 1
                p *= m / k
            total += k
        return total

    def to_dict(self) -> dict:
        return {"distribution": "poisson", "mu": self.mu}


def _check_curve(base_curve, orders) -> tuple[np.ndarray, np.ndarray]:
    orders = np.asarray(orders, dtype=float)
    curve = np.asarray(base_curve, dtype=float)
    if orders.ndim != 1 or orders.shape != curve.shape:
        raise ValueError("orders and base_curve must be 1-D and of the same length")
    if not np.all(orders > 1):
        raise ValueError("every RDP order must be > 1")
    if np.any(np.isnan(curve)) or np.any(curve < -1e-9):
        raise ValueError("an RDP curve is >= 0 at every order (inf allowed), never NaN")
    return orders, np.maximum(curve, 0.0)  # a divergence is >= 0: below is rounding


def selection_rdp(
    base_curve: Sequence[float], orders: Sequence[float], distribution: TrialDistribution
) -> np.ndarray:
    """The RDP curve of "run K ~ ``distribution`` trials, release the best".

    Args:
        base_curve: one trial's RDP at ``orders`` (both directions of the neighbouring
            relation; ``inf`` where unbounded). For a random search, ``random_search_rdp``.
        orders: the RDP orders, all > 1 (``RDP_ORDERS`` in the project).
        distribution: the law of K: ``TruncatedNegativeBinomial`` (Theorem 2, with
            ``lambda_hat`` minimised over ``orders`` and ``lambda_hat = 1``, where the
            ``eps(lambda_hat)`` term vanishes) or ``PoissonTrials`` (Theorem 6, with the
            largest allowed ``eps_hat = log(1 + 1/(lambda-1))`` and ``delta_hat`` the trial's
            delta there, converted from its RDP curve by dp-accounting's ``compute_delta``).

    Returns:
        The selection's RDP at ``orders``. Renyi divergence grows with the order, so each
        order also takes the smallest bound of any higher order; a bound below 0 is 0.
    """
    orders, curve = _check_curve(base_curve, orders)
    if isinstance(distribution, TruncatedNegativeBinomial):
        eta, big_l = distribution.eta, -math.log(distribution.gamma)
        with np.errstate(invalid="ignore"):
            candidates = (1 - 1 / orders) * curve + big_l / orders
        # lambda_hat = 1: (1 - 1/lambda_hat) = 0, the trial's order-1 RDP drops out.
        hat = min(big_l, float(np.min(candidates)))
        bound = curve + (1 + eta) * hat + math.log(distribution.mean) / (orders - 1)
    elif isinstance(distribution, PoissonTrials):
        compute_delta = _dp().rdp.rdp_privacy_accountant.compute_delta
        # compute_delta takes log(1 - e^-r), which fails for 0 < r < 1e-16: round such r up.
        lifted = np.where((curve > 0) & (curve < 1e-15), 1e-15, curve)
        bound = np.empty_like(curve)
        for i, order in enumerate(orders):
            # The largest eps_hat Theorem 6 allows: e^eps_hat = 1 + 1/(lambda - 1).
            eps_hat = math.log1p(1 / (order - 1))
            delta_hat, _ = compute_delta(orders, lifted, eps_hat)
            bound[i] = (
                curve[i] + distribution.mu * delta_hat + math.log(distribution.mu) / (order - 1)
            )
    else:
        raise TypeError(f"unknown trial distribution {distribution!r}")
    # Monotonicity in the order: D_a <= D_b for a <= b, so a higher order's bound also holds.
    by_order = np.argsort(orders)
    suffix_min = np.minimum.accumulate(bound[by_order][::-1])[::-1]
    out = np.empty_like(bound)
    out[by_order] = suffix_min
    return np.maximum(out, 0.0)


def trial_rdp(events: Sequence[PrivacyEvent]) -> np.ndarray:
    """One candidate's RDP curve at ``RDP_ORDERS``: its events composed as ``epsilon_rdp``
    composes them (``events.rdp_curve``). ``inf`` everywhere for a release without noise."""
    return rdp_curve(events)


def random_search_rdp(candidates: Sequence[Sequence[PrivacyEvent]]) -> np.ndarray:
    """The RDP curve of one trial that runs one of ``candidates`` (each a sequence of the
    events that candidate's trial releases), chosen independently of the data: the pointwise
    maximum of their curves (quasi-convexity of Renyi divergence over mixtures)."""
    if any(isinstance(c, PrivacyEvent) for c in candidates):
        raise TypeError("candidates is a sequence of event sequences: pass [events] for one")
    candidates = [list(c) for c in candidates]
    if not candidates:
        raise ValueError("a selection needs at least one candidate")
    adjacencies = {e.adjacency for c in candidates for e in c}
    if len(adjacencies) > 1:
        raise ValueError("candidates of different adjacency do not compose into one guarantee")
    return np.max([trial_rdp(c) for c in candidates], axis=0)


def selection_epsilon(
    candidates: Sequence[Sequence[PrivacyEvent]],
    delta: float,
    distribution: TrialDistribution,
) -> float:
    """Epsilon at ``delta`` of the whole selection: K ~ ``distribution`` trials, each running
    one of ``candidates`` (one configuration: ``[events]``), the best one released.

    Args:
        candidates: for each declared candidate, the events one trial of it releases (its
            training and its private score). All of it is what one trial can cost.
        delta: the selection's delta (the RDP-to-DP conversion's, as ``epsilon_rdp``).
        distribution: the law of the number of trials K.
    """
    DELTA.check("delta", delta)
    candidates = [list(c) for c in candidates]
    if candidates and all(not c for c in candidates):
        return 0.0  # trials that read no data: the output does not depend on it
    curve = selection_rdp(random_search_rdp(candidates), RDP_ORDERS, distribution)
    eps, _ = _dp().rdp.rdp_privacy_accountant.compute_epsilon(RDP_ORDERS, curve, delta)
    return float(eps)


def calibrate_selection(
    target_epsilon: float,
    delta: float,
    distribution: TrialDistribution,
    candidates_for: Callable[[float], Sequence[Sequence[PrivacyEvent]]],
    tol: float = 1e-4,
) -> float:
    """The smallest per-trial noise multiplier sigma whose selection meets the budget.

    Args:
        target_epsilon: the whole selection's epsilon budget (every trial, every candidate,
            the random number of trials, the released best).
        delta: the budget's delta.
        distribution: the law of the number of trials K.
        candidates_for: sigma -> each candidate's trial events at noise multiplier sigma
            (e.g. ``lambda s: [[GEP.event(s, q, steps)] for q, steps in grid]``).
        tol: the returned sigma's epsilon is in ``[target - tol, target]`` (or sigma is at
            the search's lower end, 1e-3, and already meets the target).

    Returns:
        sigma, with ``selection_epsilon(candidates_for(sigma), delta, distribution) <=
        target_epsilon``; bisection, since the selection's epsilon falls as sigma grows.

    Raises:
        ImpossibleTargetError: even sigma = 1e4 misses the target. The selection's bound has
            a floor that no noise removes (``log(E[K])`` and ``log(1/gamma)`` terms): raise
            the budget or ask for fewer trials on average.
    """
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon}")
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    DELTA.check("delta", delta)

    def eps(sigma: float) -> float:
        return selection_epsilon(candidates_for(sigma), delta, distribution)

    low, high = MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER
    floor = eps(high)
    if floor > target_epsilon:
        raise ImpossibleTargetError(
            f"a selection of E[K]={distribution.mean:.4g} trials ({distribution.to_dict()}) "
            f"cannot meet epsilon={target_epsilon} at delta={delta}: even sigma={high:g} "
            f"gives epsilon={floor:.4g}. Raise the budget or lower the mean number of trials."
        )
    if eps(low) <= target_epsilon:
        return low
    high_eps = floor
    for _ in range(300):
        if target_epsilon - high_eps <= tol or high - low <= 1e-12 * high:
            break
        # geometric steps while the bracket spans decades, arithmetic once it is narrow
        mid = math.sqrt(low * high) if high > 2 * low else (low + high) / 2
        mid_eps = eps(mid)
        if mid_eps <= target_epsilon:
            high, high_eps = mid, mid_eps
        else:
            low = mid
    return float(high)
