"""An adaptive residual clip (issue 13, lever 5): S2 follows a quantile of the private
residual norms, estimated from a noised count that is accounted with the step."""

import math

import pytest
import torch

from gep_fed import GEPConfig, GEPStep, PrivacyContract
from gep_fed.accounting import epsilon_rdp
from gep_fed.data.models import MLP
from gep_fed.mechanisms.mechanism import GEP, GP, ClippedSums, calibrate_noise_multiplier
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.validation import ConfigError


def test_the_count_is_accounted_as_one_more_gaussian_release():
    # GP plus a count noised like its gradient is two releases at sigma: GEP's accounting
    assert GP.accounting_noise_multiplier(2.0, count_noise=2.0) == pytest.approx(
        GEP.accounting_noise_multiplier(2.0)
    )
    # a count drowned in noise costs nothing more; a count with little noise costs a lot
    assert GEP.accounting_noise_multiplier(2.0, count_noise=1e9) == pytest.approx(
        GEP.accounting_noise_multiplier(2.0)
    )
    with_count = GEP.event(2.0, 0.05, 100, count_noise=20.0)
    without = GEP.event(2.0, 0.05, 100)
    assert epsilon_rdp([with_count], 1e-5) > epsilon_rdp([without], 1e-5)


def test_calibration_raises_sigma_so_the_count_stays_within_the_budget():
    plain = calibrate_noise_multiplier(3.0, 1e-5, 0.05, 200, "gep")
    adaptive = calibrate_noise_multiplier(3.0, 1e-5, 0.05, 200, "gep", count_noise=25.0)
    assert adaptive > plain
    event = GEP.event(adaptive, 0.05, 200, count_noise=25.0)
    assert epsilon_rdp([event], 1e-5) == pytest.approx(3.0, abs=2e-3)


def test_the_count_gets_gaussian_noise_of_its_own_std_and_is_never_released_without():
    mech = GEP(1.0, 1.0, noise_multiplier=1.0, count_within_clip=True)
    sums = ClippedSums(torch.zeros(2), torch.zeros(3), within_clip=torch.tensor(7.0))
    noise = NoiseSource(0)
    draws = torch.stack([mech.add_noise(sums, noise, 30.0).within_clip for _ in range(4000)])
    assert draws.mean().item() == pytest.approx(7.0, abs=3.0)
    assert draws.std().item() == pytest.approx(30.0, rel=0.05)
    with pytest.raises(ValueError, match="count of examples within the clip is private"):
        mech.add_noise(sums, noise)


def _problem(n=400, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=gen) * torch.linspace(0.2, 3.0, n)[:, None]  # norms spread
    y = torch.randint(0, 3, (n,), generator=gen)
    public = torch.randn(64, 12, generator=gen)
    return x, y, public


def _residual_norms(step: GEPStep, x, y) -> torch.Tensor:
    from gep_fed.mechanisms.per_example import per_example_gradients

    grads = per_example_gradients(
        step.model, step.loss_fn, x, y, step.layout, step.config.max_chunk
    )
    emb = step.subspace.embed(grads)
    return (grads.pow(2).sum(1) - emb.pow(2).sum(1)).clamp_min(0).sqrt()


@pytest.mark.parametrize("quantile", [0.3, 0.7])
def test_s2_converges_to_the_target_quantile_of_the_private_residual_norms(quantile):
    x, y, public = _problem()
    torch.manual_seed(0)
    model = MLP(12, 3, hidden=(8,))
    config = GEPConfig(
        # S2 far below every norm: the clip must grow by itself
        PrivacyContract("gep", 1.0, 0.5, clip_residual=1e-3),
        num_basis=4,
        residual_quantile=quantile,
        quantile_count_noise=2.0,
        basis_refresh=10_000,  # the model does not move: one subspace throughout
    )
    step = GEPStep(
        model,
        public,
        config,
        dataset_size=len(x),
        generator=torch.Generator().manual_seed(1),
        noise=NoiseSource(2),
    )
    sampler = torch.Generator().manual_seed(3)
    for _ in range(300):
        mask = torch.rand(len(x), generator=sampler) < config.contract.sample_rate
        step(x[mask], y[mask])
    share_within = (_residual_norms(step, x, y) <= step.mechanism.clip_residual).float().mean()
    assert share_within.item() == pytest.approx(quantile, abs=0.08)
    # every step recorded once, with the count in its accounting
    assert step.ledger.steps == 300
    sigma_eq = GEP.accounting_noise_multiplier(1.0, count_noise=2.0)
    assert all(math.isclose(e.accounting_noise_multiplier, sigma_eq) for e in step.ledger.events)


def test_without_a_target_quantile_s2_stays_and_nothing_more_is_accounted():
    x, y, public = _problem()
    model = MLP(12, 3, hidden=(8,))
    config = GEPConfig(PrivacyContract("gep", 1.0, 0.5, clip_residual=0.3), num_basis=4)
    step = GEPStep(model, public, config, dataset_size=len(x), noise=NoiseSource(0))
    for _ in range(3):
        step(x[:200], y[:200])
    assert step.mechanism.clip_residual == 0.3 and not step.mechanism.count_within_clip
    assert step.ledger.events[0].accounting_noise_multiplier == pytest.approx(1 / math.sqrt(2))


GP_CONTRACT = PrivacyContract("gp", 1.0, 0.5)


@pytest.mark.parametrize(
    "settings, problem",
    [
        ({"residual_quantile": 0.5}, "needs quantile_count_noise"),
        (
            {"residual_quantile": 0.5, "quantile_count_noise": 5.0, "contract": GP_CONTRACT},
            "use mech",
        ),
        (
            {"residual_quantile": 0.5, "quantile_count_noise": 5.0, "clip_quantile": 0.5},
            "not both",
        ),
        ({"residual_quantile": 1.5, "quantile_count_noise": 5.0}, "residual_quantile must be"),
        ({"residual_quantile": 0.5, "quantile_count_noise": 0.0}, "quantile_count_noise must"),
        ({"quantile_lr": -1.0}, "quantile_lr must be"),
    ],
)
def test_a_bad_adaptive_clip_setting_is_refused_by_name(settings, problem):
    with pytest.raises(ConfigError, match=problem):
        GEPConfig(**{"contract": PrivacyContract("gep", 1.0, 0.5), **settings})
