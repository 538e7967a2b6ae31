"""ScatterNet front end (gep_fed.data.scatternet): shapes, determinism, no trainable or
data-dependent state, per-example gradients of the heads, the lazy kymatio import."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gep_fed import GEPConfig, GEPStep, PrivacyContract
from gep_fed.data import scatternet
from gep_fed.data.scatternet import (
    PublicStandardize,
    ScatterNet,
    scatter_cnn,
    scatter_features,
    scatter_linear,
    scattering_channels,
)
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.per_example import per_example_gradients

pytest.importorskip("kymatio", reason="needs kymatio (a gep-fed dependency): pip install -e .")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The transform's many small FFTs run fastest on one thread (and on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def grey_images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 28, 28), dtype=np.uint8)


def test_channel_count_formula():
    assert scattering_channels(2, 8) == 81
    assert scattering_channels(3, 8) == 1 + 24 + 64 * 3


def test_grey_28_gives_81_by_7_by_7():
    feats = scatter_features(grey_images(5))
    assert feats.shape == (5, 81, 7, 7)
    assert feats.dtype == torch.float32
    assert torch.isfinite(feats).all()


def test_rgb_32_gives_243_by_8_by_8():
    rgb = np.random.default_rng(1).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    feats = scatter_features(rgb)
    assert feats.shape == (3, 243, 8, 8)
    assert ScatterNet(32, 3).output_shape == (243, 8, 8)


def test_features_are_deterministic_per_example_and_cached(tmp_path):
    images = grey_images(6)
    first = scatter_features(images, batch_size=4)
    again = scatter_features(images, batch_size=6)
    torch.testing.assert_close(first, again, rtol=0, atol=1e-6)
    # An example's features do not depend on which other examples are transformed with it.
    alone = scatter_features(images[2:3])
    torch.testing.assert_close(alone[0], first[2], rtol=0, atol=1e-6)
    cached = scatter_features(images, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("scatter-*.pt"))) == 1
    torch.testing.assert_close(scatter_features(images, cache_dir=tmp_path), cached)
    torch.testing.assert_close(cached, first, rtol=0, atol=1e-6)


def test_front_end_has_nothing_to_train_and_no_autograd():
    net = ScatterNet(28, 1)
    assert not any(p.requires_grad for p in net.parameters())
    assert sum(p.numel() for p in net.parameters()) == 0  # filters are fixed buffers
    x = torch.rand(2, 1, 28, 28, requires_grad=True)
    assert not net(x).requires_grad
    with pytest.raises(ValueError, match="expected"):
        net(torch.rand(2, 3, 28, 28))


def test_uint8_scaling_is_the_declared_constant():
    images = grey_images(2)
    torch.testing.assert_close(
        scatter_features(images), scatter_features(torch.from_numpy(images)[:, None] / 255.0)
    )


def test_linear_head_per_example_gradients_are_outer_products():
    feats = scatter_features(grey_images(7))
    y = torch.randint(10, (7,))
    model = scatter_linear(10)
    params = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in params) == 81 * 49 * 10 + 10
    layout = ParameterLayout.from_model(model)
    grads = per_example_gradients(model, F.cross_entropy, feats, y, layout, max_chunk=3)
    assert grads.shape == (7, layout.size)
    # cross-entropy on a linear head: dL/dW_i = (softmax - onehot) x_i^T on the normalised x_i
    with torch.no_grad():
        z = model[1](model[0](feats))
        err = model(feats).softmax(1) - F.one_hot(y, 10).float()
    expected = torch.cat([torch.einsum("nc,nd->ncd", err, z).reshape(7, -1), err], 1)
    torch.testing.assert_close(grads, expected, atol=1e-5, rtol=1e-4)


def test_groupnorm_is_per_example():
    feats = scatter_features(grey_images(4))
    model = scatter_linear(10)
    with torch.no_grad():
        together = model(feats)
        one = model(feats[1:2])
    torch.testing.assert_close(together[1:2], one)


def test_public_standardize_uses_public_statistics_only():
    public = torch.randn(50, 81, 7, 7) * 3 + 2
    norm = PublicStandardize(public)
    out = norm(public)
    torch.testing.assert_close(out.mean(dim=(0, 2, 3)), torch.zeros(81), atol=1e-4, rtol=0)
    model = scatter_linear(10, groups=None, public_features=public)
    assert isinstance(model[0], PublicStandardize)
    assert not any(b.requires_grad for b in model[0].buffers())
    with pytest.raises(ValueError, match="either"):
        scatter_linear(10, groups=27, public_features=public)


def test_scatter_cnn_shapes_and_gradients():
    for shape in ((81, 7, 7), (243, 8, 8)):
        model = scatter_cnn(10, shape, groups=27)
        x, y = torch.randn(3, *shape), torch.randint(10, (3,))
        assert model(x).shape == (3, 10)
        layout = ParameterLayout.from_model(model)
        grads = per_example_gradients(model, F.cross_entropy, x, y, layout, max_chunk=2)
        assert grads.shape == (3, layout.size) and torch.isfinite(grads).all()


def test_one_gep_step_on_scatter_features():
    private = scatter_features(grey_images(16))
    public = scatter_features(grey_images(12, seed=5))
    model = scatter_linear(10)
    config = GEPConfig(PrivacyContract("gep", 1.0, 0.5), num_basis=8, max_chunk=5)
    step = GEPStep(
        model,
        public,
        config,
        dataset_size=32,
        noise=NoiseSource(0),
        generator=torch.Generator().manual_seed(0),
    )
    step(private, torch.randint(10, (16,)))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert step.ledger.epsilon() > 0


def test_missing_kymatio_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        scatternet.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "kymatio" else real(name, *a),
    )
    with pytest.raises(ImportError, match=r"pip install 'kymatio>=0.3'"):
        ScatterNet(28, 1)
