"""Models by name: torchvision classifiers with GroupNorm, pretrained weights from local files,
and head-only fine-tuning with frozen parameters outside the release."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gep_fed.data import models
from gep_fed.data.models import (
    MLP,
    MnistCNN,
    PerExampleStochasticDepth,
    ResNet20GN,
    build_model,
    fine_tune,
    load_pretrained,
)
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.per_example import per_example_gradients, validate_model
from gep_fed.mechanisms.step import GEPStep
from gep_fed.mechanisms.step_config import GEPConfig

TORCHVISION = [
    "resnet18",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "regnet_x_400mf",
    "squeezenet1_1",
]


@pytest.fixture
def no_downloads(monkeypatch):
    """Any attempt to fetch weights fails the test (the machine is offline by design)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a download was attempted: {args}")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_builds_offline_without_batchnorm(name, no_downloads):
    import torchvision

    model = build_model(f"torchvision:{name}", num_classes=7)
    original = torchvision.models.get_model(name, weights=None, num_classes=7)
    assert not _has_batchnorm(model)
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) == sum(isinstance(m, nn.BatchNorm2d) for m in original.modules())
    validate_model(model)
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


@pytest.mark.parametrize(
    "name", ["resnet18", "mobilenet_v3_small", "squeezenet1_1", "shufflenet_v2_x0_5"]
)
def test_torchvision_input_conv_adapted_for_grey_images(name, no_downloads):
    model = build_model(f"torchvision:{name}", num_classes=3, in_channels=1)
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 32, 32)).shape == (2, 3)


def test_unadaptable_input_conv_is_refused(monkeypatch):
    monkeypatch.setattr(models, "_INPUT_CONV_PATHS", ("conv1",))
    with pytest.raises(ValueError, match=r"cannot adapt torchvision:mobilenet_v3_small.*expand"):
        build_model("torchvision:mobilenet_v3_small", 10, in_channels=1)


def test_stochastic_depth_is_per_example():
    import torchvision

    model = build_model("torchvision:efficientnet_b0", 10)
    assert any(isinstance(m, PerExampleStochasticDepth) for m in model.modules())
    assert not any(isinstance(m, torchvision.ops.StochasticDepth) for m in model.modules())
    layout = ParameterLayout.from_model(fine_tune(model, "head"))
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    grads = per_example_gradients(model, F.cross_entropy, x, y, layout, max_chunk=2)
    assert torch.isfinite(grads).all()


def test_built_in_names():
    assert isinstance(build_model("resnet20_gn", 10), ResNet20GN)
    assert isinstance(build_model("cnn", 10, in_channels=1), MnistCNN)
    mlp = build_model("mlp", 4, in_features=12, hidden=(8,))
    assert isinstance(mlp, MLP) and len(mlp.hidden) == 1
    linear = build_model("linear", 4, in_features=12)
    assert len(linear.hidden) == 0 and linear.out.in_features == 12
    with pytest.raises(ValueError, match="in_features"):
        build_model("mlp", 4)


@pytest.mark.parametrize(
    "name", ["resnet", "torchvision:not_a_model", "torchvision:fcos_resnet50_fpn"]
)
def test_unknown_names_list_what_is_accepted(name):
    with pytest.raises(ValueError, match=r"accepted: .*resnet18") as err:
        build_model(name, 10)
    if not name.startswith("torchvision:"):
        assert "'resnet20_gn'" in str(err.value) and "torchvision:<name>" in str(err.value)


def test_weights_argument_is_refused():
    with pytest.raises(ValueError, match="weights=None"):
        build_model("torchvision:resnet18", 10, weights="DEFAULT")


def test_resnet18_gn_per_example_gradients_match_a_loop():
    # float64 so that the comparison tests the per-example computation, not the rounding of
    # differently ordered float32 reductions (the result is float32 either way)
    model = build_model("torchvision:resnet18", num_classes=10).double()
    layout = ParameterLayout.from_model(model)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    y = torch.tensor([3, 7])
    grads = per_example_gradients(model, F.cross_entropy, x, y, layout, max_chunk=1)
    params = dict(model.named_parameters())
    for i in range(2):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        expected = layout.flatten({n: params[n].grad for n in layout.names}).float()
        torch.testing.assert_close(grads[i], expected, rtol=1e-4, atol=1e-7)


# -- fine-tuning: frozen parameters ----------------------------------------------------------


def test_fine_tune_head_lays_out_only_the_head():
    model = fine_tune(build_model("torchvision:resnet18", 10), "head")
    layout = ParameterLayout.from_model(model)
    assert layout.names == ("fc.weight", "fc.bias")
    assert layout.size == 512 * 10 + 10
    named = fine_tune(build_model("torchvision:mobilenet_v3_small", 10), "head", head="classifier")
    assert all(n.startswith("classifier.") for n in ParameterLayout.from_model(named).names)
    assert len(ParameterLayout.from_model(named).names) == 4  # both Linear layers
    fine_tune(model, "all")
    assert all(p.requires_grad for p in model.parameters())


def test_fine_tune_head_errors():
    model = build_model("torchvision:squeezenet1_1", 10)  # its classifier is a convolution
    with pytest.raises(ValueError, match=r"no nn\.Linear.*head="):
        fine_tune(model, "head")
    fine_tune(model, "head", head="classifier.1")
    assert ParameterLayout.from_model(model).names == ("classifier.1.weight", "classifier.1.bias")
    with pytest.raises(ValueError, match="no module 'fc'"):
        fine_tune(model, "head", head="fc")
    with pytest.raises(ValueError, match="'head' or 'all'"):
        fine_tune(model, "last")


def _run_steps(model, steps: int, size: int = 16) -> GEPStep:
    config = GEPConfig(PrivacyContract("gep", 1.0, 0.1), num_basis=8, max_chunk=4)
    gen = torch.Generator().manual_seed(0)
    public = torch.randn(4, 3, size, size, generator=gen)
    step = GEPStep(model, public, config, dataset_size=30, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        step(torch.randn(3, 3, size, size, generator=gen), torch.tensor([0, 1, 2]))
        opt.step()
    return step


def test_gep_step_leaves_frozen_parameters_alone():
    model = fine_tune(build_model("torchvision:resnet18", 10), "head")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    head_before = model.fc.weight.detach().clone()
    step = _run_steps(model, steps=2)
    assert step.layout.names == ("fc.weight", "fc.bias")
    assert step.subspace.layout.names == ("fc.weight", "fc.bias")
    for name, p in model.named_parameters():
        if name in frozen:
            assert p.grad is None, name
            assert torch.equal(p, frozen[name]), name  # weight decay and momentum skip them
    assert not torch.equal(model.fc.weight, head_before)
    assert len(step.ledger.events) == 2  # one event per released step


def test_freezing_leaves_the_accounting_unchanged():
    """Every released value is accounted: one event per step, the same as the full model's."""
    head_only = _run_steps(fine_tune(build_model("cnn", 10, 3, image_size=8), "head"), 3, size=8)
    full = _run_steps(build_model("cnn", 10, 3, image_size=8), 3, size=8)
    assert head_only.layout.size < full.layout.size
    assert len(head_only.ledger.events) == len(full.ledger.events) == 3
    assert head_only.ledger.events == full.ledger.events
    assert head_only.ledger.epsilon() == full.ledger.epsilon()


# -- pretrained weights -----------------------------------------------------------------------


def _bn_resnet18(num_classes: int = 10) -> nn.Module:
    """A torchvision resnet18 with BatchNorm whose affine and running statistics are random."""
    import torchvision

    source = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    with torch.no_grad():
        for m in source.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.normal_()
                m.bias.normal_()
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
                m.num_batches_tracked.fill_(7)
    return source


def test_batchnorm_state_dict_loads_into_the_groupnorm_model(tmp_path, no_downloads):
    source = _bn_resnet18()
    path = tmp_path / "resnet18_bn.pt"
    torch.save(source.state_dict(), path)
    model = build_model("torchvision:resnet18", 10)
    report = load_pretrained(model, path)

    src, dst = source.state_dict(), model.state_dict()
    for key in ("conv1.weight", "layer3.1.conv2.weight", "layer2.0.downsample.0.weight"):
        assert torch.equal(dst[key], src[key]), key
    for key in ("fc.weight", "fc.bias", "bn1.weight", "layer4.1.bn2.bias"):
        assert torch.equal(dst[key], src[key]), key
    assert isinstance(model.bn1, nn.GroupNorm) and isinstance(
        model.layer2[0].downsample[1], nn.GroupNorm
    )
    bn_layers = [n for n, m in source.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bn_layers) == 20
    expected_dropped = {f"{n}.{s}" for n in bn_layers for s in models._BN_STATISTICS}
    assert set(report.dropped) == expected_dropped
    assert report.complete and not report.missing and not report.unexpected
    assert set(report.loaded) == set(dst)
    assert "dropped 60 BatchNorm statistics" in report.summary()


def test_mismatched_head_is_refused_when_strict_and_skipped_otherwise(tmp_path):
    path = tmp_path / "imagenet_shaped.pt"
    torch.save({"state_dict": _bn_resnet18(num_classes=1000).state_dict()}, path)
    model = build_model("torchvision:resnet18", 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"fc\.weight: \(1000, 512\) -> \(10, 512\)"):
        load_pretrained(model, path)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched

    report = load_pretrained(model, path, strict=False)
    assert report.missing == () and report.unexpected == ()
    assert [m.split(":")[0] for m in report.mismatched] == ["fc.weight", "fc.bias"]
    assert "fc.weight" not in report.loaded and "conv1.weight" in report.loaded
    assert torch.equal(model.fc.weight, before["fc.weight"])
    assert not torch.equal(model.conv1.weight, before["conv1.weight"])


def test_missing_and_unexpected_keys_are_reported(tmp_path):
    state = build_model("cnn", 10, in_channels=1).state_dict()
    del state["fc.bias"]
    state["extra.weight"] = torch.zeros(3)
    path = tmp_path / "cnn.pt"
    torch.save(state, path)
    model = build_model("cnn", 10, in_channels=1)
    with pytest.raises(ValueError, match=r"missing.*fc\.bias"):
        load_pretrained(model, path)
    report = load_pretrained(model, path, strict=False)
    assert report.missing == ("fc.bias",) and report.unexpected == ("extra.weight",)
    assert torch.equal(model.fc.weight, state["fc.weight"])


def test_rgb_input_conv_is_adapted_to_grey(tmp_path):
    source = _bn_resnet18()
    path = tmp_path / "r18.pt"
    torch.save(source.state_dict(), path)
    model = build_model("torchvision:resnet18", 10, in_channels=1)
    report = load_pretrained(model, path)
    assert report.adapted == ("conv1.weight",)
    torch.testing.assert_close(model.conv1.weight, source.conv1.weight.sum(1, keepdim=True))


def test_load_pretrained_is_offline_only(tmp_path):
    model = build_model("cnn", 10, in_channels=1)
    with pytest.raises(ValueError, match="local file"):
        load_pretrained(model, "https://example.org/weights.pt")
    with pytest.raises(ValueError, match="local file"):
        load_pretrained(model, tmp_path / "absent.pt")
