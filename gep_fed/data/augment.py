"""Batched image augmentation for augmentation multiplicity
(``gep_fed.mechanisms.multiplicity``): every row gets its own random crop and flip, drawn in
one call for the whole batch, on the batch's device."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def crop_and_flip(
    images: torch.Tensor, padding: int = 4, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A random ``H x W`` crop of each ``(C, H, W)`` image padded by ``padding`` pixels on
    every side (by reflection), flipped left-right with probability 1/2: the CIFAR-10
    augmentation of De et al. 2022. ``generator`` (a CPU generator) fixes the draws, for
    tests and benchmarks; the augmentation's randomness has no privacy meaning."""
    if images.ndim != 4:
        raise ValueError(f"crop_and_flip takes a batch (N, C, H, W), got shape {images.shape}")
    n, c, h, w = images.shape
    if padding < 0 or padding >= min(h, w):
        raise ValueError(f"padding must be in [0, {min(h, w)}) for {h}x{w} images, got {padding}")
    device = images.device
    offsets = torch.randint(0, 2 * padding + 1, (2, n), generator=generator).to(device)
    flips = (torch.rand(n, generator=generator) < 0.5).to(device)
    padded = F.pad(images, (padding,) * 4, mode="reflect") if padding else images
    rows = offsets[0, :, None] + torch.arange(h, device=device)
    cols = offsets[1, :, None] + torch.arange(w, device=device)
    cols = torch.where(flips[:, None], cols.flip(1), cols)
    crops = padded[
        torch.arange(n, device=device)[:, None, None, None],
        torch.arange(c, device=device)[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]
    return crops.contiguous()
