"""Distributed discrete Gaussian: the sampler, the quantiser and the accounting."""

from __future__ import annotations

import math
from dataclasses import replace

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import NeighboringRelation, rdp

from gep_fed.accounting.accountant import (
    DistributedDiscreteGaussianDpEvent,
    RdpAccountant,
    _poisson_subsampled,
)
from gep_fed.accounting.events import (
    RDP_ORDERS,
    PrivacyEvent,
    distributed_step_rdp,
    epsilon_pld,
    epsilon_rdp,
)
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.distributed_noise import (
    DistributedNoise,
    discrete_gaussian,
    hadamard,
    padded_dimension,
    rotation_signs,
)
from gep_fed.mechanisms.mechanism import GP, ClippedSums


def test_the_noise_sampler_on_several_threads_keeps_every_coordinate_in_place(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    values = np.arange(5 * 8192 + 7, dtype=np.int64) * 1000
    noisy = discrete_gaussian(values, 2.0)
    assert noisy.shape == values.shape
    assert np.abs(noisy - values).max() < 40  # 20 scales: each draw stayed with its value
    assert 1.8 < np.std(noisy - values) < 2.2


def test_the_noise_sampler_draws_the_exact_discrete_gaussian():
    scale, n = 1.5, 200_000
    draws = discrete_gaussian(np.zeros(n, dtype=np.int64), scale)
    support = np.arange(-12, 13)
    exact = np.exp(-(support**2) / (2 * scale**2))
    exact /= exact.sum()
    empirical = np.array([(draws == k).mean() for k in support])
    assert 0.5 * np.abs(empirical - exact).sum() < 0.005  # total variation
    assert np.all(np.abs(draws) <= 12)  # nothing beyond 8 scales in 200k draws


def test_the_noise_sampler_adds_noise_of_its_scale_to_large_integers():
    values = np.full(50_000, 2**40, dtype=np.int64)
    noisy = discrete_gaussian(values, 1000.0)
    assert noisy.dtype == np.int64
    assert abs((noisy - values).mean()) < 30 and (noisy - values).std() == pytest.approx(
        1000, rel=0.02
    )


@pytest.mark.parametrize("d", [256, 48, 80, 12 * 64, 20 * 32])
def test_the_rotation_is_orthonormal_flat_and_inverted_by_its_transpose(d):
    """Every order it pads to (2**b, 12 * 2**b, 20 * 2**b): each entry of the matrix is
    +-1/sqrt(d), so a vector spreads over the coordinates as under Sylvester's transform."""
    x = torch.randn(d, dtype=torch.float64)
    y = hadamard(x)
    assert float(torch.linalg.vector_norm(y)) == pytest.approx(float(torch.linalg.vector_norm(x)))
    torch.testing.assert_close(hadamard(y, transpose=True), x)
    if d <= 80:
        matrix = torch.stack([hadamard(e) for e in torch.eye(d, dtype=torch.float64)])
        torch.testing.assert_close(matrix.abs(), torch.full_like(matrix, d**-0.5))


def test_a_vector_pads_by_at_most_a_third_to_an_order_of_the_rotation():
    assert padded_dimension(256) == 256 and padded_dimension(300) == 320
    assert padded_dimension(39_790) == 40_960  # Fashion-MNIST's GEP release (2**16 before)
    for length in range(12, 5000):
        d = padded_dimension(length)
        assert length <= d <= length * 4 / 3
        hadamard(torch.zeros(d))  # an order it can rotate
    with pytest.raises(ValueError, match="not an order"):
        hadamard(torch.zeros(60))


def test_the_decoded_sum_is_the_sites_clipped_sums_plus_noise_of_the_target_std():
    contract = PrivacyContract("gep", 0.8, 0.1, clip_embedding=0.5, clip_residual=0.25)
    noise = DistributedNoise(noise_shares=4, bits=20, step=2e-4)
    mech = contract.build_mechanism()
    torch.manual_seed(0)
    sites = [ClippedSums(torch.randn(64) * 3, torch.randn(4000)) for _ in range(4)]
    encoded = [noise.encode(s, mech, rotation_seed=5) for s in sites]
    assert all(e.min() >= 0 and e.max() < noise.modulus for e in encoded)
    decoded = noise.decode(sum(encoded) % noise.modulus, mech, 5, (64, 4000))
    assert decoded.noised
    truth = sites[0] + sites[1] + sites[2] + sites[3]
    error = decoded.residual.double() - truth.residual.double()
    # four shares of variance sigma^2 / 4 each: the central noise, sigma * S2
    assert error.std() == pytest.approx(0.8 * 0.25, rel=0.05)
    assert abs(error.mean()) < 0.02
    assert (decoded.embedding - truth.embedding).std() == pytest.approx(0.8 * 0.5, rel=0.3)


def test_the_rounding_coins_come_from_the_os_not_a_seeded_generator(monkeypatch):
    """The randomised rounding took its uniforms from ``torch.rand`` on a Mersenne Twister
    seeded with 63 bits (review of 2026-12-07); they are the OS's own now: a share is
    encoded with ``torch.rand`` forbidden, and the coins are uniform on [0, 1)."""
    from gep_fed.mechanisms.distributed_noise import os_uniforms

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.rand drew the rounding's coins")

    monkeypatch.setattr(torch, "rand", forbidden)
    mech = PrivacyContract("gp", 1.0, 0.1, clip_norm=1.0).build_mechanism()
    noise = DistributedNoise(noise_shares=2, bits=20, step=1e-3)
    noise.encode(ClippedSums(None, torch.ones(50) / 50), mech, rotation_seed=1)
    u = os_uniforms(200_000)
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.005  # 7 std
    assert not np.array_equal(os_uniforms(8), os_uniforms(8))


def test_a_sum_that_wraps_past_half_the_modulus_is_read_as_negative():
    mech = PrivacyContract("gp", 1.0, 0.1, clip_norm=1.0).build_mechanism()
    noise = DistributedNoise(noise_shares=1, bits=8, step=1.0)
    decoded = noise.decode(np.full(4, 255), mech, 0, (None, 4))
    # 255 = -1 (mod 256) in every rotated coordinate; rotated back: (-2 s_0, 0, 0, 0)
    sign = float(rotation_signs(0, 4)[0])
    torch.testing.assert_close(decoded.residual, torch.tensor([-2.0 * sign, 0.0, 0.0, 0.0]))


def test_unsampled_distributed_noise_is_accounted_as_opendps_discrete_gaussian():
    """One discrete Gaussian (t = 1, so tau = 0) of scale 4 and L2 sensitivity 3 is
    rho-zCDP with OpenDP's own privacy map; our curve must be rho * alpha."""
    import opendp.prelude as dp

    dp.enable_features("contrib")
    measurement = dp.m.make_gaussian(
        dp.vector_domain(dp.atom_domain(T="i64")), dp.l2_distance(T="i64"), 4.0
    )
    rho = measurement.map(3)
    curve = distributed_step_rdp(3 / 4, 0.0, 10, 1.0)
    np.testing.assert_allclose(curve, rho * np.asarray(RDP_ORDERS), rtol=1e-12)


@pytest.mark.parametrize("q", [0.01, 0.05, 0.2])
@pytest.mark.parametrize("nu", [0.7, 1.0, 2.0])
def test_distributed_accounting_equals_the_continuous_gaussian_it_approaches(q, nu):
    """With no discreteness (tau = 0, no rounding growth) the subsampled curve is the
    Gaussian's at every integer order: dp-accounting computes that one independently (its
    exact series of Mironov et al.). Fractional orders take the next integer's value, so
    epsilon may be a little above the Gaussian's, never below."""
    gaussian = rdp.RdpAccountant(RDP_ORDERS).compose(GP.event(nu, q).release).rdp
    discrete = distributed_step_rdp(1 / nu, 0.0, 1000, q)
    integer = np.array([o <= 256 and float(o).is_integer() for o in RDP_ORDERS])
    np.testing.assert_allclose(discrete[integer], gaussian[integer], rtol=1e-9)
    event = PrivacyEvent.gaussian("gp", nu, q, 200, nu)
    dist = event.as_distributed(1 / nu, 0.0, 1000, 1)
    ratio = epsilon_rdp([dist], 1e-5) / epsilon_rdp([event], 1e-5)
    # Largest where the best order is below 2 (epsilon 12 and 51 at nu = 0.7).
    assert 1 - 1e-9 <= ratio < 1.15


def test_at_a_small_budget_over_many_steps_distributed_costs_what_central_costs():
    """Fashion-MNIST's setting (GEP at sigma 3.79: nu 2.68, q 1/15, 300 steps): the epsilon
    of the distributed release is within 1 % of the Gaussian's."""
    nu, q, steps = 3.79 / math.sqrt(2), 1 / 15, 300
    central = epsilon_rdp([PrivacyEvent.gaussian("gep", 3.79, q, steps, nu)], 1e-5)
    dist = PrivacyEvent.gaussian("gep", 3.79, q, steps, nu).as_distributed(1 / nu, 0.0, 65536, 3)
    assert central == pytest.approx(2.0, abs=0.01)
    assert 1 - 1e-9 <= epsilon_rdp([dist], 1e-5) / central < 1.01


def test_the_subsampling_bound_matches_an_independent_evaluation_of_the_binomial_series():
    """The remove direction's series in plain arithmetic at order 6, for the RDP curve of a
    Gaussian of sensitivity-1 noise multiplier 1.2."""
    q, order = 0.1, 6
    eps = {a: a / (2 * 1.2**2) for a in range(2, order + 1)}
    total = (1 - q) ** order + order * q * (1 - q) ** (order - 1)
    total += sum(
        math.comb(order, j) * (1 - q) ** (order - j) * q**j * math.exp((j - 1) * eps[j])
        for j in range(2, order + 1)
    )
    at_orders = _poisson_subsampled(q, np.array([eps[a] for a in range(2, order + 1)]))
    assert at_orders[-1] == pytest.approx(math.log(total) / 5, rel=1e-12)


def test_the_subsampling_bound_at_every_order_matches_the_series_in_50_digit_arithmetic():
    """Every order 2..256 at once (as the accountant asks), against each order's series
    summed in 50-digit arithmetic: small rates, where the sum is 1 plus a little, and large."""
    import mpmath

    mpmath.mp.dps = 50
    orders = np.arange(2, 257)
    for q, multiplier in ((0.001, 0.7), (0.05, 1.5), (0.6, 4.0)):
        rdp = orders / (2 * multiplier**2) + 1e-6 * orders  # a zCDP-like curve
        got = _poisson_subsampled(q, rdp)
        for a in (2, 3, 7, 40, 129, 256):
            series = sum(
                mpmath.binomial(a, j)
                * mpmath.mpf(1 - q) ** (a - j)
                * mpmath.mpf(q) ** j
                * (mpmath.exp((j - 1) * mpmath.mpf(rdp[j - 2])) if j >= 2 else 1)
                for j in range(a + 1)
            )
            assert got[a - 2] == pytest.approx(float(mpmath.log(series) / (a - 1)), rel=1e-9)


def _both_directions(noise: np.ndarray, shift: int, q: float, order: float) -> tuple:
    """Exact Renyi divergences, remove (M||Q) and add (Q||M), of a noise on the integers
    modulo ``len(noise)`` (as the secure sum's are), shifted by ``shift`` when the example is
    sampled at rate q."""
    from scipy.special import logsumexp

    base = np.log(noise / noise.sum())
    moved = math.log(q) + np.roll(base, shift)
    mixed = moved if q == 1 else np.logaddexp(math.log1p(-q) + base, moved)
    remove = logsumexp(order * mixed + (1 - order) * base) / (order - 1)
    add = logsumexp(order * base + (1 - order) * mixed) / (order - 1)
    return remove, add


def _symmetric(values) -> np.ndarray:
    """A pmf on the integers modulo 2 len(values) - 1 with p(k) = p(-k) = values[|k|]."""
    values = np.asarray(values, dtype=float)
    return np.concatenate([values, values[:0:-1]])


@pytest.mark.parametrize("order", [1.5, 2, 3, 6, 12, 40])
@pytest.mark.parametrize("q", [0.001, 0.05, 0.3, 0.9])
def test_with_symmetric_noise_adding_an_example_costs_no_more_than_removing_it(order, q):
    """The bound's "add" half, checked exactly on noises that are not Gaussian: a sum of two
    coarse discrete Gaussians and a discrete Laplace, each symmetric, shifted by 1 and 3; the
    remove direction also equals the binomial series of the unsampled divergences."""
    k = np.arange(21)
    coarse = np.convolve(np.exp(-(k**2) / 0.72), np.exp(-(k**2) / 0.72))[:21] + 1e-12
    for noise in (_symmetric(coarse), _symmetric(np.exp(-k / 1.5))):
        for shift in (1, 3):
            remove, add = _both_directions(noise, shift, q, order)
            assert add <= remove + 1e-12
            if float(order).is_integer():
                eps = [_both_directions(noise, shift, 1.0, a)[0] for a in range(2, int(order) + 1)]
                at_orders = _poisson_subsampled(q, np.array(eps))
                assert at_orders[-1] == pytest.approx(remove, rel=1e-9)


def test_with_asymmetric_noise_adding_an_example_can_cost_more():
    """The symmetry is what the add half needs: a skewed noise breaks it (so the check above
    would catch a bound that ignored the add direction)."""
    skewed = np.array([0.05, 0.024, 0.46, 0.27, 0.13, 0.06])
    remove, add = _both_directions(skewed, 1, 0.9, 8)
    assert add > remove + 1


def test_the_divergence_of_few_coarse_shares_costs_epsilon():
    fine = DistributedNoise(noise_shares=10, bits=16, step=1e-3)
    coarse = DistributedNoise(noise_shares=10, bits=16, step=0.5)
    assert fine.tau(1.0) == 0.0 and coarse.tau(1.0) > 0
    events = [
        PrivacyContract(
            "gp", 1.0, 0.05, noise_shares=10, quantization_bits=16, quantization_step=s
        ).events(100, dimension=1024)
        for s in (fine.step, coarse.step)
    ]
    assert epsilon_rdp(events[1], 1e-5) > epsilon_rdp(events[0], 1e-5)


def test_shares_coarser_than_the_bound_assumes_are_refused_by_name():
    """tau's bound assumes each share's scale is at least 1/2 quantisation step; below it
    (1 / (1.0 sqrt(10)) = 0.32 here) the figure would not hold."""
    from gep_fed.validation import ConfigError

    coarse = PrivacyContract(
        "gp", 1.0, 0.05, noise_shares=10, quantization_bits=16, quantization_step=1.0
    )
    with pytest.raises(ConfigError, match=r"scale 0.316 quantisation steps, below the 0.5"):
        coarse.checked_share_scale()
    with pytest.raises(ConfigError, match=r"scale 0.316"):  # as a site decodes a round's
        PrivacyContract.from_record(coarse.to_record())
    assert replace(coarse, quantization_step=0.6).checked_share_scale().quantization_step == 0.6


def test_shares_finer_than_any_modulus_holds_are_refused_and_huge_sums_do_not_overflow():
    """A server's fine step scaled the unnoised sums past int64 only where they were large:
    the site's error then told the server so. The share scale is bounded from public values,
    and a sum beyond any modulus is clamped before it becomes an integer."""
    from gep_fed.validation import ConfigError

    fine = PrivacyContract(
        "gp", 2.0, 1.0, clip_norm=0.01, noise_shares=1, quantization_bits=16,
        quantization_step=1e-17,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"above 1.09951e\+12"):
        PrivacyContract.from_record(fine.to_record())
    noise = DistributedNoise(1, 16, 2.0 / 2.0**40)  # the finest share scale allowed
    mech = PrivacyContract("gp", 2.0, 1.0, clip_norm=1.0).build_mechanism()
    for size in (1.0, 1e20):  # a sum beyond every modulus encodes as any other
        share = noise.encode(ClippedSums(None, torch.full((50,), size)), mech, rotation_seed=1)
        assert share.dtype == np.int64 and share.min() >= 0 and share.max() < 2**16


@pytest.mark.parametrize("bits", [10, 12, 16, 24])
def test_sigma_is_calibrated_at_any_quantisation_depth_and_its_shares_are_wide_enough(bits):
    """Calibration's probes at small sigma are coarser than the bound assumes; only the
    contract to release is checked (checked on every contract, it refused every run at 16
    bits or fewer)."""
    contract = PrivacyContract("gp", 1.0, 0.05).with_distributed_noise(
        3, bits, 100, 1024, 1.0, 3, (4.0, 1e-5)
    )
    assert contract.distributed_noise.share_scale(contract.noise_multiplier) >= 0.5


def test_a_zcdp_event_composes_as_dp_accounting_composes_it():
    curve = distributed_step_rdp(0.5, 0.0, 64, 1.0)
    expected = rdp.RdpAccountant(list(RDP_ORDERS)).compose(dp_accounting.ZCDpEvent(0.125)).rdp
    np.testing.assert_allclose(curve, expected, rtol=1e-12)


def test_a_distributed_release_is_a_dp_accounting_event_only_the_projects_accountant_composes():
    """dp-accounting's event-and-accountant pattern: the release is a ``DpEvent`` (never a
    Gaussian one); dp-accounting's own accountants refuse it as any unknown event, the
    project's composes it at its own curve, and refuses it under another adjacency."""
    from dp_accounting import UnsupportedEventError
    from dp_accounting.pld import PLDAccountant

    from gep_fed.accounting.events import compose

    dist = PrivacyEvent.gaussian("gp", 1.0, 0.1, 3, 1.0).as_distributed(1.0, 0.0, 8, 1)
    assert dist.release == dp_accounting.PoissonSampledDpEvent(
        0.1, DistributedDiscreteGaussianDpEvent(1.0, 1.0, 0.0, 8, 1)
    )
    event = compose([dist])
    for theirs in (rdp.RdpAccountant(RDP_ORDERS), PLDAccountant()):
        assert not theirs.supports(event)
        with pytest.raises(UnsupportedEventError):
            theirs.compose(event)
    ours = RdpAccountant(RDP_ORDERS)
    assert ours.supports(event)
    np.testing.assert_array_equal(
        ours.compose(event).rdp, 3 * distributed_step_rdp(1.0, 0.0, 8, 0.1)
    )
    assert math.isnan(epsilon_pld([dist], 1e-5))
    replace_one = RdpAccountant(RDP_ORDERS, NeighboringRelation.REPLACE_ONE)
    unsampled = DistributedDiscreteGaussianDpEvent(1.0, 1.0, 0.0, 8, 1)
    assert not replace_one.supports(unsampled)
    with pytest.raises(UnsupportedEventError, match="ADD_OR_REMOVE_ONE"):
        replace_one.compose(unsampled)
