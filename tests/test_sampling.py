import pytest
import torch

from gep_fed import GEPConfig, GEPStep, PrivacyContract
from gep_fed.data.models import MnistCNN
from gep_fed.mechanisms.sampling import PoissonSampler


def test_poisson_batch_sizes_have_binomial_mean_and_variance():
    n, q, draws = 2000, 0.05, 4000
    sampler = PoissonSampler(n, q, steps=draws, generator=torch.Generator().manual_seed(0))
    sizes = torch.tensor([len(b) for b in sampler], dtype=torch.float64)
    mean, var = q * n, q * (1 - q) * n
    assert abs(sizes.mean() - mean) < 5 * (var / draws) ** 0.5
    # the sample variance of a binomial has sd about var * sqrt(2 / draws)
    assert abs(sizes.var() - var) < 5 * var * (2 / draws) ** 0.5


def test_indices_are_distinct_in_range_and_each_example_has_rate_q():
    n, q = 50, 0.3
    sampler = PoissonSampler(n, q, steps=3000, generator=torch.Generator().manual_seed(1))
    counts = torch.zeros(n)
    for idx in sampler:
        assert len(set(idx.tolist())) == len(idx) and (idx.numel() == 0 or idx.max() < n)
        counts[idx] += 1
    assert (counts / 3000 - q).abs().max() < 0.05


def test_empty_batches_occur_and_a_step_on_one_does_not_crash():
    sampler = PoissonSampler(10, 0.01, steps=50, generator=torch.Generator().manual_seed(2))
    assert any(len(b) == 0 for b in sampler)
    model = MnistCNN()
    cfg = GEPConfig(PrivacyContract("gep", 1.0, 0.01), num_basis=20)
    step = GEPStep(model, torch.randn(30, 1, 28, 28), cfg, dataset_size=10)
    step(torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.long))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert step.ledger.steps == 1


def test_projection_error_diagnostics_on_anchors_and_on_a_private_batch():
    model = MnistCNN()
    cfg = GEPConfig(PrivacyContract("gep", 1.0, 0.1), num_basis=40)
    public = torch.randn(60, 1, 28, 28)
    step = GEPStep(model, public, cfg, dataset_size=100)
    result = step.refresh_subspace(measure=True)
    assert 0 <= result.projection_error < 1
    private = step.private_projection_error(torch.randn(8, 1, 28, 28), torch.randint(10, (8,)))
    assert 0 < private <= 1
    assert step.ledger.steps == 0  # a diagnostic, not a release: nothing accounted


@pytest.mark.slow  # 335 million uniforms (~3.5 s)
def test_inclusion_rate_is_not_rounded_up_to_a_float32_grid():
    """float32 uniforms are multiples of 2^-24, so u < q holds with probability >= 2^-24
    however small q is. At q = 2^-30 over 2^24 examples, 20 samples include 20 examples in
    expectation with float32 uniforms, and 0.3 with the accounted rate."""
    q, n = 2.0**-30, 2**24
    sampler = PoissonSampler(n, q, generator=torch.Generator().manual_seed(0))
    included = sum(len(sampler.sample()) for _ in range(20))
    assert included <= 4
