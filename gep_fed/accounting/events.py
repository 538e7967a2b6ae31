"""Privacy accounting with Google's ``dp-accounting``: events, epsilon, calibration.

Every release is a ``PrivacyEvent``: ``steps`` releases of a Gaussian mechanism, each on a
Poisson sample of rate ``sample_rate``. GEP releases two clipped vectors per step and counts as
noise multiplier ``sigma / sqrt(2)``; B-GEP and GP as ``sigma``. Adjacency: add or remove one
example. Epsilon comes from RDP (Mironov et al. 2019) or, tighter, from privacy loss
distributions (PLD); both are the library's, not formulas of ours.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING

import numpy as np

from gep_fed.validation import DELTA, NOISE_MULTIPLIER, PROBABILITY

if TYPE_CHECKING:
    import dp_accounting

# dp-accounting logs a warning for each fractional RDP order whose series does not converge
# and then excludes that order: the result is still a valid bound, so the noise is dropped.
logging.getLogger("absl").addFilter(lambda record: "failed to converge" not in record.getMessage())

# dp-accounting's default orders (1.1 to 10.9 by 0.1, 11 to 63, 128 to 1024; a test pins them
# to its DEFAULT_RDP_ORDERS): a superset of Opacus' RDP orders, with high orders for small
# epsilons after many steps.
RDP_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
)
PLD_DISCRETIZATION = 1e-4


def _dp():
    """dp-accounting, imported at first use: it takes about a second, which the command
    line's help and its errors need not pay."""
    import dp_accounting
    import dp_accounting.pld
    import dp_accounting.rdp

    return dp_accounting


# Distributed releases: the highest order at which Poisson subsampling is applied.
SUBSAMPLED_MAX_ORDER = 256
MIN_NOISE_MULTIPLIER = 1e-3
MAX_NOISE_MULTIPLIER = 1e4

# Who added the noise: the releasing party itself, a server it trusts (central mode), or every
# site a share of discrete noise inside a secure sum (distributed mode).
PLACEMENTS = ("local", "trusted-server", "distributed")
# Neighbouring data sets: one example added or removed (Poisson-subsampled mechanisms), or one
# example replaced by another (single-pass Langevin: privacy amplification by iteration).
ADJACENCIES = ("add-remove", "replace-one")


class ImpossibleTargetError(ValueError):
    """No noise multiplier in the searched range reaches the requested (epsilon, delta)."""


@dataclass(frozen=True)
class PrivacyEvent:
    """``steps`` Poisson-subsampled Gaussian releases with the same parameters.

    Attributes:
        mechanism: "gep", "bgep", "gp" or "langevin" (what was released).
        noise_multiplier: the configured sigma (noise std divided by the clip norm).
        sample_rate: q, each example's independent chance to be in a step's batch
            (1.0 for full-batch or deterministic use).
        steps: how many such releases.
        accounting_noise_multiplier: the sigma of the equivalent sensitivity-1 Gaussian
            mechanism (GEP: sigma / sqrt(2)); this is what enters the accountant. Always
            supplied by the mechanism object (``Mechanism.event``), never looked up by name.
        party: who released (a site id, or "federation" in central mode).
        round: the federated round, if any.
        placement: "local" (the party added the noise itself) or "trusted-server" (central
            mode: the party sent unnoised sums to a server it trusts to add the noise).
        adjacency: "add-remove" (one example added or removed) or "replace-one" (one example
            replaced; single-pass Langevin). Events of different adjacency do not compose.
        discrete_l2_scale, discrete_tau, dimension: a "distributed" release only (a sum of
            discrete Gaussian shares over a secure sum): one example's largest move of the
            quantised vector over the noise std of the sum, rounding included (at least
            ``1 / accounting_noise_multiplier``); the divergence of a sum of discrete
            Gaussians from one; the quantised vector's dimension. Accounted by
            ``distributed_step_rdp``.
        noise_shares, max_colluding_sites: a "distributed" release's assumptions: the sum
            held the noise of at least ``noise_shares`` sites other than the (at most)
            ``max_colluding_sites`` that may collude with the server (the recording site
            unmasks only then). They do not change the figure; they state what it rests on.
    """

    mechanism: str
    noise_multiplier: float
    sample_rate: float
    steps: int = 1
    accounting_noise_multiplier: float | None = None
    party: str = ""
    round: int | None = None
    placement: str = "local"
    adjacency: str = "add-remove"
    discrete_l2_scale: float = 0.0
    discrete_tau: float = 0.0
    dimension: int = 0
    noise_shares: int = 0
    max_colluding_sites: int = 0

    def __post_init__(self) -> None:
        sigma = self.accounting_noise_multiplier
        if sigma is None:
            raise ValueError(
                "a PrivacyEvent needs its accounting_noise_multiplier: build it with the "
                "mechanism's event(...) (e.g. GEP.event(sigma, q)), which knows how many "
                "vectors one step releases"
            )
        NOISE_MULTIPLIER.check("accounting_noise_multiplier", sigma)
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.adjacency not in ADJACENCIES:
            raise ValueError(f"adjacency must be one of {ADJACENCIES}, got {self.adjacency!r}")
        if self.adjacency == "replace-one" and self.sample_rate != 1:
            raise ValueError("replace-one events are accounted without subsampling (q = 1)")
        PROBABILITY.check("sample_rate", self.sample_rate)
        NOISE_MULTIPLIER.check("noise_multiplier", self.noise_multiplier)
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"steps must be an integer >= 1, got {self.steps!r}")
        if self.is_distributed:
            if not (isinstance(self.dimension, int) and self.dimension >= 1):
                raise ValueError(f"a distributed event needs its dimension, got {self.dimension!r}")
            if not (self.discrete_tau >= 0 and math.isfinite(self.discrete_tau)):
                raise ValueError(f"discrete_tau must be finite and >= 0, got {self.discrete_tau}")
            if not (sigma > 0 and self.discrete_l2_scale * sigma >= 1 - 1e-12):
                raise ValueError(
                    "a distributed event's discrete_l2_scale must be at least "
                    f"1 / accounting_noise_multiplier, got {self.discrete_l2_scale}"
                )
            if not (isinstance(self.noise_shares, int) and self.noise_shares >= 1):
                raise ValueError("a distributed event needs its noise_shares >= 1")
        elif self.discrete_l2_scale or self.discrete_tau or self.dimension or self.noise_shares:
            raise ValueError("discrete_l2_scale, discrete_tau, dimension: distributed events only")

    @property
    def is_distributed(self) -> bool:
        return self.placement == "distributed"

    def share_alone(self) -> PrivacyEvent:
        """A distributed release as it would be if this party's own share were seen alone
        (more sites colluding than ``max_colluding_sites``): one discrete Gaussian carrying
        ``1 / noise_shares`` of the noise variance, so every noise multiplier is divided by
        ``sqrt(noise_shares)`` and no sum of shares (``tau = 0``). Other events: unchanged."""
        if not self.is_distributed:
            return self
        root = math.sqrt(self.noise_shares)
        return replace(
            self,
            noise_multiplier=self.noise_multiplier / root,
            accounting_noise_multiplier=self.accounting_noise_multiplier / root,
            discrete_l2_scale=self.discrete_l2_scale * root,
            discrete_tau=0.0,
            noise_shares=1,
        )

    def dp_event(self) -> dp_accounting.DpEvent:
        dp = _dp()
        if self.is_distributed:  # dp-accounting has no event for a subsampled sum of shares
            return dp.UnsupportedDpEvent()
        if self.accounting_noise_multiplier == 0:
            return dp.NonPrivateDpEvent()
        gaussian = dp.GaussianDpEvent(self.accounting_noise_multiplier)
        single = (
            gaussian
            if self.sample_rate == 1
            else dp.PoissonSampledDpEvent(self.sample_rate, gaussian)
        )
        return dp.SelfComposedDpEvent(single, self.steps)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PrivacyEvent:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown privacy event fields: {sorted(unknown)}")
        return cls(**data)


def _merged(events: Iterable[PrivacyEvent]) -> list[tuple]:
    """(accounting sigma, q, discrete l2 scale, tau, dimension, steps), consecutive equal
    releases merged (faster PLD)."""
    events = list(events)
    if len({e.adjacency for e in events}) > 1:
        raise ValueError(
            "cannot compose events of different adjacency (add-remove and replace-one): "
            "their epsilons bound different neighbouring relations"
        )
    merged: list[tuple] = []
    for e in events:
        key = (
            e.accounting_noise_multiplier,
            e.sample_rate,
            e.discrete_l2_scale,
            e.discrete_tau,
            e.dimension,
        )
        if merged and merged[-1][:5] == key:
            merged[-1] = (*key, merged[-1][5] + e.steps)
        else:
            merged.append((*key, e.steps))
    return merged


def _gaussian_event(accounting_sigma: float, q: float, steps: int) -> PrivacyEvent:
    return PrivacyEvent("gaussian", accounting_sigma, q, steps, accounting_sigma)


def compose(events: Iterable[PrivacyEvent]) -> dp_accounting.DpEvent:
    """The dp-accounting event of Gaussian releases (a distributed one has none)."""
    events = list(events)
    if any(e.is_distributed for e in events):
        raise ValueError("distributed releases have no dp-accounting event: use epsilon_rdp")
    parts = [_gaussian_event(sigma, q, steps).dp_event() for sigma, q, *_, steps in _merged(events)]
    return _dp().ComposedDpEvent(parts)


@functools.lru_cache(maxsize=256)
def _step_rdp(accounting_sigma: float, sample_rate: float) -> np.ndarray:
    """dp-accounting's RDP curve (at ``RDP_ORDERS``) of one release, cached: composing
    ``steps`` equal releases multiplies it by ``steps`` (RDP composes additively)."""
    single = _gaussian_event(accounting_sigma, sample_rate, 1).dp_event()
    curve = _dp().rdp.RdpAccountant(RDP_ORDERS).compose(single).rdp
    curve.flags.writeable = False
    return curve


@functools.lru_cache(maxsize=256)
def distributed_step_rdp(l2_scale: float, tau: float, dimension: int, sample_rate: float):
    """The RDP curve (at ``RDP_ORDERS``) of one distributed discrete Gaussian release on a
    Poisson sample of rate q.

    Unsampled, it is the smaller of two zCDP curves (Kairouz, Liu & Steinke 2021, Thm. 1 and
    Prop. 14): ``alpha l^2 / 2 + tau d`` and ``alpha (l + tau sqrt(d))^2 / 2``, each composed
    by dp-accounting's ``ZCDpEvent``. Subsampled, it is the exact binomial expansion of the
    "remove" direction at integer orders (``_poisson_subsampled``), which also bounds the
    "add" direction because the noise is symmetric. Between integer orders, ``(a - 1) RDP(a)``
    is interpolated linearly (it is convex in a); below order 2 it takes order 2's value.
    """

    def unsampled(orders: np.ndarray) -> np.ndarray:
        dp = _dp()
        accountant = functools.partial(dp.rdp.RdpAccountant, list(map(float, orders)))
        plain = accountant().compose(dp.ZCDpEvent(l2_scale**2 / 2, tau * dimension))
        spread = (l2_scale + tau * math.sqrt(dimension)) ** 2 / 2
        return np.minimum(plain.rdp, accountant().compose(dp.ZCDpEvent(spread)).rdp)

    curve = unsampled(np.asarray(RDP_ORDERS))
    if sample_rate < 1:  # amplified up to order 256 (the cost grows with its square)
        integers = np.arange(2, SUBSAMPLED_MAX_ORDER + 1)
        at = dict(zip(integers.tolist(), unsampled(integers), strict=True))
        amplified = np.array([_poisson_subsampled(a, sample_rate, at) for a in at])
        # (a - 1) RDP(a) is convex in a (a log-moment), so between integers it lies below the
        # chord; below 2 the chord from a = 1 (where it is 0) gives RDP(2).
        orders = np.asarray(RDP_ORDERS)
        chord = np.interp(orders, integers, (integers - 1) * amplified)
        sampled = np.where(
            orders <= SUBSAMPLED_MAX_ORDER,
            np.where(orders < 2, amplified[0], chord / np.maximum(orders - 1, 1e-12)),
            math.inf,
        )
        curve = np.minimum(curve, sampled)
    curve.flags.writeable = False
    return curve


def _poisson_subsampled(order: int, q: float, rdp_at: dict) -> float:
    """RDP at integer ``order`` of a symmetric-noise mechanism on a Poisson sample of rate q,
    from its RDP ``rdp_at[l]`` at the integers 2..order:
    ``log(sum_{l=0..a} C(a,l) (1-q)^(a-l) q^l e^((l-1) eps(l))) / (a - 1)``, where the terms
    l = 0, 1 carry E_Q[r^l] = 1 (computed in log space).

    Write Q for the output's law without the example, P with it (always in the sample),
    r = P/Q, M = (1-q)Q + qP. *Remove*: E_Q[(1 - q + q r)^a] expands binomially, and
    E_Q[r^l] = e^((l-1) D_l(P||Q)) <= e^((l-1) eps(l)): the sum above, term by term (Zhu &
    Wang, ICML 2019, Sec. 3, without their Theorem 5's factor 3, which covers any mechanism).
    *Add*: D_a(Q||M) <= D_a(M||Q) when Q and P are mirror images, Q(R x) = P(x) for an
    involution R (noise symmetric about zero, shifted by the example: R x = 2c + v - x). On a
    pair {x, R x} with ratio r at x (so 1/r and weight r Q(x) at R x), the remove minus the add
    moment is ``Q(x) [psi(s) + r psi(-s/r)]`` with ``s = q (r - 1)`` and
    ``psi(u) = (1+u)^a - (1+u)^(1-a)``; it is >= 0: for r > 1 set w = s/r, then
    ``K(r) = psi(r w) + r psi(-w)`` is convex in r (psi'' >= 0 on u >= 0), vanishes at q = 1
    (r = 1/(1-w): the two directions are equal there) and has slope ``y^(1-a) L(y)`` there,
    with y = 1 - w and
    ``L(y) = (a-1) - a y + a y^(2a-1) - (a-1) y^(2a)``, convex on (0, 1] with L(1) = L'(1) = 0;
    r < 1 is the pair seen from R x. Rounding, modular reduction and the mixture over samples
    are post-processing or handled by joint convexity, as for the Gaussian.
    """
    from scipy.special import gammaln, logsumexp

    ls = np.arange(order + 1)
    log_comb = gammaln(order + 1) - gammaln(ls + 1) - gammaln(order - ls + 1)
    eps = np.array([0.0, 0.0] + [rdp_at[int(l_)] for l_ in ls[2:]])
    terms = log_comb + (order - ls) * math.log1p(-q) + ls * math.log(q) + (ls - 1) * eps
    return float(logsumexp(terms)) / (order - 1)


def rdp_curve(events: Sequence[PrivacyEvent]) -> np.ndarray:
    """The RDP curve (at ``RDP_ORDERS``) of the composition of ``events``; ``inf``
    everywhere when a release has no noise."""
    total = np.zeros(len(RDP_ORDERS))
    for sigma, q, scale, tau, dimension, steps in _merged(events):
        if sigma == 0:
            return np.full(len(RDP_ORDERS), math.inf)
        curve = distributed_step_rdp(scale, tau, dimension, q) if dimension else _step_rdp(sigma, q)
        total = total + steps * curve
    return total


def epsilon_rdp(events: Sequence[PrivacyEvent], delta: float) -> float:
    """Epsilon at ``delta`` of the composition of ``events`` by RDP accounting."""
    _check_delta(delta)
    if not events:
        return 0.0
    total = rdp_curve(events)
    if np.isinf(total).all():
        return math.inf
    eps, _ = _dp().rdp.rdp_privacy_accountant.compute_epsilon(RDP_ORDERS, total, delta)
    return float(eps)


def epsilon_pld(events: Sequence[PrivacyEvent], delta: float) -> float:
    """Epsilon at ``delta`` by privacy loss distributions (tighter than RDP); NaN when a
    release is distributed (dp-accounting has no PLD for a sum of discrete Gaussian shares
    over many coordinates: those are accounted by RDP only)."""
    _check_delta(delta)
    if not events:
        return 0.0
    if any(e.is_distributed for e in events):
        return math.nan
    accountant = _dp().pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    return float(accountant.compose(compose(events)).get_epsilon(delta))


def pld_text(epsilon: float, digits: int = 4) -> str:
    """A PLD epsilon as reports print it ("n/a" for distributed releases, which have none)."""
    if math.isnan(epsilon):
        return "n/a (PLD: none for distributed noise; RDP applies)"
    return f"{epsilon:.{digits}f} (PLD)"


def _check_delta(delta: float) -> None:
    DELTA.check("delta", delta)


def _bisect(
    eps: Callable[[float], float],
    target_epsilon: float,
    tol: float,
    event_for: Callable[[float], PrivacyEvent],
) -> float:
    """The smallest sigma (up to ``tol``) with ``eps(sigma) <= target`` by bisection (eps
    decreases with sigma)."""
    low, high = MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER
    if eps(high) > target_epsilon:
        raise ImpossibleTargetError(
            f"epsilon={target_epsilon} is out of reach for {event_for(high).steps} distributed "
            f"steps: even sigma={high:g} gives epsilon={eps(high):.4g}"
        )
    if eps(low) <= target_epsilon:
        return low
    while high - low > tol:
        mid = (low + high) / 2 if high - low < 1 else math.sqrt(low * high)
        if eps(mid) <= target_epsilon:
            high = mid
        else:
            low = mid
    return float(high)


def calibrate(
    target_epsilon: float,
    delta: float,
    event_for: Callable[[float], PrivacyEvent],
    tol: float = 1e-4,
) -> float:
    """The smallest noise multiplier sigma (up to ``tol``) whose RDP epsilon is <= target.

    ``event_for(sigma)`` is everything the run will release at noise multiplier ``sigma``
    (e.g. ``lambda s: GEP.event(s, q, steps)``). Raises ``ImpossibleTargetError`` when even
    sigma = 1e4 does not reach the target (RDP conversion has a floor that grows with steps),
    instead of silently capping.
    """
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon}")
    _check_delta(delta)

    def eps(sigma: float) -> float:
        return epsilon_rdp([event_for(sigma)], delta)

    if event_for(1.0).is_distributed:  # no dp-accounting event: bisect on the RDP epsilon
        return _bisect(eps, target_epsilon, tol, event_for)
    best = eps(MAX_NOISE_MULTIPLIER)
    if best > target_epsilon:
        example = event_for(MAX_NOISE_MULTIPLIER)
        raise ImpossibleTargetError(
            f"epsilon={target_epsilon} at delta={delta} is out of reach for {example.steps} "
            f"steps at sample rate {example.sample_rate}: even sigma={MAX_NOISE_MULTIPLIER:g} "
            f"gives epsilon={best:.4g}. Raise the target epsilon or delta, or take fewer steps."
        )
    if eps(MIN_NOISE_MULTIPLIER) <= target_epsilon:
        return MIN_NOISE_MULTIPLIER
    dp = _dp()
    sigma = dp.calibrate_dp_mechanism(
        lambda: dp.rdp.RdpAccountant(RDP_ORDERS),
        lambda s: event_for(s).dp_event(),
        target_epsilon,
        delta,
        bracket_interval=dp.ExplicitBracketInterval(MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER),
        tol=tol,
    )
    # Brent's root may sit a hair on the wrong side of the target: step up until it meets it.
    while eps(sigma) > target_epsilon:
        sigma += tol
    return float(sigma)
