"""dp-accounting, with the one release it has no event for: a sum of discrete Gaussian shares.

``DistributedDiscreteGaussianDpEvent`` is a ``DpEvent`` like dp-accounting's own, and
``RdpAccountant`` is dp-accounting's RDP accountant that also composes it, alone or inside a
``PoissonSampledDpEvent``. Every other accountant answers it as dp-accounting's accountants
answer any event they do not know: ``supports(event)`` is False and ``compose`` raises
``UnsupportedEventError`` (so does this one under a neighbouring relation other than
add-or-remove-one, which its bound does not cover).

This module imports dp-accounting (about a second): ``events`` imports it at first use.
"""

from __future__ import annotations

import functools
import math

import attr
import numpy as np
from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import rdp_privacy_accountant

# Distributed releases: the highest order at which Poisson subsampling is applied.
SUBSAMPLED_MAX_ORDER = 256


@attr.s(frozen=True, slots=True, auto_attribs=True)
class DistributedDiscreteGaussianDpEvent(dp_event.DpEvent):
    """One release of a vector quantised to ``dimension`` integer coordinates, summed in a
    secure sum with discrete Gaussian noise split into ``noise_shares`` shares (Kairouz, Liu
    & Steinke 2021).

    Attributes:
        noise_multiplier: the sensitivity-1 Gaussian it stands for (the continuous noise it
            approaches without rounding).
        l2_scale: one example's largest move of the quantised vector over the noise std of
            the sum, rounding included (at least ``1 / noise_multiplier``).
        tau: the divergence of a sum of discrete Gaussians from one (0 for one share).
        dimension: the quantised vector's length.
        noise_shares: how many sites' shares the noise of the sum is made of.
    """

    noise_multiplier: float
    l2_scale: float
    tau: float
    dimension: int
    noise_shares: int


class RdpAccountant(rdp_privacy_accountant.RdpAccountant):
    """dp-accounting's RDP accountant, which also composes a
    ``DistributedDiscreteGaussianDpEvent`` (``distributed_rdp``) under add-or-remove-one.

    A Gaussian step (``GaussianDpEvent``, Poisson-sampled or not) is accounted exactly as the
    parent accounts it, its curve read from a cache: calibration composes the same step at
    thousands of candidate sigmas."""

    def __init__(
        self,
        orders: tuple[float, ...],
        neighboring_relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE,
    ) -> None:
        super().__init__(orders, neighboring_relation)
        self._order_key = tuple(float(o) for o in orders)

    def _maybe_compose(self, event: dp_event.DpEvent, count: int, do_compose: bool):
        q, inner = 1.0, event
        if isinstance(event, dp_event.PoissonSampledDpEvent):
            q, inner = event.sampling_probability, event.event
        if isinstance(inner, DistributedDiscreteGaussianDpEvent):
            if self.neighboring_relation is not NeighboringRelation.ADD_OR_REMOVE_ONE:
                return self.CompositionErrorDetails(
                    invalid_event=event,
                    error_message=(
                        "a distributed discrete Gaussian is accounted under ADD_OR_REMOVE_ONE "
                        f"only. Found {self.neighboring_relation}."
                    ),
                )
            if do_compose:
                curve = distributed_rdp(
                    inner.l2_scale, inner.tau, inner.dimension, q, self._order_key
                )
                self._rdp += count * curve
            return None
        if isinstance(inner, dp_event.GaussianDpEvent):
            error = super()._maybe_compose(event, count, False)
            if error is None and do_compose:
                relation = self.neighboring_relation
                self._rdp += count * _gaussian_rdp(event, self._order_key, relation)
            return error
        return super()._maybe_compose(event, count, do_compose)


# 4,096 curves (5 MB): a Langevin run's steps each have their own sigma, and a site checks
# the run's remaining steps every round.
@functools.lru_cache(maxsize=4096)
def _gaussian_rdp(
    event: dp_event.DpEvent, orders: tuple[float, ...], relation: NeighboringRelation
) -> np.ndarray:
    """dp-accounting's RDP curve of one Gaussian step, cached: composing ``count`` equal
    steps multiplies it by ``count`` (RDP composes additively), as the parent does."""
    accountant = rdp_privacy_accountant.RdpAccountant(orders, relation)
    curve = accountant.compose(event).rdp
    curve.flags.writeable = False
    return curve


@functools.lru_cache(maxsize=256)
def distributed_rdp(
    l2_scale: float, tau: float, dimension: int, sample_rate: float, orders: tuple[float, ...]
) -> np.ndarray:
    """The RDP curve (at ``orders``) of one distributed discrete Gaussian release on a
    Poisson sample of rate q.

    Unsampled, it is the smaller of two zCDP curves (Kairouz, Liu & Steinke 2021, Thm. 1 and
    Prop. 14): ``alpha l^2 / 2 + tau d`` and ``alpha (l + tau sqrt(d))^2 / 2``, each composed
    by dp-accounting's ``ZCDpEvent``. Subsampled, it is the exact binomial expansion of the
    "remove" direction at integer orders (``_poisson_subsampled``), which also bounds the
    "add" direction because the noise is symmetric. Between integer orders, ``(a - 1) RDP(a)``
    is interpolated linearly (it is convex in a); below order 2 it takes order 2's value.
    """

    def unsampled(points: np.ndarray) -> np.ndarray:
        accountant = functools.partial(
            rdp_privacy_accountant.RdpAccountant, list(map(float, points))
        )
        plain = accountant().compose(dp_event.ZCDpEvent(l2_scale**2 / 2, tau * dimension))
        spread = (l2_scale + tau * math.sqrt(dimension)) ** 2 / 2
        return np.minimum(plain.rdp, accountant().compose(dp_event.ZCDpEvent(spread)).rdp)

    curve = unsampled(np.asarray(orders))
    if sample_rate < 1:  # amplified up to order 256 (the cost grows with its square)
        integers = np.arange(2, SUBSAMPLED_MAX_ORDER + 1)
        amplified = _poisson_subsampled(sample_rate, unsampled(integers))
        # (a - 1) RDP(a) is convex in a (a log-moment), so between integers it lies below the
        # chord; below 2 the chord from a = 1 (where it is 0) gives RDP(2).
        at = np.asarray(orders)
        chord = np.interp(at, integers, (integers - 1) * amplified)
        sampled = np.where(
            at <= SUBSAMPLED_MAX_ORDER,
            np.where(at < 2, amplified[0], chord / np.maximum(at - 1, 1e-12)),
            math.inf,
        )
        curve = np.minimum(curve, sampled)
    curve.flags.writeable = False
    return curve


def _poisson_subsampled(q: float, rdp: np.ndarray) -> np.ndarray:
    """RDP at the integer orders a = 2, 3, ..., A of a symmetric-noise mechanism on a Poisson
    sample of rate q, from its RDP ``rdp`` at those orders (``rdp[a - 2]`` = eps(a)):
    ``log(sum_{l=0..a} C(a,l) (1-q)^(a-l) q^l e^((l-1) eps(l))) / (a - 1)``, where the terms
    l = 0, 1 carry E_Q[r^l] = 1 (computed in log space, every order at once).

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

    top = len(rdp) + 1
    a = np.arange(2, top + 1)[:, None]  # one row per order
    ls = np.arange(top + 1)[None, :]  # one column per term; l > a is no term of order a
    inside = ls <= a
    rest = np.where(inside, a - ls, 0)
    eps = np.concatenate([[0.0, 0.0], rdp])
    log_comb = gammaln(a + 1) - gammaln(ls + 1) - gammaln(rest + 1)
    terms = log_comb + rest * math.log1p(-q) + ls * math.log(q) + (ls - 1) * eps
    return logsumexp(np.where(inside, terms, -np.inf), axis=1) / (a[:, 0] - 1)
