"""The noise and the Poisson coins come from a keystream no one can search: not PyTorch's
generator, which keeps 32 bits of its seed."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from gep_fed.mechanisms import secret_stream
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.mechanisms.secret_stream import SecretStream


def test_pytorchs_generator_keeps_32_bits_of_its_seed_which_is_why_it_is_not_used():
    # the premise of this module: seeds equal modulo 2^32 give the same draws
    a = torch.Generator().manual_seed(12345 + 7 * 2**32)
    b = torch.Generator().manual_seed(12345)
    assert torch.equal(torch.randn(8, generator=a), torch.randn(8, generator=b))


def test_real_noise_is_keyed_by_256_bits_from_the_os(monkeypatch):
    keys = []
    real = secret_stream.os.urandom

    def recorded(n):
        keys.append(n)
        return real(n)

    monkeypatch.setattr(secret_stream.os, "urandom", recorded)
    like = torch.zeros(1000)
    first, second = NoiseSource().gaussian(like, 1.0), NoiseSource().gaussian(like, 1.0)
    assert keys == [32, 32] and not torch.equal(first, second)
    assert NoiseSource().state_dict() == {}  # a real run's key is never written


def test_seeds_sharing_their_low_32_bits_give_independent_noise():
    like = torch.zeros(256)
    a = NoiseSource(99).gaussian(like, 1.0)
    b = NoiseSource(99 + 2**40).gaussian(like, 1.0)
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.3


def test_the_os_keyed_sampler_draws_no_pytorch_randomness(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("PyTorch's generator drew the secret coins")

    monkeypatch.setattr(torch, "rand", forbidden)
    sampler = PoissonSampler(20_000, 0.1, steps=3)
    sizes = [len(sampler.sample()) for _ in range(3)]
    assert all(abs(s - 2000) < 5 * math.sqrt(2000 * 0.9) for s in sizes)


def test_gaussians_are_standard_normal_and_uniforms_have_53_bits():
    stream = SecretStream.from_seed(0, "test")
    z = stream.gaussians(200_001)
    assert len(z) == 200_001 and np.isfinite(z).all()
    assert stats.kstest(z, "norm").pvalue > 1e-3
    u = stream.uniforms(100_000)
    assert u.min() >= 0 and u.max() < 1 and stats.kstest(u, "uniform").pvalue > 1e-3
    assert np.all(u * 2.0**53 == np.floor(u * 2.0**53))  # on the 2^-53 grid
    assert len(np.unique(u)) > 99_990  # not a coarser grid


def test_a_saved_position_resumes_the_seeded_noise_exactly():
    like = torch.zeros(37, dtype=torch.float64)
    source = NoiseSource(5)
    source.gaussian(like, 2.0)
    state = source.state_dict()
    expected = source.gaussian(like, 2.0)
    resumed = NoiseSource(5)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.gaussian(like, 2.0), expected)
    with pytest.raises(ValueError, match="older gep-fed"):
        resumed.load_state_dict({"seed": 5, "generators": {}})


def test_consecutive_draws_do_not_reuse_keystream():
    stream = SecretStream.from_seed(1, "test")
    first, second = stream.uniforms(3), stream.uniforms(3)
    assert not np.intersect1d(first, second).size
    assert stream.position == 2  # 24 bytes of a 64-byte block each: never shared
