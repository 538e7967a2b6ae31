"""A fresh subspace started from the previous one (issue 54: a cheap refresh): one power
pass from the last basis tracks a slowly moving subspace better than one from a random start,
and a carried covariance lets a refresh use fewer anchors than basis vectors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gep_fed import GEPConfig, PrivacyContract
from gep_fed.mechanisms.anchors import WarmStart, compute_anchor_subspace, warm_power_method
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.subspace import (
    AnchorSubspace,
    power_method_subspace,
    subspace_from_coefficients,
)


def _planted(gen, p=200, k=6, m=60, noise=0.05, basis=None):
    """``m`` rows spanning ``basis`` (random if None) with decaying strengths, plus noise."""
    if basis is None:
        basis = torch.linalg.qr(torch.randn(p, k, generator=gen)).Q
    strengths = torch.linspace(3.0, 1.0, k)
    rows = (torch.randn(m, k, generator=gen) * strengths) @ basis.T
    return rows + noise * torch.randn(m, p, generator=gen), basis


def _captured(basis: torch.Tensor, truth: torch.Tensor) -> float:
    """Share of the true subspace inside ``basis`` (1: all of it)."""
    return float(torch.linalg.matrix_norm(basis.T @ truth) ** 2 / truth.shape[1])


def _layout(p=200):
    return ParameterLayout.from_dict({"names": ["w"], "shapes": [[p]], "groups": [["all", ["w"]]]})


def test_one_warm_pass_per_refresh_tracks_the_subspace_better_than_a_cold_one():
    gen = torch.Generator().manual_seed(0)
    layout = _layout(400)
    rows, truth = _planted(gen, p=400, noise=0.1)
    cold = power_method_subspace(lambda: [rows], layout, (6,), 1, generator=gen)
    warm = WarmStart(cold, None)
    cold_scores, warm_scores = [], []
    for _ in range(4):  # fresh anchors each refresh, the same planted subspace
        rows, _ = _planted(gen, p=400, noise=0.1, basis=truth)
        subspace, _, scales = warm_power_method(lambda r=rows: [r], layout, warm, 1, 0.0, 60)
        warm = WarmStart(subspace, scales)
        warm_scores.append(_captured(subspace.bases[0], truth))
        again = power_method_subspace(lambda r=rows: [r], layout, (6,), 1, generator=gen)
        cold_scores.append(_captured(again.bases[0], truth))
    assert min(warm_scores) > 0.95 > 0.9 > max(cold_scores)


def test_a_carried_covariance_keeps_the_subspace_with_fewer_anchors_than_vectors():
    gen = torch.Generator().manual_seed(1)
    layout = _layout()
    rows, truth = _planted(gen, m=60)
    first = power_method_subspace(lambda: [rows], layout, (6,), 4, generator=gen)
    without = with_memory = WarmStart(first, None)
    for _ in range(3):
        few, _ = _planted(gen, m=3, basis=truth)  # 3 anchors for 6 vectors
        sub0, _, s0 = warm_power_method(lambda f=few: [f], layout, without, 1, 0.0, 3)
        sub1, _, s1 = warm_power_method(lambda f=few: [f], layout, with_memory, 1, 0.8, 3)
        without, with_memory = WarmStart(sub0, s0), WarmStart(sub1, s1)
    assert _captured(with_memory.subspace.bases[0], truth) > 0.95
    assert _captured(without.subspace.bases[0], truth) < 0.8


def test_warm_coefficients_rebuild_the_basis_from_the_anchors_gradients():
    gen = torch.Generator().manual_seed(2)
    layout = _layout()
    rows, _ = _planted(gen)
    start = power_method_subspace(lambda: [rows], layout, (6,), 1, generator=gen)
    subspace, coefficients, _ = warm_power_method(
        lambda: [rows[:25], rows[25:]], layout, WarmStart(start, None), 2, 0.0, 60
    )
    rebuilt = subspace_from_coefficients(lambda: [rows], layout, coefficients)
    torch.testing.assert_close(rebuilt.bases[0], subspace.bases[0], atol=1e-4, rtol=1e-4)


def test_compute_anchor_subspace_starts_from_the_previous_result_when_it_fits():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    layout = ParameterLayout.from_model(model)
    public = torch.randn(64, 8)
    config = GEPConfig(PrivacyContract("gep", 1.0, 0.1, 1.0, 0.5), num_basis=8, num_anchors=32)

    def compute(seed, **kw):
        return compute_anchor_subspace(
            model,
            public,
            layout,
            config,
            loss_fn=F.cross_entropy,
            generator=torch.Generator().manual_seed(seed),
            **kw,
        )

    cold = compute(0)
    assert cold.warm is not None and cold.warm.scales is None
    assert cold.warm.subspace.dims == cold.subspace.dims
    warm = compute(1, previous=cold.warm)
    assert warm.warm.scales is not None
    # the same anchors and labels from a random start and from the previous basis differ;
    # a start whose sizes do not fit the layout is ignored (a cold start, as with none)
    assert not torch.allclose(warm.subspace.bases[0], compute(1).subspace.bases[0])
    other = WarmStart(
        AnchorSubspace(layout, tuple(b[:, :1] for b in cold.subspace.bases)), cold.warm.scales
    )
    torch.testing.assert_close(
        compute(1, previous=other).subspace.bases[0], compute(1).subspace.bases[0]
    )
    with pytest.raises(ValueError, match="memory"):
        compute(1, previous=cold.warm, memory=0.5, with_coefficients=True)
    with pytest.raises(ValueError, match="memory"):
        compute(1, memory=-1.0)


def test_a_memory_chain_keeps_its_basis_size_with_fewer_anchors_than_vectors():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    layout = ParameterLayout.from_model(model)
    public = torch.randn(64, 8)
    config = GEPConfig(PrivacyContract("gep", 1.0, 0.1, 1.0, 0.5), num_basis=12, num_anchors=32)
    kw = {"loss_fn": F.cross_entropy, "generator": torch.Generator().manual_seed(0)}
    first = compute_anchor_subspace(model, public, layout, config, **kw)
    few = GEPConfig(PrivacyContract("gep", 1.0, 0.1, 1.0, 0.5), num_basis=12, num_anchors=2)
    alone = compute_anchor_subspace(model, public, layout, few, **kw)
    carried = compute_anchor_subspace(
        model, public, layout, few, previous=first.warm, memory=0.8, **kw
    )
    assert max(alone.subspace.dims) <= 2 < max(first.subspace.dims)
    assert carried.subspace.dims == first.subspace.dims
