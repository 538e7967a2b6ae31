"""Privacy accounting with Google's ``dp-accounting``: events, epsilon, calibration.

Every release is a ``PrivacyEvent``: ``steps`` times one dp-accounting event (``release``), with
who released it, where its noise was added, and the neighbouring relation its figure is
against (dp-accounting's ``NeighboringRelation``). A Gaussian step is dp-accounting's
``GaussianDpEvent``, inside a ``PoissonSampledDpEvent`` when it reads a Poisson sample: GEP
releases two clipped vectors per step and counts as noise multiplier ``sigma / sqrt(2)``; B-GEP
and GP as ``sigma``. A distributed step (a sum of discrete Gaussian shares over a secure sum)
is ``accountant.DistributedDiscreteGaussianDpEvent``, which the project's ``RdpAccountant``
composes and dp-accounting's own accountants refuse, as they refuse any event they do not
know. A private selection's release, the best of a random number of runs of ``steps``
releases, is dp-accounting's ``RepeatAndSelectDpEvent`` around them (``Selection``; RDP only).
Epsilon comes from RDP (Mironov et al. 2019) or, tighter, from privacy loss distributions
(PLD); both are the library's, not formulas of ours.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from gep_fed.validation import DELTA, NOISE_MULTIPLIER, PROBABILITY, TARGET_EPSILON

if TYPE_CHECKING:
    import dp_accounting
    from dp_accounting import NeighboringRelation

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


@functools.cache
def _dp():
    """dp-accounting, imported at first use: it takes about a second, which the command
    line's help and its errors need not pay."""
    import dp_accounting
    import dp_accounting.pld
    import dp_accounting.rdp

    return dp_accounting


@functools.cache
def _accountant():
    """``gep_fed.accounting.accountant`` (it imports dp-accounting), at first use."""
    from gep_fed.accounting import accountant

    return accountant


MIN_NOISE_MULTIPLIER = 1e-3
MAX_NOISE_MULTIPLIER = 1e4

# Who added the noise: the releasing party itself, a server it trusts (central mode), or every
# site a share of discrete noise inside a secure sum (distributed mode).
PLACEMENTS = ("local", "trusted-server", "distributed")
# Neighbouring data sets, as the ledger file names them: one example added or removed
# (Poisson-subsampled mechanisms), or one example replaced by another (single-pass Langevin:
# privacy amplification by iteration). In memory, dp-accounting's NeighboringRelation.
ADJACENCIES = {"add-remove": "ADD_OR_REMOVE_ONE", "replace-one": "REPLACE_ONE"}


def neighboring_relation(adjacency: NeighboringRelation | str | None) -> NeighboringRelation:
    """dp-accounting's ``NeighboringRelation`` for ``adjacency``: itself, or its ledger name
    ("add-remove", "replace-one"); None is add-or-remove-one."""
    relation = _dp().NeighboringRelation
    if adjacency is None:
        return relation.ADD_OR_REMOVE_ONE
    if isinstance(adjacency, str) and adjacency in ADJACENCIES:
        return relation[ADJACENCIES[adjacency]]
    members = {relation[name] for name in ADJACENCIES.values()}
    if adjacency not in members:
        raise ValueError(
            f"adjacency must be one of {tuple(ADJACENCIES)} (NeighboringRelation."
            f"{'/'.join(ADJACENCIES.values())}), got {adjacency!r}"
        )
    return adjacency


def adjacency_name(relation: NeighboringRelation) -> str:
    """The ledger file's name of ``relation`` ("add-remove" or "replace-one")."""
    return next(name for name, member in ADJACENCIES.items() if relation.name == member)


def _distributed_part(name: str, otherwise: float) -> property:
    """A ``PrivacyEvent`` property: the distributed step's ``name``, else ``otherwise``."""
    return property(lambda event: getattr(event.step, name) if event.is_distributed else otherwise)


class ImpossibleTargetError(ValueError):
    """No noise multiplier in the searched range reaches the requested (epsilon, delta)."""


@dataclass(frozen=True)
class Selection:
    """A private selection (Papernot & Steinke, ICLR 2022): the event's ``steps`` releases
    are one run, run K times independently with K random and secret, and only the best run's
    output is released. K's law, as dp-accounting's ``RepeatAndSelectDpEvent`` names it:

    Attributes:
        mean: E[K], >= 1.
        shape: ``inf`` for Poisson, otherwise a truncated negative binomial's eta >= 0
            (1: geometric, 0: logarithmic).
        score_noise_multiplier: each run also releases the score it is selected by, once,
            as a Gaussian of this noise multiplier (sensitivity 1, no sampling): a run is
            then its ``steps`` releases and that score, composed (the sites' noised
            held-out counts of ``gep-fed tune --site-validation``). None: the score is
            computed without the private data (the server's own validation data).
    """

    mean: float
    shape: float
    score_noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.mean, int | float) and math.isfinite(self.mean)):
            raise ValueError(f"a selection's mean number of runs must be finite, got {self.mean!r}")
        if self.mean < 1:
            raise ValueError(f"a selection's mean number of runs must be >= 1, got {self.mean}")
        if not (isinstance(self.shape, int | float) and self.shape >= 0):
            raise ValueError(f"a selection's shape must be >= 0 (inf: Poisson), got {self.shape!r}")
        if self.score_noise_multiplier is not None:
            NOISE_MULTIPLIER.check("score_noise_multiplier", self.score_noise_multiplier)

    def run_events(self, run: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
        """One run of the selection: ``run`` (its releases), and its score's release."""
        if self.score_noise_multiplier is None:
            return run
        score = _dp().GaussianDpEvent(self.score_noise_multiplier)
        return _dp().ComposedDpEvent([run, score])

    def to_dict(self) -> dict:
        record = {"mean": self.mean, "shape": "inf" if math.isinf(self.shape) else self.shape}
        if self.score_noise_multiplier is not None:  # only when set: older records unchanged
            record["score_noise_multiplier"] = self.score_noise_multiplier
        return record

    @classmethod
    def from_dict(cls, data: dict) -> Selection:
        keys = {"mean", "shape"}
        if not isinstance(data, dict) or not keys <= set(data) <= keys | {"score_noise_multiplier"}:
            raise ValueError(
                f"a selection record holds its mean and shape (and a score's noise "
                f"multiplier), got {data!r}"
            )
        shape = math.inf if data["shape"] == "inf" else data["shape"]
        return cls(data["mean"], shape, data.get("score_noise_multiplier"))


@dataclass(frozen=True)
class PrivacyEvent:
    """``steps`` releases of one dp-accounting event, and what the figure rests on.

    Build one with a mechanism's ``event(...)`` (e.g. ``GEP.event(sigma, q)``), which knows
    how many vectors a step releases, or ``PrivacyEvent.gaussian``; a distributed release with
    ``as_distributed``.

    Attributes:
        mechanism: "gep", "bgep", "gp" or "langevin" (what was released).
        noise_multiplier: the configured sigma (noise std divided by the clip norm).
        release: one step as dp-accounting describes it: ``GaussianDpEvent`` of the
            equivalent sensitivity-1 Gaussian's noise multiplier (GEP: sigma / sqrt(2)), or a
            distributed release's ``DistributedDiscreteGaussianDpEvent``; inside a
            ``PoissonSampledDpEvent`` of rate q when the step reads a Poisson sample.
        steps: how many such releases.
        adjacency: dp-accounting's ``NeighboringRelation``: ``ADD_OR_REMOVE_ONE`` or
            ``REPLACE_ONE`` (single-pass Langevin; never subsampled). Events of different
            adjacency do not compose. "add-remove" and "replace-one" (the ledger's names) are
            accepted and converted.
        party: who released (a site id, or "federation" in central mode).
        round: the federated round, if any.
        placement: "local" (the party added the noise itself), "trusted-server" (central
            mode: the party sent unnoised sums to a server it trusts to add the noise) or
            "distributed" (a share of discrete noise inside a secure sum: the release is
            distributed, and only then).
        max_colluding_sites: a distributed release's assumption: the sum held the noise of at
            least ``noise_shares`` sites other than the (at most) ``max_colluding_sites`` that
            may collude with the server (the recording site unmasks only then). It does not
            change the figure; it states what the figure rests on.
        selection: the ``steps`` releases are one run of a private selection that releases
            only the best of a random number of runs (``Selection``), accounted as a whole
            by RDP (dp-accounting has no PLD for it); None for releases of their own.

    ``sample_rate``, ``accounting_noise_multiplier``, ``dimension``, ``discrete_l2_scale``,
    ``discrete_tau`` and ``noise_shares`` read the release. The ledger file keeps the flat
    record it always kept (``to_dict``, ``from_dict``).
    """

    mechanism: str
    noise_multiplier: float
    release: dp_accounting.DpEvent
    steps: int = 1
    adjacency: NeighboringRelation | None = None
    party: str = ""
    round: int | None = None
    placement: str = "local"
    max_colluding_sites: int = 0
    selection: Selection | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "adjacency", neighboring_relation(self.adjacency))
        dp, distributed = _dp(), _accountant().DistributedDiscreteGaussianDpEvent
        step = self.release
        if isinstance(step, dp.PoissonSampledDpEvent):
            PROBABILITY.check("sample_rate", step.sampling_probability)
            step = step.event
        if not isinstance(step, (dp.GaussianDpEvent, distributed)):
            raise ValueError(
                "a PrivacyEvent's release is a dp-accounting GaussianDpEvent or a "
                "DistributedDiscreteGaussianDpEvent, Poisson-sampled or not; got "
                f"{self.release!r}. Build events with the mechanism's event(...)"
            )
        NOISE_MULTIPLIER.check("accounting_noise_multiplier", step.noise_multiplier)
        NOISE_MULTIPLIER.check("noise_multiplier", self.noise_multiplier)
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if (self.placement == "distributed") != isinstance(step, distributed):
            raise ValueError("a distributed release is placed 'distributed', and only it")
        if self.adjacency is not self.adjacency.ADD_OR_REMOVE_ONE and self.sample_rate != 1:
            raise ValueError("replace-one events are accounted without subsampling (q = 1)")
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"steps must be an integer >= 1, got {self.steps!r}")
        if self.is_distributed:
            if not (isinstance(step.dimension, int) and step.dimension >= 1):
                raise ValueError(f"a distributed event needs its dimension, got {step.dimension!r}")
            if not (step.tau >= 0 and math.isfinite(step.tau)):
                raise ValueError(f"discrete_tau must be finite and >= 0, got {step.tau}")
            sigma = step.noise_multiplier
            if not (sigma > 0 and step.l2_scale * sigma >= 1 - 1e-12):
                raise ValueError(
                    "a distributed event's discrete_l2_scale must be at least "
                    f"1 / accounting_noise_multiplier, got {step.l2_scale}"
                )
            if not (isinstance(step.noise_shares, int) and step.noise_shares >= 1):
                raise ValueError("a distributed event needs its noise_shares >= 1")
        if self.selection is not None:
            if not isinstance(self.selection, Selection):
                raise ValueError(f"selection must be a Selection, got {self.selection!r}")
            if self.is_distributed or self.adjacency is not self.adjacency.ADD_OR_REMOVE_ONE:
                raise ValueError("a selection is of add-remove Gaussian releases only")

    @classmethod
    def gaussian(
        cls,
        mechanism: str,
        noise_multiplier: float,
        sample_rate: float,
        steps: int = 1,
        accounting_noise_multiplier: float | None = None,
        *,
        adjacency: NeighboringRelation | str | None = None,
        party: str = "",
        round: int | None = None,
        placement: str = "local",
    ) -> PrivacyEvent:
        """``steps`` Gaussian releases of noise multiplier ``accounting_noise_multiplier``
        (the equivalent sensitivity-1 Gaussian's), each on a Poisson sample of rate
        ``sample_rate`` (1: the whole data, no sampling)."""
        if accounting_noise_multiplier is None:
            raise ValueError(
                "a PrivacyEvent needs its accounting_noise_multiplier: build it with the "
                "mechanism's event(...) (e.g. GEP.event(sigma, q)), which knows how many "
                "vectors one step releases"
            )
        NOISE_MULTIPLIER.check("accounting_noise_multiplier", accounting_noise_multiplier)
        release = _sampled(sample_rate, _dp().GaussianDpEvent(accounting_noise_multiplier))
        return cls(mechanism, noise_multiplier, release, steps, adjacency, party, round, placement)

    def as_distributed(
        self, l2_scale: float, tau: float, dimension: int, noise_shares: int
    ) -> PrivacyEvent:
        """This Gaussian release as a distributed one: discrete Gaussian shares of
        ``noise_shares`` sites summed over a quantised vector of ``dimension`` coordinates
        (``DistributedDiscreteGaussianDpEvent``: one example's largest move over the noise std
        of the sum, rounding included, ``l2_scale``; the divergence from one discrete
        Gaussian, ``tau``)."""
        step = _accountant().DistributedDiscreteGaussianDpEvent(
            self.accounting_noise_multiplier, l2_scale, tau, dimension, noise_shares
        )
        return replace(self, release=_sampled(self.sample_rate, step), placement="distributed")

    @property
    def step(self) -> dp_accounting.DpEvent:
        """The release without its sampling: the Gaussian or the distributed sum."""
        return getattr(self.release, "event", self.release)

    @property
    def sample_rate(self) -> float:
        """q, each example's independent chance to be in a step's batch (1.0: no sampling)."""
        return getattr(self.release, "sampling_probability", 1.0)

    @property
    def accounting_noise_multiplier(self) -> float:
        """The sigma of the equivalent sensitivity-1 Gaussian mechanism (GEP: sigma /
        sqrt(2)): what enters the accountant."""
        return self.step.noise_multiplier

    @property
    def is_distributed(self) -> bool:
        return self.placement == "distributed"

    # A distributed release's parts (0 for any other): its DistributedDiscreteGaussianDpEvent's.
    discrete_l2_scale = _distributed_part("l2_scale", 0.0)
    discrete_tau = _distributed_part("tau", 0.0)
    dimension = _distributed_part("dimension", 0)
    noise_shares = _distributed_part("noise_shares", 0)

    def share_alone(self) -> PrivacyEvent:
        """A distributed release as it would be if this party's own share were seen alone
        (more sites colluding than ``max_colluding_sites``): one discrete Gaussian carrying
        ``1 / noise_shares`` of the noise variance, so every noise multiplier is divided by
        ``sqrt(noise_shares)`` and no sum of shares (``tau = 0``). Other events: unchanged."""
        if not self.is_distributed:
            return self
        root = math.sqrt(self.noise_shares)
        step = self.step
        alone = type(step)(
            step.noise_multiplier / root, step.l2_scale * root, 0.0, step.dimension, 1
        )
        return replace(
            self,
            noise_multiplier=self.noise_multiplier / root,
            release=_sampled(self.sample_rate, alone),
        )

    def dp_event(self) -> dp_accounting.DpEvent:
        """The dp-accounting event of all ``steps`` releases (``NonPrivateDpEvent`` without
        noise), inside a ``RepeatAndSelectDpEvent`` for a selection. A distributed one is
        composed by ``accountant.RdpAccountant`` only."""
        return _composed(self.release, self.steps, self.selection)

    def to_dict(self) -> dict:
        """The ledger file's flat record (its format since the first ledger)."""
        return {
            "mechanism": self.mechanism,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
            "accounting_noise_multiplier": self.accounting_noise_multiplier,
            "party": self.party,
            "round": self.round,
            "placement": self.placement,
            "adjacency": adjacency_name(self.adjacency),
            "discrete_l2_scale": self.discrete_l2_scale,
            "discrete_tau": self.discrete_tau,
            "dimension": self.dimension,
            "noise_shares": self.noise_shares,
            "max_colluding_sites": self.max_colluding_sites,
            # only where set: every other record (and its ledger's HMAC) reads as before
            **({} if self.selection is None else {"selection": self.selection.to_dict()}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> PrivacyEvent:
        """An event from the ledger file's flat record (``to_dict``)."""
        unknown = set(data) - set(_RECORD_DEFAULTS) - set(_RECORD_REQUIRED)
        if unknown:
            raise ValueError(f"unknown privacy event fields: {sorted(unknown)}")
        record = {**_RECORD_DEFAULTS, **data}
        placement, distributed = record["placement"], record["placement"] == "distributed"
        event = cls.gaussian(
            record["mechanism"],
            record["noise_multiplier"],
            record["sample_rate"],
            record["steps"],
            record["accounting_noise_multiplier"],
            adjacency=record["adjacency"],
            party=record["party"],
            round=record["round"],
            placement="local" if distributed else placement,
        )
        shares = (record["discrete_l2_scale"], record["discrete_tau"], record["dimension"])
        if distributed:
            event = event.as_distributed(*shares, record["noise_shares"])
        elif any(shares) or record["noise_shares"]:
            raise ValueError(
                "discrete_l2_scale, discrete_tau, dimension, noise_shares: distributed events only"
            )
        selection = record["selection"]
        return replace(
            event,
            max_colluding_sites=record["max_colluding_sites"],
            selection=None if selection is None else Selection.from_dict(selection),
        )


# The flat record's fields: those it always holds, the others with their defaults.
_RECORD_REQUIRED = ("mechanism", "noise_multiplier", "sample_rate")
_RECORD_DEFAULTS = {
    "steps": 1,
    "accounting_noise_multiplier": None,
    "party": "",
    "round": None,
    "placement": "local",
    "adjacency": "add-remove",
    "discrete_l2_scale": 0.0,
    "discrete_tau": 0.0,
    "dimension": 0,
    "noise_shares": 0,
    "max_colluding_sites": 0,
    "selection": None,
}


def _sampled(sample_rate: float, step: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    PROBABILITY.check("sample_rate", sample_rate)
    return step if sample_rate == 1 else _dp().PoissonSampledDpEvent(sample_rate, step)


def _composed(
    release: dp_accounting.DpEvent, steps: int, selection: Selection | None = None
) -> dp_accounting.DpEvent:
    dp = _dp()
    if getattr(release, "event", release).noise_multiplier == 0:
        return dp.NonPrivateDpEvent()
    run = dp.SelfComposedDpEvent(release, steps)
    if selection is None:
        return run
    return dp.dp_event.RepeatAndSelectDpEvent(
        selection.run_events(run), selection.mean, selection.shape
    )


def _relation(events: Sequence[PrivacyEvent]) -> NeighboringRelation:
    """The one neighbouring relation of ``events`` (add-or-remove-one for none)."""
    relations = {e.adjacency for e in events}
    if len(relations) > 1:
        raise ValueError(
            "cannot compose events of different adjacency (add-remove and replace-one): "
            "their epsilons bound different neighbouring relations"
        )
    return relations.pop() if relations else neighboring_relation(None)


def _merged(events: Iterable[PrivacyEvent]) -> list[tuple]:
    """(one step's release, steps, selection), consecutive equal releases merged (faster
    PLD); never a selection, whose steps are one run of its own."""
    merged: list[tuple] = []
    for e in events:
        if merged and merged[-1][0] == e.release and e.selection is None and merged[-1][2] is None:
            merged[-1] = (e.release, merged[-1][1] + e.steps, None)
        else:
            merged.append((e.release, e.steps, e.selection))
    return merged


def compose(events: Iterable[PrivacyEvent]) -> dp_accounting.DpEvent:
    """The dp-accounting event of ``events`` (all of one adjacency), consecutive equal
    releases merged. A distributed release's part is composed by ``rdp_accountant`` only:
    dp-accounting's own accountants do not support it."""
    events = list(events)
    _relation(events)
    return _dp().ComposedDpEvent([_composed(*part) for part in _merged(events)])


def rdp_accountant(adjacency: NeighboringRelation | str | None = None):
    """The project's RDP accountant (``accountant.RdpAccountant``) at ``RDP_ORDERS``:
    dp-accounting's, which also composes distributed releases."""
    return _accountant().RdpAccountant(RDP_ORDERS, neighboring_relation(adjacency))


def distributed_step_rdp(l2_scale: float, tau: float, dimension: int, sample_rate: float):
    """The RDP curve (at ``RDP_ORDERS``) of one distributed discrete Gaussian release on a
    Poisson sample of rate q (``accountant.distributed_rdp``)."""
    return _accountant().distributed_rdp(l2_scale, tau, dimension, sample_rate, RDP_ORDERS)


def rdp_curve(events: Sequence[PrivacyEvent]) -> np.ndarray:
    """The RDP curve (at ``RDP_ORDERS``) of the composition of ``events`` by the project's
    accountant; ``inf`` everywhere when a release has no noise."""
    return rdp_accountant(_relation(events)).compose(compose(events)).rdp


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
    """Epsilon at ``delta`` by privacy loss distributions (tighter than RDP); NaN when
    dp-accounting's PLD accountant does not support a release: a distributed one (it has no
    PLD for a sum of discrete Gaussian shares over many coordinates) or a selection (no PLD
    for the best of a random number of runs): those are accounted by RDP only.

    The accountant is add-or-remove-one's whatever the events' relation: a replace-one
    event's Gaussian is of sensitivity 1 between replace-one neighbours (as the RDP
    accountant reads it under either relation), i.e. the add-or-remove PLD of a shift of 1;
    dp-accounting's PLD under ``REPLACE_ONE`` would shift by 2."""
    _check_delta(delta)
    if not events:
        return 0.0
    _relation(events)
    return _pld_epsilon(tuple(_merged(events)), delta)


# Pure in its arguments, and asked the same question often (every site's ledger after every
# round holds the same composition; a tuning re-reads them): seconds each at many steps.
@functools.lru_cache(maxsize=256)
def _pld_epsilon(merged: tuple[tuple, ...], delta: float) -> float:
    event = _dp().ComposedDpEvent([_composed(*part) for part in merged])
    accountant = _dp().pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    if not accountant.supports(event):
        return math.nan
    return float(accountant.compose(event).get_epsilon(delta))


def pld_text(epsilon: float, digits: int = 4) -> str:
    """A PLD epsilon as reports print it ("n/a" for distributed releases and selections,
    which have none)."""
    if math.isnan(epsilon):
        return "n/a (PLD: none for distributed noise or a selection; RDP applies)"
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
    TARGET_EPSILON.check("target_epsilon", target_epsilon)
    _check_delta(delta)

    def eps(sigma: float) -> float:
        return epsilon_rdp([event_for(sigma)], delta)

    if event_for(1.0).is_distributed:  # the figure's root by bisection (see below)
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
    # Gaussian releases: dp-accounting's calibration (Brent's method) with the project's
    # accountant; distributed ones keep the bisection above, on the same accountant's epsilon
    # (their curve is a minimum of two and interpolated between orders).
    dp, relation = _dp(), event_for(1.0).adjacency
    sigma = dp.calibrate_dp_mechanism(
        lambda: rdp_accountant(relation),
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
