"""The privacy-critical properties of the three mechanisms, checked by materialising every
example's released contribution."""

import math

import pytest
import torch

from gep_fed.mechanisms.mechanism import BGEP, GEP, GP, PerExampleClipping
from gep_fed.mechanisms.noise import NoiseSource
from helpers import flat_layout, random_subspace

S1, S2, S = 1.5, 0.3, 1.0
SIGMA = 0.2  # the mechanisms' noise multiplier
MECHANISMS = [
    GEP(S1, S2, noise_multiplier=SIGMA),
    BGEP(S1, noise_multiplier=SIGMA),
    GP(S, noise_multiplier=SIGMA),
]


def contributions(mech, grads, subspace):
    """Each example's released (embedding, residual) contributions, in float64."""
    c: PerExampleClipping = mech.clip(grads, subspace)
    g = grads.double()
    if isinstance(mech, GP):
        return None, g * c.residual_scale.double()[:, None]
    emb = c.embedding.double()
    emb_part = emb * c.embedding_scale.double()[:, None]
    if isinstance(mech, BGEP):
        return emb_part, None
    resid = g - subspace.to("cpu", torch.float64).lift(emb)
    return emb_part, resid * c.residual_scale.double()[:, None]


def adversarial_gradients(subspace, gen):
    """Huge norms, zeros, residuals tiny relative to the gradient, ordinary rows."""
    p, k = subspace.layout.size, subspace.num_basis
    in_span = subspace.lift(torch.randn(6, k, generator=gen))
    rows = [
        torch.randn(4, p, generator=gen),  # ordinary
        1e6 * torch.randn(3, p, generator=gen),  # huge
        torch.zeros(2, p),  # zero
        1e4 * in_span + 1e-3 * torch.randn(6, p, generator=gen),  # tiny residual, large norm
        in_span * 1e3,  # (almost) no residual at all
        1e-30 * torch.randn(2, p, generator=gen),  # tiny norm
    ]
    return torch.cat(rows)


@pytest.mark.parametrize("mech", MECHANISMS, ids=["gep", "bgep", "gp"])
def test_every_released_contribution_stays_within_its_clip_norm(mech):
    gen = torch.Generator().manual_seed(3)
    layout = flat_layout(3000, 500)
    subspace = random_subspace(layout, (40, 10), gen)
    grads = adversarial_gradients(subspace, gen)
    emb, res = contributions(mech, grads, subspace)
    tol = 1 + 1e-6
    if emb is not None:
        assert torch.linalg.vector_norm(emb, dim=1).max() <= S1 * tol
    if res is not None:
        bound = S if isinstance(mech, GP) else S2
        assert torch.linalg.vector_norm(res, dim=1).max() <= bound * tol
    # ...and the sums really are the sums of those contributions
    sums = mech.clipped_sums(grads, subspace)
    if emb is not None:
        torch.testing.assert_close(sums.embedding.double(), emb.sum(0), rtol=1e-4, atol=1e-4)
    if res is not None:
        scale = max(1.0, float(res.abs().sum(0).max()))
        torch.testing.assert_close(sums.residual.double(), res.sum(0), rtol=1e-4, atol=1e-4 * scale)


def test_unclipped_examples_pass_through_unchanged():
    layout = flat_layout(200)
    subspace = random_subspace(layout, (10,))
    small = 1e-3 * torch.randn(5, 200)
    sums = MECHANISMS[0].clipped_sums(small, subspace)
    torch.testing.assert_close(
        subspace.lift(sums.embedding) + sums.residual, small.sum(0), atol=1e-6, rtol=1e-4
    )


@pytest.mark.parametrize("mech", MECHANISMS, ids=["gep", "bgep", "gp"])
def test_examples_with_non_finite_gradients_contribute_nothing(mech):
    """Clip factor 0, no error: the released sums are exactly those without such examples,
    so neither their presence nor their number leaves the site."""
    layout = flat_layout(50)
    subspace = random_subspace(layout, (5,))
    finite = torch.randn(4, 50)
    bad = torch.randn(3, 50)
    bad[0, 7], bad[1, 3], bad[2, :] = float("nan"), float("inf"), -float("inf")
    mixed = torch.cat([finite[:2], bad[:1], finite[2:], bad[1:]])
    without, with_bad = mech.clipped_sums(finite, subspace), mech.clipped_sums(mixed, subspace)
    for a, b in ((without.embedding, with_bad.embedding), (without.residual, with_bad.residual)):
        if a is not None:
            assert torch.isfinite(b).all()
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)


def mean_of_estimates(mech, grads, subspace, trials, expected):
    noise = NoiseSource(seed=11)
    sums = mech.clipped_sums(grads, subspace)
    total = torch.zeros(grads.shape[1], dtype=torch.float64)
    for _ in range(trials):
        total += mech.reconstruct(mech.add_noise(sums, noise), subspace, expected).double()
    return total / trials


def chi_square(error, mech, subspace, trials, expected):
    """Whitened squared norm of the mean estimate's error; chi-square with p dof if unbiased.

    The lifted embedding noise lives in the subspace, so the error is split into its
    in-subspace part (variance (std_e^2 + std_r^2) per basis direction) and the part
    orthogonal to it (variance std_r^2 per direction).
    """
    std_e, std_r = mech.noise_stds()
    scale = trials * expected**2
    if std_e is None:
        return float((error**2).sum()) * scale / std_r**2
    sub = subspace.to("cpu", torch.float64)
    inside = sub.embed(error[None])[0]
    outside = error - sub.lift(inside)
    var_in = std_e**2 + (std_r or 0.0) ** 2
    chi = float((inside**2).sum()) * scale / var_in
    if std_r is not None:
        chi += float((outside**2).sum()) * scale / std_r**2
    return chi


def assert_chi_square(chi, dof):
    assert abs(chi - dof) < 5 * math.sqrt(2 * dof), f"chi-square {chi:.1f} for {dof} dof"


@pytest.mark.parametrize("mech", [MECHANISMS[0], MECHANISMS[2]], ids=["gep", "gp"])
def test_estimates_are_unbiased_for_the_clipped_mean(mech):
    gen = torch.Generator().manual_seed(5)
    layout = flat_layout(300, 100)
    subspace = random_subspace(layout, (8, 4), gen)
    grads = 2 * torch.randn(16, layout.size, generator=gen) / math.sqrt(layout.size)
    grads[:3] *= 50  # some are clipped
    trials, expected = 3000, 16.0
    emb, res = contributions(mech, grads, subspace)
    target = res.sum(0) if emb is None else subspace.lift(emb.float()).double().sum(0) + res.sum(0)
    target = target / expected
    mean = mean_of_estimates(mech, grads, subspace, trials, expected)
    assert_chi_square(chi_square(mean - target, mech, subspace, trials, expected), layout.size)


def test_bgep_bias_is_exactly_the_dropped_residual():
    gen = torch.Generator().manual_seed(6)
    layout = flat_layout(300, 100)
    subspace = random_subspace(layout, (8, 4), gen)
    grads = torch.randn(16, layout.size, generator=gen) / 10
    trials, expected = 3000, 16.0
    gep, bgep = GEP(S1, S2, noise_multiplier=SIGMA), BGEP(S1, noise_multiplier=SIGMA)
    _, dropped = contributions(gep, grads, subspace)
    emb, _ = contributions(bgep, grads, subspace)
    clipped_mean = (subspace.lift(emb.float()).double().sum(0) + dropped.sum(0)) / expected
    mean = mean_of_estimates(bgep, grads, subspace, trials, expected)
    bias = mean - clipped_mean
    # the bias is minus the dropped residual; what is left is noise within the subspace
    leftover = bias + dropped.sum(0) / expected
    sub = subspace.to("cpu", torch.float64)
    assert float(torch.linalg.vector_norm(leftover - sub.lift(sub.embed(leftover[None]))[0])) < 1e-6
    assert_chi_square(chi_square(leftover, bgep, subspace, trials, expected), subspace.num_basis)
    assert float(torch.linalg.vector_norm(dropped.sum(0))) > 0.1  # the bias is real


def test_noise_has_the_calibrated_scale_per_release():
    layout = flat_layout(20000)
    subspace = random_subspace(layout, (50,))
    mech = GEP(S1, S2, noise_multiplier=3.0)
    zero = mech.clipped_sums(torch.zeros(0, layout.size), subspace)
    noisy = mech.add_noise(zero, NoiseSource(seed=1))
    assert noisy.noised
    assert float(noisy.residual.std()) == pytest.approx(3.0 * S2, rel=0.03)
    assert float(noisy.embedding.norm() / math.sqrt(50)) == pytest.approx(3.0 * S1, rel=0.3)


def test_gep_is_accounted_as_sigma_over_sqrt_two():
    assert GEP.accounting_noise_multiplier(2.0) == pytest.approx(2.0 / math.sqrt(2))
    assert BGEP.accounting_noise_multiplier(2.0) == 2.0
    assert GP.accounting_noise_multiplier(2.0) == 2.0


def test_bgep_never_computes_a_residual():
    layout = flat_layout(100)
    sums = BGEP(S1, noise_multiplier=SIGMA).clipped_sums(
        torch.randn(4, 100), random_subspace(layout, (5,))
    )
    assert sums.residual is None and sums.embedding.shape == (5,)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_clip_norms_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="clip_embedding"):
        GEP(bad, 1.0, noise_multiplier=SIGMA)
    with pytest.raises(ValueError, match="clip_norm"):
        GP(bad, noise_multiplier=SIGMA)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_mechanism_knows_its_noise_multiplier_and_refuses_a_bad_one(bad):
    assert GEP(S1, S2, noise_multiplier=2.0).noise_stds() == (2.0 * S1, 2.0 * S2)
    assert GP(S, noise_multiplier=2.0).noise_stds() == (None, 2.0 * S)
    with pytest.raises(ValueError, match="noise_multiplier"):
        GEP(S1, S2, noise_multiplier=bad)
    with pytest.raises(TypeError, match="noise_multiplier"):
        GP(S)  # no default: a mechanism without sigma would add no noise silently
