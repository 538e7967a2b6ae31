"""GEP without materialising the per-example gradients of the layers where it pays: the
embedding from Gram products with the anchors' factors (issue 21), against the materialised
route and against exact arithmetic, with the clip bounds of issue 19."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gep_fed.data.models import resnet20_gn
from gep_fed.mechanisms.anchors import (
    compute_anchor_subspace,
    planned_gram_weights,
    rebuild_anchor_subspace,
    with_gram_groups,
)
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.mechanism import BGEP, GEP
from gep_fed.mechanisms.per_example import factored_gradients, per_example_gradients
from gep_fed.mechanisms.step import clipped_sums_of_batches
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.mechanisms.subspace import AnchorSubspace, power_method_subspace


class Scaled(nn.Module):
    """A layer with parameters and no layer rule (served by torch.func)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x):
        return x * self.scale


class ConvNet(nn.Module):
    """Convolutions with and without bias, a frozen layer, a layer without a rule, GroupNorm
    in a convolution's group, and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Conv2d(3, 3, 1)
        self.frozen.requires_grad_(False)
        self.conv1, self.norm1 = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.custom = Scaled()
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = torch.tanh(self.norm1(self.conv1(self.frozen(x))))
        x = torch.relu(self.conv2(x))
        x = self.custom(F.adaptive_avg_pool2d(x, 4).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(x.flatten(1))


GROUPS = {"first": ["conv1.*", "norm1.*"], "second": ["conv2.*", "custom.*"], "head": ["head.*"]}
FACTORED = frozenset({"conv1.weight", "conv2.weight", "head.weight"})


def setup(n=11, anchors=40, k=12):
    torch.manual_seed(0)
    model = ConvNet()
    layout = ParameterLayout.from_model(model, GROUPS)
    draw = torch.Generator().manual_seed(0)
    public = torch.randn(anchors, 3, 8, 8, generator=draw)
    labels = torch.randint(10, (anchors,), generator=draw)
    x, y = torch.randn(n, 3, 8, 8, generator=draw), torch.randint(10, (n,), generator=draw)
    grads = per_example_gradients(model, F.cross_entropy, public, labels, layout, 16)
    dims = layout.allocate_basis(k, max_rank=anchors)
    subspace, coefficients = power_method_subspace(
        lambda: [grads], layout, dims, 1, generator=draw, with_coefficients=True
    )
    gram, _ = with_gram_groups(
        model, F.cross_entropy, public, labels, subspace, coefficients, FACTORED, 16
    )
    return model, layout, gram, x, y


def exact_sums(model, layout, subspace, x, y, s1, s2):
    """GEP's clipped sums in float64 with exact clip factors, for the held bases."""
    grads = factored_gradients(model, F.cross_entropy, x, y, layout, subspace.factored_weights)
    g = torch.cat(
        [
            (f.backprops.double().mT @ f.inputs.double()).reshape(len(x), -1)
            if (f := grads.factors.get(name)) is not None
            else grads.dense[:, slice(*grads.index[name])].double()
            for name, _ in layout.slices()
        ],
        1,
    )
    bases = [b.double() for b in subspace.bases]
    w = torch.cat(
        [g[:, grp.start : grp.stop] @ b for grp, b in zip(layout.groups, bases, strict=True)], 1
    )
    lift = torch.cat(
        [w[:, ks] @ b.T for (_, ks), b in zip(subspace.group_slices(), bases, strict=True)], 1
    )
    r = g - lift
    f1 = (s1 / w.norm(dim=1)).clamp(max=1)
    f2 = (s2 / r.norm(dim=1)).clamp(max=1)
    return w.T @ f1, r.T @ f2


def rel(a, b) -> float:
    return float(torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b))


def test_factored_gradients_materialise_to_the_layer_rules_gradients():
    model, layout, _gram, x, y = setup()
    factored = factored_gradients(model, F.cross_entropy, x, y, layout, FACTORED)
    dense = per_example_gradients(model, F.cross_entropy, x, y, layout, 16)
    torch.testing.assert_close(factored.to_dense(), dense, rtol=1e-5, atol=1e-7)
    assert set(factored.factors) == FACTORED
    assert factored.dense.shape[1] == layout.size - sum(
        p.numel() for n, p in model.named_parameters() if n in FACTORED
    )


@pytest.mark.parametrize("mechanism", ["gep", "bgep"])
def test_gram_route_gives_the_materialised_clipped_sums_to_1e_5(mechanism):
    """Embedding clipped (S1 small), residual not: both routes release the same sums."""
    model, layout, gram, x, y = setup()
    materialised = AnchorSubspace(layout, gram.bases)
    mech = (
        GEP(0.05, 1e6, noise_multiplier=1.0)
        if mechanism == "gep"
        else BGEP(0.05, noise_multiplier=1.0)
    )
    a = clipped_sums_of_batches(model, F.cross_entropy, [(x, y)], layout, mech, gram, 4)
    b = clipped_sums_of_batches(model, F.cross_entropy, [(x, y)], layout, mech, materialised, 4)
    assert rel(a.embedding, b.embedding) < 1e-5
    if mechanism == "gep":
        assert rel(a.residual, b.residual) < 1e-5


def test_gram_route_clips_residuals_within_1e_5_of_exact_arithmetic():
    """With most residuals clipped the two routes differ by their bounds' slack; the Gram
    route's is the smaller: its clipped sums are within 1e-5 of the float64 ones with exact
    clip factors, and no further from them than the materialised route's."""
    model, layout, gram, x, y = setup()
    materialised = AnchorSubspace(layout, gram.bases)
    mech = GEP(0.05, 0.01, noise_multiplier=1.0)
    emb, res = exact_sums(model, layout, gram, x, y, 0.05, 0.01)
    a = clipped_sums_of_batches(model, F.cross_entropy, [(x, y)], layout, mech, gram, 4)
    b = clipped_sums_of_batches(model, F.cross_entropy, [(x, y)], layout, mech, materialised, 4)
    assert rel(a.embedding, emb) < 1e-5
    assert rel(a.residual, res) < 1e-5
    assert rel(a.residual, res) <= rel(b.residual, res)


def test_held_basis_is_within_its_bound_of_the_anchors_span():
    """The Gram route's embedding is C'^T G g; the held basis' factored rows are within
    basis_error of G^T C' (float64 from the anchors' factors), and its orthonormality error
    (bounded from a (k, k) product) is above the actual one and small."""
    _model, layout, gram, _x, _y = setup()
    assert set(gram.gram) == {0, 1, 2}
    for index, group in gram.gram.items():
        basis = gram.bases[index].double()
        exact = torch.zeros_like(basis)
        start = layout.groups[index].start
        for name, f in group.factors.items():
            lo, hi = layout.index[name]
            g = (f.backprops.double().mT @ f.inputs.double()).reshape(f.inputs.shape[0], -1)
            exact[lo - start : hi - start] = g.T @ group.coefficients
        rows = torch.ones(basis.shape[0], dtype=torch.bool)
        rows[group.dense_rows] = False
        error = torch.linalg.matrix_norm(basis[rows] - exact[rows])
        assert error <= group.basis_error
        assert group.basis_error < 1e-5
        eye = torch.eye(basis.shape[1], dtype=torch.float64)
        assert torch.linalg.matrix_norm(basis.T @ basis - eye) <= group.orthonormality_error
    assert gram.orthonormality_error < 1e-5


def test_no_example_exceeds_s1_or_s2_on_the_gram_route():
    """Issue 19's bound: each example alone releases at most S1 and S2, for gradients
    scaled from tiny to huge (the inputs of the last layer scale its gradient)."""
    model, layout, gram, x, y = setup(n=6)
    worst = 0.0
    for bound in (1e-6, 0.01, 1.0):
        for scale in (1e-12, 1e-3, 1.0, 1e3, 1e8):
            for i in range(len(x)):
                xi = x[i : i + 1] * scale
                for mech, part, b in (
                    (GEP(bound, 1e30, noise_multiplier=1.0), "embedding", bound),
                    (GEP(1e30, bound, noise_multiplier=1.0), "residual", bound),
                ):
                    sums = clipped_sums_of_batches(
                        model, F.cross_entropy, [(xi, y[i : i + 1])], layout, mech, gram, 4
                    )
                    value = getattr(sums, part).double()
                    worst = max(worst, float(torch.linalg.vector_norm(value)) / b)
    assert 0.5 < worst <= 1.0, f"a contribution reached {worst} x its bound"


def test_examples_marked_invalid_or_non_finite_contribute_nothing_on_the_gram_route():
    model, layout, gram, x, y = setup(n=5)
    mech = GEP(0.05, 0.01, noise_multiplier=1.0)
    valid = torch.tensor([True, False, True, True, False])
    marked = clipped_sums_of_batches(model, F.cross_entropy, [(x, y, valid)], layout, mech, gram, 4)
    kept = clipped_sums_of_batches(
        model, F.cross_entropy, [(x[valid], y[valid])], layout, mech, gram, 4
    )
    assert rel(marked.embedding, kept.embedding) < 1e-6
    assert rel(marked.residual, kept.residual) < 1e-6
    poisoned = x.clone()
    poisoned[1, 0, 0, 0] = float("nan")
    sums = clipped_sums_of_batches(model, F.cross_entropy, [(poisoned, y)], layout, mech, gram, 4)
    assert torch.isfinite(sums.embedding).all() and torch.isfinite(sums.residual).all()


def test_past_releases_turn_the_gram_route_off():
    """Directions added to the basis are not in the anchors' span: no Gram embedding."""
    _model, layout, gram, _x, _y = setup()
    extended = gram.with_directions([torch.randn(layout.size)])
    assert extended.gram == {} and gram.factored_weights == FACTORED


def test_cost_model_picks_resnet18s_last_stage_at_64_pixels():
    """ResNet-18 at 64x64 (issue 21): the last stage has 4 output positions per
    convolution, the Gram route's cost there is a fraction of the materialised one; the
    earlier stages (16 positions and more) stay materialised."""
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=10)
    groups = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d | nn.Linear):
            groups[name] = [f"{name}.*"]
    groups["rest"] = ["*"]
    layout = ParameterLayout.from_model(model, groups)
    dims = layout.allocate_basis(490, max_rank=256)
    chosen = planned_gram_weights(model.eval(), torch.randn(1, 3, 64, 64), layout, dims, 256)
    assert chosen and all(name.startswith("layer4.") for name in chosen)
    assert {"layer4.0.conv2.weight", "layer4.1.conv1.weight", "layer4.1.conv2.weight"} <= chosen
    assert not any(name.startswith(("layer1", "layer2", "layer3")) for name in chosen)


def test_cost_model_keeps_a_group_mostly_of_materialised_parameters_materialised():
    """A weight where the Gram route pays, in a group whose other parameters (materialised
    anyway) are most of it, stays materialised; alone in its group it is planned. On
    ResNet20-GN with the benchmark's three groups the fc weight in the layer3 group had made
    the step 1.4x slower (the group's dense basis rows copied per chunk)."""
    model = nn.Sequential(
        nn.Conv2d(3, 256, 3, padding=1),
        nn.Tanh(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(256, 16),
    )
    example = torch.randn(1, 3, 8, 8)
    for groups, planned in (
        ({"all": ["*"]}, frozenset()),
        ({"conv": ["0.*"], "head": ["4.*"]}, frozenset({"4.weight"})),
    ):
        layout = ParameterLayout.from_model(model, groups)
        dims = layout.allocate_basis(12, max_rank=20)
        assert planned_gram_weights(model, example, layout, dims, 20) == planned
    resnet = resnet20_gn()
    layout = ParameterLayout.from_model(
        resnet,
        {
            "input": ["conv1.*", "norm1.*", "layer1.*"],
            "middle": ["layer2.*"],
            "output": ["layer3.*", "fc.*"],
        },
    )
    dims = layout.allocate_basis(500, max_rank=1000)
    assert planned_gram_weights(resnet, torch.randn(1, 3, 32, 32), layout, dims, 1000) == set()


def test_anchor_subspace_serves_the_planned_layers_and_a_site_rebuilds_its_basis():
    """compute_anchor_subspace builds the Gram groups the cost model chose, and the
    coefficients it returns for a site to rebuild from give the same basis."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 256), nn.Tanh(), nn.Linear(256, 10))
    layout = ParameterLayout.from_model(model)
    public = torch.randn(40, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    config = GEPConfig(PrivacyContract("gep", 1.0, 0.1), num_basis=12, max_chunk=16)
    result = compute_anchor_subspace(
        model,
        public,
        layout,
        config,
        loss_fn=F.cross_entropy,
        generator=torch.Generator().manual_seed(0),
        with_coefficients=True,
    )
    planned = planned_gram_weights(model, public[:1], layout, layout.allocate_basis(12, 40), 40)
    assert "1.weight" in planned and result.subspace.factored_weights == planned
    rebuilt = rebuild_anchor_subspace(model, result.anchors, layout, loss_fn=F.cross_entropy)
    for held, again in zip(result.subspace.bases, rebuilt.bases, strict=True):
        assert rel(again, held) < 1e-4
