import torch

from gep_fed import power_method_subspace
from helpers import flat_layout, random_subspace


def principal_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(a.double().T @ b.double())


def test_power_method_recovers_a_planted_low_rank_subspace():
    gen = torch.Generator().manual_seed(1)
    layout = flat_layout(400, 300)
    planted = [torch.linalg.qr(torch.randn(g.size, 5, generator=gen)).Q for g in layout.groups]
    coeffs = torch.randn(200, 5, generator=gen) * torch.tensor([10.0, 8, 6, 4, 3])
    grads = torch.cat([coeffs @ b.T for b in planted], dim=1)
    grads += 1e-3 * torch.randn(grads.shape, generator=gen)

    subspace = power_method_subspace(lambda: [grads[:64], grads[64:]], layout, (5, 5), 2, gen)
    for found, true in zip(subspace.bases, planted, strict=True):
        assert principal_cosines(found, true).min() > 0.999
    assert subspace.projection_error(grads) < 1e-5


def test_bases_are_orthonormal():
    gen = torch.Generator().manual_seed(2)
    layout = flat_layout(1000, 50, 7)
    grads = torch.randn(40, layout.size, generator=gen)
    subspace = power_method_subspace(lambda: [grads], layout, layout.allocate_basis(30, 40), 1, gen)
    for b in subspace.bases:
        eye = torch.eye(b.shape[1], dtype=torch.float64)
        assert torch.allclose(b.double().T @ b.double(), eye, atol=1e-5)
    assert subspace.orthonormality_error < 1e-5


def test_embed_then_lift_is_the_orthogonal_projection():
    layout = flat_layout(60, 40)
    subspace = random_subspace(layout, (6, 4))
    g = torch.randn(3, layout.size)
    projected = subspace.lift(subspace.embed(g))
    # the residual is orthogonal to the subspace, and projecting twice changes nothing
    assert torch.allclose(subspace.embed(g - projected), torch.zeros(3, 10), atol=1e-5)
    assert torch.allclose(subspace.lift(subspace.embed(projected)), projected, atol=1e-5)
