"""Distributed discrete Gaussian noise (Kairouz, Liu & Steinke, ICML 2021) for secure sums.

In distributed mode each site turns its clipped sums into integers and adds its *share* of
the noise; the secure sum (``gep_fed.federation.secure_sum``) shows the server only the sum
modulo ``2**bits``, which carries the noise of every site in it. Per site and step:

1. normalise: the released vectors divided by their clip norms and concatenated (GEP:
   embedding / S1 and residual / S2, so one example moves it by at most sqrt(2)), padded to
   the next order ``d = c 2**b`` (c in 1, 3, 5) of a Hadamard matrix (``padded_dimension``);
2. rotate with a randomised Hadamard transform (random signs from a public per-round seed,
   then Sylvester's 2**b kron Paley's order 12 or 20): it spreads the vector over the
   coordinates, so few wrap around the modulus; any rotation keeps L2 norms, so privacy does
   not depend on the seed;
3. scale by ``1 / step`` and round each coordinate up or down at random (unbiased);
4. add a discrete Gaussian of scale ``sigma / (step * sqrt(noise_shares))`` per coordinate,
   drawn by OpenDP's exact sampler from the operating system's randomness;
5. reduce modulo ``2**bits``.

Sensitivity after rounding: coupling the rounding of two neighbouring inputs on the same
uniform draws moves each coordinate by at most one more unit, so one example moves the
rounded vector by at most ``sqrt(r) / step + sqrt(d)`` units (r releases per step); the
accountant uses that bound (``DistributedNoise.l2_scale``) with the divergence of a sum of
discrete Gaussians from one (``tau``). The server maps the modular sum back to the centred
range, unscales, rotates back and splits it into the noised clipped sums.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from gep_fed.accounting.events import PrivacyEvent
from gep_fed.mechanisms.mechanism import ClippedSums, Mechanism
from gep_fed.validation import ConfigError

# The shares' modulus 2**bits divides the secure sum's 2**32, so the sum reduces exactly.
MIN_BITS, MAX_BITS = 8, 24


# The modular range must cover this many standard deviations of a coordinate of the sum.
RANGE_STDS = 8.0


@lru_cache(maxsize=4)
def _paley(q: int) -> torch.Tensor:
    """A Hadamard matrix of order q + 1 for a prime q = 3 (mod 4), by Paley's first
    construction: ``I + [[0, 1^T], [-1, Q]]`` with ``Q[i, j]`` the quadratic character of
    ``j - i`` mod q (Q is antisymmetric and ``Q Q^T = q I - J``, so ``H H^T = (q + 1) I``)."""
    squares = {(i * i) % q for i in range(1, q)}
    idx = torch.arange(q)
    diff = (idx.view(1, -1) - idx.view(-1, 1)) % q
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)])
    h = torch.eye(q + 1, dtype=torch.float64)
    h[0, 1:] += 1
    h[1:, 0] -= 1
    h[1:, 1:] += chi.double()[diff]
    return h


# Hadamard orders beside Sylvester's 2**b: 12 and 20 (Paley, from 11 and 19). Their Kronecker
# products with 2**b give every order c 2**b, c in {1, 3, 5}, so a vector pads by at most a
# third rather than up to double; each entry is still +-1/sqrt(d), spreading as evenly.
_ODD_ORDERS = {1: None, 3: 11, 5: 19}


def os_uniforms(n: int) -> np.ndarray:
    """``n`` float64 uniforms on [0, 1), 53 bits each, from the OS's CSPRNG (the randomised
    rounding's coins: no seed expanded by a non-cryptographic generator)."""
    words = np.frombuffer(os.urandom(8 * n), dtype=np.uint64)
    return (words >> np.uint64(11)).astype(np.float64) * 2.0**-53


def padded_dimension(length: int) -> int:
    """The quantised vector's dimension: the smallest order ``c * 2**b`` (c in 1, 3, 5; for
    3 and 5, b >= 2) of a Hadamard transform at least ``length``."""
    length = max(length, 1)
    best = 1 << math.ceil(math.log2(length))
    for odd in (3, 5):
        b = max(2, math.ceil(math.log2(length / odd)))
        best = min(best, odd << b)
    return best


def _factor(d: int) -> tuple[torch.Tensor | None, int]:
    """The dense Hadamard factor (None for 1) and the power of two of order ``d``."""
    odd = d >> ((d & -d).bit_length() - 1)
    if odd not in _ODD_ORDERS or (odd > 1 and d % (4 * odd)):
        raise ValueError(f"{d} is not an order of the rotation (see padded_dimension)")
    q = _ODD_ORDERS[odd]
    return (None, d) if q is None else (_paley(q), d // (q + 1))


def _fwht_rows(y: torch.Tensor) -> torch.Tensor:
    """The unnormalised Walsh-Hadamard transform of each row (length a power of two)."""
    rows, n = y.shape
    h = 1
    while h < n:
        y = y.reshape(rows, -1, 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(rows, n)


def hadamard(x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """The orthonormal Hadamard transform ``(H_c kron H_n) x / sqrt(d)`` of a vector of a
    ``padded_dimension`` length d = c n (``transpose``: its inverse, ``H_c^T kron H_n``)."""
    dense, n = _factor(x.numel())
    y = x.reshape(-1, n)
    if dense is not None:
        y = (dense.T if transpose else dense).to(y.dtype) @ y
    return _fwht_rows(y).reshape(-1) / math.sqrt(x.numel())


def rotation_signs(seed: int, dimension: int) -> torch.Tensor:
    """The rotation's random signs: public, the same at every site of a round."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (dimension,), generator=gen, dtype=torch.float64) * 2 - 1


@lru_cache(maxsize=16)
def _gaussian_sampler(scale: float):
    import opendp.prelude as dp

    dp.enable_features("contrib")
    return dp.m.make_gaussian(
        dp.vector_domain(dp.atom_domain(T="i64")), dp.l2_distance(T="i64"), scale
    )


# Coordinates per call of the sampler when it runs on several threads.
SAMPLER_CHUNK = 8192


def discrete_gaussian(values: np.ndarray, scale: float) -> np.ndarray:
    """``values`` plus independent discrete Gaussian noise of ``scale`` per coordinate
    (OpenDP's exact sampler, seeded from the operating system). It takes about 12 us a
    coordinate, so long vectors are split over ``torch.get_num_threads()`` threads (OpenDP's
    calls release the GIL)."""
    sampler = _gaussian_sampler(float(scale))
    ints = [int(v) for v in values]
    chunks = [ints[i : i + SAMPLER_CHUNK] for i in range(0, len(ints), SAMPLER_CHUNK)]
    workers = min(torch.get_num_threads(), len(chunks))
    if workers <= 1:
        return np.asarray(sampler(ints), dtype=np.int64)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(sampler, chunks))
    return np.asarray([v for part in parts for v in part], dtype=np.int64)


def distributed_event(
    event: PrivacyEvent, noise: DistributedNoise, dimension: int, releases: int
) -> PrivacyEvent:
    """``event`` (a mechanism's Gaussian event at sigma, ``releases`` vectors per step) as a
    distributed discrete Gaussian release of a quantised vector of ``dimension`` coordinates."""
    return event.as_distributed(
        noise.l2_scale(event.noise_multiplier, releases, dimension),
        noise.tau(event.noise_multiplier),
        dimension,
        noise.noise_shares,
    )


def release_clips(mechanism: Mechanism) -> tuple[float | None, float | None]:
    """The clip norms of the (embedding, residual) releases: what normalises each to norm 1
    per example (None: the mechanism releases no such vector)."""
    if mechanism.name == "gp":
        return None, mechanism.clip_norm
    if mechanism.name == "bgep":
        return mechanism.clip_embedding, None
    return mechanism.clip_embedding, mechanism.clip_residual


# Each share's discrete Gaussian scale (in quantisation steps) that the divergence bound tau
# assumes (Kairouz, Liu & Steinke 2021, Thm. 1): at least 1/2.
MIN_SHARE_SCALE = 0.5
# The largest share scale and quantised value a site samples from: far beyond what any
# 2**MAX_BITS modulus uses, and far inside int64 (OpenDP's sampler) with the noise added.
MAX_SHARE_SCALE = 2.0**40
MAX_QUANTISED = 2.0**52


@dataclass(frozen=True)
class DistributedNoise:
    """How a site quantises and noises its clipped sums in distributed mode.

    Attributes:
        noise_shares: t, how many sites' noise the sum must hold: each site adds
            ``1 / t`` of the noise variance, so the sum over at least t honest sites carries
            the full noise. A site refuses to unmask when fewer survive.
        bits: the modulus ``2**bits`` of the secure sum (each coordinate's range).
        step: the quantisation step, in units of the clip norms; finer steps grow the
            sensitivity less but wrap around the modulus sooner.
    """

    noise_shares: int
    bits: int
    step: float

    def __post_init__(self) -> None:
        if not (isinstance(self.noise_shares, int) and self.noise_shares >= 1):
            raise ConfigError(f"noise-shares must be an integer >= 1, got {self.noise_shares!r}")
        if not (isinstance(self.bits, int) and MIN_BITS <= self.bits <= MAX_BITS):
            raise ConfigError(
                f"quantization-bits must be an integer in [{MIN_BITS}, {MAX_BITS}], "
                f"got {self.bits!r}"
            )
        if not (math.isfinite(self.step) and self.step > 0):
            raise ConfigError(f"quantization-step must be a finite number > 0, got {self.step}")

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    @classmethod
    def for_sum(
        cls,
        noise_multiplier: float,
        noise_shares: int,
        bits: int,
        dimension: int,
        max_norm: float,
        max_sites: int,
    ) -> DistributedNoise:
        """The step at which ``RANGE_STDS`` standard deviations of a coordinate of the sum
        fit in the modulus: a rotated sum of norm ``max_norm`` (normalised units) spreads
        ``max_norm / sqrt(dimension)`` per coordinate, and ``max_sites`` sites add
        ``sigma**2 * max_sites / t`` of noise variance. Public inputs only."""
        spread = math.sqrt(
            max_norm**2 / dimension + noise_multiplier**2 * max_sites / noise_shares + 1e-12
        )
        return cls(noise_shares, bits, 2 * RANGE_STDS * spread / (1 << bits))

    def share_scale(self, noise_multiplier: float) -> float:
        """Each site's discrete Gaussian scale, in quantisation units."""
        return noise_multiplier / (self.step * math.sqrt(self.noise_shares))

    def l2_scale(self, noise_multiplier: float, releases: int, dimension: int) -> float:
        """One example's largest move of the rounded vector over the noise std of the sum of
        t shares: ``(sqrt(releases) + step * sqrt(dimension)) / sigma``."""
        return (math.sqrt(releases) + self.step * math.sqrt(dimension)) / noise_multiplier

    def tau(self, noise_multiplier: float) -> float:
        """The divergence of a sum of t discrete Gaussians from one (Kairouz et al., Thm. 1):
        ``10 * sum_{k<t} exp(-2 pi^2 s^2 k / (k + 1))`` for share scale s."""
        s2 = self.share_scale(noise_multiplier) ** 2
        terms = (math.exp(-2 * math.pi**2 * s2 * k / (k + 1)) for k in range(1, self.noise_shares))
        return 10 * sum(terms)

    # -- a site's side ------------------------------------------------------------------

    def encode(
        self,
        sums: ClippedSums,
        mechanism: Mechanism,
        rotation_seed: int,
    ) -> np.ndarray:
        """A site's clipped sums as its noised share of the secure sum: int64 in
        ``[0, 2**bits)`` (normalise, rotate, round at random, add the noise share, reduce)."""
        if sums.noised:
            raise ValueError("distributed mode quantises unnoised clipped sums")
        flat = normalised(sums, mechanism)
        d = padded_dimension(flat.numel())
        x = torch.zeros(d, dtype=torch.float64)
        x[: flat.numel()] = flat
        # clamped before the integers: a step the server chose fine enough would otherwise
        # overflow int64 exactly where the unnoised sums are large (an error that depends on
        # the data); the clamp is 1-Lipschitz per coordinate, so the sensitivity holds
        rotated = (hadamard(x * rotation_signs(rotation_seed, d)) / self.step).clamp(
            -MAX_QUANTISED, MAX_QUANTISED
        )
        rounded = torch.floor(rotated + torch.from_numpy(os_uniforms(d)))
        noisy = discrete_gaussian(rounded.numpy(), self.share_scale(mechanism.noise_multiplier))
        return np.mod(noisy, self.modulus)

    # -- the server's side ---------------------------------------------------------------

    def decode(
        self, modular_sum: np.ndarray, mechanism: Mechanism, rotation_seed: int, shapes: tuple
    ) -> ClippedSums:
        """The noised clipped sums from the secure sum (mod ``2**bits``) of the sites'
        ``encode`` outputs. ``shapes``: (embedding length or None, residual length or None)."""
        m = self.modulus
        centred = np.where(modular_sum >= m // 2, modular_sum - m, modular_sum).astype(np.float64)
        d = centred.size
        x = torch.from_numpy(centred) * self.step
        flat = hadamard(x, transpose=True) * rotation_signs(rotation_seed, d)
        clips = release_clips(mechanism)
        parts, start = [], 0
        for length, clip in zip(shapes, clips, strict=True):
            if length is None:
                parts.append(None)
                continue
            parts.append((flat[start : start + length] * clip).float())
            start += length
        return ClippedSums(parts[0], parts[1], noised=True)


def normalised(sums: ClippedSums, mechanism: Mechanism) -> torch.Tensor:
    """The released vectors divided by their clip norms and concatenated (float64, CPU)."""
    parts = []
    for value, clip in zip((sums.embedding, sums.residual), release_clips(mechanism), strict=True):
        if (value is None) != (clip is None):
            raise ValueError(f"{mechanism.name} sums do not match the mechanism's releases")
        if value is not None:
            parts.append(value.detach().to("cpu", torch.float64).reshape(-1) / clip)
    return torch.cat(parts)
