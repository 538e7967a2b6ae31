"""The federation server's logic (no Flower): anchors, round configs, aggregation, accounting.

Central mode: the server adds one noise draw to the sum of the sites' clipped sums,
reconstructs with the *declared* ``q * N`` and steps its optimiser; its ledger records one
step per round for the union of the sites' data. Client-side mode: the server averages the
sites' noisy deltas; its ledger tracks what each participating site is expected to have
spent (each site's own ledger is the authority and enforces the site's budget). Distributed
mode: as central mode, but the noise arrives inside the secure sum of the sites' quantised
shares, which the server decodes (``apply_distributed``); its ledger records the release as
distributed, with the accounting every site uses.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import torch

from gep_fed.accounting.events import PrivacyEvent
from gep_fed.accounting.ledger import LedgerError, PrivacyLedger
from gep_fed.data.metrics import predict
from gep_fed.data.task import Task, dataset_targets, stack_examples
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import BEST_MODEL, CHECKPOINT, CONFIG, MODEL, RunDirectory
from gep_fed.federation.site import resolve_device
from gep_fed.federation.wire import (
    CLIPPED_SUMS,
    MODEL_DELTA,
    RoundConfig,
    WireError,
    as_wire_array,
    basis_bytes,
    checked_basis,
    decode_anchors,
    decode_basis,
    encode_anchors,
    encode_basis,
    encode_state,
)
from gep_fed.mechanisms.anchors import compute_anchor_subspace, rebuild_anchor_subspace
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.langevin import check_linear
from gep_fed.mechanisms.mechanism import ClippedSums
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.observer import NoisyRelease, Observers, ReleaseObserver
from gep_fed.mechanisms.per_example import validate_model
from gep_fed.mechanisms.step import write_gradient
from gep_fed.mechanisms.subspace import AnchorSubspace
from gep_fed.validation import ConfigError

log = logging.getLogger("gep_fed.server")


@dataclass(frozen=True)
class RoundPlan:
    """What the server sends in one round. ``basis`` is None when the sites already hold
    the basis ``config.basis_id`` (or the mechanism needs none)."""

    config: RoundConfig
    state: dict
    basis: dict | None
    anchor_seconds: float
    anchor_projection_error: float | None
    basis_directions: int | None  # the basis size the sites use (None: no basis)


def validation_score(validation: Mapping[str, float]) -> float | None:
    """What the best model is chosen by: balanced accuracy, else accuracy (None: neither)."""
    score = validation.get("balanced_accuracy", validation.get("accuracy"))
    return float(score) if score is not None and math.isfinite(score) else None


def best_validation(metrics: Sequence[Mapping]) -> tuple[float | None, int | None]:
    """The best validation score of a run's metrics rows and its round (the first of equal
    ones), as ``FederationServer.keep_if_best`` keeps its model; (None, None): none."""
    best: tuple[float | None, int | None] = (None, None)
    for row in metrics:
        score = validation_score({k[4:]: v for k, v in row.items() if k.startswith("val_")})
        if score is not None and (best[0] is None or score > best[0]):
            best = (score, row["round"])
    return best


def _public_sample(
    task: Task, count: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` public examples (inputs and their labels), chosen with public
    randomness; the anchor subspace draws from these."""
    public = task.public_dataset()
    pick = torch.randperm(len(public), generator=generator)[:count].sort().values
    return stack_examples(public, pick.tolist())


# How many times the model's largest weight (and 1) a site's delta may move a weight: far
# beyond any noised update (a step size of 10 over 100 steps of noise std 10 moves ~1e3).
IMPLAUSIBLE_DELTA = 1e6


class FederationServer:
    """Holds the global model and everything the server does between messages.

    Args:
        cfg: the run's configuration.
        task: the task: the server builds its model and reads only its public anchors and its
            evaluation data.
        run: the run directory (ledger, metrics, checkpoints).
        total_examples: N, the declared union size: central and distributed mode divide
            the noisy sum by ``q N``; in client mode each site divides its own by ``q N /
            num_sites`` (``RoundConfig.site_examples``). Required in client mode.
        observers: release observers (``gep_fed.mechanisms.observer``): each sees every
            central release once the server's noise is added. The server forms no clipped
            sums, so it asks none of them for rows. Never attached in a real run.
        round_offset: added to every round number the sites see (``wire_round``): a
            search's trials share one Flower run, whose rounds must keep increasing at every
            site (``gep_fed.flower.search``). 0 for a run of its own.
        scored: the sites will be asked to score the final model (``RoundLoop.score_sites``);
            every round config says so, so a site plans that release from the first round.
        selection: the trial's terms in a private selection with a random number of trials
            (``wire.SelectionTerms`` as JSON), sent in every round config; "" outside one.
    """

    def __init__(
        self,
        cfg: FederationConfig,
        task: Task,
        run: RunDirectory,
        total_examples: int | None,
        *,
        observers: Iterable[ReleaseObserver] = (),
        round_offset: int = 0,
        scored: bool = False,
        selection: str = "",
    ) -> None:
        self.cfg = cfg
        self.run = run
        self.round_offset = round_offset
        self.scored = scored
        self.selection = selection
        self.task = task
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)  # the initial model (public)
        self.model = task.build_model().to(self.device)
        validate_model(self.model)  # BatchNorm named, with its fix, before any anchor step
        if cfg.mechanism == "langevin":
            check_linear(self.model)  # before any round: its guarantee needs a convex loss
        self.layout = ParameterLayout.from_model(self.model)
        if cfg.augmentation_copies and task.augmentation() is None:
            raise ConfigError(
                f"augmentation_copies {cfg.augmentation_copies}: task {cfg.task!r} (model "
                f"{cfg.model!r}) has no augmentation (Task.augmentation); use 0"
            )
        if total_examples and cfg.delta * total_examples >= 1:
            # (epsilon, delta) with delta >= 1/N allows publishing one of the N examples whole
            raise ConfigError(
                f"delta {cfg.delta:g} is not below 1/N = {1 / total_examples:.3g} for the "
                f"{total_examples} examples of the sites' data: a guarantee at it allows one "
                "example to leak whole; give a delta well below 1/N"
            )
        self.total_examples = total_examples
        # client mode: the public size every site normalises by, never a site's own count
        self.site_examples = 0
        if not cfg.noise_mode.server_steps:
            if not total_examples:
                raise ConfigError(
                    "client mode needs total_examples, N, the declared size of the sites' "
                    "data: each site normalises its noisy sums by the public N / num_sites"
                )
            self.site_examples = max(1, round(total_examples / cfg.num_sites))
        # Langevin sites add their own noise from beta0 and account per step themselves.
        self.langevin = cfg.mechanism == "langevin"
        # One contract, sigma resolved once: sent to every site and the source of the
        # server's own mechanism.
        self.contract = cfg.contract
        self.mechanism = self.contract.build_mechanism()
        self.gep = None if self.langevin else cfg.anchor_config
        self.generator = torch.Generator().manual_seed(cfg.seed)  # public randomness
        self.public = _public_sample(task, cfg.num_public, self.generator)
        self._basis_capped_said = False
        self.run_lock = None  # the run directory's lock, where ``open_server`` took it
        self.eval_data = task.eval_dataset()
        self.validation_data = task.validation_dataset()
        self.best: tuple[int, float] | None = None  # (round, validation score) kept so far
        self.noise = NoiseSource(cfg.noise_seed)
        owner = cfg.noise_mode.ledger_owner()
        # sigma = 0 switches the noise off: no guarantee, so no budget to enforce.
        budget = cfg.target_epsilon if self.contract.noise_multiplier > 0 else None
        self.ledger = PrivacyLedger.open(run.ledger_path, cfg.delta, budget, owner, create=True)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=cfg.server_lr, momentum=cfg.server_momentum
        )
        self.completed_rounds = 0
        # The served model (evaluated, kept, saved): the iterates' running average when
        # ema_decay > 0, started at the first update; the iterate itself otherwise.
        self.average: torch.nn.Module | None = None
        self.subspace: AnchorSubspace | None = None
        self.basis_id = -1
        self._basis_arrays: dict | None = None
        self.observers = Observers(observers)

    # -- accounting --------------------------------------------------------------------

    def round_events(self, round_: int) -> list[PrivacyEvent]:
        """The releases one round makes (per site in client mode)."""
        if self.langevin:  # step-dependent and site-size-dependent: the sites' ledgers count
            return []
        dimension = self.quantized_dimension if self.cfg.noise_mode.secure_sum else 0
        return self.cfg.noise_mode.server_events(
            self.contract, round_, self.cfg.local_steps, dimension
        )

    @property
    def num_basis(self) -> int | None:
        """k of the current basis (before the first: the configured k, an upper bound)."""
        if not self.mechanism.uses_subspace:
            return None
        return self.subspace.num_basis if self.subspace is not None else self.cfg.num_basis

    @property
    def quantized_dimension(self) -> int:
        """The length of every site's quantised share in distributed mode."""
        return self.contract.quantized_dimension(self.num_basis, self.layout.size)

    def epsilon_spent(self, site_epsilon_max: float | None) -> float:
        """The epsilon a run shows: the federation's ledger (central mode) or each site's
        expected spend (client mode). Langevin's steps are accounted by the sites alone, so
        it shows the largest epsilon the sites' own ledgers report."""
        if self.langevin:
            return math.nan if site_epsilon_max is None else site_epsilon_max
        return self.ledger.epsilon()

    def check_budget(self, round_: int) -> None:
        """Raise ``BudgetExceededError`` if round ``round_`` would exceed the budget."""
        self.ledger.check_budget(self.round_events(round_))

    def last_round(self, round_: int) -> int:
        """The run's last round as planned at round ``round_`` (which fits the budget): the
        configured last, or the last the budget holds when a given sigma would outspend it
        (the run stops there). The sites are told it, and refuse a run they cannot finish."""
        budget, last = self.ledger.budget_epsilon, self.cfg.rounds
        one_round = self.round_events(round_)  # every round releases alike

        def fits(through: int) -> bool:
            rounds = through - round_ + 1
            events = [replace(e, steps=e.steps * rounds) for e in one_round]
            return self.ledger.epsilon_after(events) <= budget

        if budget is None or self.langevin or fits(last):
            return last
        held, over = round_, last  # bisection: the spend grows with the rounds
        while over - held > 1:
            middle = (held + over) // 2
            held, over = (middle, over) if fits(middle) else (held, middle)
        return held

    def wire_round(self, round_: int) -> int:
        """Round ``round_`` of this run as the sites number it (``round_offset`` added)."""
        return self.round_offset + round_

    # -- one round ---------------------------------------------------------------------

    def plan_round(self, round_: int) -> RoundPlan:
        """Anchor subspace (if due), the round config and the global state to send."""
        cfg = self.cfg
        anchor_seconds, proj_err = 0.0, None
        basis_id = (round_ - 1) // cfg.basis_refresh
        if self.mechanism.uses_subspace and basis_id != self.basis_id:
            result = compute_anchor_subspace(
                self.model,
                self.public[0].to(self.device),
                self.layout,
                self.gep,
                loss_fn=self.task.loss,
                public_labels=self.public[1].to(self.device),
                multilabel=self.task.kind != "multiclass",
                generator=self.generator,
                measure=True,
                with_coefficients=cfg.basis_transport == "rebuild",
            )
            # Reconstruct with the basis the sites will use: as received (float16 included),
            # or rebuilt from the anchors and coefficients as sent, the way a site does.
            try:
                if cfg.basis_transport == "rebuild":
                    self._basis_arrays = encode_anchors(result.anchors)
                    sent = decode_anchors(self._wire_arrays(), self.layout)
                    self.subspace = checked_basis(
                        rebuild_anchor_subspace(
                            self.model,
                            sent,
                            self.layout,
                            loss_fn=self.task.loss,
                            max_chunk=self.gep.max_chunk,
                        ),
                        "server",
                    )
                else:
                    self._basis_arrays = encode_basis(result.subspace, cfg.basis_dtype)
                    self.subspace = decode_basis(self._wire_arrays(), self.layout, cfg.basis_dtype)
            except WireError as err:  # the sites would refuse it: say which setting to change
                public = int(self.public[0].shape[0])
                anchors = min(cfg.num_anchors or public, public)
                raise ConfigError(
                    f"the round's basis is refused as the sites would refuse it ({err}): "
                    f"num_basis {cfg.num_basis} asks for {list(result.subspace.dims)} "
                    f"directions per group from {anchors} anchors, more than their gradients "
                    "span in some group; lower num_basis or hold more anchors"
                ) from err
            self.subspace = self.subspace.to(self.device)
            self.basis_id = basis_id
            asked = self.layout.allocate_basis(cfg.num_basis)
            if sum(self.subspace.dims) < sum(asked) and not self._basis_capped_said:
                self._basis_capped_said = True
                log.warning(
                    "num_basis %d: the basis has %d directions (%s per group, asked %s): "
                    "%d anchors span no more in some group; hold more anchors for a larger one",
                    cfg.num_basis,
                    sum(self.subspace.dims),
                    list(self.subspace.dims),
                    list(asked),
                    min(cfg.num_anchors or len(self.public[0]), len(self.public[0])),
                )
            anchor_seconds, proj_err = result.seconds, result.projection_error
        rc = RoundConfig(
            round=self.wire_round(round_),
            last_round=self.wire_round(self.last_round(round_)),
            mode=cfg.mode,
            privacy=self.contract,
            local_steps=cfg.local_steps,
            local_lr=float(cfg.local_lr),
            local_momentum=float(cfg.local_momentum),
            augmentation_copies=cfg.augmentation_copies,
            basis_id=self.basis_id if self.mechanism.uses_subspace else -1,
            basis_dtype=cfg.basis_dtype,
            layout=json.dumps(self.layout.to_dict()),
            scored=self.scored,
            # only the trusted server adds noise of its own (central mode)
            server_noise_seeded=self.noise.seeded
            and cfg.noise_mode.site_placement == "trusted-server",
            selection=self.selection,
            site_examples=self.site_examples,
        )
        return RoundPlan(
            rc,
            encode_state(self.model.state_dict()),
            self._basis_arrays if self.mechanism.uses_subspace else None,
            anchor_seconds,
            proj_err,
            sum(self.subspace.dims) if self.mechanism.uses_subspace else None,
        )

    def _wire_arrays(self) -> dict:
        return {k: as_wire_array(v) for k, v in self._basis_arrays.items()}

    def close(self) -> None:
        """The run is over: let another process run its directory."""
        if self.run_lock is not None:
            self.run_lock.close()
            self.run_lock = None

    @property
    def basis_nbytes(self) -> int:
        return basis_bytes(self._basis_arrays) if self._basis_arrays else 0

    def check_plausible(self, sums: ClippedSums, sender: str) -> None:
        """Reject clipped sums larger than clipping allows for any plausible batch.

        One site's batch is part of a Poisson sample of the union with mean ``q N``; a norm
        above ``S * (q N + 8 sd + 8)`` cannot come from honestly clipped examples. The
        rejection names the field and the bound, never the norm: the sums are unnoised site
        data, and nothing computed from them may reach the server's metrics or reports.
        """
        q = self.contract.sample_rate
        mean = q * self.total_examples
        ceiling = mean + 8 * math.sqrt(mean * (1 - q)) + 8
        mech = self.mechanism
        bounds = {
            "embedding": getattr(mech, "clip_embedding", None),
            "residual": getattr(mech, "clip_residual", getattr(mech, "clip_norm", None)),
        }
        for name, value in (("embedding", sums.embedding), ("residual", sums.residual)):
            if value is None or bounds[name] is None:
                continue
            norm = float(torch.linalg.vector_norm(value.double()))
            if norm > bounds[name] * ceiling:
                raise WireError(
                    sender,
                    f"{CLIPPED_SUMS}.{name}",
                    f"norm exceeds clip bound {bounds[name]:g} x plausible batch "
                    f"{ceiling:.0f}: not honestly clipped",
                )

    def check_plausible_delta(self, delta: torch.Tensor, sender: str) -> None:
        """Reject a site's model delta with a value above ``IMPLAUSIBLE_DELTA`` times the
        model's largest weight (and 1): no private update comes near it, and a finite one of
        3e38 left a committed model that evaluated to NaN and a run that could not resume."""
        scale = 1.0 + float(self.layout.flatten_params(self.model).abs().max())
        if float(delta.abs().max()) > IMPLAUSIBLE_DELTA * scale:
            raise WireError(
                sender,
                MODEL_DELTA,
                f"a value above {IMPLAUSIBLE_DELTA:g} x the model's scale: not a private update",
            )

    def apply_central(self, round_: int, sums: list[ClippedSums]) -> None:
        """Add the noise once to the total, reconstruct with q*N, step, account."""
        total = sums[0]
        for s in sums[1:]:
            total = total + s
        total = ClippedSums(
            *(None if t is None else t.to(self.device) for t in (total.embedding, total.residual))
        )
        self.ledger.check_budget(self.round_events(round_))
        self._step(round_, self.mechanism.add_noise(total, self.noise))

    def apply_distributed(self, round_: int, modular_sum: np.ndarray) -> None:
        """Decode the secure sum of the sites' shares (noise included), reconstruct with q*N,
        step, account."""
        self.ledger.check_budget(self.round_events(round_))
        residual = None if self.mechanism.name == "bgep" else self.layout.size
        noisy = self.contract.distributed_noise.decode(  # the rotation the sites used
            modular_sum, self.mechanism, self.wire_round(round_), (self.num_basis, residual)
        )
        self._step(
            round_,
            ClippedSums(
                *(
                    None if t is None else t.to(self.device)
                    for t in (noisy.embedding, noisy.residual)
                ),
                noised=True,
            ),
        )

    def _step(self, round_: int, noisy: ClippedSums) -> None:
        self.observers.notify(
            NoisyRelease(
                noisy, self.contract.noise_multiplier, self.contract.sample_rate, self.mechanism
            )
        )
        estimate = self.mechanism.reconstruct(
            noisy, self.subspace, self.contract.sample_rate * self.total_examples
        )
        self.optimizer.zero_grad(set_to_none=True)
        write_gradient(self.model, self.layout, estimate)
        self.optimizer.step()
        self._update_average(round_)
        self._commit(round_)

    def apply_client(self, round_: int, deltas: list[torch.Tensor]) -> None:
        """Average the sites' noisy deltas (equal weights: site sizes are not used) and step."""
        mean = torch.stack([d.to(self.device) for d in deltas]).mean(0)
        self.optimizer.zero_grad(set_to_none=True)
        write_gradient(self.model, self.layout, -mean)
        self.optimizer.step()
        self._update_average(round_)
        self._commit(round_)

    def _update_average(self, round_: int) -> None:
        """One step of the running average of the iterates. The decay warms up as
        ``min(decay, (1 + t) / (10 + t))`` so that early rounds do not hold the initial
        model. Post-processing of released updates: no privacy cost."""
        decay = self.cfg.ema_decay
        if not decay:
            return
        if self.average is None:
            self.average = copy.deepcopy(self.model)
            return
        weight = min(decay, (1 + round_) / (10 + round_))
        with torch.no_grad():
            for avg, cur in zip(
                self.average.state_dict().values(), self.model.state_dict().values(), strict=True
            ):
                if avg.is_floating_point():
                    avg.mul_(weight).add_(cur, alpha=1 - weight)
                else:
                    avg.copy_(cur)

    @property
    def served_model(self) -> torch.nn.Module:
        """The model evaluated, kept and saved: the running average, else the iterate."""
        return self.model if self.average is None else self.average

    def evaluate(self) -> dict:
        """The task's metrics on the server's evaluation data, with the share of its most
        frequent class (``majority_rate``: what always predicting that class scores)."""
        metrics = self.task.metrics(*predict(self.served_model, self.eval_data, device=self.device))
        return {**metrics, "majority_rate": self.majority_rate}

    def validate(self) -> dict | None:
        """The task's metrics on its validation data (None when it has none)."""
        if self.validation_data is None:
            return None
        return self.task.metrics(
            *predict(self.served_model, self.validation_data, device=self.device)
        )

    def keep_if_best(self, round_: int, validation: Mapping[str, float]) -> bool:
        """Save the model as ``best_model.pt`` if this round's validation score (balanced
        accuracy, else accuracy) beats every earlier round's; returns whether it did."""
        score = validation_score(validation)
        if score is None:
            return False
        if self.best is not None and score <= self.best[1]:
            return False
        self.best = (round_, float(score))
        self.run.save_torch(
            BEST_MODEL,
            {
                "model": self.served_model.state_dict(),
                "layout": self.layout.to_dict(),
                "round": round_,
                "validation": dict(validation),
            },
        )
        return True

    @cached_property
    def majority_rate(self) -> float:
        targets = np.asarray(dataset_targets(self.eval_data))
        if targets.ndim != 1 or not len(targets):  # multi-label: no single majority class
            return float("nan")
        return float(np.bincount(targets.astype(np.int64)).max() / len(targets))

    # -- persistence ---------------------------------------------------------------------

    def _commit(self, round_: int) -> None:
        """Account the round, then make it durable: the checkpoint (model and ledger
        together, one atomic write) first, then the ledger file. A crash in between is
        repaired by ``resume`` from the checkpoint, so no round is lost or counted twice."""
        self.ledger.record(*self.round_events(round_), save=False)
        self.completed_rounds = round_
        self.run.save_torch(
            CHECKPOINT,
            {
                "round": round_,
                "model": self.model.state_dict(),
                "average": None if self.average is None else self.average.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(),
                # a seeded source's position (a resumed test run must not redraw its noise);
                # empty for the OS-keyed one, whose state would let a reader remove its noise
                "noise": self.noise.state_dict(),
                "ledger": self.ledger.to_json(),
                "config_sha256": self.run.config_digest(),
                "saved": time.time(),
            },
        )
        self.ledger.save()

    def save_model(self) -> None:
        self.run.save_torch(
            MODEL, {"model": self.served_model.state_dict(), "layout": self.layout.to_dict()}
        )

    def resume(self) -> int:
        """Restore the last checkpoint (if any); returns the last completed round."""
        ckpt = self.run.load_torch(CHECKPOINT)
        # the metrics' applied rounds: a server ledger without steps (Langevin's sites account
        # for themselves) cannot tell a lost or older checkpoint
        applied = max((r["round"] for r in self.run.read_metrics() if r.get("applied")), default=0)
        if ckpt is None:
            if self.ledger.steps:
                raise LedgerError(
                    f"{self.ledger.path} records {self.ledger.steps} step(s) but there is no "
                    "checkpoint to resume from; refusing to start over on a spent ledger"
                )
            if applied:
                raise LedgerError(
                    f"{self.run.path} records round {applied} applied but holds no checkpoint "
                    "to resume from; refusing to start over (restore the checkpoint, or start "
                    "a new run)"
                )
            return 0
        if ckpt.get("config_sha256") not in (None, self.run.config_digest()):
            raise LedgerError(
                f"{CHECKPOINT} was written by a run of other settings than {self.run.path}'s "
                f"{CONFIG}: a checkpoint of another run; refusing to resume (restore this run's "
                "own, or start a new run)"
            )
        if int(ckpt["round"]) < applied:
            raise LedgerError(
                f"{CHECKPOINT} holds round {int(ckpt['round'])}, but {self.run.path} records "
                f"round {applied} applied: an older checkpoint; refusing to resume (restore the "
                "newest one)"
            )
        saved = PrivacyLedger.from_json(ckpt["ledger"], source=f"checkpoint {CHECKPOINT}")
        on_disk = self.ledger.events
        if on_disk != saved.events[: len(on_disk)]:
            raise LedgerError(
                f"{self.ledger.path} and {CHECKPOINT} disagree about what was released; "
                "refusing to resume (restore both from the same backup)"
            )
        if len(on_disk) < len(saved.events):  # crashed between checkpoint and ledger write
            self.ledger.recover(saved.events)
        self.model.load_state_dict(ckpt["model"])
        if ckpt.get("average") is not None:
            self.average = copy.deepcopy(self.model)
            self.average.load_state_dict(ckpt["average"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.generator.set_state(ckpt["generator"])
        self.noise.load_state_dict(ckpt.get("noise", {}))
        self.completed_rounds = int(ckpt["round"])
        best = self.run.load_torch(BEST_MODEL)
        if best is not None and int(best["round"]) <= self.completed_rounds:
            self.best = (int(best["round"]), validation_score(best["validation"]))
        return self.completed_rounds
