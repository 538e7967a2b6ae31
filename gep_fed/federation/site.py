"""A site's private trainer (no Flower): what a hospital's machine computes each round.

Before computing anything, a round is checked against the site's own policy (modes, replay,
noise) and its own ledger (budget); the release is recorded in the ledger before it is
computed, so a failure can over-count but never under-count.

Central mode (only by the site's opt-in): one Poisson sample, clipped sums, *no noise*; the
trusted server adds it. The site records the release as noised by a trusted server.
Client-side mode: ``local_steps`` private steps with the site's own noise.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gep_fed.accounting.events import PrivacyEvent
from gep_fed.accounting.ledger import BudgetExceededError, PrivacyLedger
from gep_fed.config import ConfigError, FederationConfig, GEPConfig
from gep_fed.data.datasets import ArrayDataset, DataError
from gep_fed.data.partition import partition_indices
from gep_fed.data.tasks import load_task
from gep_fed.federation.policy import SiteConfig, SitePolicy
from gep_fed.federation.wire import RoundConfig, RoundRefused
from gep_fed.mechanisms.langevin import LangevinConfig, LangevinTrainer
from gep_fed.mechanisms.mechanism import ClippedSums
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.per_example import per_example_gradients, validate_model
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.mechanisms.step import GEPStep
from gep_fed.mechanisms.subspace import AnchorSubspace

if TYPE_CHECKING:  # the audit builds on this module
    from gep_fed.accounting.audit import GradientCanaries


def resolve_device(preference: str = "auto") -> torch.device:
    """``cuda`` when available (or asked for), else ``cpu``."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available here")
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(preference)


@dataclass(frozen=True)
class SiteRelease:
    """What a site sends for one round: clipped sums (central) or a noisy delta (client)."""

    sums: ClippedSums | None = None
    delta: torch.Tensor | None = None


class Site:
    """One site: its private data, model replica, policy, noise and ledger.

    Args:
        site_id: recorded in the ledger.
        model: a model of the federation's architecture (its weights are overwritten).
        inputs, targets: the site's private examples (never leave this object).
        policy: what the site accepts (modes, budget, noise); the site's own.
        ledger: the site's own ledger, on the site's disk; every release is recorded in it.
        noise: the site's noise; cryptographically seeded unless the policy fixes a seed.
        sampler_generator: Poisson sampling randomness (None: seeded from the OS).
    """

    def __init__(
        self,
        site_id: str,
        model: nn.Module,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        policy: SitePolicy,
        *,
        device: torch.device | str = "cpu",
        ledger: PrivacyLedger | None = None,
        noise: NoiseSource | None = None,
        sampler_generator: torch.Generator | None = None,
        max_chunk: int = 128,
    ) -> None:
        validate_model(model)
        if len(inputs) == 0:
            raise ValueError(f"site {site_id} has no training examples")
        self.site_id = site_id
        self.policy = policy
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.inputs, self.targets = inputs.to(self.device), targets.to(self.device)
        self.ledger = ledger
        self.noise = noise if noise is not None else NoiseSource(policy.noise_seed)
        self.sampler_generator = sampler_generator
        self.max_chunk = max_chunk
        # Audit canaries (accounting.audit): gradients that join this site's samples. Audits only.
        self.canaries: GradientCanaries | None = None

    @property
    def num_examples(self) -> int:
        return len(self.inputs)

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict({k: v.to(self.device) for k, v in state.items()})

    def run_round(
        self, rc: RoundConfig, subspace: AnchorSubspace | None, last_round: int | None = None
    ) -> SiteRelease:
        """Admit the round (policy, then budget), record it, compute the release.

        Raises ``RoundRefused`` ("mode not allowed", "replayed round", "over budget") before
        anything is computed or recorded.
        """
        if self.ledger is None:
            raise ValueError(f"site {self.site_id}: needs its ledger")
        self.policy.admit(rc, last_round)
        try:
            self.ledger.check_budget(self.round_events(rc))
        except BudgetExceededError:
            raise RoundRefused("over budget") from None
        if rc.mode == "central":
            return SiteRelease(sums=self.central_sums(subspace, rc))
        return SiteRelease(delta=self.local_update(subspace, rc))

    def round_events(self, rc: RoundConfig) -> list[PrivacyEvent]:
        """What the round releases, as this site's ledger records it."""
        if rc.mode == "central":
            return rc.privacy.events(
                1, party=self.site_id, round=rc.round, placement="trusted-server"
            )
        if rc.privacy.is_langevin:
            return self._langevin_trainer(rc).multi_pass_events(
                self.num_examples, _first_langevin_step(rc), rc.local_steps
            )
        return rc.privacy.events(rc.local_steps, party=self.site_id, round=rc.round)

    def _sample(self, rate: float) -> torch.Tensor:
        return PoissonSampler(self.num_examples, rate, 1, self.sampler_generator).sample()

    def central_sums(self, subspace: AnchorSubspace | None, rc: RoundConfig) -> ClippedSums:
        """Clipped sums of one Poisson sample at the current weights: unnoised, for a server
        the site trusts. Recorded in the site's ledger as noised by that server."""
        self.ledger.record(*self.round_events(rc))
        mechanism = rc.privacy.build_mechanism()
        layout = rc.parameter_layout()
        idx = self._sample(rc.privacy.sample_rate).to(self.device)
        grads = per_example_gradients(
            self.model,
            F.cross_entropy,
            self.inputs[idx],
            self.targets[idx],
            layout,
            self.max_chunk,
        )
        sub = subspace.to(self.device) if subspace is not None else None
        if self.canaries is not None:
            rows = self.canaries.sample_rows(sub, rc.privacy.sample_rate)
            grads = torch.cat([grads, rows.to(grads)])
        return mechanism.clipped_sums(grads, sub)

    def local_update(self, subspace: AnchorSubspace | None, rc: RoundConfig) -> torch.Tensor:
        """``rc.local_steps`` private steps from the current weights; returns the noisy
        model delta (flattened in the round's layout order). Each step is recorded in the
        site's ledger before it is computed."""
        if rc.privacy.is_langevin:
            return self._langevin_update(rc)
        self.ledger.check_budget(self.round_events(rc))
        layout = rc.parameter_layout()
        layout.check_matches(self.model)
        before = layout.flatten_params(self.model).clone()
        step = GEPStep(
            self.model,
            None,
            GEPConfig.from_contract(rc.privacy, max_chunk=self.max_chunk),
            dataset_size=self.num_examples,
            noise=self.noise,
            ledger=self.ledger,
            party=self.site_id,
            round=rc.round,
            canaries=self.canaries,
        )
        if subspace is not None:
            step.set_subspace(subspace)
        opt = torch.optim.SGD(self.model.parameters(), lr=rc.local_lr, momentum=rc.local_momentum)
        for _ in range(rc.local_steps):
            idx = self._sample(rc.privacy.sample_rate).to(self.device)
            opt.zero_grad(set_to_none=True)
            step(self.inputs[idx], self.targets[idx])
            opt.step()
        return layout.flatten_params(self.model) - before

    def _langevin_trainer(self, rc: RoundConfig) -> LangevinTrainer:
        config = LangevinConfig(
            schedule="multi-pass",
            grad_bound=rc.privacy.clip_norm,
            beta0=rc.privacy.langevin_beta0,
            steps=rc.local_steps,
            batch=max(1, round(rc.privacy.sample_rate * self.num_examples)),
            delta=self.policy.delta,
        )
        return LangevinTrainer(
            self.model,
            config,
            ledger=self.ledger,
            noise=self.noise,
            generator=self.sampler_generator,
            party=self.site_id,
        )

    def _langevin_update(self, rc: RoundConfig) -> torch.Tensor:
        """Multi-pass Langevin steps continuing the schedule across rounds, each accounted
        in the site's ledger."""
        layout = rc.parameter_layout()
        before = layout.flatten_params(self.model).clone()
        trainer = self._langevin_trainer(rc)
        trainer.fit(self.inputs, self.targets, first_step=_first_langevin_step(rc))
        return layout.flatten_params(self.model) - before


def _first_langevin_step(rc: RoundConfig) -> int:
    """The schedule's step index at the start of the round: rounds continue it."""
    return (rc.round - 1) * rc.local_steps + 1


def load_site_data(site: SiteConfig, fed: FederationConfig) -> ArrayDataset:
    """The site's private training examples: its partition (simulation) or its file."""
    if site.partition_id is not None:
        task = load_task(
            fed.task, fed.data_dir, fed.num_public, fed.medmnist_path or None, fed.seed
        )
        parts = partition_indices(
            task.train.labels, fed.num_sites, fed.partition, fed.dirichlet_alpha, fed.seed
        )
        if not (0 <= site.partition_id < len(parts)):
            raise ConfigError(
                f"partition-id {site.partition_id} is out of range for {len(parts)} sites"
            )
        return task.train.subset(parts[site.partition_id])
    return load_site_file(site.data_path)


def load_site_file(path: str | Path) -> ArrayDataset:
    """A site's data file: ``.npz`` with ``images`` and ``labels``, or MedMNIST layout."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            keys = set(npz.files)
            if {"images", "labels"} <= keys:
                images, labels = npz["images"], npz["labels"]
            elif {"train_images", "train_labels"} <= keys:
                images, labels = npz["train_images"], npz["train_labels"]
            else:
                raise DataError(
                    f"{path} has arrays {sorted(keys)}; expected 'images' and 'labels' (or a "
                    "MedMNIST file with 'train_images' and 'train_labels')"
                )
    except FileNotFoundError as err:
        raise DataError(f"site data file {path} does not exist") from err
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise DataError(f"cannot read site data file {path}: {err}") from err
    if images.dtype != np.uint8 or images.ndim not in (3, 4):
        raise DataError(
            f"{path}: images must be uint8 (N, H, W[, C]), got {images.dtype}{images.shape}"
        )
    labels = labels.reshape(-1)
    if not np.issubdtype(labels.dtype, np.integer) or (labels < 0).any():
        raise DataError(f"{path}: labels must be non-negative integers")
    return ArrayDataset(images, labels.astype(np.int64))
