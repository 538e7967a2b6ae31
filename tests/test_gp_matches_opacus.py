"""Our GP step is Opacus's DP-SGD step: the same clipped mean gradient and noise of the same
scale, on a residual network with GroupNorm (the benchmark's ResNet20-GN)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from gep_fed.data.models import resnet20_gn
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.step import GEPStep
from gep_fed.mechanisms.step_config import GEPConfig

N, B = 4000, 16  # dataset size and batch: the estimate divides by q n = B


def our_gradient(model, x, y, clip, sigma, seed=3):
    model = copy.deepcopy(model)
    contract = PrivacyContract(
        "gp", sigma, B / N, clip_embedding=clip, clip_residual=clip, clip_norm=clip
    )
    step = GEPStep(model, None, GEPConfig(contract), dataset_size=N, noise=NoiseSource(seed))
    step(x, y)
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def opacus_gradient(model, x, y, clip, sigma, seed=3):
    opacus = pytest.importorskip("opacus")  # here: the other worker never imports it
    module = opacus.GradSampleModule(copy.deepcopy(model))
    optimizer = opacus.optimizers.DPOptimizer(
        torch.optim.SGD(module.parameters(), lr=0.1),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        expected_batch_size=B,
        generator=torch.Generator().manual_seed(seed),
    )
    F.cross_entropy(module(x), y).backward()
    optimizer.pre_step()
    return torch.cat([p.grad.flatten() for p in module.parameters()])


@pytest.fixture(scope="module")
def batch():
    torch.manual_seed(0)
    return resnet20_gn(3, 10), torch.randn(B, 3, 32, 32), torch.randint(0, 10, (B,))


@pytest.mark.parametrize("clip", [10.0, 0.1])  # most examples unclipped / all clipped
def test_gp_clipped_mean_equals_opacus_dp_optimizer(batch, clip):
    model, x, y = batch
    ours, theirs = our_gradient(model, x, y, clip, 0.0), opacus_gradient(model, x, y, clip, 0.0)
    assert torch.linalg.vector_norm(ours - theirs) <= 1e-5 * torch.linalg.vector_norm(theirs)


def test_gp_noise_has_opacus_scale(batch):
    model, x, y = batch
    clip, sigma = 1.0, 1.0
    ours = our_gradient(model, x, y, clip, sigma) - our_gradient(model, x, y, clip, 0.0)
    theirs = opacus_gradient(model, x, y, clip, sigma) - opacus_gradient(model, x, y, clip, 0.0)
    expected = sigma * clip / B  # per coordinate, on ~270k coordinates: within 1 %
    assert ours.std().item() == pytest.approx(expected, rel=0.01)
    assert theirs.std().item() == pytest.approx(expected, rel=0.01)
