"""A site's private trainer (no Flower): what a hospital's machine computes each round.

Central mode: one Poisson sample, clipped sums, *no noise* (the trusted server adds it).
Client-side mode: ``local_steps`` private steps with the site's own noise, each recorded in
the site's own ledger, which refuses a round that would exceed the site's budget.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gep_fed.accounting import PrivacyEvent
from gep_fed.config import DEVICES, ConfigError, FederationConfig, GEPConfig
from gep_fed.data import ArrayDataset, DataError
from gep_fed.langevin import LangevinConfig, LangevinTrainer
from gep_fed.ledger import PrivacyLedger
from gep_fed.mechanisms import ClippedSums
from gep_fed.noise import NoiseSource
from gep_fed.partition import partition_indices
from gep_fed.per_example import per_example_gradients, validate_model
from gep_fed.sampling import PoissonSampler
from gep_fed.step import GEPStep, make_mechanism
from gep_fed.subspace import AnchorSubspace
from gep_fed.tasks import load_task
from gep_fed.wire import RoundConfig


def resolve_device(preference: str = "auto") -> torch.device:
    """``cuda`` when available (or asked for), else ``cpu``."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available here")
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(preference)


class Site:
    """One site: its private data, model replica, noise and (client-side mode) ledger.

    Args:
        site_id: recorded in the ledger.
        model: a model of the federation's architecture (its weights are overwritten).
        inputs, targets: the site's private examples (never leave this object).
        ledger: the site's own ledger (client-side mode), on the site's disk.
        noise: the site's noise (client-side mode); cryptographically seeded by default.
        sampler_generator: Poisson sampling randomness (None: seeded from the OS).
    """

    def __init__(
        self,
        site_id: str,
        model: nn.Module,
        inputs: torch.Tensor,
        targets: torch.Tensor,
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
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.inputs, self.targets = inputs.to(self.device), targets.to(self.device)
        self.ledger = ledger
        self.noise = noise if noise is not None else NoiseSource()
        self.sampler_generator = sampler_generator
        self.max_chunk = max_chunk

    @property
    def num_examples(self) -> int:
        return len(self.inputs)

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict({k: v.to(self.device) for k, v in state.items()})

    def _sample(self, rate: float) -> torch.Tensor:
        return PoissonSampler(self.num_examples, rate, 1, self.sampler_generator).sample()

    def central_sums(self, subspace: AnchorSubspace | None, rc: RoundConfig) -> ClippedSums:
        """Clipped sums of one Poisson sample at the current weights (unnoised: for a
        trusted server only)."""
        mechanism = make_mechanism(_gep_config(rc))
        layout = rc.parameter_layout()
        idx = self._sample(rc.sample_rate).to(self.device)
        grads = per_example_gradients(
            self.model,
            F.cross_entropy,
            self.inputs[idx],
            self.targets[idx],
            layout,
            self.max_chunk,
        )
        sub = subspace.to(self.device) if subspace is not None else None
        return mechanism.clipped_sums(grads, sub)

    def local_update(self, subspace: AnchorSubspace | None, rc: RoundConfig) -> torch.Tensor:
        """``rc.local_steps`` private steps from the current weights; returns the noisy
        model delta (flattened in the round's layout order).

        Raises ``BudgetExceededError`` before computing anything if the steps would exceed
        this site's budget.
        """
        if self.ledger is None:
            raise ValueError(f"site {self.site_id}: client-side mode needs the site's ledger")
        if rc.mechanism == "langevin":
            return self._langevin_update(rc)
        events = [
            PrivacyEvent(
                rc.mechanism,
                rc.noise_multiplier,
                rc.sample_rate,
                party=self.site_id,
                round=rc.round,
            )
            for _ in range(rc.local_steps)
        ]
        self.ledger.check_budget(events)
        layout = rc.parameter_layout()
        layout.check_matches(self.model)
        before = layout.flatten_params(self.model).clone()
        step = GEPStep(
            self.model,
            None,
            _gep_config(rc),
            dataset_size=self.num_examples,
            noise=self.noise,
            ledger=self.ledger,
            party=self.site_id,
            round=rc.round,
        )
        if subspace is not None:
            step.set_subspace(subspace)
        opt = torch.optim.SGD(self.model.parameters(), lr=rc.local_lr, momentum=rc.local_momentum)
        for _ in range(rc.local_steps):
            idx = self._sample(rc.sample_rate).to(self.device)
            opt.zero_grad(set_to_none=True)
            step(self.inputs[idx], self.targets[idx])
            opt.step()
        return layout.flatten_params(self.model) - before

    def _langevin_update(self, rc: RoundConfig) -> torch.Tensor:
        """Multi-pass Langevin steps continuing the schedule across rounds (step index
        ``(round - 1) * local_steps + 1`` onward), each accounted in the site's ledger."""
        layout = rc.parameter_layout()
        before = layout.flatten_params(self.model).clone()
        trainer = LangevinTrainer(
            self.model,
            _langevin_config(rc, self.num_examples),
            ledger=self.ledger,
            noise=self.noise,
            generator=self.sampler_generator,
            party=self.site_id,
        )
        first = (rc.round - 1) * rc.local_steps + 1
        self.ledger.check_budget(
            trainer.multi_pass_events(self.num_examples, first, rc.local_steps)
        )
        trainer.fit(self.inputs, self.targets, first_step=first)
        return layout.flatten_params(self.model) - before


def _langevin_config(rc: RoundConfig, n: int) -> LangevinConfig:
    return LangevinConfig(
        schedule="multi-pass",
        grad_bound=rc.clip_norm,
        beta0=rc.langevin_beta0,
        steps=rc.local_steps,
        batch=max(1, round(rc.sample_rate * n)),
    )


def _gep_config(rc: RoundConfig) -> GEPConfig:
    return GEPConfig(
        mechanism=rc.mechanism,
        noise_multiplier=rc.noise_multiplier,
        sample_rate=rc.sample_rate,
        clip_embedding=rc.clip_embedding,
        clip_residual=rc.clip_residual,
        clip_norm=rc.clip_norm,
    )


@dataclass(frozen=True)
class SiteConfig:
    """A site's own settings, from its node config: never from the server.

    Attributes:
        site_id: how the site names itself in its ledger and replies.
        data_path: the site's private data, an ``.npz`` with ``images`` and ``labels``, or a
            MedMNIST file (its train split). Empty in simulation (a partition is used).
        partition_id, num_partitions: the simulated site's share of the pooled data.
        ledger_path: the site's own ledger (client-side mode); it persists across runs, so
            the budget covers everything the site ever released from this data.
        epsilon_budget, delta: the site's own budget; refuses rounds beyond it.
        device: "auto" (cuda when available), "cpu" or "cuda".
    """

    site_id: str
    data_path: str = ""
    partition_id: int | None = None
    num_partitions: int | None = None
    ledger_path: str = ""
    epsilon_budget: float | None = None
    delta: float = 1e-5
    device: str = "auto"

    @classmethod
    def from_node_config(
        cls, node_config: Mapping[str, object], fed: FederationConfig, run_directory: str
    ) -> SiteConfig:
        known = {
            "site-id",
            "data-path",
            "partition-id",
            "num-partitions",
            "ledger-path",
            "epsilon-budget",
            "delta",
            "device",
        }
        unknown = sorted(set(node_config) - known)
        if unknown:
            raise ConfigError(f"unknown node config key(s) {unknown}; known: {sorted(known)}")
        pid = node_config.get("partition-id")
        simulated = pid is not None
        if not simulated and not node_config.get("data-path"):
            raise ConfigError("node config needs 'data-path' (the site's private data file)")
        if not simulated and fed.mode == "client" and not node_config.get("ledger-path"):
            raise ConfigError(
                "node config needs 'ledger-path' in client-side mode: the site's own ledger "
                "must live on the site's disk and persist across runs"
            )
        site_id = str(node_config.get("site-id", f"site-{pid}" if simulated else "site"))
        ledger = str(node_config.get("ledger-path", "")) or str(
            Path(run_directory) / "sites" / f"{site_id}" / "ledger.json"
        )
        budget = node_config.get("epsilon-budget", fed.target_epsilon)
        if fed.noise_multiplier == 0:  # noise switched off: a non-private run has no budget
            budget = None
        cfg = cls(
            site_id=site_id,
            data_path=str(node_config.get("data-path", "")),
            partition_id=None if pid is None else int(pid),
            num_partitions=(
                None
                if node_config.get("num-partitions") is None
                else int(node_config["num-partitions"])
            ),
            ledger_path=ledger,
            epsilon_budget=None if budget is None else float(budget),
            delta=float(node_config.get("delta", fed.delta)),
            device=str(node_config.get("device", fed.device)),
        )
        if cfg.device not in DEVICES:
            raise ConfigError(
                f"node config device must be one of {list(DEVICES)}, got {cfg.device!r}"
            )
        if cfg.epsilon_budget is not None and not (cfg.epsilon_budget > 0):
            raise ConfigError(f"node config epsilon-budget must be > 0, got {cfg.epsilon_budget}")
        if not (0 < cfg.delta < 1):
            raise ConfigError(f"node config delta must be in (0, 1), got {cfg.delta}")
        return cfg


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
