"""The anchor subspace: a per-group orthonormal basis of public (anchor) gradients.

Built only from public data at the current (already private) parameters, so computing it
costs no privacy. Private gradients are embedded in it (``embed``) and mapped back (``lift``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from gep_fed.mechanisms.clip_bounds import (
    U64,
    block_row_norms,
    check_dtype,
    combine_block_norms,
    gamma,
    underflow_error,
    unit_roundoff,
)
from gep_fed.mechanisms.factored import PerExampleGradients
from gep_fed.mechanisms.gram import GramGroup
from gep_fed.mechanisms.groups import ParameterLayout

GradientChunks = Callable[[], Iterable[torch.Tensor]]

# Rows of a basis per float32 partial product of the bounded embedding: each partial is a
# dot product of this length, whose rounding error is proven small (gamma(1024, u32) = 6e-5
# relative); the partials are summed in float64. Shorter blocks bound it tighter and cost
# more (at 64 rows, 1.6x the time of the embedding of a (32, 590k) chunk).
EMBED_BLOCK = 1024
# Partial products computed per batched call (bounds the (blocks, n, k_g) temporary).
_BLOCKS_PER_CALL = 256
# Rows of a basis taken to float64 at a time by the checks of its norms: a whole float64
# copy of a large basis would double the memory the subspace holds.
CHECK_ROWS = 8192


def _float64_row_blocks(basis: torch.Tensor):
    for start in range(0, basis.shape[0], CHECK_ROWS):
        yield basis[start : start + CHECK_ROWS].double()


@dataclass(frozen=True)
class AnchorSubspace:
    """One orthonormal basis per parameter group.

    Attributes:
        layout: the parameter layout the bases refer to.
        bases: for group ``g`` a ``(p_g, k_g)`` matrix with orthonormal columns.
        gram: per group index, the anchors' factors that embed its factored weights
            without materialising their gradients (``gep_fed.mechanisms.gram``); empty
            when the subspace holds only bases (as a received one does).
    """

    layout: ParameterLayout
    bases: tuple[torch.Tensor, ...]
    gram: dict[int, GramGroup] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.bases) != len(self.layout.groups):
            raise ValueError(
                f"{len(self.bases)} bases for {len(self.layout.groups)} parameter groups"
            )
        for group, basis in zip(self.layout.groups, self.bases, strict=True):
            if basis.ndim != 2 or basis.shape[0] != group.size or basis.shape[1] < 1:
                raise ValueError(
                    f"basis of group {group.name!r} has shape {tuple(basis.shape)}, "
                    f"expected ({group.size}, k_g >= 1)"
                )

    @property
    def dims(self) -> tuple[int, ...]:
        """``k_g`` per group."""
        return tuple(b.shape[1] for b in self.bases)

    @property
    def num_basis(self) -> int:
        return sum(self.dims)

    @property
    def device(self) -> torch.device:
        return self.bases[0].device

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> AnchorSubspace:
        return AnchorSubspace(
            self.layout,
            tuple(b.to(device=device, dtype=dtype) for b in self.bases),
            {index: gram.to(device) for index, gram in self.gram.items()},
        )

    def _pairs(self):
        k0 = 0
        for group, basis in zip(self.layout.groups, self.bases, strict=True):
            yield slice(group.start, group.stop), slice(k0, k0 + basis.shape[1]), basis
            k0 += basis.shape[1]

    def embed(self, grads: torch.Tensor) -> torch.Tensor:
        """``(n, p) -> (n, k)``: each group's slice times its basis."""
        out = grads.new_empty(grads.shape[0], self.num_basis)
        for cols, ks, basis in self._pairs():
            torch.matmul(grads[:, cols], basis.to(grads.dtype), out=out[:, ks])
        return out

    def embed_bounded(
        self, grads: torch.Tensor | PerExampleGradients
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``embed``, with a proven bound on its rounding error.

        Returns the embedding ``W`` (``grads``' dtype), per row an upper bound on
        ``||W_i - B^T g_i||`` in exact arithmetic (``B`` the bases as held), and per row an
        upper bound on ``||g_i||`` (from the same block norms). Each group's
        product is summed from partial products over ``EMBED_BLOCK`` rows of the basis, each
        within ``gamma(EMBED_BLOCK, u) sum_j |g_j| |B_jl|``, which Cauchy-Schwarz bounds by the
        block norms of ``g`` and of ``B``'s columns; the partials are summed in float64.

        Gradients with weights kept as factors (``PerExampleGradients``, for the groups in
        ``gram``) have those weights' part embedded by Gram products with the anchors
        (``gep_fed.mechanisms.gram``), whose bound adds ``basis_error * ||g_fac,i||``."""
        factored = isinstance(grads, PerExampleGradients)
        dense = grads.dense if factored else grads
        check_dtype(dense.dtype)
        n, dtype = dense.shape[0], dense.dtype
        u, eta = unit_roundoff(dtype), underflow_error(dtype)
        out = dense.new_empty(n, self.num_basis)
        err2 = torch.zeros(n, dtype=torch.float64, device=dense.device)
        grad_blocks = []
        for index, (cols, ks, basis) in enumerate(self._pairs()):
            gram = self.gram.get(index) if factored else None
            if (
                factored
                and gram is None
                and any(name in grads.factors for name in self.layout.groups[index].param_names)
            ):
                raise ValueError(
                    f"group {self.layout.groups[index].name!r} has factored gradients but "
                    "this subspace has no anchor factors for it"
                )
            g = (
                dense[:, grads.dense_columns(self.layout.groups[index])]
                if factored
                else dense[:, cols]
            )
            b = (basis[gram.dense_rows] if gram is not None else basis).to(dtype)
            block_norms = (
                self._dense_block_norms[index] if gram is not None else self._block_norms[index]
            )
            p_g, k_g = b.shape
            acc = torch.zeros(n, k_g, dtype=torch.float64, device=dense.device)
            for start in range(0, p_g, EMBED_BLOCK * _BLOCKS_PER_CALL):
                stop = min(p_g, start + EMBED_BLOCK * _BLOCKS_PER_CALL)
                full = (stop - start) // EMBED_BLOCK * EMBED_BLOCK
                if full:
                    blocks = full // EMBED_BLOCK
                    gb = g[:, start : start + full].reshape(n, blocks, EMBED_BLOCK)
                    bb = b[start : start + full].reshape(blocks, EMBED_BLOCK, k_g)
                    acc += torch.bmm(gb.transpose(0, 1), bb).sum(0, dtype=torch.float64)
                if start + full < stop:
                    acc += (g[:, start + full : stop] @ b[start + full : stop]).double()
            blocks = block_norms.shape[0]
            g_norms = block_row_norms(g, EMBED_BLOCK)  # (n, blocks), upper bounds
            grad_blocks.append(g_norms)
            partial = g_norms @ block_norms  # (n, k_g): >= sum_j |g_j||B_jl|, blockwise
            rel = gamma(min(EMBED_BLOCK, p_g), u) + 2 * gamma(blocks + 1, U64)
            entry = rel * partial + (p_g + 1) * eta
            extra = None
            if gram is not None:
                gram_emb, gram_entry, fac_norms = gram.embed(grads)
                acc += gram_emb
                entry = entry + gram_entry + gamma(2, U64) * acc.abs()
                grad_blocks.append(fac_norms)
                fac_norm = torch.linalg.vector_norm(fac_norms, dim=1) * (1 + gamma(8, U64))
                extra = gram.basis_error * fac_norm * (1 + 2 * U64)
            out[:, ks] = acc.to(dtype)
            entry = entry + u * (1 + 2 * u) * out[:, ks].abs().double()  # the final rounding
            norm = torch.linalg.vector_norm(entry, dim=1) * (1 + gamma(k_g + blocks + 4, U64))
            if extra is not None:
                norm = (norm + extra) * (1 + 2 * U64)
            err2 += norm**2
        grad_norms = combine_block_norms(torch.cat(grad_blocks, 1))
        return out, err2.sqrt() * (1 + 2 * U64), grad_norms

    @cached_property
    def _block_norms(self) -> tuple[torch.Tensor, ...]:
        """Per group, the float64 norms of each ``EMBED_BLOCK`` rows of each basis column,
        raised to upper bounds: ``(blocks, k_g)``."""
        return tuple(block_row_norms(b.T.contiguous(), EMBED_BLOCK).T for b in self.bases)

    @cached_property
    def _dense_block_norms(self) -> dict[int, torch.Tensor]:
        """``_block_norms`` of the rows of each Gram group's dense (not factored) parameters."""
        return {
            index: block_row_norms(self.bases[index][gram.dense_rows].T.contiguous(), EMBED_BLOCK).T
            for index, gram in self.gram.items()
        }

    @property
    def factored_weights(self) -> frozenset[str]:
        """The weights whose private gradients this subspace embeds from their factors."""
        return frozenset(name for gram in self.gram.values() for name in gram.factors)

    @cached_property
    def frobenius_norms(self) -> tuple[float, ...]:
        """Upper bounds on each basis's Frobenius norm (``sqrt(k_g)`` when orthonormal)."""
        # a sum of squares is within gamma(numel) of the exact one in any order, and so
        # summed block by block
        return tuple(
            math.sqrt(sum(float(blk.square().sum()) for blk in _float64_row_blocks(b)))
            * (1 + gamma(b.numel() + 2, U64))
            for b in self.bases
        )

    def lift(self, embedding: torch.Tensor) -> torch.Tensor:
        """``(k,) -> (p,)`` or ``(n, k) -> (n, p)``: back to parameter space."""
        batched = embedding.ndim == 2
        emb = embedding if batched else embedding.unsqueeze(0)
        out = emb.new_empty(emb.shape[0], self.layout.size)
        for cols, ks, basis in self._pairs():
            torch.matmul(emb[:, ks], basis.to(emb.dtype).T, out=out[:, cols])
        return out if batched else out[0]

    def with_directions(self, directions: Sequence[torch.Tensor]) -> AnchorSubspace:
        """This subspace, each group's basis extended by the group's part of ``directions``
        (``(p,)`` vectors), orthogonalised against it; parts already (numerically) inside
        the subspace add nothing."""
        if not directions:
            return self
        stacked = torch.stack([d.to(self.device, self.bases[0].dtype) for d in directions], 1)
        bases = []
        for cols, _, basis in self._pairs():
            extra = stacked[cols]
            for _ in range(2):  # twice: one Gram-Schmidt pass loses orthogonality in float32
                extra = extra - basis @ (basis.T @ extra)
            q, r = torch.linalg.qr(extra)
            scale = torch.linalg.vector_norm(stacked[cols], dim=0).clamp_min(1e-30)
            keep = r.diagonal().abs() > 1e-4 * scale
            bases.append(torch.cat([basis, q[:, keep]], 1) if keep.any() else basis)
        return AnchorSubspace(self.layout, tuple(bases))

    def group_slices(self):
        """(parameter columns, embedding columns) per group."""
        return [(cols, ks) for cols, ks, _ in self._pairs()]

    @cached_property
    def orthonormality_error(self) -> float:
        """``max_g ||B_g^T B_g - I||_F`` (0 for an exactly orthonormal basis), computed in
        float64 and raised by that computation's own rounding bound, so it is an upper bound."""
        errs = []
        for index, b in enumerate(self.bases):
            if index in self.gram:  # bounded when built, from the (k, k) C'^T G G^T C'
                errs.append(self.gram[index].orthonormality_error)
                continue
            gram = torch.eye(b.shape[1], dtype=torch.float64, device=b.device).neg_()
            for blk in _float64_row_blocks(b):
                gram.addmm_(blk.T, blk)
            computed = torch.linalg.matrix_norm(gram).item()
            # each entry of B^T B is a length-p dot product of columns of norm ~1, within
            # gamma(p) of the exact one in any order of summation (here block by block)
            slack = b.shape[1] * gamma(b.shape[0] + 2, U64) * (1 + computed) ** 2
            errs.append(computed + slack)
        return max(errs)

    def projection_error(self, grads: torch.Tensor) -> float:
        """``sum_i ||r_i||^2 / sum_i ||g_i||^2``: the share of gradient energy outside the subspace.

        A diagnostic: on private gradients its value is not released by the mechanisms.
        """
        total = torch.linalg.vector_norm(grads, dtype=torch.float64) ** 2
        if total == 0:
            return 0.0
        resid = grads.double() - self.lift(self.embed(grads.double()))
        return float(torch.linalg.vector_norm(resid) ** 2 / total)


def power_method_subspace(
    gradient_chunks: GradientChunks,
    layout: ParameterLayout,
    dims: tuple[int, ...],
    power_iterations: int = 1,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    with_coefficients: bool = False,
) -> AnchorSubspace | tuple[AnchorSubspace, tuple[torch.Tensor, ...]]:
    """Top-``k_g`` right singular subspace of each group's anchor-gradient block.

    Starting from a Gaussian ``(p_g, k_g)`` matrix ``L``, each of ``power_iterations`` passes
    computes ``L <- orth(G_g^T (G_g L))`` with ``G_g`` streamed in chunks, so the ``m x p``
    anchor-gradient matrix never needs to exist at once.

    Args:
        gradient_chunks: called once per pass; yields ``(chunk, p)`` anchor-gradient blocks
            (the same gradients each pass).
        dims: ``k_g`` per group (see ``ParameterLayout.allocate_basis``).
        generator: for the random start (public randomness).
        with_coefficients: also return, per group, the ``(m, k_g)`` coefficients ``C_g`` of
            the basis in the anchors' gradients: the last pass's ``Q R = G_g^T Y`` gives
            ``Q = G_g^T (Y R^-1)``, so ``subspace_from_coefficients`` rebuilds the basis from
            the anchors' gradients and ``C_g`` alone (``m k_g`` numbers instead of ``p_g k_g``).
    """
    if power_iterations < 1:
        raise ValueError(f"power_iterations must be >= 1, got {power_iterations}")
    if len(dims) != len(layout.groups):
        raise ValueError(f"{len(dims)} basis sizes for {len(layout.groups)} groups")
    starts = [
        torch.randn(g.size, k, generator=generator, dtype=torch.float32).to(device)
        for g, k in zip(layout.groups, dims, strict=True)
    ]
    current = starts
    cols = [slice(g.start, g.stop) for g in layout.groups]
    for step in range(power_iterations):
        acc = [torch.zeros_like(s) for s in current]
        keep = with_coefficients and step == power_iterations - 1
        products: list[list[torch.Tensor]] = [[] for _ in cols]
        for chunk in gradient_chunks():
            for g, sl in enumerate(cols):
                block = chunk[:, sl]
                y = block @ current[g]
                acc[g].addmm_(block.T, y)
                if keep:
                    products[g].append(y)
        factors = [torch.linalg.qr(a) for a in acc]
        current = [f.Q for f in factors]
    subspace = AnchorSubspace(layout, tuple(current))
    if not with_coefficients:
        return subspace
    coefficients = tuple(  # C = Y R^-1: solve C R = Y
        torch.linalg.solve_triangular(f.R, torch.cat(y), upper=True, left=False)
        for f, y in zip(factors, products, strict=True)
    )
    return subspace, coefficients


def subspace_from_coefficients(
    gradient_chunks: GradientChunks,
    layout: ParameterLayout,
    coefficients: Sequence[torch.Tensor],
) -> AnchorSubspace:
    """The basis ``B_g = G_g^T C_g`` from the anchors' gradients (streamed in chunks, rows in
    order) and each group's ``(m, k_g)`` coefficients (``power_method_subspace(...,
    with_coefficients=True)``). Public data and public weights only: no privacy cost."""
    if len(coefficients) != len(layout.groups):
        raise ValueError(f"{len(coefficients)} coefficient blocks for {len(layout.groups)} groups")
    bases = [
        torch.zeros(g.size, c.shape[1], dtype=torch.float32, device=c.device)
        for g, c in zip(layout.groups, coefficients, strict=True)
    ]
    row = 0
    for chunk in gradient_chunks():
        rows = slice(row, row + chunk.shape[0])
        for g, group in enumerate(layout.groups):
            bases[g].addmm_(chunk[:, group.start : group.stop].T, coefficients[g][rows])
        row += chunk.shape[0]
    if row != coefficients[0].shape[0]:
        raise ValueError(f"{row} anchor gradients for {coefficients[0].shape[0]} coefficient rows")
    return AnchorSubspace(layout, tuple(bases))
