"""The layer engine (per-example gradients from layer rules) gives today's per-example
gradients and clipped sums, on every kind of model the tests use, and keeps the clip bounds."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gep_fed.data.models import MLP, MnistCNN, resnet20_gn
from gep_fed.mechanisms.anchors import compute_anchor_subspace, with_gram_groups
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.layer_gradients import (
    LayerEngineUnavailable,
    check_examples_kept_apart,
    factor_shapes,
    fallback_layers,
)
from gep_fed.mechanisms.per_example import factored_gradients, per_example_gradients
from gep_fed.mechanisms.step import clipped_sums_of_batches
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.mechanisms.subspace import AnchorSubspace, power_method_subspace


class Scaled(nn.Module):
    """A layer with its own parameter and no layer rule."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return x * self.scale


class WithCustomLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.custom, self.fc2 = nn.Linear(12, 16), Scaled(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.custom(self.fc1(x))))


class SharedLayer(nn.Module):
    """One linear layer applied twice: its per-example gradients add up over both uses."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = nn.Linear(12, 12), nn.Linear(12, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu_(self.fc1(x)))


class BatchCentred(nn.Module):
    """Subtracts the batch mean: one example's output depends on the others."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.tanh(h - h.mean(0, keepdim=True)))


class GatedBatchCentring(nn.Module):
    """Mixes examples only when ``gate`` is not 0: a server could send 0 while the engine's
    probe runs and another value afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 4)
        self.gate = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.tanh(h + self.gate * (h - h.mean(0, keepdim=True))))


class ReadsThePreviousExample(nn.Module):
    """Example i also reads example i - 1, and example 0 reads none: example 0's output is
    its own, so a probe that compares only example 0 passes it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc1(x)
        previous = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
        return self.fc2(torch.tanh(h + 0.5 * previous))


class OnlyTheThirdReadsTheSecond(nn.Module):
    """Only example 2 of a batch reads another (example 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc1(x)
        reads = torch.zeros(len(h), len(h), dtype=h.dtype)
        if len(h) > 2:
            reads[2, 1] = 1.0
        return self.fc2(torch.tanh(h + reads @ h))


class InputIndependentLayer(nn.Module):
    """A layer whose input does not depend on the model's input (a learned offset of a
    constant): no gradient with respect to the input passes through it."""

    def __init__(self) -> None:
        super().__init__()
        self.offset, self.out = nn.Linear(3, 12), nn.Linear(12, 4)
        self.register_buffer("constant", torch.linspace(-1, 1, 3))

    def forward(self, x):
        return self.out(torch.tanh(x + self.offset(self.constant.expand(len(x), 3))))


class EmbeddedSigns(nn.Module):
    """An embedding of indices computed from the input (no gradient reaches the input)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(2, 5), nn.Linear(12 * 5, 4)

    def forward(self, x):
        return self.out(self.embed((x > 0).long()).flatten(1))


def frozen_mlp() -> nn.Module:
    model = MLP(12, 4, hidden=(16, 8))
    model.hidden[0].requires_grad_(False)
    model.out.bias.requires_grad_(False)
    return model


def unused_head() -> nn.Module:
    model = MLP(12, 4, hidden=(16,))
    model.spare = nn.Linear(3, 3)  # trainable, never called: gradient 0
    return model


def small_mnist_cnn() -> nn.Module:
    return MnistCNN(image_size=16)


MODELS = {
    # small images (factored inner products cost positions squared) that still cross every
    # layer: the CNN's two pooling stages (16, 8, 4 pixels), ResNet20's three stages (8, 4, 2)
    "mnist_cnn": (small_mnist_cnn, (1, 16, 16)),
    "resnet20_gn": (resnet20_gn, (3, 8, 8)),
    "frozen_layers": (frozen_mlp, (12,)),
    "layer_without_rule": (WithCustomLayer, (12,)),
    "shared_layer": (SharedLayer, (12,)),
    "unused_parameters": (unused_head, (12,)),
    "input_independent_layer": (InputIndependentLayer, (12,)),
    "embedding_of_the_input": (EmbeddedSigns, (12,)),
}


def data(shape, n=7, dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, *shape, generator=generator, dtype=dtype), torch.arange(n) % 4


@pytest.mark.parametrize("name", list(MODELS))
def test_the_layer_engine_gives_the_vmap_engines_per_example_gradients(name):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().double()
    layout = ParameterLayout.from_model(model)
    x, y = data(shape)
    layers = per_example_gradients(model, F.cross_entropy, x, y, layout, 3, "layers")
    vmap = per_example_gradients(model, F.cross_entropy, x, y, layout, 3, "vmap")
    torch.testing.assert_close(layers, vmap, rtol=1e-5, atol=1e-7)
    assert layers.abs().sum() > 0


def test_a_channels_last_image_batch_gets_the_same_per_example_gradients():
    """RGB images permuted from height x width x channels arrive channels-last; Opacus's
    convolution rule, reading them with contiguous strides, gave ResNet20-GN's stride-2 and
    first convolutions wrong gradients (relative error 0.8 on CIFAR-10)."""
    torch.manual_seed(0)
    model = resnet20_gn(3, 10).double()
    layout = ParameterLayout.from_model(model)
    x, y = data((32, 32, 3))
    x = x.permute(0, 3, 1, 2)
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    layers = per_example_gradients(model, F.cross_entropy, x, y, layout, 3, "layers")
    vmap = per_example_gradients(model, F.cross_entropy, x.contiguous(), y, layout, 3, "vmap")
    torch.testing.assert_close(layers, vmap, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mechanism", ["gep", "bgep", "gp"])
@pytest.mark.parametrize("name", list(MODELS))
def test_both_engines_give_the_same_clipped_sums_to_1e_5(name, mechanism):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().double()
    layout = ParameterLayout.from_model(model)
    x, y = data(shape, n=9)
    contract = PrivacyContract(
        mechanism,
        noise_multiplier=1.0,
        sample_rate=0.1,
        clip_embedding=0.05,
        clip_residual=0.02,
        clip_norm=0.05,
    )  # small clips: most examples are clipped, so the factors are tested too
    config = GEPConfig(contract, num_basis=8, num_anchors=8)
    subspace = None
    if mechanism != "gp":
        public, _ = data(shape, n=8)
        subspace = compute_anchor_subspace(
            model,
            public,
            layout,
            config,
            loss_fn=F.cross_entropy,
            generator=torch.Generator().manual_seed(1),
        ).subspace
    sums = {
        engine: clipped_sums_of_batches(
            model,
            F.cross_entropy,
            [(x, y)],
            layout,
            contract.build_mechanism(),
            subspace,
            4,
            engine=engine,
            factored_layers=False,  # the engines alone; factored layers: the next test
        )
        for engine in ("layers", "vmap")
    }
    for part in ("embedding", "residual"):
        a, b = getattr(sums["layers"], part), getattr(sums["vmap"], part)
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.linalg.vector_norm(a - b) <= 1e-5 * torch.linalg.vector_norm(b)


def exact_clipped_sums(mech, grads, subspace):
    """A mechanism's clipped sums in float64 with exact clip factors (the bases as held)."""
    g = grads.double()
    if subspace is None:
        f = (mech.clip_norm / g.norm(dim=1)).clamp(max=1)
        return None, g.T @ f
    bases = [b.double() for b in subspace.bases]
    w = torch.cat(
        [g[:, cols] @ b for (cols, _), b in zip(subspace.group_slices(), bases, strict=True)], 1
    )
    f1 = (mech.clip_embedding / w.norm(dim=1)).clamp(max=1)
    if not hasattr(mech, "clip_residual"):
        return w.T @ f1, None
    lift = torch.cat(
        [w[:, ks] @ b.T for (_, ks), b in zip(subspace.group_slices(), bases, strict=True)], 1
    )
    r = g - lift
    f2 = (mech.clip_residual / r.norm(dim=1)).clamp(max=1)
    return w.T @ f1, r.T @ f2


@pytest.mark.parametrize("mechanism", ["gep", "bgep", "gp"])
@pytest.mark.parametrize("name", list(MODELS))
def test_factored_layers_give_the_materialised_clipped_sums(name, mechanism):
    """Every Linear and Conv2d weight kept as factors (issue 21: Gram embedding for GEP and
    B-GEP, ghost norms for GP). With the residual unclipped, both routes release the same
    sums to 1e-5. With most examples clipped, the clip factors are what the bounds allow:
    the factored route's sums are within 1e-4 of exact arithmetic (1e-6 on most models; an
    example almost inside the subspace amplifies the float32 basis' rounding) and never
    further from it than the materialised route's (within 1e-2)."""
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().double()
    layout = ParameterLayout.from_model(model)
    x, y = data(shape, n=9)
    weights = frozenset(factor_shapes(model, x, layout))
    assert weights
    subspace = materialised = None
    if mechanism != "gp":
        public, labels = data(shape, n=8)
        grads = per_example_gradients(model, F.cross_entropy, public, labels, layout, 8)
        dims = layout.allocate_basis(8, max_rank=8)
        basis, coefficients = power_method_subspace(
            lambda: [grads],
            layout,
            dims,
            1,
            generator=torch.Generator().manual_seed(1),
            with_coefficients=True,
        )
        subspace, _ = with_gram_groups(
            model, F.cross_entropy, public, labels, basis, coefficients, weights, 8
        )
        weights = subspace.factored_weights
        assert weights
        materialised = AnchorSubspace(layout, subspace.bases)
    factored = factored_gradients(model, F.cross_entropy, x, y, layout, weights)
    dense = per_example_gradients(model, F.cross_entropy, x, y, layout, 9, "vmap")
    loose = PrivacyContract(
        mechanism, 1.0, 0.1, clip_embedding=0.05, clip_residual=1e6, clip_norm=1e6
    )
    tight = PrivacyContract(
        mechanism, 1.0, 0.1, clip_embedding=0.05, clip_residual=0.02, clip_norm=0.05
    )
    a = loose.build_mechanism().clipped_sums(factored, subspace)
    b = loose.build_mechanism().clipped_sums(dense, materialised)
    for part in ("embedding", "residual"):
        u, v = getattr(a, part), getattr(b, part)
        if v is not None:
            assert torch.linalg.vector_norm(u - v) <= 1e-5 * torch.linalg.vector_norm(v)
    mech = tight.build_mechanism()
    got, held = mech.clipped_sums(factored, subspace), mech.clipped_sums(dense, materialised)
    for part, exact in zip(
        ("embedding", "residual"), exact_clipped_sums(mech, dense, materialised), strict=True
    ):
        if exact is not None:
            scale = torch.linalg.vector_norm(exact)
            off = float(torch.linalg.vector_norm(getattr(got, part).double() - exact) / scale)
            off_held = float(torch.linalg.vector_norm(getattr(held, part).double() - exact) / scale)
            assert off <= 1e-4 and off <= off_held + 1e-6
            assert off_held <= 1e-2


def test_a_layer_without_a_rule_is_named_and_still_served():
    assert fallback_layers(WithCustomLayer()) == ["custom (Scaled)"]
    assert fallback_layers(MnistCNN()) == []


def test_an_output_changed_in_place_sends_the_model_to_vmap_with_the_layer_named():
    model = InPlace().double()
    layout = ParameterLayout.from_model(model)
    x, y = data((12,))
    with pytest.warns(UserWarning, match=r"outputs of fc1 are modified in place"):
        got = per_example_gradients(model, F.cross_entropy, x, y, layout, 4, "layers")
    expected = per_example_gradients(model, F.cross_entropy, x, y, layout, 4, "vmap")
    torch.testing.assert_close(got, expected)


def test_a_model_that_mixes_examples_is_differentiated_one_example_at_a_time():
    """A batched pass would give each example a "gradient" that depends on the others (its
    clip would not bound one example's influence): the probe sends the model to torch.func,
    which differentiates each example alone, before any private batch is differentiated."""
    model = BatchCentred().double()
    layout = ParameterLayout.from_model(model)
    x, y = data((12,))
    with pytest.warns(UserWarning, match=r"depends on the other examples of its batch"):
        got = per_example_gradients(model, F.cross_entropy, x, y, layout, 4, "layers")
    alone = torch.stack(
        [
            per_example_gradients(
                model, F.cross_entropy, x[i : i + 1], y[i : i + 1], layout, 1, "vmap"
            )[0]
            for i in range(len(x))
        ]
    )
    torch.testing.assert_close(got, alone)


def each_example_alone(model, x, y, layout) -> torch.Tensor:
    """Every example's gradient computed in a batch of its own (no mixing possible)."""
    return torch.cat(
        [
            per_example_gradients(
                model, F.cross_entropy, x[i : i + 1], y[i : i + 1], layout, 1, "vmap"
            )
            for i in range(len(x))
        ]
    )


@pytest.mark.parametrize("mixing", [ReadsThePreviousExample, OnlyTheThirdReadsTheSecond])
def test_a_model_that_mixes_only_later_examples_of_a_batch_is_caught(mixing):
    """Example 0's output is its own in both models: the probe compares every example of
    its batch, so examples 1 and 2 reading another send the model to torch.func."""
    model = mixing().double()
    layout = ParameterLayout.from_model(model)
    x, y = data((12,))
    with pytest.raises(LayerEngineUnavailable, match=r"depends on the other examples"):
        check_examples_kept_apart(model, x)
    with pytest.warns(UserWarning, match=r"depends on the other examples of its batch"):
        got = per_example_gradients(model, F.cross_entropy, x, y, layout, 4, "layers")
    torch.testing.assert_close(got, each_example_alone(model, x, y, layout))


def test_weights_that_switch_mixing_on_after_the_probe_are_caught():
    model = GatedBatchCentring().double()
    layout = ParameterLayout.from_model(model)
    x, y = data((12,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # gate 0: no mixing, the layer engine serves it
        per_example_gradients(model, F.cross_entropy, x, y, layout, 4, "layers")
    state = {**model.state_dict(), "gate": torch.tensor(1.0, dtype=torch.float64)}
    model.load_state_dict(state)  # the next round's weights, as a site loads them
    with pytest.warns(UserWarning, match=r"depends on the other examples of its batch"):
        got = per_example_gradients(model, F.cross_entropy, x, y, layout, 4, "layers")
    torch.testing.assert_close(got, each_example_alone(model, x, y, layout))


def test_dropout_does_not_send_a_model_to_torch_func():
    """Two dropout layers draw per-example masks: the probe compares passes of equal shapes
    and seed, so it does not mistake the masks for mixing."""
    model = nn.Sequential(
        nn.Linear(12, 32), nn.Dropout(0.5), nn.Tanh(), nn.Dropout(0.3), nn.Linear(32, 4)
    ).train()
    layout = ParameterLayout.from_model(model)
    x, y = data((12,), dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads = per_example_gradients(model, F.cross_entropy, x, y, layout, 4, "layers")
    assert torch.isfinite(grads).all() and grads.abs().sum() > 0


def test_the_layer_engine_leaves_the_models_gradients_and_hooks_alone():
    model = MnistCNN()
    layout = ParameterLayout.from_model(model)
    x, y = data((1, 28, 28), dtype=torch.float32)
    per_example_gradients(model, F.cross_entropy, x, y, layout, 4, "layers")
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())


@pytest.mark.parametrize("mechanism", ["gp", "gep-s1", "gep-s2"])
def test_no_example_exceeds_its_clip_through_the_layer_engine(mechanism):
    """Issue 19's float case end to end: huge gradients (output weights scaled by 1e7) and
    S = 1e-30; each example's release, taken alone, stays within its bound."""
    torch.manual_seed(0)
    model = MLP(12, 4, hidden=(16,))
    with torch.no_grad():
        model.out.weight.mul_(1e7)
    layout = ParameterLayout.from_model(model)
    x, y = data((12,), n=20, dtype=torch.float32)
    tiny, loose = 1e-30, 1e30
    clips = {
        "gp": (loose, loose, tiny),
        "gep-s1": (tiny, loose, loose),
        "gep-s2": (loose, tiny, loose),
    }
    s1, s2, s = clips[mechanism]
    contract = PrivacyContract(
        "gp" if mechanism == "gp" else "gep",
        noise_multiplier=1.0,
        sample_rate=0.1,
        clip_embedding=s1,
        clip_residual=s2,
        clip_norm=s,
    )
    subspace = None
    if mechanism != "gp":
        subspace = compute_anchor_subspace(
            model,
            x[:8],
            layout,
            GEPConfig(contract, num_basis=4, num_anchors=8),
            loss_fn=F.cross_entropy,
            generator=torch.Generator().manual_seed(1),
        ).subspace
    worst = 0.0
    for i in range(len(x)):
        sums = clipped_sums_of_batches(
            model,
            F.cross_entropy,
            [(x[i : i + 1], y[i : i + 1])],
            layout,
            contract.build_mechanism(),
            subspace,
            engine="layers",
        )
        part = sums.embedding if mechanism == "gep-s1" else sums.residual
        worst = max(worst, float(torch.linalg.vector_norm(part.double())) / tiny)
    assert worst <= 1.0, f"an example reached {worst} x its clip"
