"""Gaussian noise for releases, from a secret stream keyed by the OS's CSPRNG in real runs.

A fixed seed makes the noise predictable to whoever knows it, which voids the guarantee, so
seeds are for tests and benchmarks only; ``NoiseSource.seeded`` says which kind a run used.
"""

from __future__ import annotations

import torch

from gep_fed.mechanisms.secret_stream import SecretStream


class NoiseSource:
    """Independent Gaussian draws on any device, from ChaCha20's keystream (``SecretStream``).

    Args:
        seed: ``None`` (default) keys the stream from ``os.urandom`` so the noise cannot be
            reproduced or searched for; an integer makes it reproducible (tests and benchmarks
            only).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._stream = (
            SecretStream.from_os() if seed is None else SecretStream.from_seed(seed, "noise")
        )

    @property
    def seeded(self) -> bool:
        return self.seed is not None

    def gaussian(self, like: torch.Tensor, std: float) -> torch.Tensor:
        """A draw of ``N(0, std^2)`` with the shape, dtype and device of ``like`` (drawn in
        float64 on the CPU, then cast and moved). Box-Muller pairs are used both only where
        the release is rounded below float64 (``SecretStream.gaussians``)."""
        paired = like.dtype != torch.float64
        draws = self._stream.gaussians(like.numel(), paired)
        draws = torch.from_numpy(draws).reshape(like.shape)
        return (draws * std).to(dtype=like.dtype, device=like.device)

    def state_dict(self) -> dict:
        """The stream's position, to resume a seeded run exactly; empty for a cryptographic
        source, whose state written to a file would let its reader reproduce the noise."""
        if not self.seeded:
            return {}
        return {"seed": self.seed, "position": self._stream.position}

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream ``state_dict`` saved (a cryptographic source keeps its own)."""
        if not self.seeded or not state:
            return
        if state["seed"] != self.seed:
            raise ValueError(
                f"noise state of seed {state['seed']} given to a source of seed {self.seed}"
            )
        if "position" not in state:
            raise ValueError(
                "this noise state was saved by an older gep-fed (PyTorch generators, replaced by "
                "a ChaCha20 stream): a seeded run cannot continue it exactly; start it over"
            )
        self._stream = SecretStream.from_seed(self.seed, "noise", state["position"])

    def __repr__(self) -> str:
        return f"NoiseSource(seed={self.seed})" if self.seeded else "NoiseSource(cryptographic)"
