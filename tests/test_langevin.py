"""Langevin DP-SGD: the RDP expression, the sampling step, single-pass data use."""

import math

import numpy as np
import pytest
import torch
from dp_accounting import rdp

from gep_fed import MLP, MnistCNN, NoiseSource
from gep_fed.accounting import RDP_ORDERS, PrivacyEvent, epsilon_rdp
from gep_fed.langevin import (
    LangevinConfig,
    LangevinTrainer,
    beta0_for_epsilon,
    langevin_update,
    single_pass_batch_sizes,
)
from gep_fed.per_example import IncompatibleModelError


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


@pytest.mark.parametrize("eta, G, beta0, n", [(0.5, 1.0, 2.0, 300), (0.05, 3.0, 0.01, 97)])
def test_single_pass_rdp_equals_a_direct_computation_at_every_order(eta, G, beta0, n):
    sizes = single_pass_batch_sizes(n)
    trainer = LangevinTrainer(
        MLP(3, 2, hidden=()), LangevinConfig(eta=eta, grad_bound=G, beta0=beta0)
    )
    (event,) = trainer.single_pass_events(n)
    curve = rdp.RdpAccountant(RDP_ORDERS).compose(event.dp_event()).rdp
    direct = np.array([direct_bound(a, eta, G, beta0, sizes) for a in RDP_ORDERS[::10]])
    np.testing.assert_allclose(curve[::10], direct, rtol=1e-9)
    # Proposition 4 as printed (F = 1) would under-state this schedule's privacy loss
    printed = 2 * 4.0 * eta**2 * G**2 / beta0
    assert direct_bound(4.0, eta, G, beta0, sizes) > printed


def test_beta0_calibration_meets_the_target():
    beta0 = beta0_for_epsilon(2.0, 1e-5, eta=0.5, grad_bound=1.0, n=500)
    sigma = (
        LangevinTrainer(MLP(3, 2, hidden=()), LangevinConfig(eta=0.5, beta0=beta0))
        .single_pass_events(500)[0]
        .accounting_noise_multiplier
    )
    event = PrivacyEvent("langevin", sigma, 1.0, 1, accounting_noise_multiplier=sigma)
    assert epsilon_rdp([event], 1e-5) == pytest.approx(2.0, abs=1e-3)


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


def test_single_pass_uses_each_example_at_most_once():
    n = 300
    assert sum(single_pass_batch_sizes(n)) <= n
    x, y = torch.randn(n, 5), torch.randint(3, (n,))
    model = MLP(5, 3, hidden=())
    trainer = LangevinTrainer(
        model,
        LangevinConfig(eta=0.5, beta0=1.0),
        noise=NoiseSource(0),
        generator=torch.Generator().manual_seed(0),
    )
    used = torch.cat(trainer.fit(x, y))
    assert len(used) == len(set(used.tolist())) <= n
    assert trainer.ledger.steps == 1  # the last iterate is the one release


def test_multi_pass_accounts_every_step_conservatively():
    n = 200
    x, y = torch.randn(n, 5), torch.randint(3, (n,))
    cfg = LangevinConfig(schedule="multi-pass", beta0=0.5, steps=50, batch=4)
    trainer = LangevinTrainer(
        MLP(5, 3, hidden=()), cfg, noise=NoiseSource(0), generator=torch.Generator().manual_seed(0)
    )
    used = trainer.fit(x, y)
    assert len(used) == 50
    assert trainer.ledger.steps == 49  # step 1 draws from the prior: no data, no release
    exact = []
    for event in trainer.ledger.events:
        assert event.sample_rate == pytest.approx(4 / n)
    for t in range(2, 51):
        eta, lam = trainer._multi_pass_rates(t, n)
        s = lam * eta
        exact.append(math.sqrt(s * (2 - s) * 0.5) / ((1 - s) * eta))
    recorded = [e.accounting_noise_multiplier for e in trainer.ledger.events]
    assert all(r <= e for r, e in zip(recorded, exact, strict=True))
    assert all(r >= 0.99 * e for r, e in zip(recorded, exact, strict=True))


def test_non_linear_models_are_refused_with_the_reason():
    with pytest.raises(IncompatibleModelError, match="convex"):
        LangevinTrainer(MnistCNN(), LangevinConfig())


def test_langevin_runs_in_the_federation_in_client_mode(tmp_path):
    from gep_fed.config import ConfigError, FederationConfig
    from gep_fed.ledger import PrivacyLedger
    from simulations.runner import simulate

    with pytest.raises(ConfigError, match="client mode on a linear model"):
        FederationConfig(mechanism="langevin", model="mlp")
    fed = FederationConfig(
        mechanism="langevin",
        model="linear",
        rounds=2,
        local_steps=3,
        langevin_beta0=0.05,
        clip_norm=1.0,
        noise_seed=1,
        run_dir=str(tmp_path),
        run_name="r",
    )
    result = simulate(fed, progress=False)
    assert all(m["sites_ok"] == 3 for m in result.metrics)
    ledger = PrivacyLedger.load(tmp_path / "r" / "sites" / "site-0" / "ledger.json")
    # step 1 of the schedule draws from the prior (no data): 2 x 3 - 1 accounted steps
    assert ledger.steps == 5 and {e.mechanism for e in ledger.events} == {"langevin"}
    assert 0 < ledger.epsilon() < float("inf")
