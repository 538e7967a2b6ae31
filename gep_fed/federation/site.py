"""A site's private trainer (no Flower): what a hospital's machine computes each round.

Before computing anything, a round is checked against the site's own policy (modes, replay,
noise) and its own ledger (budget); the release is recorded in the ledger before it is
computed, so a failure can over-count but never under-count.

Central mode (only by the site's opt-in): one Poisson sample, clipped sums, *no noise*; the
trusted server adds it. The site records the release as noised by a trusted server.
Client-side mode: ``local_steps`` private steps with the site's own noise.
Distributed mode (by opt-in): one Poisson sample's clipped sums, quantised, with the site's
share of discrete noise (``gep_fed.mechanisms.distributed_noise``), for a secure sum.

Data stay on disk until sampled: each step Poisson-samples indices, loads only those examples
through a ``DataLoader`` over the sampled subset (worker processes, pinned memory and
non-blocking copies when the site computes on CUDA), and computes per-example gradients in
chunks of ``max_chunk`` examples, clipping and summing chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from gep_fed.accounting.events import PrivacyEvent
from gep_fed.accounting.ledger import BudgetExceededError, PrivacyLedger
from gep_fed.data.partition import partition_indices
from gep_fed.data.task import CheckedExamples, Task, dataset_targets, stack_examples
from gep_fed.federation.modes import SiteRelease
from gep_fed.federation.policy import SiteConfig, SitePolicy
from gep_fed.federation.site_score import (
    check_countable,
    class_counts,
    noisy_counts,
    score_event,
    split_site_data,
)
from gep_fed.federation.wire import RebuildCost, RoundConfig, RoundRefused
from gep_fed.mechanisms.anchors import AnchorSet, rebuild_anchor_subspace
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.langevin import LangevinConfig, LangevinTrainer
from gep_fed.mechanisms.mechanism import ClippedSums
from gep_fed.mechanisms.multiplicity import Augment, AugmentationMultiplicity
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.observer import Observers, ReleaseObserver
from gep_fed.mechanisms.per_example import LossFn, validate_model
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.mechanisms.step import GEPStep, clipped_sums_of_batches
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.mechanisms.subspace import AnchorSubspace
from gep_fed.validation import ConfigError


def resolve_device(preference: str = "auto") -> torch.device:
    """``cuda`` when available (or asked for), else ``cpu``."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available here")
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(preference)


class Site:
    """One site: its private data, model replica, policy, noise and ledger.

    Args:
        site_id: recorded in the ledger.
        model: a model of the federation's architecture (its weights are overwritten).
        dataset: the site's private examples, read only as each Poisson sample takes them
            (they never leave this object). Each is read and checked on its own
            (``CheckedExamples``): one that cannot be read or does not suit the task is
            dropped from every sample (clip factor 0), never turned into an error.
        policy: what the site accepts (modes, budget, noise); the site's own.
        loss_fn: the task's loss (per example); cross-entropy by default.
        kind: the task's kind ("multiclass", "binary", "multilabel"): which targets are valid.
        ledger: the site's own ledger, on the site's disk; every release is recorded in it.
        noise: the site's noise; cryptographically seeded unless the policy fixes a seed.
        sampler_generator: Poisson sampling randomness (None: a ``SecretStream`` keyed by the OS).
        max_chunk: at most this many examples are loaded and differentiated at once.
        num_workers: ``DataLoader`` worker processes that decode the sampled examples.
        augmentation: the task's augmentation (``Task.augmentation``), used when a round
            asks for ``augmentation_copies``; a site without one refuses such rounds.
        observers: release observers (``gep_fed.mechanisms.observer``) of every release the
            site computes: their extra rows join its samples' clipped sums, and in client-side
            mode each sees the noisy release of every local step. One that adds rows changes
            the site's private sums: never in a real run (the Flower apps attach none).
        validation: the examples the site holds out to score models on (never in
            ``dataset``); None: the site has none and releases no score.
    """

    def __init__(
        self,
        site_id: str,
        model: nn.Module,
        dataset: Dataset,
        policy: SitePolicy,
        *,
        loss_fn: LossFn = F.cross_entropy,
        kind: str = "multiclass",
        device: torch.device | str = "cpu",
        ledger: PrivacyLedger | None = None,
        noise: NoiseSource | None = None,
        sampler_generator: torch.Generator | None = None,
        max_chunk: int = 128,
        num_workers: int = 0,
        augmentation: Augment | None = None,
        observers: Iterable[ReleaseObserver] = (),
        validation: Dataset | None = None,
    ) -> None:
        validate_model(model)
        if len(dataset) == 0:
            raise ValueError(f"site {site_id} has no training examples")
        self.site_id = site_id
        self.policy = policy
        self.device = torch.device(device)
        self.model = model.to(self.device)
        # The site's own layout: every round's must equal it (names, shapes, groups).
        self.layout = ParameterLayout.from_model(self.model)
        self.dataset = CheckedExamples.of(dataset, kind, self.model)
        self.loss_fn = loss_fn
        self.ledger = ledger
        self.noise = noise if noise is not None else NoiseSource(policy.noise_seed)
        self.sampler_generator = sampler_generator
        self.max_chunk = max_chunk
        self.num_workers = num_workers
        self.augmentation = augmentation
        self.observers = Observers(observers)
        self.kind = kind
        # Checked like the training part: an unreadable held-out example counts nowhere in a
        # score, and never turns the score into an error the server would see.
        self.validation = (
            None
            if validation is None
            else CheckedExamples(
                validation, self.dataset.placeholder, kind, self.dataset.num_outputs
            )
        )

    @property
    def num_examples(self) -> int:
        return len(self.dataset)

    def batches(
        self, indices: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The sampled examples, loaded ``max_chunk`` at a time and moved to the device, as
        ``(inputs, targets, valid)``: ``valid`` marks the examples that could be read and
        checked (the others are placeholders, dropped by the mechanism)."""
        if len(indices) == 0:
            return iter(())
        cuda = self.device.type == "cuda"
        loader = DataLoader(
            Subset(self.dataset, indices.tolist()),
            batch_size=self.max_chunk,
            num_workers=self.num_workers,
            pin_memory=cuda,
        )
        return (
            (
                x.to(self.device, non_blocking=cuda),
                y.to(self.device, non_blocking=cuda),
                valid.to(self.device, non_blocking=cuda),
            )
            for x, y, valid in loader
        )

    @torch.no_grad()
    def training_loss(self) -> float:
        """The mean loss over all the site's data: NOT private (released only when the site's
        own policy allows it, labelled as outside the guarantee)."""
        total, count = 0.0, 0
        for x, y, valid in self.batches(torch.arange(self.num_examples)):
            if valid.any():
                total += float(self.loss_fn(self.model(x[valid]), y[valid])) * int(valid.sum())
                count += int(valid.sum())
        return total / max(count, 1)

    def score_counts(self, classes: int) -> np.ndarray:
        """The current model's noised per-class counts on the held-out examples
        (``gep_fed.federation.site_score``), recorded in the ledger before they are computed.

        Raises ``RoundRefused``: "release not allowed" when the site's node config holds out
        no examples or sets no ``score-noise``; "over budget" beyond its budget."""
        if self.ledger is None:
            raise ValueError(f"site {self.site_id}: needs its ledger")
        std = self.policy.score_noise
        if std is None or self.validation is None:
            raise RoundRefused("release not allowed")
        check_countable(self.kind)
        try:
            self.ledger.record(score_event(std, self.site_id))
        except BudgetExceededError:
            raise RoundRefused("over budget") from None
        counts = class_counts(self.model, self.validation, self.kind, classes, self.max_chunk)
        return noisy_counts(counts, std, self.noise)

    def rebuild_subspace(self, anchors: AnchorSet) -> AnchorSubspace:
        """The round's basis from public anchors and coefficients the server sent, at the
        current (received) weights: public data only, nothing private is read. Refused
        ("over compute limit") from the anchors' shapes, before anything is allocated or
        computed, when it costs more than the site's policy allows (``max-rebuild-work``,
        ``max-rebuild-mib``)."""
        self.policy.admit_rebuild(RebuildCost.of_anchors(anchors, self.layout))
        return rebuild_anchor_subspace(
            self.model, anchors, self.layout, loss_fn=self.loss_fn, max_chunk=self.max_chunk
        )

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict({k: v.to(self.device) for k, v in state.items()})

    def run_round(
        self,
        rc: RoundConfig,
        subspace: AnchorSubspace | None,
        last_round: int | None = None,
        declined_through: int | None = None,
    ) -> SiteRelease:
        """Admit the round (policy, then budget), record it, compute the release.

        ``last_round``: the last round this site was sent in the run (replays are refused).
        ``declined_through``: the last planned round of a run this site already refused for
        its budget; every round up to it is refused too, so a refused run never spends.

        Raises ``RoundRefused`` ("mode not allowed", "replayed round", "over budget",
        "malformed round", "over compute limit") before anything is computed or recorded.
        "over budget": the budget cannot hold this round and the rest of the run's plan
        (to ``rc.last_round``), so a run that could not finish spends nothing.
        """
        if self.ledger is None:
            raise ValueError(f"site {self.site_id}: needs its ledger")
        self.admit(rc, last_round)
        if declined_through is not None and rc.round <= declined_through:
            raise RoundRefused("over budget")
        try:
            self.ledger.check_budget(self.planned_events(rc, subspace))
        except BudgetExceededError:
            raise RoundRefused("over budget") from None
        return rc.noise_mode.release(self, rc, subspace)

    def admit(self, rc: RoundConfig, last_round: int | None) -> None:
        """The site's policy, then the round's layout against the site's own model."""
        self.policy.admit(rc, last_round)
        if rc.parameter_layout() != self.layout:
            # another layout (a name twice, other shapes or groups) would mis-assign columns
            raise RoundRefused("malformed round")
        if rc.augmentation_copies and self.augmentation is None:
            raise RoundRefused("malformed round")  # the site's task has no augmentation

    def multiplicity(self, rc: RoundConfig) -> AugmentationMultiplicity | None:
        """The round's augmentation multiplicity (None: each example once, unaugmented)."""
        if not rc.augmentation_copies:
            return None
        return AugmentationMultiplicity(rc.augmentation_copies, self.augmentation)

    def round_events(
        self, rc: RoundConfig, subspace: AnchorSubspace | None = None
    ) -> list[PrivacyEvent]:
        """What the round releases, as this site's ledger records it (the round's mode
        says)."""
        return rc.noise_mode.site_events(self, rc, subspace)

    def planned_events(
        self, rc: RoundConfig, subspace: AnchorSubspace | None = None
    ) -> list[PrivacyEvent]:
        """What the run releases from this round through its last planned one, as this
        site's ledger would compose it: Langevin's steps each with their own sigma, round by
        round; every other round releases what this one does, so its events repeat. A run
        that will ask for a score (``rc.scored``) adds the score this site releases, if any."""
        rounds = range(rc.round, rc.last_round + 1)
        if rc.privacy.is_langevin:
            planned = [e for r in rounds for e in self.round_events(replace(rc, round=r), subspace)]
        else:
            planned = [
                replace(e, steps=e.steps * len(rounds)) for e in self.round_events(rc, subspace)
            ]
        releases_score = self.policy.score_noise is not None and self.validation is not None
        if rc.scored and releases_score:  # the score it will be asked for after the rounds
            planned.append(score_event(self.policy.score_noise, self.site_id))
        return planned

    def langevin_events(self, rc: RoundConfig) -> list[PrivacyEvent]:
        """A Langevin round's events: step-dependent and dependent on this site's size."""
        return self._langevin_trainer(rc).multi_pass_events(
            rc.site_examples, _first_langevin_step(rc), rc.local_steps
        )

    def _sample(self, rate: float) -> torch.Tensor:
        return PoissonSampler(self.num_examples, rate, 1, self.sampler_generator).sample()

    def central_sums(self, subspace: AnchorSubspace | None, rc: RoundConfig) -> ClippedSums:
        """Clipped sums of one Poisson sample at the current weights: unnoised, for a server
        the site trusts. Recorded in the site's ledger as noised by that server."""
        self.ledger.record(*self.round_events(rc))
        return self._clipped_sums(subspace, rc)

    def distributed_share(self, subspace: AnchorSubspace | None, rc: RoundConfig) -> np.ndarray:
        """One Poisson sample's clipped sums, quantised with this site's share of discrete
        noise (the round number seeds the public rotation): only the secure sum of all
        shares may be revealed. Recorded in the site's ledger before it is computed."""
        self.ledger.record(*self.round_events(rc, subspace))
        sums = self._clipped_sums(subspace, rc)
        return rc.privacy.distributed_noise.encode(sums, rc.mechanism, rc.round)

    def _clipped_sums(self, subspace: AnchorSubspace | None, rc: RoundConfig) -> ClippedSums:
        sub = subspace.to(self.device) if subspace is not None else None
        extra = self.observers.rows(sub, rc.privacy.sample_rate)
        return clipped_sums_of_batches(
            self.model,
            self.loss_fn,
            self.batches(self._sample(rc.privacy.sample_rate)),
            self.layout,
            rc.mechanism,
            sub,
            self.max_chunk,
            extra,
            multiplicity=self.multiplicity(rc),
        )

    def local_update(self, subspace: AnchorSubspace | None, rc: RoundConfig) -> torch.Tensor:
        """``rc.local_steps`` private steps from the current weights; returns the noisy
        model delta (flattened in the round's layout order). Each step is recorded in the
        site's ledger before it is computed."""
        if rc.privacy.is_langevin:
            return self._langevin_update(rc)
        layout = self.layout
        before = layout.flatten_params(self.model).clone()
        step = GEPStep(
            self.model,
            None,
            GEPConfig(rc.privacy, max_chunk=self.max_chunk),
            dataset_size=rc.site_examples,  # public: the site's own count would leak
            loss_fn=self.loss_fn,
            noise=self.noise,
            ledger=self.ledger,
            party=self.site_id,
            round=rc.round,
            observers=self.observers,
            multiplicity=self.multiplicity(rc),
        )
        if subspace is not None:
            step.set_subspace(subspace)
        opt = torch.optim.SGD(self.model.parameters(), lr=rc.local_lr, momentum=rc.local_momentum)
        for _ in range(rc.local_steps):
            opt.zero_grad(set_to_none=True)
            step.step(self.batches(self._sample(rc.privacy.sample_rate)))
            opt.step()
        return layout.flatten_params(self.model) - before

    def _langevin_trainer(self, rc: RoundConfig) -> LangevinTrainer:
        config = LangevinConfig(
            schedule="multi-pass",
            grad_bound=rc.privacy.clip_norm,
            beta0=rc.privacy.langevin_beta0,
            steps=rc.local_steps,
            batch=max(1, round(rc.privacy.sample_rate * rc.site_examples)),
            delta=self.policy.delta,
        )
        return LangevinTrainer(
            self.model,
            config,
            ledger=self.ledger,
            noise=self.noise,
            generator=self.sampler_generator,
            party=self.site_id,
            observers=self.observers,
        )

    def _langevin_update(self, rc: RoundConfig) -> torch.Tensor:
        """Multi-pass Langevin steps continuing the schedule across rounds, each accounted
        in the site's ledger."""
        layout = self.layout
        before = layout.flatten_params(self.model).clone()
        trainer = self._langevin_trainer(rc)
        inputs, targets = self._langevin_examples
        trainer.fit(
            inputs.to(self.device),
            targets.to(self.device),
            first_step=_first_langevin_step(rc),
            dataset_size=rc.site_examples,  # public: the schedule follows no private count
        )
        return layout.flatten_params(self.model) - before

    @cached_property
    def _langevin_examples(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Langevin runs on linear models over small feature sets: its data fit in memory.
        Examples that fail their checks are left out of the training, as a non-finite
        gradient is elsewhere; the schedule and the accounting follow the declared n
        (``RoundConfig.site_examples``), never this count."""
        inputs, targets, valid = stack_examples(self.dataset)
        return inputs[valid], targets[valid]


def _first_langevin_step(rc: RoundConfig) -> int:
    """The schedule's step index at the start of the round: rounds continue it."""
    return (rc.round - 1) * rc.local_steps + 1


def site_dataset(
    task: Task, site: SiteConfig, num_sites: int, partition: str, alpha: float, seed: int
) -> Dataset:
    """The site's private data: its own file (a deployed site, the path from its node
    config; a simulated site given its own data), or its share of the task's pooled data
    (a simulated site)."""
    if site.partition_id is None or site.data_path:
        return task.site_dataset(site.data_path)
    shares = pooled_shares(task, num_sites, partition, alpha, seed)
    if not (0 <= site.partition_id < len(shares)):
        raise ConfigError(
            f"partition-id {site.partition_id} is out of range for {len(shares)} sites"
        )
    return shares[site.partition_id]


def site_data_parts(
    task: Task,
    site: SiteConfig,
    num_sites: int = 0,
    partition: str = "iid",
    alpha: float = 0.0,
    seed: int = 0,
    coins_key: bytes | None = None,
) -> tuple[Dataset, Dataset]:
    """(training, held-out) parts of the site's data (``site_dataset``): the examples it holds
    out to score models on (its ``validation-fraction``), by secret coins drawn once for this
    run from ``coins_key`` (``new_coins_key``, kept by the site for the run; seeded only by a
    simulated site's ``noise-seed``, for tests); none when 0."""
    data = site_dataset(task, site, num_sites, partition, alpha, seed)
    if not site.validation_fraction:
        return data, Subset(data, [])
    return split_site_data(data, site.validation_fraction, site.policy.noise_seed, coins_key)


def pooled_shares(
    task: Task, num_sites: int, partition: str, alpha: float, seed: int
) -> list[Subset]:
    """The simulated sites' shares of the task's pooled data (``train_dataset``)."""
    pooled = task.train_dataset()
    parts = partition_indices(dataset_targets(pooled), num_sites, partition, alpha, seed)
    return [Subset(pooled, part.tolist()) for part in parts]
