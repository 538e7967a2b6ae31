import torch

from gep_fed.mechanisms.subspace import power_method_subspace
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


def test_extending_by_directions_keeps_the_basis_orthonormal_and_contains_them():
    layout = flat_layout(300, 200)
    subspace = random_subspace(layout, (6, 4))
    gen = torch.Generator().manual_seed(3)
    directions = [torch.randn(layout.size, generator=gen) for _ in range(3)]
    inside = subspace.lift(torch.randn(subspace.num_basis, generator=gen))
    extended = subspace.with_directions([*directions, inside])
    assert extended.dims == (9, 7)  # the direction already inside adds nothing
    assert extended.orthonormality_error < 1e-5
    assert extended.projection_error(torch.stack(directions)) < 1e-10
    for old, new in zip(subspace.bases, extended.bases, strict=True):
        torch.testing.assert_close(new[:, : old.shape[1]], old)  # the public part unchanged
    assert subspace.with_directions([]) is subspace


def test_a_step_spans_its_latest_releases_at_no_privacy_cost():
    """With past_releases = 2, each step's subspace holds the two previous released
    estimates (the gradients the optimiser saw), and the ledger is the same as without."""
    from gep_fed import GEPConfig, GEPStep, PrivacyContract
    from gep_fed.data.models import MLP

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 20, generator=gen), torch.randint(3, (64,), generator=gen)
    public = torch.randn(50, 20, generator=gen)
    ledgers, dims = [], []
    for past in (0, 2):
        torch.manual_seed(0)
        model = MLP(20, 3, hidden=(16,))
        config = GEPConfig(
            PrivacyContract("gep", 1.0, 0.5),
            num_basis=8,
            past_releases=past,
            basis_refresh=1,
        )
        step = GEPStep(model, public, config, dataset_size=64, generator=gen)
        released = []
        for _ in range(4):
            step(x, y)
            released.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        step(x, y)
        if past:
            assert step.subspace.projection_error(torch.stack(released[-2:])) < 1e-8
        dims.append(step.subspace.num_basis)
        ledgers.append(step.ledger.epsilon())
    assert dims[1] > dims[0]
    assert ledgers[0] == ledgers[1]


def test_the_basis_checks_read_every_row_of_a_basis_taller_than_their_blocks():
    """Orthonormality error and Frobenius norm are summed over float64 blocks of rows; a
    departure in the last row of a basis longer than two blocks is counted."""
    from gep_fed.mechanisms.subspace import CHECK_ROWS, AnchorSubspace

    gen = torch.Generator().manual_seed(3)
    layout = flat_layout(2 * CHECK_ROWS + 5)
    basis = torch.linalg.qr(torch.randn(layout.size, 4, generator=gen)).Q
    exact = AnchorSubspace(layout, (basis,))
    assert exact.orthonormality_error < 1e-5
    bumped = basis.clone()
    bumped[-1] += 0.1
    off = AnchorSubspace(layout, (bumped,))
    b64 = bumped.double()
    whole = float(torch.linalg.matrix_norm(b64.T @ b64 - torch.eye(4, dtype=torch.float64)))
    assert whole > 0.01
    assert whole <= off.orthonormality_error <= whole * (1 + 1e-6) + 1e-9
    (norm,) = off.frobenius_norms
    assert (
        float(torch.linalg.matrix_norm(b64))
        <= norm
        <= float(torch.linalg.matrix_norm(b64)) * (1 + 1e-9)
    )
