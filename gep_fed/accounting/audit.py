"""One-run privacy audit: an empirical *lower* bound on epsilon from a single training run.

Method (Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS
2023), white box:

1. ``m`` canaries are made; each is included in the private data with probability 1/2, by a
   secret coin. An included canary is an example like any other: at every step it joins the
   Poisson sample with probability q. A canary is injected as a per-example *gradient* (a
   random direction, at twice the clip norm so clipping acts on it), so no model has to
   memorise anything.
2. The auditor sees every noisy release. A canary's score accumulates its inner product with
   each release, each component divided by its noise standard deviation, as the log
   likelihood ratio of "included" against "excluded" under Poisson sampling.
3. The auditor guesses "included" for the highest scores and "excluded" for the lowest, and
   abstains on the rest. Theorem 3 of the paper bounds how many of ``r`` guesses an
   (epsilon, delta)-DP mechanism lets be right; observing more right guesses than that
   rejects (epsilon, delta) at the chosen confidence. The audited epsilon is the largest
   epsilon rejected.

What it proves: the run is *not* (epsilon_lb, delta)-DP with 95 % confidence, so a claimed
epsilon below epsilon_lb is wrong (the implementation leaks more than it accounts). What it
does not prove: that the run *is* private at the claimed epsilon. The bound is loose: for
Gaussian mechanisms it reaches about 40 % of the true epsilon at a few thousand canaries, and
subsampling loosens it further, so it catches gross errors (noise missing, clipping off, a
sampling scheme far from the one accounted) rather than small ones.

Assumptions: canaries are independent of the rest of the data and of the randomness of the
mechanism; the guesses are a function of the releases and the canaries only; the grid of
guess counts is fixed in advance (a Bonferroni correction covers choosing its best entry).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
from scipy import stats

from gep_fed.mechanisms.mechanism import GP, ClippedSums, Mechanism
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.mechanisms.subspace import AnchorSubspace

METHOD = "one-run audit, white box (Steinke, Nasr & Jagielski 2023, Theorem 3)"
# Canaries that cover what each mechanism releases.
CANARY_KINDS = {
    "gep": ("embedding", "residual", "both"),  # S1 and its noise, S2 and its, both at once
    "bgep": ("embedding",),
    "gp": ("gradient",),
}
# Guess counts tried, as fractions of the canaries (each guessing in and out).
GUESS_FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
CANARY_NORM_FACTOR = 2.0


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Probability that an (epsilon, delta)-DP mechanism lets at least ``v`` of ``r`` guesses
    about ``m`` canaries be right (Theorem 3 of Steinke et al.): a binomial tail at the
    accuracy of epsilon-DP randomised response, plus delta's share."""
    if not (0 <= v <= r <= m):
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    if v == 0:
        return 1.0
    accuracy = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(v - 1, r, accuracy))
    i = np.arange(1, v + 1)
    window = np.cumsum(stats.binom.pmf(v - i, r, accuracy)) / i
    return min(1.0, tail + 2 * m * delta * float(window.max()))


def epsilon_lower_bound(
    m: int, r: int, v: int, delta: float, confidence: float = 0.95
) -> float:
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


@dataclass(frozen=True)
class Guesses:
    """The auditor's best guesses: ``correct`` of ``guesses`` right (the rest abstained)."""

    guesses: int
    correct: int
    epsilon_lower_bound: float


def best_guesses(
    scores: np.ndarray,
    included: np.ndarray,
    delta: float,
    confidence: float = 0.95,
    fractions: Sequence[float] = GUESS_FRACTIONS,
) -> Guesses:
    """Guess "in" for the top and "out" for the bottom ``k`` scores, for each ``k`` of the
    fixed grid; the grid's best bound holds at ``confidence`` after a Bonferroni correction."""
    m = len(scores)
    order = np.argsort(-scores, kind="stable")
    level = 1.0 - (1.0 - confidence) / len(fractions)
    best = Guesses(0, 0, 0.0)
    for fraction in fractions:
        k = max(1, int(fraction * m))
        if 2 * k > m:
            continue
        correct = int(included[order[:k]].sum() + (~included[order[m - k :]]).sum())
        bound = epsilon_lower_bound(m, 2 * k, correct, delta, level)
        if bound > best.epsilon_lower_bound or best.guesses == 0:
            best = Guesses(2 * k, correct, bound)
    return best


class GradientCanaries:
    """``m`` canary gradients for ``mechanism``, their secret inclusion, and their scores.

    Args:
        count: m, the number of canaries (half of them, in expectation, are included).
        size: p, the number of parameters (a canary is a ``(p,)`` gradient).
        mechanism: the mechanism whose clip norms the canaries exceed (x2), and whose noise
            the scores are divided by.
        kinds: canary kinds (``CANARY_KINDS``), assigned in turn; default: all the
            mechanism releases.
        generator: seeds the canaries, their inclusion and their sampling (an audit is an
            experiment: fixed seeds make it repeatable).
    """

    def __init__(
        self,
        count: int,
        size: int,
        mechanism: Mechanism,
        kinds: Sequence[str] | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        kinds = tuple(kinds or CANARY_KINDS[mechanism.name])
        unknown = set(kinds) - set(CANARY_KINDS[mechanism.name])
        if unknown or count < 2:
            raise ValueError(
                f"{mechanism.name} audits need >= 2 canaries of kinds "
                f"{CANARY_KINDS[mechanism.name]}, got {count} of {kinds}"
            )
        self.mechanism = mechanism
        self.generator = generator or torch.Generator().manual_seed(0)
        self.kind = np.array([kinds[i % len(kinds)] for i in range(count)])
        self.included = (torch.rand(count, generator=self.generator) < 0.5).numpy()
        self.directions = _unit(torch.randn(count, size, generator=self.generator))
        self.scores = np.zeros(count)
        self.steps = 0
        self._sampler = PoissonSampler(int(self.included.sum()), 1.0, 1, self.generator)
        self._members = torch.from_numpy(np.flatnonzero(self.included))
        self._coords: torch.Tensor | None = None  # unit embedding coordinates (m, k), fixed
        self._embedding: torch.Tensor | None = None  # this step's, zero for residual canaries
        self._residual: torch.Tensor | None = None  # this step's unit residuals (m, p)

    @property
    def count(self) -> int:
        return len(self.kind)

    def _prepare(self, subspace: AnchorSubspace | None) -> None:
        """Each canary's unit embedding and residual directions for this step's subspace."""
        if subspace is None:
            self._embedding, self._residual = None, self.directions
            return
        if self._coords is None or self._coords.shape[1] != subspace.num_basis:
            noise = torch.randn(self.count, subspace.num_basis, generator=self.generator)
            self._coords = _unit(noise)
        coords = self._coords.to(subspace.device)
        directions = self.directions.to(subspace.device)
        residual = _unit(directions - subspace.lift(subspace.embed(directions)))
        uses_embedding = torch.from_numpy(np.isin(self.kind, ("embedding", "both")))
        uses_residual = torch.from_numpy(np.isin(self.kind, ("residual", "both")))
        self._embedding = coords * uses_embedding[:, None].to(coords)
        self._residual = residual * uses_residual[:, None].to(residual)

    def sample_rows(self, subspace: AnchorSubspace | None, sample_rate: float) -> torch.Tensor:
        """The gradients of the included canaries that this step's Poisson sample (rate q,
        as for every example) takes, at twice their clip norms."""
        self._prepare(subspace)
        self._sampler.sample_rate = sample_rate
        members = self._members[self._sampler.sample()]
        norms = _clip_norms(self.mechanism)
        rows = self._residual[members] * (CANARY_NORM_FACTOR * norms[1])
        if self._embedding is not None:
            rows = rows + subspace.lift(self._embedding[members]) * (
                CANARY_NORM_FACTOR * norms[0]
            )
        return rows

    def observe(self, release: ClippedSums, noise_multiplier: float, sample_rate: float) -> None:
        """Add one noisy release to every canary's score (white box).

        The step's statistic ``z`` is the release's inner product with the canary, each
        component divided by its noise std: ``N(c / sigma, c)`` if the canary was sampled
        (``c`` components at their clip norms), else ``N(0, c)`` (interference aside). The
        score adds the log likelihood ratio of "included" (sampled with probability q) to
        "excluded": ``log(1 - q + q exp(z / sigma - c / (2 sigma^2)))``, the most powerful
        test of inclusion under Poisson sampling.
        """
        std_e, std_r = self.mechanism.noise_stds(noise_multiplier)
        z = torch.zeros(self.count, dtype=torch.float64)
        if release.embedding is not None and self._embedding is not None:
            z += (self._embedding.double() @ release.embedding.double().cpu()) / std_e
        if release.residual is not None:
            z += (self._residual.double() @ release.residual.double().cpu()) / std_r
        components = torch.from_numpy(np.where(self.kind == "both", 2.0, 1.0))
        log_ratio = z / noise_multiplier - components / (2 * noise_multiplier**2)
        q = sample_rate
        if q < 1:
            step = torch.logaddexp(torch.full_like(z, math.log1p(-q)), math.log(q) + log_ratio)
        else:
            step = log_ratio
        self.scores += step.numpy()
        self.steps += 1

    def guesses(self, delta: float, confidence: float = 0.95) -> Guesses:
        return best_guesses(self.scores, self.included, delta, confidence)


def _unit(rows: torch.Tensor) -> torch.Tensor:
    return rows / torch.linalg.vector_norm(rows, dim=1, keepdim=True).clamp_min(1e-30)


def _clip_norms(mechanism: Mechanism) -> tuple[float, float]:
    """(embedding, residual-or-gradient) clip norms."""
    if mechanism.name == "gp":
        return 0.0, mechanism.clip_norm
    if mechanism.name == "bgep":
        return mechanism.clip_embedding, 0.0
    return mechanism.clip_embedding, mechanism.clip_residual


@dataclass(frozen=True)
class AuditResult:
    """What an audit claims and finds (the JSON written to the run directory)."""

    mechanism: str
    mode: str
    placement: str
    claimed_epsilon_rdp: float
    claimed_epsilon_pld: float
    delta: float
    epsilon_lower_bound: float
    confidence: float
    canaries: int
    canary_kinds: tuple[str, ...]
    included: int
    guesses: int
    correct: int
    steps: int
    sample_rate: float
    noise_multiplier: float
    method: str = METHOD

    def to_dict(self) -> dict:
        return asdict(self)


AUDIT_MODES = ("single", "central", "client")


@dataclass(frozen=True)
class AuditSetup:
    """One audit run: a mechanism at a target epsilon, through the real code path.

    Attributes:
        mechanism: "gep", "bgep", "gp" or "langevin" (multi-pass, on a linear model, mode
            "single"; its epsilon follows from the schedule, so ``epsilon`` is not a target).
        mode: "single" (``GEPStep``), "central" (``Site`` clipped sums, noised by
            ``FederationServer``) or "client" (``Site`` local steps with its own noise).
        epsilon, delta: the target the noise multiplier is calibrated to (the claim).
        canaries: m; steps and sample_rate: T and q of the audited run.
        examples: real private examples at the audited site (scikit-learn's digits); few, so
            that their gradients interfere little with the canaries.
        num_basis: k of the anchor subspace (GEP, B-GEP); embedding canaries share these k
            dimensions, so a larger k lets them interfere less.
        seed: fixes the canaries, their inclusion, the sampling and the noise (an audit is an
            experiment: repeatable by design).
    """

    mechanism: str = "gep"
    mode: str = "client"
    epsilon: float = 8.0
    delta: float = 1e-5
    canaries: int = 1000
    steps: int = 1
    sample_rate: float = 1.0
    examples: int = 16
    num_basis: int = 256
    seed: int = 0
    confidence: float = 0.95

    def __post_init__(self) -> None:
        known = (*CANARY_KINDS, "langevin")
        if self.mechanism not in known or self.mode not in AUDIT_MODES:
            raise ValueError(
                f"audits cover mechanisms {known} in modes {AUDIT_MODES}, got "
                f"{self.mechanism!r} in {self.mode!r}"
            )
        if self.mechanism == "langevin" and self.mode != "single":
            raise ValueError("Langevin is audited in mode 'single' (LangevinTrainer)")


def run_audit(setup: AuditSetup, run_dir: str | None = None) -> AuditResult:
    """Train with canaries through the real code path of ``setup.mode`` and bound epsilon.

    ``run_dir`` holds the federation server's files in the central and client modes (a
    temporary folder when None)."""
    import tempfile

    from torch.utils.data import Subset

    from gep_fed.accounting.ledger import PrivacyLedger
    from gep_fed.config import FederationConfig
    from gep_fed.data.task import TaskSettings, stack_examples
    from gep_fed.data.tasks import DigitsTask
    from gep_fed.federation.policy import SitePolicy
    from gep_fed.federation.rundir import RunDirectory
    from gep_fed.federation.server import FederationServer
    from gep_fed.federation.site import Site
    from gep_fed.mechanisms.mechanism import calibrate_noise_multiplier
    from gep_fed.mechanisms.noise import NoiseSource
    from gep_fed.mechanisms.step import GEPStep

    s = setup
    task = DigitsTask(TaskSettings(model="mlp", num_public=300, seed=s.seed))
    private = Subset(task.train_dataset(), range(s.examples))
    x, y = stack_examples(private)
    if s.mechanism == "langevin":
        return _audit_langevin(s, x, y)
    sigma = calibrate_noise_multiplier(s.epsilon, s.delta, s.sample_rate, s.steps, s.mechanism)
    fed = FederationConfig(
        mode="central" if s.mode == "central" else "client",
        mechanism=s.mechanism,
        noise_multiplier=sigma,
        sample_rate=s.sample_rate,
        target_epsilon=s.epsilon,
        delta=s.delta,
        rounds=s.steps if s.mode == "central" else 1,
        local_steps=s.steps,
        num_basis=s.num_basis,
        num_public=300,
        clip_embedding=1.0,
        clip_residual=1.0,
        clip_norm=1.0,
        basis_refresh=10**6,
        seed=s.seed,
        noise_seed=s.seed + 1,
        run_dir=run_dir or tempfile.mkdtemp(prefix="gep-fed-audit-"),
        run_name="federation",
    )
    contract = fed.contract(sigma)
    torch.manual_seed(s.seed)
    model = task.build_model()
    size = sum(p.numel() for p in model.parameters())
    seeded = torch.Generator().manual_seed(s.seed)
    canaries = GradientCanaries(s.canaries, size, contract.build_mechanism(), generator=seeded)
    sampling = torch.Generator().manual_seed(s.seed + 2)
    if s.mode == "single":
        step = GEPStep(
            model,
            stack_examples(task.public_dataset())[0],
            replace(fed.anchor_config(contract), basis_refresh=10**6),
            dataset_size=s.examples,
            noise=NoiseSource(s.seed + 1),
            generator=torch.Generator().manual_seed(s.seed),
            canaries=canaries,
        )
        for idx in PoissonSampler(s.examples, s.sample_rate, s.steps, sampling):
            step(x[idx], y[idx])
        ledger, placement = step.ledger, "local"
    else:
        run = RunDirectory(fed.run_directory(0))
        run.path.mkdir(parents=True, exist_ok=True)
        server = FederationServer(fed, task, run, total_examples=s.examples)
        policy = SitePolicy(s.epsilon, s.delta, accepted_modes=("client", "central"))
        site = Site(
            "audited-site",
            task.build_model(),
            private,
            policy,
            ledger=PrivacyLedger(s.delta, s.epsilon, "audited-site"),
            noise=NoiseSource(s.seed + 3),
            sampler_generator=sampling,
        )
        site.canaries = server.canaries = canaries
        for round_ in range(1, fed.rounds + 1):
            plan = server.plan_round(round_)
            site.load_state(server.model.state_dict())
            release = site.run_round(plan.config, server.subspace)
            if s.mode == "central":
                server.apply_central(round_, [release.sums])
        ledger = server.ledger if s.mode == "central" else site.ledger
        placement = "trusted-server" if s.mode == "central" else "local"
    found = canaries.guesses(s.delta, s.confidence)
    return AuditResult(
        mechanism=s.mechanism,
        mode=s.mode,
        placement=placement,
        claimed_epsilon_rdp=ledger.epsilon("rdp"),
        claimed_epsilon_pld=ledger.epsilon("pld"),
        delta=s.delta,
        epsilon_lower_bound=found.epsilon_lower_bound,
        confidence=s.confidence,
        canaries=canaries.count,
        canary_kinds=tuple(dict.fromkeys(canaries.kind.tolist())),
        included=int(canaries.included.sum()),
        guesses=found.guesses,
        correct=found.correct,
        steps=canaries.steps,
        sample_rate=s.sample_rate,
        noise_multiplier=sigma,
    )


def _audit_langevin(s: AuditSetup, x: torch.Tensor, y: torch.Tensor) -> AuditResult:
    """Multi-pass Langevin on a linear model: every iterate is a release."""
    from gep_fed.data.models import MLP
    from gep_fed.mechanisms.langevin import LangevinConfig, LangevinTrainer
    from gep_fed.mechanisms.noise import NoiseSource

    torch.manual_seed(s.seed)
    model = MLP(x[0].numel(), 10, hidden=())
    config = LangevinConfig(
        schedule="multi-pass",
        grad_bound=1.0,
        beta0=1.0,
        steps=s.steps,
        batch=max(1, round(s.sample_rate * s.examples)),
        delta=s.delta,
    )
    trainer = LangevinTrainer(
        model,
        config,
        noise=NoiseSource(s.seed + 1),
        generator=torch.Generator().manual_seed(s.seed + 2),
    )
    size = sum(p.numel() for p in model.parameters())
    seeded = torch.Generator().manual_seed(s.seed)
    trainer.canaries = canaries = GradientCanaries(s.canaries, size, GP(1.0), generator=seeded)
    trainer.fit(x.flatten(1), y)
    found = canaries.guesses(s.delta, s.confidence)
    events = trainer.ledger.events
    return AuditResult(
        mechanism="langevin",
        mode="single",
        placement="local",
        claimed_epsilon_rdp=trainer.ledger.epsilon("rdp"),
        claimed_epsilon_pld=trainer.ledger.epsilon("pld"),
        delta=s.delta,
        epsilon_lower_bound=found.epsilon_lower_bound,
        confidence=s.confidence,
        canaries=canaries.count,
        canary_kinds=("gradient",),
        included=int(canaries.included.sum()),
        guesses=found.guesses,
        correct=found.correct,
        steps=canaries.steps,
        sample_rate=events[0].sample_rate if events else s.sample_rate,
        noise_multiplier=min((e.noise_multiplier for e in events), default=math.inf),
    )


def report_lines(result: AuditResult) -> list[str]:
    """The audit's section of a run's ``report.md``."""
    r = result
    return [
        "## Privacy audit",
        "",
        f"- audited: **{r.mechanism}**, mode **{r.mode}** (noise placement: {r.placement}), "
        f"{r.steps} release(s) at q = {r.sample_rate:g}, sigma = {r.noise_multiplier:.4f}",
        f"- claimed epsilon at delta = {r.delta:g}: {r.claimed_epsilon_rdp:.4f} (RDP), "
        f"{r.claimed_epsilon_pld:.4f} (PLD)",
        f"- audited lower bound ({r.confidence:.0%} confidence): epsilon >= "
        f"**{r.epsilon_lower_bound:.4f}** from {r.correct} right of {r.guesses} guesses about "
        f"{r.canaries} canaries ({', '.join(r.canary_kinds)}; {r.included} included)",
        f"- method: {r.method}",
        "- a lower bound, not a proof of privacy: a bound above the claim shows the run leaks "
        "more than it accounts; a bound below it does not show the claim holds",
        "",
    ]
