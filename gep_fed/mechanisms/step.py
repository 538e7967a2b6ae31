"""``GEPStep``: a private gradient step in the shape of a PyTorch training loop.

    step, sampler = private_step(model, public_inputs, target_epsilon=2.0, delta=1e-5,
                                 sample_rate=q, steps=900, dataset_size=len(train))
    for idx in sampler:           # Poisson samples, as the accounting assumes
        optimizer.zero_grad()
        step(x[idx], y[idx])      # fills every parameter's .grad with the private estimate
        optimizer.step()
    print(step.ledger.epsilon())

Each call is one accounted release in ``step.ledger``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.mechanisms.anchors import AnchorResult, compute_anchor_subspace
from gep_fed.mechanisms.contract import (
    DEFAULT_CLIP_EMBEDDING,
    DEFAULT_CLIP_NORM,
    DEFAULT_CLIP_RESIDUAL,
    PrivacyContract,
)
from gep_fed.mechanisms.factored import LayerFactors, PerExampleGradients
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.mechanism import ClippedSums, Mechanism
from gep_fed.mechanisms.multiplicity import AugmentationMultiplicity
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.observer import NoisyRelease, Observers, ReleaseObserver
from gep_fed.mechanisms.per_example import (
    LossFn,
    factored_gradients,
    per_example_gradients,
    planned_ghost_weights,
    validate_model,
)
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.mechanisms.subspace import AnchorSubspace

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StepReport:
    """What one step did. Local diagnostics: nothing here is released or accounted."""

    refreshed: AnchorResult | None
    mechanism: Mechanism


class GEPStep:
    """Computes a private gradient estimate and writes it into the model's ``.grad``.

    Args:
        model: any ``nn.Module`` whose forward treats examples independently (no BatchNorm).
        public_inputs: public, non-sensitive examples for the anchor subspace (ignored for GP;
            may be None when the subspace is supplied with ``set_subspace``).
        config: mechanism, noise and clipping (see ``GEPConfig``).
        dataset_size: n, the number of private examples; the estimate divides by ``q n``.
        loss_fn: per-batch loss ``loss_fn(outputs, targets)``; cross-entropy by default.
        public_labels: the public data's labels, for ``anchor_labels="true"``.
        noise: source of the Gaussian noise (default: cryptographically seeded).
        ledger: where each step is recorded (default: a new in-memory ledger at delta 1e-5).
        generator: public randomness (anchor subset, random labels, power-method start).
        party: recorded with each event (e.g. a site id).
        round: recorded with each event (a federated round), if given.
        observers: release observers (``gep_fed.mechanisms.observer``), called at each step:
            their extra rows join the sample's clipped sums, and each sees the noisy
            release. One that adds rows changes the private sums: never in a real run.
        multiplicity: clip and noise each example's mean gradient over augmented copies of
            it (``AugmentationMultiplicity``); no privacy meaning (the row still depends on
            one example and is clipped alike), ``copies`` times the compute.
    """

    def __init__(
        self,
        model: nn.Module,
        public_inputs: torch.Tensor | None,
        config: GEPConfig,
        *,
        dataset_size: int,
        loss_fn: LossFn = F.cross_entropy,
        public_labels: torch.Tensor | None = None,
        noise: NoiseSource | None = None,
        ledger: PrivacyLedger | None = None,
        generator: torch.Generator | None = None,
        party: str = "",
        round: int | None = None,
        observers: Iterable[ReleaseObserver] = (),
        multiplicity: AugmentationMultiplicity | None = None,
    ) -> None:
        validate_model(model)
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be >= 1, got {dataset_size}")
        self.model = model
        self.config = config
        self.dataset_size = dataset_size
        self.loss_fn = loss_fn
        self.public_inputs = public_inputs
        self.public_labels = public_labels
        self.noise = noise if noise is not None else NoiseSource()
        self.ledger = ledger if ledger is not None else PrivacyLedger(delta=1e-5)
        self.generator = generator
        self.party = party
        self.round = round
        self.observers = Observers(observers)
        self.multiplicity = multiplicity
        self.layout = ParameterLayout.from_model(model, config.groups)
        self.mechanism = config.contract.build_mechanism()
        if config.residual_quantile is not None:
            self.mechanism = replace(self.mechanism, count_within_clip=True)
        self.subspace: AnchorSubspace | None = None
        self._anchor_subspace: AnchorSubspace | None = None  # public part of ``subspace``
        self._released: deque[torch.Tensor] = deque(maxlen=config.past_releases)
        self._steps_since_refresh = 0
        self._external_subspace = False

    @property
    def expected_batch_size(self) -> float:
        return self.config.contract.sample_rate * self.dataset_size

    def set_subspace(self, subspace: AnchorSubspace) -> None:
        """Use ``subspace`` (e.g. received from a server) until the next call of this method."""
        if subspace.layout.names != self.layout.names:
            raise ValueError("the subspace's parameter layout does not match the model")
        self.subspace = subspace.to(next(self.model.parameters()).device)
        self._external_subspace = True

    def refresh_subspace(self, measure: bool = False) -> AnchorResult:
        """Recompute the anchor subspace at the current parameters (public data only)."""
        if self.public_inputs is None:
            raise ValueError("no public data: pass public_inputs or call set_subspace")
        result = compute_anchor_subspace(
            self.model,
            self.public_inputs,
            self.layout,
            self.config,
            loss_fn=self.loss_fn,
            public_labels=self.public_labels,
            generator=self.generator,
            measure=measure,
        )
        self.subspace = self._anchor_subspace = result.subspace
        if self.config.clip_quantile is not None:
            self.mechanism = self.config.contract.build_mechanism(
                result.clip_embedding, result.clip_residual
            )
        self._steps_since_refresh = 0
        return result

    @property
    def _own_subspace(self) -> bool:
        """The step computes its subspace from its public data (not given by a server)."""
        return self.mechanism.uses_subspace and not self._external_subspace

    @property
    def refresh_due(self) -> bool:
        """The next step recomputes the anchor subspace (so the current one need not be kept)."""
        return self._own_subspace and (
            self.subspace is None or self._steps_since_refresh >= self.config.basis_refresh
        )

    def state_dict(self) -> dict:
        """What this step carries from one call to the next, to resume a run exactly: the
        public anchor subspace while it is still in use, the past releases it also spans,
        the clips (adapted ones included) and a seeded noise source's streams. The ledger
        is its owner's to save. Released or public values only, apart from the noise state
        of a seeded (test or benchmark) source."""
        keep = self._own_subspace and not self.refresh_due
        return {
            "anchor_subspace": self._anchor_subspace if keep else None,
            "steps_since_refresh": self._steps_since_refresh,
            "released": list(self._released),
            "mechanism": self.mechanism,
            "noise": self.noise.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict``'s state (the model and ledger restored by their owner)."""
        device = next(self.model.parameters()).device
        subspace = state["anchor_subspace"]
        self.subspace = self._anchor_subspace = None if subspace is None else subspace.to(device)
        self._steps_since_refresh = state["steps_since_refresh"]
        self._released.clear()
        self._released.extend(r.to(device) for r in state["released"])
        self.mechanism = state["mechanism"]
        self.noise.load_state_dict(state["noise"])

    def private_projection_error(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Share of a private batch's gradient energy outside the current subspace.

        A local diagnostic computed from private data without noise: it is NOT covered by
        the privacy guarantee and must not be released (logged, sent, published).
        """
        if self.subspace is None:
            raise ValueError("no subspace yet: call refresh_subspace or set_subspace first")
        device = next(self.model.parameters()).device
        grads = per_example_gradients(
            self.model,
            self.loss_fn,
            inputs.to(device),
            targets.to(device),
            self.layout,
            self.config.max_chunk,
            self.config.engine,
        )
        return self.subspace.projection_error(grads)

    def clipped_sums(self, batches: Iterable[Batch]) -> ClippedSums:
        """Per-example gradients of a private sample, clipped and summed batch by batch
        (not yet private)."""
        extra = self.observers.rows(self.subspace, self.config.contract.sample_rate)
        return clipped_sums_of_batches(
            self.model,
            self.loss_fn,
            batches,
            self.layout,
            self.mechanism,
            self.subspace,
            self.config.max_chunk,
            extra,
            self.config.engine,
            self.config.factored_layers,
            self.multiplicity,
        )

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepReport:
        """One private step on a Poisson-sampled batch held in memory (any size, including
        0), differentiated ``max_chunk`` examples at a time; ``step`` takes a sample streamed
        in batches."""
        chunk = self.config.max_chunk
        return self.step(
            [(inputs[i : i + chunk], targets[i : i + chunk]) for i in range(0, len(inputs), chunk)]
        )

    def step(self, batches: Iterable[Batch]) -> StepReport:
        """One private step on a Poisson sample given as ``(inputs, targets)`` batches (e.g. a
        ``DataLoader`` over the sampled indices): per-example gradient memory is bounded by
        ``max_chunk`` examples, whatever the sample's size.

        Records the release in the ledger first: a step that would exceed the ledger's
        budget raises ``BudgetExceededError`` before anything is computed, and a step that
        fails after recording is over-counted, never under-counted.
        """
        contract = self.config.contract
        self.ledger.record(
            *contract.events(
                1, count_noise=self.config.count_noise, party=self.party, round=self.round
            )
        )
        refreshed = self.refresh_subspace() if self.refresh_due else None
        if self._own_subspace and self._released:
            self.subspace = self._anchor_subspace.with_directions(list(self._released))
        sums = self.clipped_sums(batches)
        noisy = self.mechanism.add_noise(sums, self.noise, self.config.count_noise)
        self.observers.notify(
            NoisyRelease(noisy, contract.noise_multiplier, contract.sample_rate, self.mechanism)
        )
        estimate = self.mechanism.reconstruct(noisy, self.subspace, self.expected_batch_size)
        write_gradient(self.model, self.layout, estimate)
        if self._released.maxlen:
            self._released.append(estimate.detach().clone())
        self._steps_since_refresh += 1
        report = StepReport(refreshed, self.mechanism)
        if noisy.within_clip is not None:
            self._adapt_residual_clip(float(noisy.within_clip))
        return report

    def _adapt_residual_clip(self, noisy_count: float) -> None:
        """Andrew et al.'s geometric update of S2 from the noised count (post-processing)."""
        share = noisy_count / self.expected_batch_size
        factor = math.exp(-self.config.quantile_lr * (share - self.config.residual_quantile))
        self.mechanism = replace(
            self.mechanism, clip_residual=self.mechanism.clip_residual * factor
        )


class PrivateStep(NamedTuple):
    """A step calibrated to a budget, with the sampler whose batches the accounting assumes."""

    step: GEPStep
    sampler: PoissonSampler


def private_step(
    model: nn.Module,
    public_inputs: torch.Tensor | None,
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    dataset_size: int,
    mechanism: str = "gep",
    clip_embedding: float = DEFAULT_CLIP_EMBEDDING,
    clip_residual: float = DEFAULT_CLIP_RESIDUAL,
    clip_norm: float = DEFAULT_CLIP_NORM,
    loss_fn: LossFn = F.cross_entropy,
    generator: torch.Generator | None = None,
    **step_settings,
) -> PrivateStep:
    """A private step from a target epsilon in one call (as Opacus's make_private_with_epsilon).

    The contract is built once: sigma is the smallest that keeps ``steps`` releases of
    ``mechanism`` on Poisson samples of rate ``sample_rate`` within ``(target_epsilon,
    delta)`` (RDP, ``dp-accounting``). The step's ledger enforces that budget, so a step
    beyond the plan raises ``BudgetExceededError`` before it computes anything. The sampler
    draws ``steps`` Poisson samples of ``range(dataset_size)``, the batches the accounting
    assumes, keyed by the operating system (amplification by sampling needs a sample the
    adversary cannot predict).

    Args:
        clip_embedding, clip_residual, clip_norm: S1, S2 (GEP, B-GEP) and S (GP): each
            example's bound; the noise is sigma times each.
        step_settings: ``GEPConfig``'s privacy-free knobs (``num_basis``, ``max_chunk``, ...)
            and, for an adaptive S2, ``residual_quantile`` with ``quantile_count_noise``
            (the count it releases is accounted: sigma grows to keep the budget).
        generator: the step's public randomness (anchor subset, random labels, power method).
    """
    adaptive = step_settings.get("residual_quantile") is not None
    contract = PrivacyContract.for_budget(
        mechanism,
        target_epsilon,
        delta,
        sample_rate,
        steps,
        count_noise=step_settings.get("quantile_count_noise") if adaptive else None,
        clip_embedding=clip_embedding,
        clip_residual=clip_residual,
        clip_norm=clip_norm,
    )
    step = GEPStep(
        model,
        public_inputs,
        GEPConfig(contract, **step_settings),
        dataset_size=dataset_size,
        loss_fn=loss_fn,
        ledger=PrivacyLedger(delta, budget_epsilon=target_epsilon),
        generator=generator,
    )
    return PrivateStep(step, PoissonSampler(dataset_size, sample_rate, steps))


def clipped_sums_of_batches(
    model: nn.Module,
    loss_fn: LossFn,
    batches: Iterable[Batch],
    layout: ParameterLayout,
    mechanism: Mechanism,
    subspace: AnchorSubspace | None,
    max_chunk: int = 128,
    extra_rows: torch.Tensor | None = None,
    engine: str = "layers",
    factored_layers: bool = True,
    multiplicity: AugmentationMultiplicity | None = None,
) -> ClippedSums:
    """Clip every example's gradient and sum, one batch at a time, on the model's device.

    Clipping is per example and the sums are additive, so streaming batches changes nothing
    but the memory: at most ``max_chunk`` per-example gradients exist at once. A batch may
    carry a third tensor, ``valid``: its invalid rows (examples that failed their checks)
    are dropped like non-finite gradients, with clip factor 0. ``extra_rows`` are
    per-example gradients added as they are (a release observer's). An empty sample gives zero
    sums of the right shapes. ``engine``: see ``per_example_gradients``; on the layer engine
    with ``factored_layers``, the weights the subspace embeds by Gram products (GEP, B-GEP),
    or whose norms cost less as ghost norms (GP: ``planned_ghost_weights``), are kept as
    factors and never materialised (``GEPConfig.factored_layers``). With ``multiplicity``,
    an example's gradient is the mean over its augmented copies, differentiated
    ``max_chunk // copies`` examples at a time (``AugmentationMultiplicity``)."""
    device = next(p for p in model.parameters() if p.requires_grad).device
    total = None
    factored = frozenset()
    factoring = engine == "layers" and factored_layers
    if factoring and mechanism.uses_subspace and subspace is not None:
        factored = subspace.factored_weights  # embedded by Gram products
    if multiplicity is not None:
        batches = multiplicity.chunks(batches, max_chunk)
        max_chunk = multiplicity.examples_per_chunk(max_chunk)  # in examples from here
    copies = 1 if multiplicity is None else multiplicity.copies
    for inputs, targets, *valid in batches:
        # once, here: the planning passes below run the model on them too
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if multiplicity is not None:
            inputs, targets = multiplicity.expand(inputs, targets)  # ``valid`` per example
        if factoring and not mechanism.uses_subspace and inputs.shape[0]:
            factored = planned_ghost_weights(model, inputs, layout)  # GP: ghost norms
        if factored and inputs.shape[0]:
            sums = _factored_sums(
                model,
                loss_fn,
                inputs,
                targets,
                valid,
                layout,
                mechanism,
                subspace,
                max_chunk,
                factored,
                copies,
            )
            if sums is not None:
                total = sums if total is None else total + sums
                continue
        grads = per_example_gradients(
            model, loss_fn, inputs, targets, layout, max_chunk * copies, engine
        )
        if multiplicity is not None:
            grads = multiplicity.average(grads)
        if valid:
            invalid = ~valid[0].to(device=device, dtype=torch.bool)
            grads = grads.masked_fill(invalid[:, None], float("nan"))
        sums = mechanism.clipped_sums(grads, subspace)
        total = sums if total is None else total + sums
    if extra_rows is not None or total is None:
        rows = extra_rows if extra_rows is not None else torch.empty(0, layout.size)
        sums = mechanism.clipped_sums(rows.to(device=device, dtype=torch.float32), subspace)
        total = sums if total is None else total + sums
    return total


def _factored_sums(
    model, loss_fn, inputs, targets, valid, layout, mechanism, subspace, max_chunk, factored, copies
) -> ClippedSums | None:
    """``clipped_sums_of_batches`` for one batch with the subspace's Gram weights kept as
    factors (``max_chunk`` examples at a time, each as its ``copies`` consecutive rows, whose
    gradients are averaged); None when the layer engine cannot serve the model (the caller
    then materialises every gradient)."""
    total = None
    for start in range(0, inputs.shape[0] // copies, max_chunk):
        stop = start + max_chunk
        rows = slice(start * copies, stop * copies)
        grads = factored_gradients(model, loss_fn, inputs[rows], targets[rows], layout, factored)
        if grads is None:
            return None
        if copies > 1:
            grads = grads.merged_copies(copies)
        if valid:
            invalid = ~valid[0][start:stop].to(device=inputs.device, dtype=torch.bool)
            grads = PerExampleGradients(
                layout,
                grads.dense.masked_fill(invalid[:, None], float("nan")),
                {
                    n: LayerFactors(
                        f.inputs, f.backprops.masked_fill(invalid[:, None, None], float("nan"))
                    )
                    for n, f in grads.factors.items()
                },
            )
        sums = mechanism.clipped_sums(grads, subspace)
        total = sums if total is None else total + sums
    return total


def write_gradient(model: nn.Module, layout: ParameterLayout, flat: torch.Tensor) -> None:
    """Set each parameter's ``.grad`` to its slice of ``flat``."""
    params = dict(model.named_parameters())
    for name, value in layout.unflatten(flat).items():
        p = params[name]
        p.grad = value.detach().to(dtype=p.dtype).clone()
