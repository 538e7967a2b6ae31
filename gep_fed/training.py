"""Training on one machine: the private loop (``GEPStep`` on the Poisson samples its accounting
assumes, every step in a ledger) and the non-private baseline, with the hooks experiments
need: public labels for the anchors, iterate averaging, a callback per step, and checkpoints
from which an interrupted run resumes exactly.

Used by ``gep-fed compare`` (the pooled-data reference a federation is measured against), the
benchmarks and the simulations. Evaluation is the task's (``gep_fed.data.metrics.evaluate``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.files import write_atomically
from gep_fed.mechanisms.multiplicity import AugmentationMultiplicity
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.mechanisms.step import GEPStep
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.validation import NON_NEGATIVE, ConfigError

log = logging.getLogger(__name__)
_clock = time.monotonic  # when checkpoints are due (replaced in tests)


@dataclass(frozen=True)
class Checkpoint:
    """Where ``train_private`` keeps the state of its loop, so that a run interrupted (a
    session's end, a crash) resumes where it was saved and ends as the unbroken run would.

    The file holds the model, the optimiser, the ledger of the steps taken and the state of
    the step (``GEPStep.state_dict``); the randomness of the sampling and of a seeded noise
    source only when the caller fixed them (tests and benchmarks: a real run's secret
    randomness is never written, and resumes from fresh draws): post-processing of the
    noised releases and public data, like the model, beside the evaluations ``evaluate_fn``
    made so far (as private as the data it evaluates on). It is removed when the run
    finishes; a file written for other inputs is refused, never overwritten.

    Attributes:
        path: the checkpoint file.
        interval: seconds between saves. A save waits for a step after which the anchor
            subspace is recomputed, so that the subspace (k times the model's size) need
            not be written, unless twice the interval has passed.
        generators: other seeded generators the run draws from (an augmentation's), saved
            and restored with the rest.
    """

    path: Path
    interval: float = 300.0
    generators: tuple[torch.Generator, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        NON_NEGATIVE.check("checkpoint interval (seconds)", self.interval)
        for gen in self.generators:
            if not isinstance(gen, torch.Generator):
                kind = type(gen).__name__
                raise ConfigError(f"checkpoint generators must be torch.Generators, got {kind}")


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
    """The final evaluation's accuracy, the run's ledger (None without privacy), the
    evaluations along the way, and the step a checkpoint resumed the run from (0: none)."""

    accuracy: float
    ledger: PrivacyLedger | None
    history: list[dict] = field(default_factory=list)
    resumed_at: int = 0

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
    checkpoint: Checkpoint | None = None,
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
        checkpoint: save the loop's state there and resume from it (``Checkpoint``).
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
    copies = None if multiplicity is None else multiplicity.copies
    # the private data by its shape only: a digest of it would be data-dependent state
    # outside the guarantee, in a file the guarantee is meant to cover
    private = [(t.dtype, tuple(t.shape)) for t in (x, y)]
    inputs = (private, public_x, config, steps, optimizer, average_iterates, copies)
    fingerprint = "" if checkpoint is None else _fingerprint(*inputs)
    loop = _Loop(model, opt, sched, averaged, step, generator, checkpoint, fingerprint)
    start, history = loop.resume()
    sampler = PoissonSampler(
        len(x), config.contract.sample_rate, steps - start, generator=generator
    )
    batches = tqdm(sampler, disable=not progress, desc=config.contract.mechanism, initial=start)
    for i, idx in enumerate(batches, start):
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
        if i + 1 < steps:
            loop.save_if_due(i + 1, history)
    if checkpoint is not None:
        checkpoint.path.unlink(missing_ok=True)
    final_model = model if averaged is None else averaged.module
    final = evaluate_fn(final_model) if evaluate_fn else {}
    return TrainResult(final.get("accuracy", float("nan")), ledger, history, start)


def _fingerprint(*inputs) -> str:
    """What a checkpoint must have been written for: the private data's shapes, the public
    data, the settings, the length."""
    h = hashlib.sha256()
    for item in inputs:
        if isinstance(item, torch.Tensor):
            h.update(repr((item.dtype, tuple(item.shape))).encode())
            h.update(item.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(item).encode())
    return h.hexdigest()


@dataclass
class _Loop:
    """The state of ``train_private``'s loop, saved to and restored from a ``Checkpoint``."""

    model: nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    averaged: nn.Module | None
    step: GEPStep
    generator: torch.Generator | None
    checkpoint: Checkpoint | None
    fingerprint: str
    saved_at: float = field(default_factory=lambda: _clock())

    def _generators(self) -> list[torch.Generator]:
        own = [] if self.generator is None else [self.generator]
        return own + list(self.checkpoint.generators)

    def resume(self) -> tuple[int, list[dict]]:
        """The step to start from and the evaluations so far (0 and none without a file)."""
        if self.checkpoint is None or not self.checkpoint.path.exists():
            return 0, []
        path = self.checkpoint.path
        try:
            # the file is this machine's own (written below), like any model it trains
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:
            raise ValueError(
                f"checkpoint {path} cannot be read ({err}); it is left as it is: move it away "
                "to start the run over"
            ) from err
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError(
                f"checkpoint {path} was written for other data, settings or length than this "
                "run's; it is left as it is: give this run another path, or move it away"
            )
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        if self.averaged is not None:
            self.averaged.load_state_dict(state["averaged"])
        self.step.ledger.recover(PrivacyLedger.from_json(state["ledger"], str(path)).events)
        self.step.load_state_dict(state["step"])
        for gen, gen_state in zip(self._generators(), state["generators"], strict=True):
            gen.set_state(gen_state)
        log.info("resuming from %s at step %d", path, state["done"])
        return state["done"], state["history"]

    def save_if_due(self, done: int, history: list[dict]) -> None:
        if self.checkpoint is None:
            return
        elapsed = _clock() - self.saved_at
        # wait for a step whose subspace is recomputed next, unless that is long in coming
        if elapsed < self.checkpoint.interval or (
            not self.step.refresh_due and elapsed < 2 * self.checkpoint.interval
        ):
            return
        state = {
            "fingerprint": self.fingerprint,
            "done": done,
            "history": history,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "averaged": None if self.averaged is None else self.averaged.state_dict(),
            "ledger": self.step.ledger.to_json(),
            "step": self.step.state_dict(),
            "generators": [g.get_state() for g in self._generators()],
        }
        write_atomically(self.checkpoint.path, lambda fh: torch.save(state, fh))
        self.saved_at = _clock()


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
