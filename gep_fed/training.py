"""Training on one machine: the private loop (``GEPStep`` on the Poisson samples its accounting
assumes, every step in a ledger) and the non-private baseline, with the hooks experiments
need: public labels for the anchors, iterate averaging, a callback per step.

Used by ``gep-fed compare`` (the pooled-data reference a federation is measured against), the
benchmarks and the simulations. Evaluation is the task's (``gep_fed.data.metrics.evaluate``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.mechanisms.multiplicity import AugmentationMultiplicity
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.mechanisms.step import GEPStep
from gep_fed.mechanisms.step_config import GEPConfig


@dataclass(frozen=True)
class OptimizerConfig:
    """SGD with momentum; the learning rate is divided by 10 after ``decay_at`` of the steps."""

    lr: float = 0.5
    momentum: float = 0.9
    weight_decay: float = 0.0
    decay_at: float | None = None

    def make(self, model: nn.Module, steps: int):
        opt = torch.optim.SGD(
            model.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
        milestones = [] if self.decay_at is None else [int(self.decay_at * steps)]
        return opt, torch.optim.lr_scheduler.MultiStepLR(opt, milestones, gamma=0.1)


@dataclass
class TrainResult:
    """The final evaluation's accuracy, the run's ledger (None without privacy), and the
    evaluations along the way."""

    accuracy: float
    ledger: PrivacyLedger | None
    history: list[dict] = field(default_factory=list)

    @property
    def epsilon(self) -> float | None:
        return None if self.ledger is None else self.ledger.epsilon()


def train_private(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    public_x: torch.Tensor | None,
    config: GEPConfig,
    steps: int,
    optimizer: OptimizerConfig,
    *,
    delta: float = 1e-5,
    generator: torch.Generator | None = None,
    noise: NoiseSource | None = None,
    public_labels: torch.Tensor | None = None,
    average_iterates: float | None = None,
    multiplicity: AugmentationMultiplicity | None = None,
    evaluate_fn: Callable[[nn.Module], dict] | None = None,
    eval_every: int = 0,
    on_step: Callable[[int, GEPStep], None] | None = None,
    progress: bool = False,
) -> TrainResult:
    """``steps`` private steps on Poisson samples of ``(x, y)``; returns the final evaluation.

    Args:
        generator: drives sampling and public randomness; pass one only in tests and
            benchmarks (a known sampling seed voids privacy amplification by sampling).
        public_labels: the public data's own labels (``anchor_labels="true"``).
        average_iterates: evaluate an exponential moving average of the parameters with this
            decay instead of the last iterate (post-processing: no privacy cost).
        multiplicity: each example's gradient averaged over augmented copies before it is
            clipped (``AugmentationMultiplicity``; no privacy cost).
        evaluate_fn: ``evaluate_fn(model) -> metrics``, every ``eval_every`` steps (0: at the
            end only) and at the end; the result's ``accuracy`` is the final one's.
        on_step: called after each step with the step's index (from 1) and the ``GEPStep``.
    """
    ledger = PrivacyLedger(delta)
    step = GEPStep(
        model,
        public_x,
        config,
        dataset_size=len(x),
        public_labels=public_labels,
        noise=noise,
        ledger=ledger,
        generator=generator,
        multiplicity=multiplicity,
    )
    opt, sched = optimizer.make(model, steps)
    averaged = None
    if average_iterates is not None:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(average_iterates))
    sampler = PoissonSampler(len(x), config.contract.sample_rate, steps, generator=generator)
    history = []
    for i, idx in enumerate(tqdm(sampler, disable=not progress, desc=config.contract.mechanism)):
        opt.zero_grad(set_to_none=True)
        step(x[idx], y[idx])
        opt.step()
        sched.step()
        if averaged is not None:
            averaged.update_parameters(model)
        if on_step is not None:
            on_step(i + 1, step)
        if evaluate_fn and eval_every and (i + 1) % eval_every == 0:
            history.append({"step": i + 1, **evaluate_fn(model)})
    final_model = model if averaged is None else averaged.module
    final = evaluate_fn(final_model) if evaluate_fn else {}
    return TrainResult(final.get("accuracy", float("nan")), ledger, history)


def train_nonprivate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    batch_size: int,
    optimizer: OptimizerConfig,
    *,
    generator: torch.Generator | None = None,
    evaluate_fn: Callable[[nn.Module], dict] | None = None,
) -> TrainResult:
    """``steps`` ordinary minibatch SGD steps on shuffled batches (no privacy), each copied to
    the model's device."""
    device = next(model.parameters()).device
    opt, sched = optimizer.make(model, steps)
    order = torch.randperm(len(x), generator=generator)
    pos = 0
    for _ in range(steps):
        if pos + batch_size > len(x):
            order, pos = torch.randperm(len(x), generator=generator), 0
        idx = order[pos : pos + batch_size]
        pos += batch_size
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx].to(device)), y[idx].to(device)).backward()
        opt.step()
        sched.step()
    final = evaluate_fn(model) if evaluate_fn else {}
    return TrainResult(final.get("accuracy", float("nan")), None)
