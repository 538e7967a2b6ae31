"""Augmentation multiplicity (De et al. 2022, "Unlocking High-Accuracy Differentially Private
Image Classification through Scale"): each private example's gradient is the mean of its
gradients on several augmented copies of it, and that mean is what is clipped and noised.

Privacy is unchanged: a row still depends on its own example alone (and on the
augmentation's randomness, which is independent of the data), and it is clipped like any
other row, so the sensitivity, the noise and the accounting are those of one copy. What
changes is the row's variance: the mean over copies is a less noisy estimate of the
example's expected gradient under augmentation, at ``copies`` times the compute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from gep_fed.validation import AT_LEAST_ONE, ConfigError

Augment = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AugmentationMultiplicity:
    """Average each example's gradient over ``copies`` augmented copies before clipping.

    Attributes:
        copies: K, the augmented copies of each example (1: one augmented copy).
        augment: maps a batch of inputs to a batch of augmented inputs of the same length
            (e.g. ``gep_fed.data.augment.crop_and_flip``), drawing fresh randomness at every
            call. It must treat each row on its own: one that mixes rows (mixup across the
            batch) makes a row depend on other examples and voids the guarantee, and it is
            not checked. Its randomness has no privacy meaning (it need not be secret).
    """

    copies: int
    augment: Augment

    def __post_init__(self) -> None:
        AT_LEAST_ONE.check("copies", self.copies)
        if not callable(self.augment):
            raise ConfigError(
                f"augment must be a function from a batch of inputs to a batch of augmented "
                f"inputs, got {type(self.augment).__name__}"
            )

    def examples_per_chunk(self, max_chunk: int) -> int:
        """How many examples to differentiate at once so their copies fit ``max_chunk`` rows
        (at least one example, whose copies are never split)."""
        return max(1, max_chunk // self.copies)

    def chunks(self, batches: Iterable[tuple], max_chunk: int) -> Iterator[tuple]:
        """``batches`` cut into batches of at most ``examples_per_chunk`` examples."""
        size = self.examples_per_chunk(max_chunk)
        for batch in batches:
            for start in range(0, batch[0].shape[0], size):
                yield tuple(t[start : start + size] for t in batch)

    def expand(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The augmented copies of each example, an example's copies in consecutive rows."""
        copies = self.augment(inputs.repeat_interleave(self.copies, 0))
        if not isinstance(copies, torch.Tensor) or copies.shape[0] != inputs.shape[0] * self.copies:
            raise ValueError(
                f"augment must return one augmented row per input row: given "
                f"{inputs.shape[0] * self.copies} rows, it returned "
                f"{getattr(copies, 'shape', type(copies).__name__)}"
            )
        return copies, targets.repeat_interleave(self.copies, 0)

    def average(self, grads: torch.Tensor) -> torch.Tensor:
        """Each example's mean gradient over its copies, from the copies' ``(n K, p)`` rows in
        ``expand``'s order (``PerExampleGradients.merged_copies`` for factored ones)."""
        return grads.reshape(-1, self.copies, grads.shape[1]).mean(1)
