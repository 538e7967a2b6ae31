"""Poisson sampling: each example joins each batch independently with probability ``q``.

The subsampled-Gaussian RDP bound assumes exactly this; shuffled fixed-size batches do not
satisfy it. Batch sizes vary (mean ``q n``, variance ``q (1 - q) n``) and may be zero.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gep_fed.mechanisms.secret_stream import SecretStream


class PoissonSampler:
    """Yields, per step, the indices of a Poisson sample of ``range(num_examples)``.

    Usable as a ``torch.utils.data.DataLoader`` ``batch_sampler``, but indexing in-memory
    tensors (``x[idx]``) also handles empty batches, which a default collate does not.

    Args:
        num_examples: n, the size of the private data set.
        sample_rate: q in (0, 1], each example's chance to be in a batch.
        steps: batches per pass (default: ``round(1 / q)``, one epoch in expectation).
        generator: randomness of the sampling. The accounting assumes it is secret: leave it
            None in real runs (a ``SecretStream`` keyed by the OS); pass a seeded
            ``torch.Generator`` only in tests and benchmarks.
    """

    def __init__(
        self,
        num_examples: int,
        sample_rate: float,
        steps: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if num_examples < 0:
            raise ValueError(f"num_examples must be >= 0, got {num_examples}")
        if not (0 < sample_rate <= 1):
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.num_examples = num_examples
        self.sample_rate = sample_rate
        self.steps = steps if steps is not None else max(1, round(1 / sample_rate))
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        self.generator = generator
        # not PyTorch's generator: it keeps 32 bits of its seed, few enough to search
        self._secret = SecretStream.from_os() if generator is None else None

    def sample(self) -> torch.Tensor:
        """One batch: a sorted ``int64`` tensor of indices, possibly empty."""
        # float64 uniforms: float32 ones are multiples of 2^-24, which would include each
        # example with probability ceil(q 2^24) / 2^24 >= q, above the accounted rate.
        if self._secret is not None:
            u = torch.from_numpy(self._secret.uniforms(self.num_examples))
        else:
            u = torch.rand(self.num_examples, generator=self.generator, dtype=torch.float64)
        mask = u < self.sample_rate
        return mask.nonzero().flatten()

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.steps):
            yield self.sample()

    def __len__(self) -> int:
        return self.steps

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * self.num_examples
