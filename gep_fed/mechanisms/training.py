"""Centralised training loops: private (GEP, B-GEP, GP) and non-private, and evaluation.

Used by benchmarks and as the pooled-data reference a federation is measured against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from gep_fed.accounting.ledger import PrivacyLedger
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
    accuracy: float
    epsilon: float | None
    history: list[dict] = field(default_factory=list)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> dict:
    """Accuracy, mean cross-entropy and, for two classes, ROC AUC."""
    model.eval()
    logits = torch.cat([model(x[i : i + batch]) for i in range(0, len(x), batch)])
    model.train()
    out = {
        "accuracy": float((logits.argmax(1) == y).float().mean()),
        "loss": float(F.cross_entropy(logits, y)),
    }
    if logits.shape[1] == 2:
        out["auc"] = roc_auc(logits.softmax(1)[:, 1], y)
    return out


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (probability a positive outranks a negative; ties count 1/2)."""
    from sklearn.metrics import roc_auc_score

    if labels.min() == labels.max():
        return float("nan")
    return float(roc_auc_score(labels.cpu().numpy(), scores.cpu().numpy()))


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
    evaluate_fn: Callable[[nn.Module], dict] | None = None,
    eval_every: int = 0,
    progress: bool = False,
) -> TrainResult:
    """``steps`` private steps on Poisson samples of ``(x, y)``; returns the final evaluation.

    ``generator`` drives sampling and public randomness; pass one only in tests and benchmarks.
    """
    ledger = PrivacyLedger(delta)
    step = GEPStep(
        model,
        public_x,
        config,
        dataset_size=len(x),
        noise=noise,
        ledger=ledger,
        generator=generator,
    )
    opt, sched = optimizer.make(model, steps)
    sampler = PoissonSampler(len(x), config.contract.sample_rate, steps, generator=generator)
    history = []
    for i, idx in enumerate(tqdm(sampler, disable=not progress, desc=config.contract.mechanism)):
        opt.zero_grad(set_to_none=True)
        step(x[idx], y[idx])
        opt.step()
        sched.step()
        if evaluate_fn and eval_every and (i + 1) % eval_every == 0:
            history.append({"step": i + 1, **evaluate_fn(model)})
    final = evaluate_fn(model) if evaluate_fn else {}
    return TrainResult(final.get("accuracy", float("nan")), ledger.epsilon(), history)


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
    """``steps`` ordinary minibatch SGD steps on shuffled batches (no privacy)."""
    opt, sched = optimizer.make(model, steps)
    order = torch.randperm(len(x), generator=generator)
    pos = 0
    for _ in range(steps):
        if pos + batch_size > len(x):
            order, pos = torch.randperm(len(x), generator=generator), 0
        idx = order[pos : pos + batch_size]
        pos += batch_size
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        sched.step()
    final = evaluate_fn(model) if evaluate_fn else {}
    return TrainResult(final.get("accuracy", float("nan")), None)
