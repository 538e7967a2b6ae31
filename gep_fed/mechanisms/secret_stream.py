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
        renew: draw a fresh key from the OS when the 2^38 bytes of this one are used up (an
            OS-keyed stream); otherwise that raises.
    """

    def __init__(self, key: bytes, position: int = 0, renew: bool = False) -> None:
        if len(key) != 32:
            raise ValueError(f"a stream key is 32 bytes, got {len(key)}")
        if not (isinstance(position, int) and 0 <= position < _MAX_BLOCKS):
            raise ValueError(f"stream position must be an integer in [0, 2^32), got {position!r}")
        self._key = key
        self.position = position
        self._renew = renew

    @classmethod
    def from_os(cls) -> SecretStream:
        return cls(os.urandom(32), renew=True)

    @classmethod
    def from_seed(cls, seed: int, purpose: str, position: int = 0) -> SecretStream:
        """A reproducible stream (tests and benchmarks): the key hashes ``purpose`` and
        ``seed``, so the noise and the sampling of one seed are independent streams."""
        key = hashlib.sha256(f"gep-fed {purpose} seed {int(seed)}".encode()).digest()
        return cls(key, position)

    def _words(self, count: int) -> np.ndarray:
        """``count`` uint64 words of keystream from ``position``, which moves past them."""
        blocks = math.ceil(8 * count / _BLOCK)
        if self.position + blocks > _MAX_BLOCKS:
            # a run of a large model can draw 2^35 Gaussians; a step must not fail after its
            # release was recorded
            if not self._renew or blocks > _MAX_BLOCKS:
                raise RuntimeError("this secret stream is used up (2^38 bytes): draw a new key")
            self._key, self.position = os.urandom(32), 0
        nonce = self.position.to_bytes(4, "little") + bytes(12)
        encryptor = Cipher(algorithms.ChaCha20(self._key, nonce), mode=None).encryptor()
        self.position += blocks
        return np.frombuffer(encryptor.update(bytes(blocks * _BLOCK)), dtype=np.uint64)[:count]

    def uniforms(self, count: int) -> np.ndarray:
        """``count`` float64 uniforms on [0, 1), multiples of 2^-53 (53 random bits each)."""
        return (self._words(count) >> np.uint64(11)).astype(np.float64) * 2.0**-53

    def gaussians(self, count: int, paired: bool = True) -> np.ndarray:
        """``count`` float64 draws of N(0, 1), by the Box-Muller transform of two 53-bit
        uniforms (the first on (0, 1] as ``1 - u``, so its logarithm is finite).

        ``paired``: both of a transform's outputs, ``r cos(t)`` and ``r sin(t)``, are used.
        Never for values released in float64: the pairs two grids of 2^53 uniforms reach
        are a sparse set of the float64 plane, so whoever sees both can test a guess of the
        unnoised values bit for bit (a site's score counts, before). Unpaired, each value
        comes from 2^106 inputs and no such test is left; it costs twice the keystream."""
        if not paired:
            u = self.uniforms(2 * count)
            return np.sqrt(-2.0 * np.log1p(-u[:count])) * np.cos((2.0 * np.pi) * u[count:])
        pairs = (count + 1) // 2
        u = self.uniforms(2 * pairs)
        radius = np.sqrt(-2.0 * np.log1p(-u[:pairs]))
        angle = (2.0 * np.pi) * u[pairs:]
        return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]
