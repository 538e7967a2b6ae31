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


def box_muller_pair_reaches(y0: float, y1: float, c0: float, c1: float, std: float) -> bool:
    """Whether two released float64 values ``c + std * z`` can be one Box-Muller pair of
    53-bit uniforms: the uniforms near the ones the pair implies, tried bit for bit."""
    z0, z1 = (y0 - c0) / std, (y1 - c1) / std
    near = np.arange(-16, 17)
    k1 = np.round(-np.expm1(-(z0 * z0 + z1 * z1) / 2) * 2.0**53) + near
    k2 = np.round((np.arctan2(z1, z0) % (2 * np.pi)) / (2 * np.pi) * 2.0**53) + near
    radius = np.sqrt(-2.0 * np.log1p(-(k1 * 2.0**-53)))[:, None]
    angle = ((2.0 * np.pi) * (k2 * 2.0**-53))[None, :]
    f0 = c0 + (torch.from_numpy(radius * np.cos(angle)) * std).numpy()
    f1 = c1 + (torch.from_numpy(radius * np.sin(angle)) * std).numpy()
    return bool(((f0 == y0) & (f1 == y1)).any())


def test_float64_releases_hold_no_box_muller_pair_that_would_test_a_guess_bit_for_bit():
    """A site's score counts leave in float64. Released as the two halves of Box-Muller
    pairs, the true counts reproduce both values exactly (the review: 200 of 200) and a
    neighbour's rarely (8-33 of 200): an epsilon near 2-3 where the ledger said 0.35."""
    from gep_fed.federation.site_score import noisy_counts

    reached = 0
    for _ in range(40):
        y = noisy_counts(np.array([[5.0], [0.0]]), 20.0, NoiseSource())
        reached += box_muller_pair_reaches(y[0, 0], y[1, 0], 5.0, 0.0, 20.0)
    assert reached <= 12  # paired: 40 of 40; unpaired: chance coincidences, about 3
    z = SecretStream.from_seed(3, "test").gaussians(100_000, paired=False)
    assert stats.kstest(z, "norm").pvalue > 1e-3


def test_an_os_keyed_stream_draws_a_new_key_when_its_own_is_used_up():
    """2^38 bytes is 2^35 Gaussians: about 3,000 steps of an 11-million-parameter model. A
    step whose release is recorded must not then fail for want of keystream."""
    source = NoiseSource()
    source._stream.position = secret_stream._MAX_BLOCKS - 1
    assert torch.isfinite(source.gaussian(torch.zeros(100), 1.0)).all()
    seeded = SecretStream.from_seed(0, "test", position=secret_stream._MAX_BLOCKS - 1)
    with pytest.raises(RuntimeError, match="used up"):
        seeded.uniforms(100)  # a seeded stream cannot renew and stay reproducible
    with pytest.raises(ValueError, match="stream position"):
        SecretStream.from_seed(0, "test", position=-1)
