"""Gaussian noise for releases, seeded from the operating system's CSPRNG in real runs.

A fixed seed makes the noise predictable to whoever knows it, which voids the guarantee, so
seeds are for tests and benchmarks only; ``NoiseSource.seeded`` says which kind a run used.
"""

from __future__ import annotations

import secrets

import torch


class NoiseSource:
    """Independent Gaussian draws on any device.

    Args:
        seed: ``None`` (default) seeds from ``secrets`` so the noise cannot be reproduced;
            an integer makes it reproducible (tests and benchmarks only).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._base = seed if seed is not None else secrets.randbits(63)
        self._generators: dict[str, torch.Generator] = {}

    @property
    def seeded(self) -> bool:
        return self.seed is not None

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            gen = torch.Generator(device=device)
            # A distinct stream per device, derived from the base seed.
            gen.manual_seed((self._base + len(self._generators) * 0x9E3779B97F4A7C15) % 2**63)
            self._generators[key] = gen
        return self._generators[key]

    def gaussian(self, like: torch.Tensor, std: float) -> torch.Tensor:
        """A draw of ``N(0, std^2)`` with the shape, dtype and device of ``like``."""
        noise = torch.empty_like(like)
        noise.normal_(0.0, std, generator=self._generator(like.device))
        return noise

    def state_dict(self) -> dict:
        """The generators' states, to resume a seeded run exactly; empty for a cryptographic
        source, whose state written to a file would let its reader reproduce the noise."""
        if not self.seeded:
            return {}
        return {
            "seed": self.seed,
            "generators": {k: g.get_state() for k, g in self._generators.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue the streams ``state_dict`` saved (a cryptographic source keeps its own)."""
        if not self.seeded or not state:
            return
        if state["seed"] != self.seed:
            raise ValueError(
                f"noise state of seed {state['seed']} given to a source of seed {self.seed}"
            )
        for key, gen_state in state["generators"].items():
            self._generator(torch.device(key)).set_state(gen_state)

    def __repr__(self) -> str:
        return f"NoiseSource(seed={self.seed})" if self.seeded else "NoiseSource(cryptographic)"
