"""Embedding without per-example gradients: the anchors' Gram products.

A group's basis is spanned by the anchors' gradients, ``B = G^T C`` (``G`` the ``(m, p_g)``
anchor gradients, ``C`` their ``(m, k_g)`` coefficients), so a private gradient's embedding
is ``B^T g_i = C^T (G g_i)``: ``m`` inner products with the anchors' gradients, which for a
layer kept as factors (``gep_fed.mechanisms.factored``) cost ``T S (d_in + d_out)`` each
instead of the ``d_in d_out k_g`` of materialising ``g_i`` and multiplying it by ``B``. On
late convolution stages (few output positions, many channels) that is several times less.

For the embedding to be ``B^T g_i`` for the basis a site holds, the held basis is built from
the same factors: ``C`` is re-orthonormalised in float64 (``C^T (G G^T) C = L L^T``,
``C' = C L^-T``) and ``B = fl32(G^T C')`` is computed in float64. ``basis_error`` bounds
``||B - G^T C'||_F``; the embedding's error bound adds ``basis_error * ||g_i||`` to the
float64 products' own. Everything here is public: the anchors' factors and coefficients
come from public data at public weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gep_fed.mechanisms.clip_bounds import U64, gamma, unit_roundoff
from gep_fed.mechanisms.factored import LayerFactors, PerExampleGradients
from gep_fed.mechanisms.groups import ParameterLayout

# Output channels of a basis block built at once (bounds the (m, block, d_in) float64 tensor).
_CHANNELS_PER_BLOCK = 16


@dataclass(frozen=True)
class GramGroup:
    """What one group's Gram embedding needs of its anchors.

    Attributes:
        factors: per factored weight of the group, the anchors' factors ``(m, S, d)``.
        nu: per factored weight, ``(m,)`` float64 upper bounds on ``sum_s ||d_ms|| ||a_ms||``.
        coefficients: ``(m, k_g)`` float64 ``C'``: the group's factored rows of the held
            basis are ``fl(G^T C')``.
        basis_error: an upper bound on ``||B_fac - G_fac^T C'||_F`` for the held basis'
            factored rows.
        dense_rows: the group's rows (indices within the group) of its other parameters.
        orthonormality_error: an upper bound on ``||B^T B - I||_F`` for the held basis.
    """

    factors: dict[str, LayerFactors]
    nu: dict[str, torch.Tensor]
    coefficients: torch.Tensor
    basis_error: float
    dense_rows: torch.Tensor
    orthonormality_error: float

    def to(self, device) -> GramGroup:
        return GramGroup(
            {
                n: LayerFactors(f.inputs.to(device), f.backprops.to(device))
                for n, f in self.factors.items()
            },
            {n: v.to(device) for n, v in self.nu.items()},
            self.coefficients.to(device),
            self.basis_error,
            self.dense_rows.to(device),
            self.orthonormality_error,
        )

    def embed(self, grads: PerExampleGradients) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The factored part of the embedding of ``grads``: ``(n, k_g)`` float64 ``C'^T (G g_i)``,
        an ``(n, k_g)`` bound on each entry's error against the exact product (float64
        products of the factors), and ``(n,)`` upper bounds on ``||g_fac,i||`` (ghost norms,
        one per factored weight, as ``(n, weights)``)."""
        c = self.coefficients
        inner = entry_error = None
        norms = []
        for name, anchor in self.factors.items():
            mine = grads.factors[name]
            k = mine.inner(anchor)
            norms.append(mine.norm_bounds)
            err = mine.relative_error(anchor.positions) * torch.outer(mine.nu, self.nu[name])
            inner = k if inner is None else inner + k
            entry_error = err if entry_error is None else entry_error + err
        m = c.shape[0]
        emb = inner @ c
        abs_c = c.abs()
        bound = (entry_error + gamma(m + len(self.factors) + 2, U64) * inner.abs()) @ abs_c
        bound = bound * (1 + gamma(m + 2, U64))
        return emb, bound, torch.stack(norms, 1)


def factor_gram(factors: dict[str, LayerFactors]) -> torch.Tensor:
    """``(m, m)`` float64 ``G G^T`` of the factored weights' anchor gradients."""
    return sum(f.inner(f) for f in factors.values())


def build_gram_group(
    layout: ParameterLayout,
    group_index: int,
    factors: dict[str, LayerFactors],
    dense_anchor_gradients: torch.Tensor,
    coefficients: torch.Tensor,
) -> tuple[torch.Tensor, GramGroup] | None:
    """The held basis ``(p_g, k_g)`` of one group and its ``GramGroup``, from the anchors'
    factors of the group's factored weights, the anchors' ``(m, p_dense_g)`` gradients of
    its other parameters (in layout order) and the power method's coefficients ``C``
    (``(m, k_g)``). None when ``C^T G G^T C`` is not positive definite in float64 (the
    anchors span fewer than ``k_g`` directions): that group keeps the power method's basis.
    """
    group = layout.groups[group_index]
    dense64 = dense_anchor_gradients.double()
    gram = factor_gram(factors) + dense64 @ dense64.T
    c = coefficients.double()
    chol, info = torch.linalg.cholesky_ex(c.T @ gram @ c)
    if int(info) != 0:
        return None
    c = torch.linalg.solve_triangular(chol, c.T, upper=False).T  # C L^-T
    basis = torch.empty(group.size, c.shape[1], dtype=torch.float32, device=c.device)
    dense_rows = []
    dense_col = 0
    for name in group.param_names:
        start, stop = layout.index[name]
        rows = slice(start - group.start, stop - group.start)
        if name in factors:
            f = factors[name]
            a, d = f.inputs.double(), f.backprops.double()
            d_in = a.shape[2]
            for o in range(0, d.shape[2], _CHANNELS_PER_BLOCK):
                ob = slice(o, min(o + _CHANNELS_PER_BLOCK, d.shape[2]))
                g = (d[:, :, ob].mT @ a).reshape(a.shape[0], -1)  # (m, block d_in)
                basis[rows.start + o * d_in : rows.start + ob.stop * d_in] = (c.T @ g).T.float()
        else:
            width = stop - start
            block = dense64[:, dense_col : dense_col + width]
            basis[rows] = (block.T @ c).float()
            dense_rows.append(torch.arange(rows.start, rows.stop, device=c.device))
            dense_col += width
    nu = {name: f.nu for name, f in factors.items()}
    positions = max(f.positions for f in factors.values())
    u = unit_roundoff(torch.float32)
    fac_rows = torch.cat(
        [
            torch.arange(layout.index[n][0], layout.index[n][1], device=c.device) - group.start
            for n in group.param_names
            if n in factors
        ]
    )
    held_norm = float(torch.linalg.vector_norm(basis[fac_rows], dtype=torch.float64))
    nu_norm = float(torch.linalg.vector_norm(torch.stack(list(nu.values()), 1)))
    c_norm = float(torch.linalg.vector_norm(c))
    m = c.shape[0]
    # |fl32(B64) - B64| <= u |B64|; B64 = fl64(G64^T C') within gamma(m) |G64|^T |C'|;
    # G64 = fl64(D^T A) within gamma(S) sum_s |d_s| |a_s|^T: norms by Cauchy-Schwarz
    basis_error = (
        u * (1 + 2 * u) * held_norm
        + (gamma(m + 2, U64) + gamma(positions + 2, U64)) * (1 + 1e-6) * nu_norm * c_norm
    )
    rows = (
        torch.cat(dense_rows) if dense_rows else torch.zeros(0, dtype=torch.long, device=c.device)
    )
    # ||B^T B - I|| from the (k, k) C'^T K C' (no pass over the p_g rows): K as computed is
    # within E_K of G G^T entrywise, the product within gamma(2m) |C'|^T |K| |C'|, and the
    # held basis within beta of G^T C' (its dense rows' G are the float32 anchor gradients)
    dense_norms = torch.linalg.vector_norm(dense64, dim=1) * (1 + gamma(dense64.shape[1] + 2, U64))
    e_k = gamma(dense64.shape[1] + 2, U64) * torch.outer(dense_norms, dense_norms)
    for name, f in factors.items():
        e_k = e_k + f.relative_error(f.positions) * torch.outer(nu[name], nu[name])
    product = c.T @ gram @ c
    eye = torch.eye(product.shape[0], dtype=torch.float64, device=c.device)
    slack = c.abs().T @ (e_k + gamma(2 * m + 4, U64) * gram.abs()) @ c.abs()
    omega = float(torch.linalg.matrix_norm(product - eye) + torch.linalg.matrix_norm(slack))
    all_norm = math.sqrt(nu_norm**2 + float(dense_norms.square().sum()))
    beta = (
        u * (1 + 2 * u) * float(torch.linalg.vector_norm(basis, dtype=torch.float64))
        + (gamma(m + 2, U64) + gamma(positions + 2, U64)) * (1 + 1e-6) * all_norm * c_norm
    )
    orthonormality = (omega + 2 * beta * math.sqrt(1 + omega) + beta**2) * (1 + 1e-6)
    return basis, GramGroup(dict(factors), nu, c, basis_error * (1 + 1e-6), rows, orthonormality)


def gram_pays(factors_shape: tuple[int, int, int], num_anchors: int, k_g: int) -> bool:
    """Whether the Gram embedding of a layer (per example: ``m T^2 (d_in + d_out)`` float64
    multiply-adds, counted twice for float64) costs less than materialising its gradient and
    embedding it (``d_in d_out (k_g + T)`` float32)."""
    t, d_in, d_out = factors_shape
    gram = 2 * num_anchors * t * t * (d_in + d_out)
    direct = d_in * d_out * (k_g + t)
    return gram < direct and math.isfinite(gram)
