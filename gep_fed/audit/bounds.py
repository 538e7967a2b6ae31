"""The audit's statistics: lower bounds on epsilon and on mu from the auditor's guesses about
the canaries and from their scores (Steinke et al.'s Theorem 3, the f-DP analysis for the
Gaussian curve, the Gaussian fit), and the mu a run claims. See ``gep_fed.audit``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np

METHOD = (
    "one-run audit, white box: Steinke, Nasr & Jagielski 2023 (Theorem 3); f-DP of "
    "Mahloujifar, Melis & Chaudhuri 2024; Gaussian fit of the scores (noncentral t)"
)
# Guess counts tried, as fractions of the canaries (each guessing in and out).
GUESS_FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Probability that an (epsilon, delta)-DP mechanism lets at least ``v`` of ``r`` guesses
    about ``m`` canaries be right (Theorem 3 of Steinke et al.): a binomial tail at the
    accuracy of epsilon-DP randomised response, plus delta's share."""
    if not (0 <= v <= r <= m):
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    if v == 0:
        return 1.0
    from scipy import stats  # here, not at import: `gep-fed` starts without SciPy's stats

    accuracy = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(v - 1, r, accuracy))
    i = np.arange(1, v + 1)
    window = np.cumsum(stats.binom.pmf(v - i, r, accuracy)) / i
    return min(1.0, tail + 2 * m * delta * float(window.max()))


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """The largest epsilon that ``v`` right guesses out of ``r`` reject at ``confidence``
    (0 when even epsilon = 0 is not rejected)."""
    alpha = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < alpha:
        lo, hi = hi, 2 * hi
    for _ in range(40):
        mid = (lo + hi) / 2
        if p_value(m, r, v, mid, delta) < alpha:
            lo = mid
        else:
            hi = mid
    return lo


def gdp_consistent(m: int, r: int, v: int, mu: float, alpha: float = 0.05) -> bool:
    """Whether ``v`` right guesses out of ``r`` about ``m`` canaries are consistent, at level
    ``alpha``, with a mechanism that is mu-GDP for each canary (the f-DP one-run analysis of
    Mahloujifar, Melis & Chaudhuri 2024, for the Gaussian trade-off curve
    ``G_mu(x) = Phi(Phi^-1(1 - x) - mu)``): a recursion over the number of right guesses
    bounds the probability of the observed outcome by the curve itself, rather than by
    epsilon-DP randomised response as in Theorem 3 of Steinke et al."""
    if not (0 < r <= m and 0 <= v <= r):
        raise ValueError(f"need 0 <= v <= r <= m and r > 0, got v={v}, r={r}, m={m}")
    scaled = alpha * r / m
    right, wrong = scaled * v / r, scaled * (r - v) / r
    normal = NormalDist()  # per-scalar calls: ~50x faster than scipy's
    for i in range(v - 1, -1, -1):
        quantile = normal.inv_cdf(min(max(right, 1e-300), 1 - 1e-16))
        bound = max(wrong, normal.cdf(quantile - mu))
        right += i / (r - i) * (bound - wrong)
        wrong = bound
    return right + wrong <= r / m


def gdp_mu_lower_bound(m: int, r: int, v: int, confidence: float = 0.95) -> float:
    """The largest mu such that no mechanism that is mu-GDP per canary explains ``v`` right
    guesses out of ``r`` at ``confidence`` (0 when mu = 0 explains them)."""
    alpha = 1.0 - confidence
    if gdp_consistent(m, r, v, 0.0, alpha):
        return 0.0
    lo, hi = 0.0, 1.0
    while not gdp_consistent(m, r, v, hi, alpha):
        lo, hi = hi, 2 * hi
        if hi > 64:  # every right: nothing short of no privacy explains it
            return math.inf
    for _ in range(40):
        mid = (lo + hi) / 2
        if gdp_consistent(m, r, v, mid, alpha):
            hi = mid
        else:
            lo = mid
    return lo


def gdp_epsilon(mu: float, delta: float) -> float:
    """Epsilon at ``delta`` of a mu-GDP mechanism (Dong, Roth & Su 2022, Corollary 2.13)."""
    if mu <= 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    from scipy import stats

    def delta_at(eps: float) -> float:
        return float(
            stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
        )

    lo, hi = 0.0, 1.0
    while delta_at(hi) > delta:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if delta_at(mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass(frozen=True)
class Guesses:
    """The auditor's best guesses: ``correct`` of ``guesses`` right (the rest abstained)."""

    guesses: int
    correct: int
    epsilon_lower_bound: float
    gdp_mu_lower_bound: float = 0.0
    fitted_mu_lower_bound: float = math.nan


def fitted_mu_lower_bound(
    scores: np.ndarray, included: np.ndarray, confidence: float = 0.95
) -> float:
    """Lower confidence bound on the standardised shift ``mu = (mean_in - mean_out) / sd`` of
    the canaries' scores, *assuming* they are Gaussian with one variance whether a canary is
    included or not (exact for Gaussian mechanisms without subsampling, where the score of a
    canary is ``N(mu, 1)`` if included and ``N(0, 1)`` if not, interference aside).

    The observed t statistic is noncentral-t with noncentrality ``mu sqrt(n1 n0 / n)``; the
    bound is the smallest ``mu`` not rejected at ``confidence``. Because it measures the
    spread of the scores rather than trusting the claimed noise std, a mechanism adding less
    noise than it accounts shows a larger ``mu``. A parametric estimate: it can catch a leak
    the distribution-free analyses cannot, but it is only as sound as its assumption."""
    from scipy import optimize, stats

    n1, n0 = int(included.sum()), int((~included).sum())
    if n1 < 2 or n0 < 2:
        return 0.0
    x1, x0 = scores[included], scores[~included]
    pooled = ((n1 - 1) * x1.var(ddof=1) + (n0 - 1) * x0.var(ddof=1)) / (n1 + n0 - 2)
    scale = math.sqrt(n1 * n0 / (n1 + n0))
    t = (x1.mean() - x0.mean()) / math.sqrt(max(pooled, 1e-300)) * scale
    df, alpha = n1 + n0 - 2, 1.0 - confidence

    def excess(nc: float) -> float:  # P(T >= t | nc) - alpha, increasing in nc
        return float(stats.nct.sf(t, df, nc)) - alpha

    if excess(0.0) >= 0:
        return 0.0
    hi = max(1.0, 2 * t)
    while excess(hi) < 0:
        hi *= 2
    return optimize.brentq(excess, 0.0, hi, xtol=1e-6) / scale


def best_guesses(
    scores: np.ndarray,
    included: np.ndarray,
    delta: float,
    confidence: float = 0.95,
    fractions: Sequence[float] = GUESS_FRACTIONS,
) -> Guesses:
    """Guess "in" for the top and "out" for the bottom ``k`` scores, for each ``k`` of the
    fixed grid; the grid's best bounds (Steinke et al.'s epsilon and the f-DP mu, each
    maximised on its own) hold at ``confidence`` after a Bonferroni correction."""
    m = len(scores)
    order = np.argsort(-scores, kind="stable")
    level = 1.0 - (1.0 - confidence) / len(fractions)
    best, best_mu = Guesses(0, 0, 0.0), 0.0
    for fraction in fractions:
        k = max(1, int(fraction * m))
        if 2 * k > m:
            continue
        correct = int(included[order[:k]].sum() + (~included[order[m - k :]]).sum())
        bound = epsilon_lower_bound(m, 2 * k, correct, delta, level)
        best_mu = max(best_mu, gdp_mu_lower_bound(m, 2 * k, correct, level))
        if bound > best.epsilon_lower_bound or best.guesses == 0:
            best = Guesses(2 * k, correct, bound)
    return replace(best, gdp_mu_lower_bound=best_mu)


def claimed_gdp_mu(events) -> float:
    """The GDP parameter mu of releases without subsampling (q = 1): Gaussian mechanisms
    compose exactly as ``mu = sqrt(sum_t 1 / sigma_t^2)``. NaN when any release is
    subsampled: a subsampled Gaussian is not exactly GDP, so the f-DP analysis does not apply.
    A distributed release claims its sensitivity after rounding over the noise std
    (``discrete_l2_scale``), when its discrete noise is a single discrete Gaussian's to the
    last digit (``discrete_tau`` 0; else NaN)."""
    if not events or any(e.sample_rate != 1 for e in events):
        return math.nan
    if any(e.is_distributed and e.discrete_tau > 0 for e in events):
        return math.nan
    return math.sqrt(
        sum(
            e.steps
            * (e.discrete_l2_scale**2 if e.is_distributed else e.accounting_noise_multiplier**-2)
            for e in events
        )
    )
