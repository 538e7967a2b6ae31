"""Langevin DP-SGD (Ma, Marinov & Zhang): noisy SGD with a Gaussian prior, for convex models.

Algorithm 1 of the paper, from ``w_1 ~ N(0, beta0 I)``: a minibatch gradient step
``w~ = w - eta_t G(w)``, then ``w_t ~ N((1 - lambda_t eta_t) w~, lambda_t eta_t (2 - lambda_t eta_t)
beta0 I)``. Per-example clipping to ``G`` enforces the gradient bound the analysis assumes.

Two schedules, private under different neighbouring relations (their epsilons do not compose,
and the accountant refuses to mix them):

- **single pass** (Theorem 1, Proposition 4): constant ``eta``, ``lambda_t = 1 / (t eta)``,
  minibatch sizes ``b_t = ceil(sqrt(T / (2 (T - t + 1))))``, each example used at most once. Only
  the *last iterate* is private, under **replace-one** adjacency (one example replaced by
  another: what privacy amplification by iteration bounds). Two corrections to the paper, both
  found by direct computation: (1) these sizes sum to about 1.8 T, not at most T, so T is the
  largest number of steps whose batches fit in the n examples (about n / 1.8); (2) the bound the
  proof applies (Feldman et al. 2020, Theorem 3.1) gives ``(alpha, 2 alpha eta^2 G^2 F / beta0)``
  -RDP with ``F = max_tau 1 / (b_tau^2 sum_{t >= tau} 1/t)``, which is up to 2 for these sizes
  (the paper's proof drops the 2 in ``b_t``). We account with the exact F: one Gaussian
  mechanism of noise multiplier ``sqrt(beta0 / (4 eta^2 G^2 F))``. The bound needs every step to
  be non-expansive: a convex, L-smooth per-example loss, ``eta <= 2 / L``, and a clip that never
  binds (a binding clip can expand distances). The trainer enforces these for softmax
  cross-entropy on one ``nn.Linear`` whose inputs have norm at most a declared
  ``feature_norm_bound`` R (checked on the data): gradients are at most
  ``sqrt(2 (R^2 + 1_bias))`` and ``L <= (R^2 + 1_bias) / 2``.
- **multi pass** (Theorem 2's schedule):
  ``eta_t = sqrt(beta0) / (G sqrt(8 ln(2.5 t^2 / (n delta)) t))``, ``lambda_1 = 1 / eta_1``,
  ``lambda_t = 1/eta_t - 1/eta_{t-1}``, on Poisson samples of expected size ``batch``. Every
  iterate is released, under **add-remove** adjacency, and each step is accounted as what it
  is: a Poisson-subsampled Gaussian mechanism on ``(1 - lambda_t eta_t) eta_t sum_i clip(g_i) /
  batch`` (sensitivity ``(1 - lambda_t eta_t) eta_t G / batch``) with noise
  ``sqrt(lambda_t eta_t (2 - lambda_t eta_t) beta0)``, composed by dp-accounting (the paper's
  own bound uses advanced composition instead). Noise multipliers are rounded *down* to three
  significant digits so equal steps merge; rounding down only over-states the privacy cost.
  Since ``eta_t`` scales with ``sqrt(beta0) / G``, the noise multiplier does not depend on
  ``beta0`` or G: the privacy is set by n, batch, delta and the number of steps alone (so beta0
  cannot be calibrated to an epsilon), while beta0 and G set the step sizes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gep_fed.accounting.events import PrivacyEvent, calibrate
from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.mechanism import GP, ClippedSums
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.observer import NoisyRelease, Observers, ReleaseObserver
from gep_fed.mechanisms.per_example import IncompatibleModelError, LossFn, per_example_gradients
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.validation import ConfigError

SCHEDULES = ("single-pass", "multi-pass")


def batch_sizes(steps: int) -> list[int]:
    """Theorem 1's minibatch sizes ``ceil(sqrt(T / (2 (T - t + 1))))`` for ``t = 1..T``."""
    return [math.ceil(math.sqrt(steps / (2 * (steps - t + 1)))) for t in range(1, steps + 1)]


def single_pass_batch_sizes(n: int) -> list[int]:
    """The schedule for the longest T whose batches fit in ``n`` examples (each used once)."""
    lo, hi = 1, n
    while lo < hi:  # sum(batch_sizes(T)) grows with T
        mid = (lo + hi + 1) // 2
        if sum(batch_sizes(mid)) <= n:
            lo = mid
        else:
            hi = mid - 1
    return batch_sizes(lo)


def amplification_factor(sizes: list[int]) -> float:
    """``F = max_tau 1 / (b_tau^2 sum_{t=tau}^T 1/t)`` of Feldman et al.'s bound for
    ``lambda_t = 1/(t eta)``: the last iterate is ``(alpha, 2 alpha eta^2 G^2 F / beta0)``-RDP."""
    tail, worst = 0.0, 0.0
    for t in range(len(sizes), 0, -1):
        tail += 1.0 / t
        worst = max(worst, 1.0 / (sizes[t - 1] ** 2 * tail))
    return worst


def single_pass_noise_multiplier(
    eta: float, grad_bound: float, beta0: float, factor: float = 1.0
) -> float:
    """The single-pass last iterate as a Gaussian mechanism:
    ``alpha / (2 s^2) = 2 alpha eta^2 G^2 F / beta0``."""
    return math.sqrt(beta0 / factor) / (2 * eta * grad_bound)


def single_pass_event(noise_multiplier: float, party: str = "") -> PrivacyEvent:
    """The single-pass release: the last iterate, private against replacing one example."""
    return PrivacyEvent.gaussian(
        "langevin",
        noise_multiplier,
        1.0,
        1,
        accounting_noise_multiplier=noise_multiplier,
        party=party,
        adjacency="replace-one",
    )


def softmax_linear_bounds(feature_norm_bound: float, bias: bool) -> tuple[float, float]:
    """``(gradient bound, smoothness L)`` of softmax cross-entropy on a linear model whose
    inputs have norm at most R: the gradient is ``(p - e_y) (x, 1_bias)^T`` with
    ``||p - e_y|| <= sqrt(2)``, and the Hessian in the logits has eigenvalues <= 1/2."""
    squared = feature_norm_bound**2 + (1.0 if bias else 0.0)
    return math.sqrt(2.0 * squared), squared / 2.0


def multi_pass_eta(t: int, n: int, beta0: float, grad_bound: float, delta: float) -> float:
    """Theorem 2's step size ``eta_t``."""
    return math.sqrt(beta0) / (grad_bound * math.sqrt(8 * math.log(2.5 * t * t / (n * delta)) * t))


def _round_down(x: float, digits: int = 3) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    scale = 10 ** (digits - 1 - math.floor(math.log10(abs(x))))
    return math.floor(x * scale) / scale


def langevin_update(
    params: torch.Tensor,
    grad: torch.Tensor,
    eta: float,
    lam: float,
    beta0: float,
    noise: NoiseSource,
) -> torch.Tensor:
    """One step of Algorithm 1: gradient step, shrink toward 0, Gaussian noise. The step
    is taken in float64 and cast back after the noise: in float32, ``eta * grad`` could
    overflow before it (an inf no noise hides, in the sign of the unnoised sum), while a
    cast after it is post-processing."""
    shrink = lam * eta
    if not (0 < shrink <= 1):
        raise ValueError(f"lambda_t * eta_t must be in (0, 1], got {shrink}")
    mean = (1 - shrink) * (params.double() - eta * grad.double())
    noised = mean + noise.gaussian(mean, math.sqrt(shrink * (2 - shrink) * beta0))
    return noised.to(params.dtype)


@dataclass(frozen=True)
class LangevinConfig:
    """Algorithm 1's knobs.

    Attributes:
        schedule: "single-pass" (last iterate private against replacing one example,
            Proposition 4) or "multi-pass" (every iterate private against adding or removing
            one example, per-step accounting).
        grad_bound: G, each example's gradient is clipped to this norm. Single pass: must be at
            least the largest gradient norm, so that the clip never binds.
        beta0: the prior variance; with eta and G it sets the privacy (single pass:
            noise multiplier sqrt(beta0) / (2 eta G)); multi-pass: it scales the step sizes.
        eta: the constant step size (single pass; at most 2 / L).
        steps: T for multi-pass (default n).
        batch: expected Poisson batch size (multi-pass).
        delta: used by Theorem 2's step-size schedule (multi-pass).
        feature_norm_bound: R, declared bound on every example's input norm to the linear
            layer (required for single pass, checked on the data); it fixes the gradient bound
            and smoothness that amplification by iteration needs.
    """

    schedule: str = "single-pass"
    grad_bound: float = 1.0
    beta0: float = 1.0
    eta: float = 0.5
    steps: int | None = None
    batch: int = 1
    delta: float = 1e-5
    feature_norm_bound: float | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        for name in ("grad_bound", "beta0", "eta"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        r = self.feature_norm_bound
        if r is not None and not (r > 0 and math.isfinite(r)):
            raise ValueError(f"feature_norm_bound must be a finite number > 0, got {r}")


def beta0_for_epsilon(
    target_epsilon: float, delta: float, eta: float, grad_bound: float, n: int
) -> float:
    """The prior variance that makes the single-pass last iterate on ``n`` examples
    (epsilon, delta)-DP against replacing one example, calibrated by dp-accounting."""
    sigma = calibrate(target_epsilon, delta, single_pass_event)
    factor = amplification_factor(single_pass_batch_sizes(n))
    return factor * (2 * eta * grad_bound * sigma) ** 2


def multi_pass_rates(t: int, n: int, config: LangevinConfig) -> tuple[float, float]:
    """``(eta_t, lambda_t)`` of Theorem 2's schedule on ``n`` examples."""
    c = config
    eta = multi_pass_eta(t, n, c.beta0, c.grad_bound, c.delta)
    if t == 1:
        return eta, 1.0 / eta
    return eta, 1.0 / eta - 1.0 / multi_pass_eta(t - 1, n, c.beta0, c.grad_bound, c.delta)


# The largest step ``eta_t G`` or noise std a multi-pass step may take: far above any useful
# schedule, far below float32's range (a model's parameters).
MAX_STEP_SCALE = 1e30


def multi_pass_events(
    config: LangevinConfig, n: int, first_step: int, steps: int, party: str = ""
) -> list[PrivacyEvent]:
    """Per-step accounting of multi-pass steps ``first_step .. first_step + steps - 1``:
    noise std over the sensitivity ``(1 - lambda_t eta_t) eta_t G / batch`` of the mean.
    Raises ``ConfigError`` for a schedule whose step or noise exceeds ``MAX_STEP_SCALE``
    (public values: beta0, G, n, delta), which would leave the model's float range (a site
    refuses such a round as malformed)."""
    c = config
    q = min(1.0, c.batch / n)
    events = []
    low = max(1, first_step - 1)  # step t's rates read eta_{t-1} too
    if not 2.5 * low * low > n * c.delta:  # Theorem 2's log term must be positive
        raise ConfigError(
            f"Langevin's schedule needs n * delta < 2.5 t^2 from step {low}: n {n} with delta "
            f"{c.delta:g} is outside it; a smaller delta or the true n"
        )
    for t in range(first_step, first_step + steps):
        eta, lam = multi_pass_rates(t, n, c)
        shrink = lam * eta
        std = math.sqrt(shrink * (2 - shrink) * c.beta0)
        if not (eta * c.grad_bound <= MAX_STEP_SCALE and std <= MAX_STEP_SCALE):
            raise ConfigError(
                f"Langevin step {t} would move by eta_t G = {eta * c.grad_bound:.3g} with noise "
                f"std {std:.3g} (beta0 {c.beta0:g}, G {c.grad_bound:g}, n {n}): above "
                f"{MAX_STEP_SCALE:g}, outside any useful schedule; lower beta0"
            )
        if shrink >= 1:  # the output forgets the gradient entirely: nothing released
            continue
        sensitivity = (1 - shrink) * eta * c.grad_bound / c.batch
        sigma = _round_down(std / sensitivity)
        events.append(
            PrivacyEvent.gaussian(
                "langevin", sigma, q, 1, accounting_noise_multiplier=sigma, party=party
            )
        )
    return events


def check_linear(model: nn.Module) -> nn.Linear:
    """The guarantees need a convex loss: accept a model with one ``nn.Linear`` (returned)."""
    layers = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    if len(layers) != 1 or not isinstance(layers[0], nn.Linear):
        raise IncompatibleModelError(
            "Langevin DP-SGD's guarantee (privacy amplification by iteration) holds for convex "
            "losses: use a single nn.Linear model (logistic or linear regression), e.g. "
            "gep_fed.MLP(in_features, classes, hidden=())"
        )
    return layers[0]


def check_single_pass(config: LangevinConfig, layer: nn.Linear, loss_fn: LossFn) -> None:
    """Refuse a single-pass configuration whose steps may be expansive, naming the failed
    condition and its fix: amplification by iteration needs each step non-expansive."""
    if loss_fn is not F.cross_entropy:
        raise ValueError(
            "single-pass Langevin needs loss_fn=F.cross_entropy: its gradient bound and "
            "smoothness, which amplification by iteration needs, are derived for softmax "
            "cross-entropy; use schedule='multi-pass' for other losses"
        )
    r = config.feature_norm_bound
    if r is None:
        raise ValueError(
            "single-pass Langevin needs feature_norm_bound: declare R >= every example's input "
            "norm (e.g. 1.0 for rows scaled to unit norm); it fixes the gradient bound and "
            "smoothness that amplification by iteration needs"
        )
    bias = layer.bias is not None
    need, smooth = softmax_linear_bounds(r, bias)
    if config.grad_bound < need:
        hint = ""
        if bias:
            hint = f", or use a model without bias (then >= {math.sqrt(2.0) * r:.4g})"
        raise ValueError(
            f"grad_bound={config.grad_bound} can bind: gradients reach {need:.4g} for inputs of "
            f"norm <= {r}{' with a bias' if bias else ''}, and a binding clip can make a step "
            "expansive, which voids amplification by iteration. Raise grad_bound to "
            f">= {need:.4g}{hint}"
        )
    if config.eta > 2.0 / smooth:
        raise ValueError(
            f"eta={config.eta} exceeds 2/L = {2.0 / smooth:.4g} (L = {smooth:.4g}, the smoothness "
            f"of softmax cross-entropy for inputs of norm <= {r}): the gradient step can then "
            f"be expansive, which voids amplification by iteration. Lower eta to <= "
            f"{2.0 / smooth:.4g}"
        )


class LangevinTrainer:
    """Runs Algorithm 1 on a linear model and records its privacy in a ``PrivacyLedger``.

    Args:
        model: a single ``nn.Linear`` (logistic regression with cross-entropy by default).
        config: schedule, G, beta0, eta (single pass: also feature_norm_bound).
        loss_fn: single pass: ``F.cross_entropy`` only (its bounds are known).
        noise: Gaussian noise source (cryptographically seeded by default).
        generator: data order / sampling randomness (None: the sampling keyed by the OS; the
            single pass's public order from PyTorch's generator).
        observers: release observers (``gep_fed.mechanisms.observer``): their extra rows join
            every step's sample, and in the multi-pass schedule each sees every iterate's
            release. One that adds rows changes the private sums: never in a real run.

    Raises:
        ValueError: single pass, when a condition of amplification by iteration fails.
    """

    def __init__(
        self,
        model: nn.Module,
        config: LangevinConfig,
        *,
        loss_fn: LossFn = F.cross_entropy,
        ledger: PrivacyLedger | None = None,
        noise: NoiseSource | None = None,
        generator: torch.Generator | None = None,
        party: str = "",
        observers: Iterable[ReleaseObserver] = (),
    ) -> None:
        self.layer = check_linear(model)
        if config.schedule == "single-pass":
            check_single_pass(config, self.layer, loss_fn)
        self.model, self.config, self.loss_fn = model, config, loss_fn
        self.layout = ParameterLayout.from_model(model)
        self.ledger = ledger if ledger is not None else PrivacyLedger(config.delta)
        self.noise = noise if noise is not None else NoiseSource()
        self.generator = generator
        self.party = party
        self._clip = GP(config.grad_bound, noise_multiplier=0.0)  # clips; Langevin adds its noise
        self.observers = Observers(observers)

    def _mean_clipped_gradient(self, x, y, divide_by: float, sample_rate: float = 1.0):
        grads = per_example_gradients(self.model, self.loss_fn, x, y, self.layout)
        extra = self.observers.rows(None, sample_rate)
        if extra is not None:
            grads = torch.cat([grads, extra.to(grads)])
        return self._clip.clipped_sums(grads, None).residual / divide_by

    def _set(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for name, value in self.layout.unflatten(flat).items():
                dict(self.model.named_parameters())[name].copy_(value)

    def single_pass_events(self, n: int) -> list[PrivacyEvent]:
        c = self.config
        factor = amplification_factor(single_pass_batch_sizes(n))
        sigma = single_pass_noise_multiplier(c.eta, c.grad_bound, c.beta0, factor)
        return [single_pass_event(sigma, self.party)]

    def fit(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        first_step: int = 1,
        *,
        dataset_size: int | None = None,
    ) -> list[torch.Tensor]:
        """Train on ``(x, y)``; returns the indices used per step (single pass: each at most
        once). The privacy cost is recorded before training starts. ``first_step`` continues a
        multi-pass schedule (e.g. across federated rounds); ``dataset_size`` is the public n
        the multi-pass schedule (sample rate, step sizes) is computed for (default ``len(x)``).

        Raises:
            ValueError: single pass, when an example's input norm exceeds feature_norm_bound
                (the message says only that, not which example or by how much): the guarantee
                covers data sets inside the declared bound, and a refusal reveals that this
                one is not.
        """
        if self.config.schedule == "single-pass":
            if dataset_size is not None:
                raise ValueError("dataset_size applies to the multi-pass schedule only")
            return self._single_pass(x, y)
        return self._multi_pass(x, y, first_step, dataset_size or len(x))

    def _check_feature_norms(self, x: torch.Tensor) -> None:
        seen = []
        hook = self.layer.register_forward_hook(lambda _m, i, out: seen.append((i[0], out)))
        try:
            with torch.no_grad():
                output = self.model(x)
        finally:
            hook.remove()
        if len(seen) != 1 or seen[0][1] is not output:  # the bounds hold for these logits only
            raise IncompatibleModelError(
                "single-pass Langevin needs the model's output to be its nn.Linear layer's "
                "output (the logits of softmax cross-entropy), unchanged"
            )
        inputs = seen[0][0]
        r = self.config.feature_norm_bound
        if bool((inputs.flatten(1).double().norm(dim=1) > r).any()):
            raise ValueError(
                f"an example's input norm exceeds feature_norm_bound={r}: scale the rows to "
                "norm <= R (float rounding can lift a row scaled to exactly R above it: aim "
                "just under) or declare a larger bound (grad_bound and eta follow it)"
            )

    def _single_pass(self, x, y) -> list[torch.Tensor]:
        c, n = self.config, len(x)
        self._check_feature_norms(x)
        self.ledger.record(*self.single_pass_events(n))
        order = torch.randperm(n, generator=self.generator)
        used, pos = [], 0
        w = self.layout.flatten_params(self.model).clone()
        for t, size in enumerate(single_pass_batch_sizes(n), start=1):
            idx = order[pos : pos + size]
            pos += size
            used.append(idx)
            self._set(w)
            grad = self._mean_clipped_gradient(x[idx], y[idx], len(idx))
            w = langevin_update(w, grad, c.eta, 1.0 / (t * c.eta), c.beta0, self.noise)
        self._set(w)
        return used

    def multi_pass_events(self, n: int, first_step: int, steps: int) -> list[PrivacyEvent]:
        """Per-step accounting of steps ``first_step .. first_step + steps - 1``."""
        return multi_pass_events(self.config, n, first_step, steps, self.party)

    def _multi_pass(self, x, y, first_step: int, n: int) -> list[torch.Tensor]:
        c = self.config
        steps = c.steps or n
        self.ledger.record(*self.multi_pass_events(n, first_step, steps))
        q = min(1.0, c.batch / n)
        sampler = PoissonSampler(len(x), q, steps, self.generator)
        w = self.layout.flatten_params(self.model).clone()
        used = []
        for t, idx in enumerate(sampler, start=first_step):
            used.append(idx)
            eta, lam = multi_pass_rates(t, n, c)
            self._set(w)
            grad = self._mean_clipped_gradient(x[idx], y[idx], float(c.batch), q)
            before, w = w, langevin_update(w, grad, eta, lam, c.beta0, self.noise)
            if self.observers:
                self._observe_release(before, w, eta, lam, q)
        self._set(w)
        return used

    def _observe_release(self, before, after, eta: float, lam: float, q: float) -> None:
        """What an observer who sees every iterate learns from one step: the noisy clipped
        gradient sum ``b (before - after / (1 - lambda eta)) / eta``, with noise std
        ``sqrt(lambda eta (2 - lambda eta) beta0) b / ((1 - lambda eta) eta)``."""
        c, shrink = self.config, lam * eta
        if shrink >= 1:  # the iterate forgets the gradient: nothing released
            return
        scale = c.batch / ((1 - shrink) * eta)
        released = (before * (1 - shrink) - after) * scale
        std = math.sqrt(shrink * (2 - shrink) * c.beta0) * scale
        self.observers.notify(
            NoisyRelease(ClippedSums(None, released), std / c.grad_bound, q, self._clip)
        )


__all__ = [
    "LangevinConfig",
    "LangevinTrainer",
    "beta0_for_epsilon",
    "langevin_update",
    "multi_pass_eta",
    "multi_pass_events",
    "single_pass_batch_sizes",
    "single_pass_event",
    "single_pass_noise_multiplier",
    "softmax_linear_bounds",
]
