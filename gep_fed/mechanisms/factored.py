"""Per-example gradients of linear and convolution layers kept as factors.

For a layer whose output at position ``t`` is ``W a_t`` (a linear layer, ``t`` over a
sequence; a convolution, ``t`` over output pixels and ``a_t`` the unfolded input patch),
example ``i``'s weight gradient is ``g_i = sum_t d_it a_it^T``, from the layer's inputs ``A_i``
``(T, d_in)`` and output gradients ``D_i`` ``(T, d_out)``. Inner products of two such gradients
need only the factors: ``<g_i, g_m> = sum_{t,s} (d_it . d_ms) (a_it . a_ms)``, which costs
``T S (d_in + d_out)`` instead of the ``d_in d_out`` of a materialised gradient. Where the
anchor subspace is spanned by the anchors' gradients, ``B = G^T C``, the embedding
``B^T g_i = C^T (G g_i)`` is such inner products (``gep_fed.mechanisms.gram``), and
``||g_i||`` is one too (a ghost norm, Li et al. 2022).

Every product here is computed in float64 from float32 (or float64) factors, with an
error bound relative to ``nu_i = sum_t ||d_it|| ||a_it||`` (``>= ||g_i||``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from gep_fed.mechanisms.clip_bounds import U64, gamma
from gep_fed.mechanisms.groups import ParameterLayout


def factorable(module: nn.Module) -> bool:
    """Whether ``module``'s weight gradient can be kept as factors: a Linear, or a Conv2d
    with one group and zero padding given as numbers (so that unfolding its input gives
    exactly the patches it multiplies)."""
    if isinstance(module, nn.Linear):
        return module.weight.requires_grad
    return (
        isinstance(module, nn.Conv2d)
        and module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
        and module.weight.requires_grad
    )


@dataclass(frozen=True)
class LayerFactors:
    """One layer's per-example weight gradients ``g_i = D_i^T A_i`` as their factors.

    Attributes:
        inputs: ``(n, T, d_in)``, the layer's (unfolded) inputs per output position.
        backprops: ``(n, T, d_out)``, the gradients of each example's loss with respect to
            the layer's outputs.
    """

    inputs: torch.Tensor
    backprops: torch.Tensor

    @classmethod
    def of(cls, module: nn.Module, activation: torch.Tensor, backprop: torch.Tensor):
        """The factors of ``module`` (``factorable``) from its input and output gradient."""
        n = activation.shape[0]
        if isinstance(module, nn.Conv2d):
            patches = F.unfold(
                activation,
                module.kernel_size,
                dilation=module.dilation,
                padding=module.padding,
                stride=module.stride,
            )
            return cls(patches.transpose(1, 2), backprop.reshape(n, backprop.shape[1], -1).mT)
        return cls(
            activation.reshape(n, -1, activation.shape[-1]),
            backprop.reshape(n, -1, backprop.shape[-1]),
        )

    @property
    def positions(self) -> int:
        return self.inputs.shape[1]

    def weight_sum(self, scale: torch.Tensor) -> torch.Tensor:
        """``sum_i scale_i g_i`` as a ``(d_out, d_in)`` matrix (the gradients' dtype)."""
        scaled = self.backprops * scale.to(self.backprops.dtype)[:, None, None]
        return scaled.flatten(0, 1).T @ self.inputs.flatten(0, 1)

    def bias_gradients(self) -> torch.Tensor:
        """``(n, d_out)``: each example's gradient of the layer's bias."""
        return self.backprops.sum(1)

    def merged_copies(self, copies: int) -> LayerFactors:
        """The mean gradient of each run of ``copies`` consecutive examples, as factors: their
        positions side by side, output gradients divided by ``copies`` (``g = sum_{k,t}
        d_kt a_kt^T / copies``)."""
        n, t = self.inputs.shape[:2]
        return LayerFactors(
            self.inputs.reshape(n // copies, copies * t, -1),
            self.backprops.reshape(n // copies, copies * t, -1) / copies,
        )

    def without(self, rows: torch.Tensor) -> LayerFactors:
        """These factors with the examples ``rows`` (a mask) zeroed (dropped examples)."""
        keep = ~rows[:, None, None]
        return LayerFactors(self.inputs.where(keep, 0.0), self.backprops.where(keep, 0.0))

    @cached_property
    def nu(self) -> torch.Tensor:
        """``(n,)`` float64 upper bounds on ``sum_t ||d_it|| ||a_it||`` (so on ``||g_i||``);
        computed once (the embedding's bound, the ghost norm and the release all read it)."""
        a = torch.linalg.vector_norm(self.inputs, dim=2, dtype=torch.float64)
        d = torch.linalg.vector_norm(self.backprops, dim=2, dtype=torch.float64)
        d_in, d_out = self.inputs.shape[2], self.backprops.shape[2]
        return (a * d).sum(1) * (1 + gamma(d_in + d_out + self.positions + 6, U64))

    def relative_error(self, other_positions: int) -> float:
        """The bound, relative to ``nu_i nu_m``, on the error of one float64 inner product
        ``<g_i, g_m>`` computed by ``inner`` against factors with ``other_positions``."""
        d_in, d_out = self.inputs.shape[2], self.backprops.shape[2]
        t = self.positions * other_positions
        return gamma(d_in + 2, U64) + gamma(d_out + 2, U64) + gamma(t + 4, U64)

    def inner(self, other: LayerFactors) -> torch.Tensor:
        """``(n, m)`` float64: ``<g_i, g'_m>`` for these examples against ``other``'s."""
        n, t = self.inputs.shape[:2]
        m, s = other.inputs.shape[:2]
        a = self.inputs.flatten(0, 1).double() @ other.inputs.flatten(0, 1).double().T
        d = self.backprops.flatten(0, 1).double() @ other.backprops.flatten(0, 1).double().T
        return (a * d).reshape(n, t, m, s).sum((1, 3))

    def squared_norms(self) -> torch.Tensor:
        """``(n,)`` float64: ``||g_i||^2`` as computed by ``sum_{t,s} (d_t.d_s)(a_t.a_s)``
        (within ``relative_error(T) nu_i^2`` of the exact value)."""
        a = self.inputs.double()
        d = self.backprops.double()
        return ((a @ a.mT) * (d @ d.mT)).sum((1, 2))

    @cached_property
    def norm_bounds(self) -> torch.Tensor:
        """``(n,)`` float64 upper bounds on ``||g_i||`` (ghost norms), computed once."""
        squared = self.squared_norms() + self.relative_error(self.positions) * self.nu**2
        return squared.clamp_min(0).sqrt() * (1 + 2 * U64)


def ghost_pays(shape: tuple[int, int, int]) -> bool:
    """Whether a ghost norm of a layer with factors ``(T, d_in, d_out)`` (``T^2 (d_in +
    d_out)`` float64 multiply-adds, counted twice) costs less than materialising its gradient,
    taking its norm and summing it (``d_in d_out`` each, twice over memory): mixed ghost
    clipping's choice (Bu et al. 2022), per layer."""
    t, d_in, d_out = shape
    return t * t * (d_in + d_out) < d_in * d_out


def dense_index(layout: ParameterLayout, factored: frozenset[str]) -> dict[str, tuple[int, int]]:
    """Columns of each parameter not in ``factored`` in a matrix that holds only those, in
    layout order (so each group's dense parameters stay contiguous)."""
    index, pos = {}, 0
    for name, cols in layout.slices():
        if name not in factored:
            index[name] = (pos, pos + cols.stop - cols.start)
            pos += cols.stop - cols.start
    return index


@dataclass(frozen=True)
class PerExampleGradients:
    """One chunk's per-example gradients: most parameters' as columns, some weights' as
    factors (never materialised).

    Attributes:
        layout: the parameter layout of the flattened gradient.
        dense: ``(n, p_dense)``: the columns of every parameter not in ``factors``, in
            layout order (``dense_index``).
        factors: ``{parameter name: LayerFactors}`` for the weights kept as factors.
    """

    layout: ParameterLayout
    dense: torch.Tensor
    factors: dict[str, LayerFactors]

    @property
    def n(self) -> int:
        return self.dense.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.dense.dtype

    @cached_property
    def index(self) -> dict[str, tuple[int, int]]:
        return dense_index(self.layout, frozenset(self.factors))

    def dense_columns(self, group) -> slice:
        """The columns of ``group``'s dense parameters in ``dense`` (empty if none)."""
        spans = [self.index[n] for n in group.param_names if n in self.index]
        return slice(spans[0][0], spans[-1][1]) if spans else slice(0, 0)

    def merged_copies(self, copies: int) -> PerExampleGradients:
        """The mean gradient of each run of ``copies`` consecutive examples."""
        return PerExampleGradients(
            self.layout,
            self.dense.reshape(-1, copies, self.dense.shape[1]).mean(1),
            {name: f.merged_copies(copies) for name, f in self.factors.items()},
        )

    def without(self, rows: torch.Tensor) -> PerExampleGradients:
        """These gradients with the examples ``rows`` (a mask) set to zero."""
        return PerExampleGradients(
            self.layout,
            self.dense.masked_fill(rows[:, None], 0.0),
            {name: f.without(rows) for name, f in self.factors.items()},
        )

    def weighted_sum(self, scale: torch.Tensor) -> torch.Tensor:
        """``sum_i scale_i g_i`` as a ``(p,)`` vector in layout order."""
        out = self.dense.new_empty(self.layout.size)
        dense_sum = self.dense.T @ scale
        for name, cols in self.layout.slices():
            if name in self.factors:
                out[cols] = self.factors[name].weight_sum(scale).reshape(-1)
            else:
                start, stop = self.index[name]
                out[cols] = dense_sum[start:stop]
        return out

    def to_dense(self) -> torch.Tensor:
        """The ``(n, p)`` matrix (materialising the factored gradients): for tests."""
        out = self.dense.new_empty(self.n, self.layout.size)
        for name, cols in self.layout.slices():
            if name in self.factors:
                f = self.factors[name]
                out[:, cols] = (f.backprops.mT @ f.inputs).reshape(self.n, -1)
            else:
                start, stop = self.index[name]
                out[:, cols] = self.dense[:, start:stop]
        return out
