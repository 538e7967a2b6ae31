"""The audit's harness: trains through the real code path with canaries attached, and sets
the run's claim beside the bounds. The one part of the audit that builds trainers and a
federation (``GEPStep``, ``LangevinTrainer``, ``Site``, ``FederationServer``); the
production code knows nothing of it. See ``gep_fed.audit``."""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass, replace

import torch
from torch.utils.data import Subset

from gep_fed.accounting.events import pld_text
from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.audit.bounds import METHOD, claimed_gdp_mu, gdp_epsilon
from gep_fed.audit.canaries import CANARY_KINDS, GradientCanaries
from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.models import MLP
from gep_fed.data.task import TaskSettings, stack_examples
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.modes import MODE_NAMES, mode_named
from gep_fed.federation.policy import SitePolicy
from gep_fed.federation.rundir import RunDirectory
from gep_fed.federation.server import FederationServer
from gep_fed.federation.site import Site
from gep_fed.mechanisms.langevin import LangevinConfig, LangevinTrainer
from gep_fed.mechanisms.mechanism import GP, calibrate_noise_multiplier
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.mechanisms.step import GEPStep
from gep_fed.validation import AT_LEAST_ONE, PROBABILITY, Range


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
    claimed_mu: float
    gdp_mu_lower_bound: float
    epsilon_lower_bound_gdp: float
    fitted_mu_lower_bound: float
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

    @property
    def caught_by(self) -> tuple[str, ...]:
        """The analyses whose bound exceeds the claim: each is evidence that the run leaks
        more than it accounts ("steinke" and "f-dp" without assumptions on the mechanism,
        "gaussian-fit" assuming Gaussian scores). Empty for a run that passes."""
        return tuple(
            name
            for name, caught in (
                ("steinke", self.epsilon_lower_bound > self.claimed_epsilon_rdp),
                ("f-dp", self.gdp_mu_lower_bound > self.claimed_mu),
                ("gaussian-fit", self.fitted_mu_lower_bound > self.claimed_mu),
            )
            if caught
        )


# "single": one GEPStep without a federation; the others: a federation in that mode.
SINGLE = "single"
AUDIT_MODES = (SINGLE, *MODE_NAMES)
# Distributed audits: the audited site and two more, each adding a third of the noise.
DISTRIBUTED_SITES = 3


@dataclass(frozen=True)
class AuditSetup:
    """One audit run: a mechanism at a target epsilon, through the real code path.

    Attributes:
        mechanism: "gep", "bgep", "gp" or "langevin" (multi-pass, on a linear model, mode
            "single"; its epsilon follows from the schedule, so ``epsilon`` is not a target).
        mode: "single" (``GEPStep``), "central" (``Site`` clipped sums, noised by
            ``FederationServer``), "client" (``Site`` local steps with its own noise) or
            "distributed" (the audited ``Site`` and two more, holding other examples, each
            quantise and add a third of the noise; the secure sum adds their masked shares
            and the server decodes the sum). Every federated mode runs through the round
            loop and each site's ClientApp in process (``_federate``): the wire format, the
            sites' checks and ledgers, the secure sum's pinned keys and masks.
        epsilon, delta: the target the noise multiplier is calibrated to (the claim).
        canaries: m; steps and sample_rate: T and q of the audited run.
        examples: real private examples at the audited site (scikit-learn's digits); few, so
            that their gradients interfere little with the canaries.
        num_basis: k of the anchor subspace (GEP, B-GEP); embedding canaries share these k
            dimensions, so a larger k lets them interfere less.
        canary_kinds: the kinds of canary (``CANARY_KINDS``; default: every kind the
            mechanism releases, in turn). Aiming all of them at one kind (GEP's "both", which
            meets both clips and so the whole claim) makes the Gaussian fit of that kind ~3x
            as sure.
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
    num_basis: int = 1024
    canary_kinds: tuple[str, ...] | None = None
    seed: int = 0
    confidence: float = 0.95

    def __post_init__(self) -> None:
        known = (*CANARY_KINDS, "langevin")
        if self.mechanism not in known or self.mode not in AUDIT_MODES:
            raise ValueError(
                f"audits cover mechanisms {known} in modes {AUDIT_MODES}, got "
                f"{self.mechanism!r} in {self.mode!r}"
            )
        if self.mechanism == "langevin" and self.mode != SINGLE:
            raise ValueError("Langevin is audited in mode 'single' (LangevinTrainer)")
        Range(0, integer=True).check("seed", self.seed)
        for name in ("canaries", "steps", "examples", "num_basis"):
            AT_LEAST_ONE.check(name, getattr(self, name))
        PROBABILITY.check("sample_rate", self.sample_rate)


def peer_examples(setup: AuditSetup, i: int) -> range:
    """The examples of peer site ``i`` of a distributed audit (after the audited site's)."""
    return range(setup.examples * i, setup.examples * (i + 1))


def run_audit(setup: AuditSetup, run_dir: str | None = None) -> AuditResult:
    """Train with canaries through the real code path of ``setup.mode`` and bound epsilon.

    ``run_dir`` holds the federation server's files in the central and client modes (a
    temporary folder when None)."""
    s = setup
    task = DigitsTask(TaskSettings(model="mlp", num_public=s.num_basis, seed=s.seed))
    private = Subset(task.train_dataset(), range(s.examples))
    x, y = stack_examples(private)
    if s.mechanism == "langevin":
        return _audit_langevin(s, x, y)
    sigma = calibrate_noise_multiplier(s.epsilon, s.delta, s.sample_rate, s.steps, s.mechanism)
    noise_mode = mode_named("client" if s.mode == SINGLE else s.mode)
    distributed = noise_mode.secure_sum
    fed = FederationConfig(
        mode=noise_mode.name,
        mechanism=s.mechanism,
        noise_multiplier=sigma,
        sample_rate=s.sample_rate,
        # sigma is calibrated for the Gaussian; distributed accounting claims more for it (the
        # audit checks whatever the ledger claims), so its budgets leave room for that claim
        target_epsilon=s.epsilon * (10 if distributed else 1),
        delta=s.delta,
        rounds=s.steps if noise_mode.server_steps else 1,
        local_steps=s.steps,
        num_basis=s.num_basis,
        num_public=s.num_basis,
        clip_embedding=1.0,
        clip_residual=1.0,
        clip_norm=1.0,
        basis_refresh=10**6,
        seed=s.seed,
        noise_seed=s.seed + 1,
        run_dir=run_dir or tempfile.mkdtemp(prefix="gep-fed-audit-"),
        run_name="federation",
        num_sites=DISTRIBUTED_SITES if distributed else 3,
        # the canaries are examples of the audited site too (each in a batch with chance q):
        # the server's plausibility check of a site's clipped sums counts them
        total_examples=s.examples * (DISTRIBUTED_SITES if distributed else 1) + s.canaries,
    )
    resolved = fed.resolve()
    contract = resolved.contract
    torch.manual_seed(s.seed)
    model = task.build_model()
    size = sum(p.numel() for p in model.parameters())
    seeded = torch.Generator().manual_seed(s.seed)
    canaries = GradientCanaries(
        s.canaries, size, contract.build_mechanism(), s.canary_kinds, generator=seeded
    )
    sampling = torch.Generator().manual_seed(s.seed + 2)
    if s.mode == SINGLE:
        step = GEPStep(
            model,
            stack_examples(task.public_dataset())[0],
            replace(resolved.anchor_config, basis_refresh=10**6),
            dataset_size=s.examples,
            noise=NoiseSource(s.seed + 1),
            generator=torch.Generator().manual_seed(s.seed),
            observers=(canaries,),
        )
        for idx in PoissonSampler(s.examples, s.sample_rate, s.steps, sampling):
            step(x[idx], y[idx])
        ledger, placement = step.ledger, "local"
    else:
        run = RunDirectory(fed.run_directory(0))
        run.path.mkdir(parents=True, exist_ok=True)
        server = FederationServer(
            fed, task, run, total_examples=fed.total_examples, observers=(canaries,)
        )
        budget = fed.target_epsilon
        policy = SitePolicy(  # seeded, as the audit's server is: it takes its seeded rounds
            budget,
            s.delta,
            accepted_modes=AUDIT_MODES[1:],
            noise_shares=fed.shares_needed,
            noise_seed=s.seed + 3,
        )
        sites = [
            Site(
                "audited-site" if i == 0 else f"peer-{i}",
                task.build_model(),
                private if i == 0 else Subset(task.train_dataset(), peer_examples(s, i)),
                policy,
                ledger=PrivacyLedger(s.delta, budget, f"site-{i}"),
                noise=NoiseSource(s.seed + 3 + i),
                sampler_generator=sampling if i == 0 else torch.Generator().manual_seed(i),
                observers=(canaries,) if i == 0 else (),
            )
            for i in range(DISTRIBUTED_SITES if distributed else 1)
        ]
        _federate(fed, server, sites)
        ledger = server.ledger if noise_mode.server_steps else sites[0].ledger
        placement = noise_mode.site_placement
    found = canaries.guesses(s.delta, s.confidence)
    return AuditResult(
        mechanism=s.mechanism,
        mode=s.mode,
        placement=placement,
        claimed_epsilon_rdp=ledger.epsilon("rdp"),
        claimed_epsilon_pld=ledger.epsilon("pld"),
        delta=s.delta,
        epsilon_lower_bound=found.epsilon_lower_bound,
        claimed_mu=claimed_gdp_mu(ledger.events),
        gdp_mu_lower_bound=found.gdp_mu_lower_bound,
        epsilon_lower_bound_gdp=gdp_epsilon(found.gdp_mu_lower_bound, s.delta),
        fitted_mu_lower_bound=found.fitted_mu_lower_bound,
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


def _federate(fed: FederationConfig, server: FederationServer, sites: list[Site]) -> None:
    """``fed.rounds`` rounds through the production path, in process: the round loop, the
    wire format both ways, each site's ClientApp (its checks, its ledger, the secure sum's
    pinned keys and masks), with ``sites`` served as the simulation's nodes."""
    from gep_fed.federation.rounds import RoundLoop
    from gep_fed.flower.clientapp import make_client_app, served_sites
    from gep_fed.flower.grid import FlowerGrid
    from gep_fed.flower.in_process import in_process_grid
    from gep_fed.flower.simulation import simulated_site_settings

    simulation = simulated_site_settings(fed)
    with in_process_grid(make_client_app(fed, simulation), len(sites)) as grid:
        nodes = dict(zip(grid.contexts, sites, strict=True))
        with served_sites(grid.contexts, nodes, fed, simulation):
            RoundLoop(server, progress=False).run(FlowerGrid(grid), 1, fed.rounds)


def _audit_langevin(s: AuditSetup, x: torch.Tensor, y: torch.Tensor) -> AuditResult:
    """Multi-pass Langevin on a linear model: every iterate is a release."""
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
    size = sum(p.numel() for p in model.parameters())
    seeded = torch.Generator().manual_seed(s.seed)
    # the canaries read the clip norm; Langevin's noise is its own
    clip_only = GP(1.0, noise_multiplier=0.0)
    canaries = GradientCanaries(s.canaries, size, clip_only, generator=seeded)
    trainer = LangevinTrainer(
        model,
        config,
        noise=NoiseSource(s.seed + 1),
        generator=torch.Generator().manual_seed(s.seed + 2),
        observers=(canaries,),
    )
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
        claimed_mu=claimed_gdp_mu(trainer.ledger.events),
        gdp_mu_lower_bound=found.gdp_mu_lower_bound,
        epsilon_lower_bound_gdp=gdp_epsilon(found.gdp_mu_lower_bound, s.delta),
        fitted_mu_lower_bound=found.fitted_mu_lower_bound,
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
        f"{pld_text(r.claimed_epsilon_pld)}",
        f"- audited lower bound ({r.confidence:.0%} confidence): epsilon >= "
        f"**{r.epsilon_lower_bound:.4f}** from {r.correct} right of {r.guesses} guesses about "
        f"{r.canaries} canaries ({', '.join(r.canary_kinds)}; {r.included} included)",
        f"- f-DP analysis (Gaussian curve): mu >= **{r.gdp_mu_lower_bound:.4f}** against the "
        f"claimed mu = {r.claimed_mu:.4f} (epsilon >= {r.epsilon_lower_bound_gdp:.4f} for a "
        "mu-GDP mechanism; defined for releases without subsampling)",
        f"- Gaussian fit of the scores (assumes Gaussian scores; q = 1 only): mu >= "
        f"**{r.fitted_mu_lower_bound:.4f}** against the claimed mu = {r.claimed_mu:.4f}",
        f"- claim violated: **{', '.join(r.caught_by) or 'no'}**",
        f"- method: {r.method}",
        "- a lower bound, not a proof of privacy: a bound above the claim shows the run leaks "
        "more than it accounts; a bound below it does not show the claim holds",
        "",
    ]
