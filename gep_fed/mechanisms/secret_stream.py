"""Secret randomness: ChaCha20's keystream under a 256-bit key, read as uniforms and Gaussians.

The guarantee assumes that nobody can predict a site's noise or its Poisson coins. PyTorch's
CPU generator cannot promise that: it keeps 32 bits of any seed, so whoever sees one noised
release can try every seed, find the one whose noise it holds, and subtract it. A key from the
OS's CSPRNG (``os.urandom``) leaves a search of 2^256 keys. A test or benchmark fixes a seed, and
its key is the seed's SHA-256 (no seed is expanded by a non-cryptographic generator).
"""

from __future__ import annotations

import hashlib
import math
import os

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

_BLOCK = 64  # ChaCha20's block, in bytes
_MAX_BLOCKS = 2**32  # the 32-bit block counter of the 16-byte nonce


class SecretStream:
    """Uniform and Gaussian draws from ChaCha20's keystream (nonce 0), read block by block.

    Args:
        key: 32 bytes. ``SecretStream.from_os()`` draws one; ``SecretStream.from_seed`` derives
            one for tests and benchmarks, whose draws anyone knowing the seed can reproduce.
        position: the first block to read (``position`` of a stream saved earlier resumes it).
    """

    def __init__(self, key: bytes, position: int = 0) -> None:
        if len(key) != 32:
            raise ValueError(f"a stream key is 32 bytes, got {len(key)}")
        if not 0 <= position < _MAX_BLOCKS:
            raise ValueError(f"stream position must be in [0, 2^32), got {position}")
        self._key = key
        self.position = position

    @classmethod
    def from_os(cls) -> SecretStream:
        return cls(os.urandom(32))

    @classmethod
    def from_seed(cls, seed: int, purpose: str) -> SecretStream:
        """A reproducible stream (tests and benchmarks): the key hashes ``purpose`` and
        ``seed``, so the noise and the sampling of one seed are independent streams."""
        return cls(hashlib.sha256(f"gep-fed {purpose} seed {int(seed)}".encode()).digest())

    def _words(self, count: int) -> np.ndarray:
        """``count`` uint64 words of keystream from ``position``, which moves past them."""
        blocks = math.ceil(8 * count / _BLOCK)
        if self.position + blocks > _MAX_BLOCKS:
            raise RuntimeError("this secret stream is used up (2^38 bytes): draw a new key")
        nonce = self.position.to_bytes(4, "little") + bytes(12)
        encryptor = Cipher(algorithms.ChaCha20(self._key, nonce), mode=None).encryptor()
        self.position += blocks
        return np.frombuffer(encryptor.update(bytes(blocks * _BLOCK)), dtype=np.uint64)[:count]

    def uniforms(self, count: int) -> np.ndarray:
        """``count`` float64 uniforms on [0, 1), multiples of 2^-53 (53 random bits each)."""
        return (self._words(count) >> np.uint64(11)).astype(np.float64) * 2.0**-53

    def gaussians(self, count: int) -> np.ndarray:
        """``count`` float64 draws of N(0, 1), by the Box-Muller transform of pairs of
        53-bit uniforms (the first of each pair on (0, 1], so its logarithm is finite)."""
        pairs = (count + 1) // 2
        u = self.uniforms(2 * pairs)
        radius = np.sqrt(-2.0 * np.log1p(-u[:pairs]))  # 1 - u on (0, 1]
        angle = (2.0 * np.pi) * u[pairs:]
        return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]
