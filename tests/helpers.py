"""Small builders shared by the tests."""

from __future__ import annotations

import torch

from gep_fed.mechanisms.groups import ParameterGroup, ParameterLayout
from gep_fed.mechanisms.subspace import AnchorSubspace


def flat_layout(*sizes: int) -> ParameterLayout:
    """A layout of one parameter per group, with the given sizes."""
    names = tuple(f"p{i}" for i in range(len(sizes)))
    groups, pos = [], 0
    for name, size in zip(names, sizes, strict=True):
        groups.append(ParameterGroup(name, (name,), pos, pos + size))
        pos += size
    return ParameterLayout(names, tuple((s,) for s in sizes), tuple(groups))


def random_subspace(layout: ParameterLayout, dims, generator=None) -> AnchorSubspace:
    bases = tuple(
        torch.linalg.qr(torch.randn(g.size, k, generator=generator)).Q
        for g, k in zip(layout.groups, dims, strict=True)
    )
    return AnchorSubspace(layout, bases)
