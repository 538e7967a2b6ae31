"""Langevin DP-SGD: the RDP expression, the sampling step, the sensitivity each schedule
accounts, the conditions amplification by iteration needs, single-pass data use."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dp_accounting import NeighboringRelation, rdp
from torch import nn

from gep_fed.accounting.events import RDP_ORDERS, PrivacyEvent, epsilon_rdp
from gep_fed.data.models import MLP, MnistCNN
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.langevin import (
    LangevinConfig,
    LangevinTrainer,
    beta0_for_epsilon,
    langevin_update,
    multi_pass_rates,
    single_pass_batch_sizes,
    single_pass_event,
    softmax_linear_bounds,
)
from gep_fed.mechanisms.mechanism import GP
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.per_example import IncompatibleModelError, per_example_gradients
from gep_fed.validation import ConfigError


def direct_bound(alpha, eta, G, beta0, sizes):
    """Feldman et al. (2020) Thm 3.1 as the paper applies it, evaluated term by term:
    max over tau of 2 alpha eta G^2 / (b_tau^2 beta0 sum_{t>=tau} lambda_t),
    lambda_t = 1/(t eta)."""
    T = len(sizes)
    return max(
        2
        * alpha
        * eta
        * G**2
        / (sizes[tau - 1] ** 2 * beta0 * sum(1 / (t * eta) for t in range(tau, T + 1)))
        for tau in range(1, T + 1)
    )


def flat(model):
    return ParameterLayout.from_model(model).flatten_params(model)


def single_pass_config(**overrides):
    """A single-pass configuration the trainer accepts for a model with a bias: inputs of norm
    <= 1, G = 2 (the largest softmax cross-entropy gradient), eta <= 2 / L = 2."""
    knobs = {"eta": 0.5, "beta0": 1.0, "grad_bound": 2.0, "feature_norm_bound": 1.0}
    return LangevinConfig(**{**knobs, **overrides})


@pytest.mark.parametrize("eta, G, beta0, n", [(0.5, 1.0, 2.0, 300), (0.05, 3.0, 0.01, 97)])
def test_single_pass_rdp_equals_a_direct_computation_at_every_order(eta, G, beta0, n):
    sizes = single_pass_batch_sizes(n)
    config = LangevinConfig(eta=eta, grad_bound=G, beta0=beta0, feature_norm_bound=G / 2**0.5)
    trainer = LangevinTrainer(nn.Linear(3, 2, bias=False), config)
    (event,) = trainer.single_pass_events(n)
    curve = rdp.RdpAccountant(RDP_ORDERS).compose(event.dp_event()).rdp
    direct = np.array([direct_bound(a, eta, G, beta0, sizes) for a in RDP_ORDERS[::10]])
    np.testing.assert_allclose(curve[::10], direct, rtol=1e-9)
    # Proposition 4 as printed (F = 1) would under-state this schedule's privacy loss
    printed = 2 * 4.0 * eta**2 * G**2 / beta0
    assert direct_bound(4.0, eta, G, beta0, sizes) > printed


def test_beta0_calibration_meets_the_target_under_replace_one_adjacency():
    beta0 = beta0_for_epsilon(2.0, 1e-5, eta=0.5, grad_bound=2.0, n=500)
    trainer = LangevinTrainer(MLP(3, 2, hidden=()), single_pass_config(beta0=beta0))
    (event,) = trainer.single_pass_events(500)
    assert event.adjacency is NeighboringRelation.REPLACE_ONE
    sigma = event.accounting_noise_multiplier
    assert epsilon_rdp([single_pass_event(sigma)], 1e-5) == pytest.approx(2.0, abs=1e-3)


def test_sampling_step_has_the_algorithm_1_mean_and_variance():
    d, draws = 200, 4000
    w, g = torch.randn(d), torch.randn(d)
    eta, lam, beta0 = 0.3, 1.5, 0.7
    noise = NoiseSource(seed=3)
    samples = torch.stack([langevin_update(w, g, eta, lam, beta0, noise) for _ in range(draws)])
    shrink = lam * eta
    mean = (1 - shrink) * (w - eta * g)
    var = shrink * (2 - shrink) * beta0
    z = (samples.mean(0) - mean) / math.sqrt(var / draws)
    assert abs(float((z**2).sum()) - d) < 5 * math.sqrt(2 * d)
    assert float(samples.var(0).mean()) == pytest.approx(var, rel=0.02)


def test_a_step_at_the_edge_of_float32_releases_no_overflow_that_follows_the_gradient():
    """The server sets the global model: with a parameter at float32's largest value, a step
    taken in float32 overflowed to inf before the noise exactly where the unnoised gradient
    pointed up. The step is taken in float64 and the noised result cast back."""
    top = torch.finfo(torch.float32).max
    w = torch.full((4,), top)
    up, down = torch.full((4,), -1.0), torch.full((4,), 1.0)  # gradient step = -eta g
    eta, lam, beta0 = 1e32, 1e-33, 1e-6  # shrink 0.1; the noise std ~1e-3
    for g in (up, down):
        step = langevin_update(w, g, eta, lam, beta0, NoiseSource(seed=1))
        assert step.dtype == torch.float32 and bool(torch.isfinite(step).all()), g


def test_a_schedule_beyond_any_useful_step_is_refused_from_its_public_values():
    """beta0, G and n come from the round config (the server): a step or noise of 1e30 or
    more is refused before anything is recorded or computed."""
    from gep_fed.mechanisms.langevin import multi_pass_events

    huge = LangevinConfig(schedule="multi-pass", grad_bound=0.01, beta0=1e76, batch=1)
    with pytest.raises(ValueError, match="lower beta0"):
        multi_pass_events(huge, 100, 2, 1)
    plain = LangevinConfig(schedule="multi-pass", beta0=1.0, delta=1e-5)
    assert multi_pass_events(plain, 100, 2, 1)
    # n delta >= 2.5 t^2 leaves Theorem 2's log term at or below 0: named, not a math error
    for n, first in ((250_000, 1), (250_001, 1), (500_000, 2)):
        with pytest.raises(ConfigError, match=r"n \* delta < 2\.5 t\^2"):
            multi_pass_events(plain, n, first, 1)


def test_single_pass_uses_each_example_at_most_once_and_is_one_replace_one_release():
    n = 300
    assert sum(single_pass_batch_sizes(n)) <= n
    x, y = 0.99 * F.normalize(torch.randn(n, 5), dim=1), torch.randint(3, (n,))
    trainer = LangevinTrainer(
        MLP(5, 3, hidden=()),
        single_pass_config(),
        noise=NoiseSource(0),
        generator=torch.Generator().manual_seed(0),
    )
    used = torch.cat(trainer.fit(x, y))
    assert len(used) == len(set(used.tolist())) <= n
    assert trainer.ledger.steps == 1  # the last iterate is the one release
    assert trainer.ledger.events[0].adjacency is NeighboringRelation.REPLACE_ONE
    # its epsilon bounds another neighbouring relation than the multi-pass (add-remove) one's
    multi = LangevinTrainer(MLP(5, 3, hidden=()), LangevinConfig(schedule="multi-pass", batch=4))
    with pytest.raises(ValueError, match="different adjacency"):
        epsilon_rdp([*trainer.ledger.events, *multi.multi_pass_events(n, 1, 3)], 1e-5)


def test_multi_pass_accounted_sensitivity_is_the_measured_worst_case_shift():
    """One real multi-pass step on D and on D plus an example whose gradient is clipped: the
    same noise and the same (full) Poisson sample, so the iterates differ by the shift of the
    mean alone, which the accounting must bound, tightly."""
    n, batch, beta0, G = 8, 8, 0.01, 1.0
    x, y = F.normalize(torch.randn(n, 4), dim=1), torch.randint(3, (n,))
    extra_x, extra_y = 10 * F.normalize(torch.randn(1, 4), dim=1), torch.tensor([1])
    cfg = LangevinConfig(schedule="multi-pass", beta0=beta0, grad_bound=G, steps=1, batch=batch)
    start = MLP(4, 3, hidden=())
    runs = []
    for xs, ys in ((x, y), (torch.cat([x, extra_x]), torch.cat([y, extra_y]))):
        trainer = LangevinTrainer(
            copy.deepcopy(start),
            cfg,
            noise=NoiseSource(0),
            generator=torch.Generator().manual_seed(0),
        )
        # step 2 (step 1 draws from the prior); both at the public size n, sample rate 1
        trainer.fit(xs, ys, first_step=2, dataset_size=n)
        runs.append(trainer)
    grad = per_example_gradients(start, F.cross_entropy, extra_x, extra_y, runs[1].layout)
    assert float(grad.norm()) > 2 * G  # the extra example's gradient is clipped
    shift = float((flat(runs[1].model) - flat(runs[0].model)).norm())
    (event,) = runs[1].ledger.events
    eta, lam = multi_pass_rates(2, n, cfg)
    s = lam * eta
    accounted = math.sqrt(s * (2 - s) * beta0) / event.accounting_noise_multiplier
    assert shift <= accounted <= 1.01 * shift


def test_multi_pass_accounts_every_step_conservatively_and_tightly():
    n, batch, beta0, G = 200, 4, 0.5, 1.5
    x, y = torch.randn(n, 5), torch.randint(3, (n,))
    cfg = LangevinConfig(schedule="multi-pass", beta0=beta0, grad_bound=G, steps=50, batch=batch)
    trainer = LangevinTrainer(
        MLP(5, 3, hidden=()), cfg, noise=NoiseSource(0), generator=torch.Generator().manual_seed(0)
    )
    used = trainer.fit(x, y)
    assert len(used) == 50
    assert trainer.ledger.steps == 49  # step 1 draws from the prior: no data, no release
    for event in trainer.ledger.events:
        assert event.sample_rate == pytest.approx(batch / n)
        assert event.adjacency is NeighboringRelation.ADD_OR_REMOVE_ONE
    exact = []
    for t in range(2, 51):
        eta, lam = multi_pass_rates(t, n, cfg)
        s = lam * eta
        exact.append(math.sqrt(s * (2 - s) * beta0) / ((1 - s) * eta * G / batch))
    recorded = [e.accounting_noise_multiplier for e in trainer.ledger.events]
    assert all(r <= e for r, e in zip(recorded, exact, strict=True))
    assert all(r >= 0.99 * e for r, e in zip(recorded, exact, strict=True))
    # accounting the sensitivity without the 1 / batch over-states epsilon several times
    overstated = [
        PrivacyEvent.gaussian("langevin", e / batch, batch / n, 1, e / batch) for e in exact
    ]
    assert epsilon_rdp(trainer.ledger.events, 1e-5) < epsilon_rdp(overstated, 1e-5) / 3


def test_softmax_cross_entropy_bounds_hold_for_a_linear_model_with_bias():
    R, classes = 1.5, 4
    bound, smooth = softmax_linear_bounds(R, bias=True)
    model = nn.Linear(3, classes)
    layout = ParameterLayout.from_model(model)
    x = R * F.normalize(torch.randn(64, 3), dim=1)
    y = torch.randint(classes, (64,))
    worst_norm, worst_curvature = 0.0, 0.0
    for scale in (0.0, 1.0, 30.0):  # at 30 a wrong class takes almost all the mass
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(scale * torch.randn_like(p))
        grads = per_example_gradients(model, F.cross_entropy, x, y, layout)
        worst_norm = max(worst_norm, float(grads.norm(dim=1).max()))
        for i in range(8):
            w = flat(model).double()

            def loss(v, i=i):
                W, b = v[: 3 * classes].view(classes, 3), v[3 * classes :]
                return F.cross_entropy(x[i : i + 1].double() @ W.T + b, y[i : i + 1])

            hessian = torch.autograd.functional.hessian(loss, w)
            worst_curvature = max(worst_curvature, float(torch.linalg.eigvalsh(hessian)[-1]))
    assert 0.99 * bound < worst_norm <= bound * (1 + 1e-6)  # float32 gradients
    assert worst_curvature <= smooth


def test_clipping_can_make_a_gradient_step_expansive():
    """Why single pass refuses a clip that binds: a linear softmax model with bias, ||x|| = 1,
    eta = 1 (<= 2 / L) and G = sqrt(2) moves two parameter vectors apart."""
    x, y = torch.tensor([[1.0]]), torch.tensor([0])

    def step(biases, G):
        model = nn.Linear(1, 3)
        with torch.no_grad():
            model.weight.zero_()
            model.bias.copy_(torch.tensor(biases))
        layout = ParameterLayout.from_model(model)
        grads = per_example_gradients(model, F.cross_entropy, x, y, layout)
        clipped = GP(G, noise_multiplier=0.0).clipped_sums(grads, None).residual
        return flat(model), flat(model) - clipped

    def expansion(G):
        (u, after_u), (v, after_v) = step([-8.0, -1.0, 1.0], G), step([-5.0, -2.0, -1.0], G)
        return float((after_u - after_v).norm() / (u - v).norm())

    assert expansion(math.sqrt(2.0)) > 1.007  # the clip binds: distances grow
    assert expansion(2.0) <= 1.0  # G = sqrt(2 (1 + 1)) never binds: non-expansive


@pytest.mark.parametrize(
    "model, config, loss_fn, message",
    [
        (MLP(3, 2, hidden=()), LangevinConfig(grad_bound=2), F.cross_entropy, "feature_norm_bound"),
        (
            MLP(3, 2, hidden=()),
            single_pass_config(grad_bound=math.sqrt(2.0)),
            F.cross_entropy,
            r"raise grad_bound to >= 2, or use a model without bias \(then >= 1.414\)",
        ),
        (
            nn.Linear(3, 2, bias=False),
            single_pass_config(grad_bound=math.sqrt(2.0), eta=4.5),
            F.cross_entropy,
            "lower eta to <= 4",
        ),
        (MLP(3, 2, hidden=()), single_pass_config(), F.mse_loss, "cross_entropy"),
    ],
)
def test_single_pass_refuses_what_amplification_by_iteration_cannot_bound(
    model, config, loss_fn, message
):
    with pytest.raises(ValueError, match=f"(?i){message}"):
        LangevinTrainer(model, config, loss_fn=loss_fn)


def test_single_pass_refuses_data_beyond_the_declared_feature_norm():
    x, y = 0.99 * F.normalize(torch.randn(40, 3), dim=1), torch.randint(2, (40,))
    trainer = LangevinTrainer(MLP(3, 2, hidden=()), single_pass_config(), noise=NoiseSource(0))
    with pytest.raises(ValueError, match=r"exceeds feature_norm_bound=1\.0"):
        trainer.fit(torch.cat([x, 1.02 * x[:1]]), torch.cat([y, y[:1]]))
    assert trainer.ledger.steps == 0  # refused before anything is released
    rescaled = LangevinTrainer(nn.Sequential(nn.Linear(3, 2), nn.Tanh()), single_pass_config())
    with pytest.raises(IncompatibleModelError, match="output"):
        rescaled.fit(x, y)


def test_non_linear_models_are_refused_with_the_reason():
    with pytest.raises(IncompatibleModelError, match="convex"):
        LangevinTrainer(MnistCNN(), LangevinConfig())


def test_langevin_federates_only_in_client_mode_on_a_linear_model():
    """Its guarantee needs a convex loss (a federation of it runs in tests/test_cli.py)."""
    from gep_fed.federation.config import FederationConfig
    from gep_fed.validation import ConfigError

    with pytest.raises(ConfigError, match="client mode on a linear model"):
        FederationConfig(mechanism="langevin", model="mlp")
    with pytest.raises(ConfigError, match="client mode on a linear model"):
        FederationConfig(mechanism="langevin", model="linear", mode="central")
