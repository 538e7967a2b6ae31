"""Clip bounds hold in floating point: no example contributes more than S, S1 or S2, for
every supported dtype, every clip norm in the accepted range and every gradient norm up to
the float maximum (issue 19, points 3 and 4).

A contribution is measured as the release of a one-example batch (the sums of that example
alone), its norm taken in float64.
"""

import math

import pytest
import torch

from gep_fed.mechanisms.clip_bounds import CLIP_BOUND_RANGE, clip_factors, gamma
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.groups import ParameterGroup, ParameterLayout
from gep_fed.mechanisms.mechanism import BGEP, GEP, GP
from gep_fed.mechanisms.subspace import AnchorSubspace
from gep_fed.validation import ConfigError


def one_group(p: int, basis: torch.Tensor) -> AnchorSubspace:
    layout = ParameterLayout(("w",), ((p,),), (ParameterGroup("all", ("w",), 0, p),))
    return AnchorSubspace(layout, (basis,))


def norm(x: torch.Tensor | None) -> float:
    return float(torch.linalg.vector_norm(x.double()))


def contribution(mechanism, g: torch.Tensor, subspace=None) -> tuple[float, float]:
    """(embedding norm, residual norm) released for the single example ``g``."""
    sums = mechanism.clipped_sums(g[None], subspace)
    emb = 0.0 if sums.embedding is None else norm(sums.embedding)
    res = 0.0 if sums.residual is None else norm(sums.residual)
    return emb, res


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_gp_contribution_exceeds_its_clip_norm_anywhere_in_the_float_range(dtype):
    """Clip norms across the accepted range against gradient norms from below the clip up to
    the float maximum, including the factors that fall below the normal range."""
    generator = torch.Generator().manual_seed(0)
    top = math.log10(torch.finfo(dtype).max) - 1
    worst = 0.0
    for bound in (1e-30, 5.1e-30, 1e-12, 3e-7, 0.1, 1.0, 1e6, 1e30):
        for scale in torch.logspace(-35, top, 40, dtype=torch.float64):
            g = torch.randn(50, generator=generator, dtype=dtype)
            g = g / torch.linalg.vector_norm(g) * float(scale)
            if not torch.isfinite(g).all():
                continue
            _, res = contribution(GP(bound, noise_multiplier=1.0), g)
            worst = max(worst, res / bound)
    assert worst <= 1.0, f"a contribution reached {worst} x S"


def test_gp_clip_factors_below_the_normal_range_are_flushed_to_zero():
    """The issue's case: S = 1e-30, gradient norms near 1e15 (factor ~1e-45, a float32
    subnormal that used to round up to 1.96, 1.33 and 1.01 x S): such an example now
    contributes nothing, like one with a non-finite gradient."""
    for n in (1.0e15, 1.3e15, 1.7e15, 2.9e15):
        g = torch.full((100,), n / 10)
        _, res = contribution(GP(1e-30, noise_multiplier=1.0), g)
        assert res <= 1e-30
        factor = GP(1e-30, noise_multiplier=1.0).clip(g[None], None).residual_scale
        assert factor.item() == 0.0 or factor.item() >= torch.finfo(torch.float32).smallest_normal


def test_clip_factors_round_down_into_float32():
    """A factor just below a float32 value rounds to nearest upward; it must step down."""
    norms = torch.tensor([3.0, 7.0, 1.0 / 3.0, 10.0], dtype=torch.float64)
    for bound in (0.1, 1e-30, 0.7, 2.0):
        factors = clip_factors(norms, bound, None, torch.float32, 1).double()
        assert (factors * norms <= bound).all()


@pytest.mark.parametrize("mechanism", ["gep-s1", "gep-s2", "bgep"])
def test_no_gep_contribution_exceeds_s1_or_s2_for_huge_or_tiny_gradients(mechanism):
    p, k = 2_000, 8
    generator = torch.Generator().manual_seed(1)
    basis = torch.linalg.qr(torch.randn(p, k, generator=generator)).Q
    subspace = one_group(p, basis)
    worst = 0.0
    for bound in (1e-30, 1e-9, 0.05, 1e4):
        for scale in torch.logspace(-32, 37, 30, dtype=torch.float64):
            g = torch.randn(p, generator=generator)
            g = g / torch.linalg.vector_norm(g) * float(scale)
            if mechanism == "bgep":
                emb, _ = contribution(BGEP(bound, noise_multiplier=1.0), g, subspace)
                worst = max(worst, emb / bound)
            elif mechanism == "gep-s1":
                emb, _ = contribution(GEP(bound, 1e30, noise_multiplier=1.0), g, subspace)
                worst = max(worst, emb / bound)
            else:
                _, res = contribution(GEP(1e30, bound, noise_multiplier=1.0), g, subspace)
                worst = max(worst, res / bound)
    assert worst <= 1.0, f"a contribution reached {worst} x the bound"


@pytest.mark.parametrize("p", [100_000, 1_000_000, 4_000_000])
def test_the_residual_bound_holds_for_equal_entry_basis_columns(p):
    """Point 4: a basis column with all entries 1/sqrt(p) and a gradient a b + c e_0. Every
    product in b^T g has the same sign, so rounding accumulates like p u rather than a
    random walk; the released residual used to reach 1.30 S2 (p = 1e5), 1.22 (1e6) and
    2.11 (4e6)."""
    b = torch.full((p, 1), 1 / math.sqrt(p))
    subspace = one_group(p, b)
    e0 = torch.zeros(p)
    e0[0] = 1.0
    worst = 0.0
    for a in (1.0, 10.0, 100.0, 1000.0):
        for c in (1e-3, 1e-2, 1e-1):
            g = a * b[:, 0] + c * e0
            s2 = c / 2  # the true residual (about c) is clipped
            _, res = contribution(GEP(1e6, s2, noise_multiplier=1.0), g, subspace)
            worst = max(worst, res / s2)
    assert worst <= 1.0, f"the residual reached {worst} x S2"


def test_the_embedding_error_bound_covers_the_actual_float32_error():
    """embed_bounded's error bound is above the float32 embedding's distance to the exact
    (float64) product, and not far above it (the residual stays useful)."""
    p, k = 300_000, 16
    generator = torch.Generator().manual_seed(2)
    basis = torch.linalg.qr(torch.randn(p, k, generator=generator)).Q
    subspace = one_group(p, basis)
    grads = torch.randn(8, p, generator=generator) * torch.logspace(-3, 3, 8)[:, None]
    grads[0] = basis[:, 0] * 1e3 + 1e-4  # same-sign terms
    emb, err, grad_norm = subspace.embed_bounded(grads)
    exact = grads.double() @ basis.double()
    actual = torch.linalg.vector_norm(emb.double() - exact, dim=1)
    assert (actual <= err).all()
    assert (grad_norm >= torch.linalg.vector_norm(grads.double(), dim=1)).all()
    # the bound is a small multiple of sqrt(k) gamma(1024, u) ||g||: GEP's residual stays tight
    rel = err / torch.linalg.vector_norm(grads.double(), dim=1)
    assert (rel < 10 * math.sqrt(k) * gamma(1024, 2**-24)).all()


def test_gep_still_clips_the_residual_tightly_in_the_normal_range():
    """The rigorous bound costs almost nothing on an ordinary gradient: the residual's clip
    factor is within 1 % of S2 over the exact residual norm."""
    p, k = 50_000, 20
    generator = torch.Generator().manual_seed(3)
    basis = torch.linalg.qr(torch.randn(p, k, generator=generator)).Q
    subspace = one_group(p, basis)
    g = torch.randn(4, p, generator=generator)
    exact = torch.linalg.vector_norm(
        g.double() - (g.double() @ basis.double()) @ basis.double().T, dim=1
    )
    clipping = GEP(1.0, 0.01, noise_multiplier=1.0).clip(g, subspace)
    ideal = 0.01 / exact
    assert (clipping.residual_scale.double() <= ideal).all()
    assert (clipping.residual_scale.double() >= 0.99 * ideal).all()


@pytest.mark.parametrize("value", [5.1e-38, 1e-31, 2e30, float("inf"), float("nan"), 0.0])
def test_clip_norms_outside_the_accepted_range_are_refused(value):
    low, high = CLIP_BOUND_RANGE
    assert not (low <= value <= high)
    with pytest.raises(ValueError, match="in \\[1e-30, 1e\\+30\\]"):
        GP(value, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="clip_norm"):
        PrivacyContract("gp", 1.0, 0.1, clip_norm=value)


def test_half_precision_gradients_are_refused_by_name():
    with pytest.raises(ValueError, match="float32 or float64"):
        GP(1.0, noise_multiplier=1.0).clipped_sums(torch.ones(2, 3, dtype=torch.float16), None)
