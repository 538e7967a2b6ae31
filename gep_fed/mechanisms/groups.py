"""Parameter groups: how the flattened parameter vector is split for the anchor subspace.

GEP computes one orthonormal basis per group of parameters (the paper: input layer, output
layer, the stages between). Grouping cuts the power method's cost from ``2 m k p`` to
``2 m sum_g k_g p_g`` and gives every part of the network its own share of the basis.
The layout is public information (it depends on the architecture only).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

_NORM_LAYERS = (nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm)


@dataclass(frozen=True)
class ParameterGroup:
    """A contiguous slice ``[start, stop)`` of the flattened parameter vector."""

    name: str
    param_names: tuple[str, ...]
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ParameterLayout:
    """The order, shapes and groups of the trainable parameters in the flattened vector.

    Parameters are laid out group after group, so each group is one contiguous slice.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[ParameterGroup, ...]
    index: Mapping[str, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        repeated = sorted({n for n in self.names if self.names.count(n) > 1})
        if repeated:
            # a name given twice would leave columns of the flattened vector unwritten
            raise ValueError(f"the layout names parameter(s) {repeated} more than once")
        offsets, pos = {}, 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            n = math.prod(shape)
            offsets[name] = (pos, pos + n)
            pos += n
        object.__setattr__(self, "index", offsets)
        covered = [n for g in self.groups for n in g.param_names]
        if covered != list(self.names):
            raise ValueError("groups must list the parameters in layout order, each once")
        start = 0
        for g in self.groups:
            size = sum(offsets[n][1] - offsets[n][0] for n in g.param_names)
            if (g.start, g.stop) != (start, start + size):
                raise ValueError(
                    f"group {g.name!r} spans [{g.start}, {g.stop}), its parameters "
                    f"[{start}, {start + size})"
                )
            start += size

    @property
    def size(self) -> int:
        return self.groups[-1].stop if self.groups else 0

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return tuple(g.size for g in self.groups)

    def slices(self) -> Iterator[tuple[str, slice]]:
        """(parameter name, columns of the flattened vector) in layout order."""
        for name in self.names:
            start, stop = self.index[name]
            yield name, slice(start, stop)

    @classmethod
    def from_model(
        cls, model: nn.Module, groups: Mapping[str, Sequence[str]] | None = None
    ) -> ParameterLayout:
        """Lay out ``model``'s trainable parameters.

        Args:
            groups: ``{group name: [fnmatch patterns of parameter names]}``; each parameter joins
                the first group with a matching pattern. ``None`` gives the layer-aware default:
                one group per top-level child module, a child holding only normalisation layers
                joining the group before it (so the input layer, each stage, and the output
                layer are groups, as in the GEP paper).
        """
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        assignment = _assign_by_patterns(named, groups) if groups else _layer_aware(model, named)
        order = list(dict.fromkeys(assignment[n] for n, _ in named))
        names, shapes, built, pos = [], [], [], 0
        for gname in order:
            members = [(n, p) for n, p in named if assignment[n] == gname]
            size = sum(p.numel() for _, p in members)
            built.append(ParameterGroup(gname, tuple(n for n, _ in members), pos, pos + size))
            pos += size
            names += [n for n, _ in members]
            shapes += [tuple(p.shape) for _, p in members]
        return cls(tuple(names), tuple(shapes), tuple(built))

    def to_dict(self) -> dict:
        return {
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "groups": [[g.name, list(g.param_names)] for g in self.groups],
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> ParameterLayout:
        try:
            names = tuple(str(n) for n in data["names"])
            shapes = tuple(tuple(int(d) for d in s) for s in data["shapes"])
            index = {n: math.prod(s) for n, s in zip(names, shapes, strict=True)}
            groups, pos = [], 0
            for gname, members in data["groups"]:
                size = sum(index[m] for m in members)
                groups.append(ParameterGroup(str(gname), tuple(members), pos, pos + size))
                pos += size
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed parameter layout: {err!r}") from err
        return cls(names, shapes, tuple(groups))

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Concatenate ``{name: tensor}`` into one vector in layout order."""
        return torch.cat([tensors[name].reshape(-1) for name in self.names])

    def flatten_params(self, model: nn.Module) -> torch.Tensor:
        return self.flatten(dict(model.named_parameters())).detach()

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a flat vector into ``{name: tensor}`` views with the parameters' shapes."""
        return {
            name: vector[cols].view(shape)
            for (name, cols), shape in zip(self.slices(), self.shapes, strict=True)
        }

    def allocate_basis(self, k: int, max_rank: int | None = None) -> tuple[int, ...]:
        """Share ``k`` basis vectors across groups in proportion to sqrt(group size).

        Each group gets ``floor(k sqrt(p_g) / sum_j sqrt(p_j))``, at least 1, and at most
        ``min(p_g, max_rank)`` (a basis cannot have more directions than the anchors span).
        """
        if k < len(self.groups):
            raise ValueError(
                f"num_basis={k} is smaller than the number of parameter groups "
                f"({len(self.groups)}); each group needs at least one basis vector"
            )
        roots = [math.sqrt(s) for s in self.group_sizes]
        total = sum(roots)
        cap = [s if max_rank is None else min(s, max_rank) for s in self.group_sizes]
        return tuple(
            max(1, min(c, math.floor(k * r / total))) for r, c in zip(roots, cap, strict=True)
        )


def _assign_by_patterns(named, groups: Mapping[str, Sequence[str]]) -> dict[str, str]:
    assignment = {}
    for name, _ in named:
        for gname, patterns in groups.items():
            if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
                assignment[name] = gname
                break
    missing = [n for n, _ in named if n not in assignment]
    if missing:
        raise ValueError(
            f"parameters {missing} match no group pattern; add a catch-all group such as "
            "{'rest': ['*']} last"
        )
    return assignment


def _layer_aware(model: nn.Module, named) -> dict[str, str]:
    group_of_child: dict[str, str] = {}
    previous = None
    for child_name, child in model.named_children():
        if not any(p.requires_grad for p in child.parameters()):
            continue
        param_modules = [m for m in child.modules() if any(True for _ in m.parameters(False))]
        only_norm = all(isinstance(m, _NORM_LAYERS) for m in param_modules)
        group_of_child[child_name] = previous if (only_norm and previous) else child_name
        previous = group_of_child[child_name]
    assignment = {}
    for name, _ in named:
        head = name.split(".", 1)[0]
        assignment[name] = group_of_child.get(head, "root") if "." in name else "root"
    return assignment
