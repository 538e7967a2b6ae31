"""Augmentation multiplicity: an example's released row is the mean of its augmented copies'
gradients, clipped once, on every route of the engine; its sensitivity stays one clip bound."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gep_fed.data.augment import crop_and_flip
from gep_fed.mechanisms.anchors import with_gram_groups
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.layer_gradients import factor_shapes
from gep_fed.mechanisms.multiplicity import AugmentationMultiplicity
from gep_fed.mechanisms.per_example import per_example_gradients
from gep_fed.mechanisms.step import GEPStep, clipped_sums_of_batches
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.mechanisms.subspace import AnchorSubspace, power_method_subspace
from gep_fed.validation import ConfigError

COPIES = 3


class SmallConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(4, 8)
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = torch.relu(self.norm(self.conv(x)))
        return self.head(F.adaptive_avg_pool2d(x, 4).flatten(1))


def by_copy(x: torch.Tensor) -> torch.Tensor:
    """A deterministic augmentation that depends only on a row's copy index (rows come as
    each example's copies in turn): flip odd copies, shift each copy's brightness."""
    copy = torch.arange(len(x)) % COPIES
    shifted = x + 0.1 * copy.to(x.dtype)[:, None, None, None]
    return torch.where((copy % 2 == 1)[:, None, None, None], shifted.flip(3), shifted)


def setup(n=7):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    layout = ParameterLayout.from_model(model)
    draw = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 8, 8, generator=draw, dtype=torch.float64)
    y = torch.randint(5, (n,), generator=draw)
    return model, layout, x, y


def gram_subspace(model, layout, k=6, anchors=10):
    """A subspace of public gradients with every factorable weight embedded by Gram products,
    and the same bases materialised."""
    draw = torch.Generator().manual_seed(1)
    public = torch.randn(anchors, 3, 8, 8, generator=draw, dtype=torch.float64)
    labels = torch.randint(5, (anchors,), generator=draw)
    grads = per_example_gradients(model, F.cross_entropy, public, labels, layout, 16)
    dims = layout.allocate_basis(k, max_rank=anchors)
    basis, coefficients = power_method_subspace(
        lambda: [grads], layout, dims, 1, generator=draw, with_coefficients=True
    )
    weights = frozenset(factor_shapes(model, public, layout))
    gram, _ = with_gram_groups(
        model, F.cross_entropy, public, labels, basis, coefficients, weights, 16
    )
    assert gram.factored_weights
    return gram, AnchorSubspace(layout, gram.bases)


def mean_of_copies(model, layout, x, y):
    """Each example's mean gradient over its ``by_copy`` copies, by torch.func."""
    copies = by_copy(x.repeat_interleave(COPIES, 0))
    grads = per_example_gradients(
        model, F.cross_entropy, copies, y.repeat_interleave(COPIES), layout, 64, "vmap"
    )
    return grads.reshape(len(x), COPIES, -1).mean(1)


def rel(a, b) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


@pytest.mark.parametrize("clipped", [True, False])
@pytest.mark.parametrize("max_chunk", [1, 4, 64])
@pytest.mark.parametrize("route", ["gp-ghost", "gep-gram", "gep-materialised"])
def test_an_examples_row_is_the_mean_of_its_copies_gradients_on_every_route(
    route, max_chunk, clipped
):
    """Clipped sums with multiplicity equal (to 1e-5: the engine works in float32) the
    clipped sums of the per-example means, clipping binding or not, whether the copies are
    differentiated by ghost norms (GP), Gram products (GEP) or materialised, and however the
    examples are chunked (a chunk smaller than the copies keeps an example's copies together)."""
    model, layout, x, y = setup()
    mechanism = "gp" if route.startswith("gp") else "gep"
    # the Gram route's residual clip factors carry its error bounds' slack (1e-4 here with or
    # without copies: tests/test_layer_gradients.py), so there the residual is left unclipped
    s = 0.02 if clipped else 1e6
    s2 = 0.01 if clipped and route != "gep-gram" else 1e6
    contract = PrivacyContract(mechanism, 1.0, 0.1, clip_embedding=s, clip_residual=s2, clip_norm=s)
    mech = contract.build_mechanism()
    gram = materialised = None
    if mechanism == "gep":
        gram, materialised = gram_subspace(model, layout)
    subspace = gram if route == "gep-gram" else materialised
    got = clipped_sums_of_batches(
        model,
        F.cross_entropy,
        [(x[:4], y[:4]), (x[4:], y[4:])],
        layout,
        mech,
        subspace,
        max_chunk,
        multiplicity=AugmentationMultiplicity(COPIES, by_copy),
    )
    want = mech.clipped_sums(mean_of_copies(model, layout, x, y), materialised)
    for part in ("embedding", "residual"):
        if getattr(want, part) is not None:
            assert rel(getattr(got, part), getattr(want, part)) < 1e-5, part


@pytest.mark.parametrize("mechanism", ["gp", "gep"])
def test_an_example_with_its_copies_moves_the_sums_by_at_most_one_clip_bound(mechanism):
    """The privacy claim: removing one example (all its copies) changes each released sum by
    at most its clip bound, although its copies' clipped gradients, released one row each,
    would add up to nearly ``COPIES`` bounds."""
    model, layout, x, y = setup()
    clip = 1e-3
    contract = PrivacyContract(
        mechanism, 1.0, 0.1, clip_embedding=clip, clip_residual=clip, clip_norm=clip
    )
    mech = contract.build_mechanism()
    subspace = gram_subspace(model, layout)[0] if mechanism == "gep" else None
    multiplicity = AugmentationMultiplicity(COPIES, by_copy)

    def sums(xs, ys):
        return clipped_sums_of_batches(
            model, F.cross_entropy, [(xs, ys)], layout, mech, subspace, 8, multiplicity=multiplicity
        )

    full, without = sums(x, y), sums(x[1:], y[1:])
    copies = by_copy(x[:1].repeat_interleave(COPIES, 0))
    one_row_each = clipped_sums_of_batches(
        model, F.cross_entropy, [(copies, y[:1].repeat(COPIES))], layout, mech, subspace, 8
    )
    for part in ("embedding", "residual"):
        if getattr(full, part) is None:
            continue
        moved = float(torch.linalg.vector_norm(getattr(full, part) - getattr(without, part)))
        assert 0.5 * clip < moved <= clip * (1 + 1e-6), part
        assert float(torch.linalg.vector_norm(getattr(one_row_each, part))) > 1.5 * clip


def test_a_step_with_multiplicity_records_the_same_release_as_one_without():
    """Accounting is unchanged: the ledger's event and epsilon are those of a plain step."""
    model, _layout, x, y = setup()
    contract = PrivacyContract("gp", 1.0, 0.5, clip_norm=0.1)
    plain = GEPStep(model, None, GEPConfig(contract), dataset_size=len(x))
    multiple = GEPStep(
        model,
        None,
        GEPConfig(contract),
        dataset_size=len(x),
        multiplicity=AugmentationMultiplicity(4, crop_and_flip),
    )
    plain(x, y)
    multiple(x, y)
    assert multiple.ledger.events == plain.ledger.events
    assert multiple.ledger.epsilon() == plain.ledger.epsilon()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_bad_multiplicity_settings_are_named():
    with pytest.raises(ConfigError, match="copies"):
        AugmentationMultiplicity(0, crop_and_flip)
    with pytest.raises(ConfigError, match="augment must be a function"):
        AugmentationMultiplicity(2, "crop")
    model, layout, x, y = setup()
    dropping = AugmentationMultiplicity(2, lambda batch: batch[1:])
    mech = PrivacyContract("gp", 1.0, 0.1).build_mechanism()
    with pytest.raises(ValueError, match="one augmented row per input row"):
        clipped_sums_of_batches(
            model, F.cross_entropy, [(x, y)], layout, mech, None, multiplicity=dropping
        )


def test_crop_and_flip_takes_a_window_of_the_reflected_image_per_row():
    draw = torch.Generator().manual_seed(0)
    images = torch.randn(16, 3, 8, 8, generator=draw)
    out = crop_and_flip(images, 2, generator=torch.Generator().manual_seed(3))
    again = crop_and_flip(images, 2, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(out, again)
    padded = F.pad(images, (2, 2, 2, 2), mode="reflect")
    flipped = 0
    for i in range(len(images)):
        windows = [
            w
            for dy in range(5)
            for dx in range(5)
            for w in (padded[i, :, dy : dy + 8, dx : dx + 8],)
        ]
        plain = any(torch.equal(out[i], w) for w in windows)
        mirrored = any(torch.equal(out[i], w.flip(2)) for w in windows)
        assert plain or mirrored, i
        flipped += not plain
    assert 0 < flipped < len(images)
    unpadded = crop_and_flip(images, 0, generator=draw)
    assert all(
        torch.equal(o, im) or torch.equal(o, im.flip(2))
        for o, im in zip(unpadded, images, strict=True)
    )
    with pytest.raises(ValueError, match="batch"):
        crop_and_flip(images[0])
    with pytest.raises(ValueError, match="padding"):
        crop_and_flip(images, 8)
