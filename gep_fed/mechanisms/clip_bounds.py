"""Clip factors that bound every example's contribution in floating point, not only on paper.

A clip factor ``min(1, S / ||v||)`` computed in float64 and cast to float32 can round *up*,
and below float32's normal range it can round up by far more than one ulp (a subnormal keeps
few significant bits). The released vector is also computed in float32, so its norm can
exceed the factor times the exact norm. Here every quantity a factor is computed from is an
upper bound that holds in IEEE arithmetic (round to nearest), and each factor is rounded
*down* into the gradients' dtype; factors below that dtype's normal range are flushed to 0
(such an example contributes nothing, like one with a non-finite gradient).

Notation of the bounds (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 3):
``u`` the unit roundoff of a dtype, ``gamma(n, u) = n u / (1 - n u)`` the relative error bound
of a length-``n`` dot product or sum, in any summation order, ``eta`` the absolute error of a
product that underflows (half the smallest subnormal).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from gep_fed.validation import Range

# The clip norms a mechanism accepts (S, S1, S2). Inside this range float32 holds every
# clipped contribution and its noise with room to spare, and the absolute error of products
# that underflow (``eta`` per entry) stays below 1e-9 of the bound for any model size.
CLIP_BOUND_RANGE = (1e-30, 1e30)
CLIP_BOUND = Range(*CLIP_BOUND_RANGE)
SUPPORTED_DTYPES = (torch.float32, torch.float64)
U64 = 2.0**-53
# Entries per block of a row norm (GP's clip): gamma(67, u32) = 4e-6, so the bound is within
# that of the exact norm, at the cost of one pass over the matrix as for longer blocks.
ROW_NORM_BLOCK = 64


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def underflow_error(dtype: torch.dtype) -> float:
    """``eta``: the most a product that underflows can be off (half the smallest subnormal)."""
    return torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / 2


def gamma(n: int, u: float) -> float:
    """``n u / (1 - n u)``: the relative error bound of a length-``n`` sum or dot product."""
    if n * u >= 0.5:
        raise ValueError(f"a length-{n} float sum has no useful error bound (n u = {n * u:.3g})")
    return n * u / (1 - n * u)


def gamma_of(n: torch.Tensor, u: float) -> torch.Tensor:
    """``gamma`` for a tensor of lengths (each with ``n u < 0.5``)."""
    return n * u / (1 - n * u)


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"per-example gradients must be float32 or float64 to be clipped with proven "
            f"bounds, got {dtype}"
        )


def block_row_norms(matrix: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``(n, ceil(p / block))`` float64 upper bounds on the exact norm of each row's
    consecutive ``block`` entries.

    Computed in the matrix's own dtype (a float64 reduction over a large matrix costs as
    much as the embedding itself): a sum of ``block`` squares is within ``gamma(block + 1, u)``
    of the exact one in any order, and squares that underflow add at most ``eta`` each."""
    n, p = matrix.shape
    u, eta = unit_roundoff(matrix.dtype), underflow_error(matrix.dtype)
    full = p // block * block
    parts = []
    if full:
        blocks = matrix[:, :full].reshape(n, full // block, block)
        parts.append(torch.linalg.vector_norm(blocks, dim=2))
    if full < p:
        parts.append(torch.linalg.vector_norm(matrix[:, full:], dim=1)[:, None])
    if not parts:
        return matrix.new_zeros(n, 0, dtype=torch.float64)
    computed = torch.cat(parts, 1).double()
    # sqrt of (1 + gamma) relative, one more u for the root, then the underflow term; a
    # shorter last block has its own (smaller) bound
    length = torch.full((computed.shape[1],), float(block), dtype=torch.float64)
    if full < p:
        length[-1] = p - full
    length = length.to(computed.device)
    return computed * (1 + gamma_of(length + 3, u)) + (length * eta).sqrt()


def row_norms(matrix: torch.Tensor, block: int = ROW_NORM_BLOCK) -> torch.Tensor:
    """Float64 upper bounds on the exact L2 norm of each row (from ``block_row_norms``,
    combined in float64)."""
    return combine_block_norms(block_row_norms(matrix, block))


def combine_block_norms(blocks: torch.Tensor) -> torch.Tensor:
    """Upper bounds on row norms from upper bounds on their blocks' norms."""
    return torch.linalg.vector_norm(blocks, dim=1) * (1 + gamma(blocks.shape[1] + 3, U64))


def small_row_norms(matrix: torch.Tensor) -> torch.Tensor:
    """Float64 norms of the rows of a matrix with few columns (an embedding), within
    ``gamma(k + 3, u64)`` of the exact ones: float32 or float64 entries square exactly or
    almost in float64, and never underflow there."""
    return torch.linalg.vector_norm(matrix, dim=1, dtype=torch.float64)


def small_row_norms_error(columns: int) -> float:
    """The relative error bound of ``small_row_norms`` for ``columns`` entries per row."""
    return gamma(columns + 3, U64)


def scaled_release_norm(norms: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An upper bound, per unit of clip factor, on the norm of ``fl(s * v)`` computed in
    ``dtype`` for a vector of exact norm at most ``norms``: each product rounds by ``u``."""
    return norms * (1 + unit_roundoff(dtype))


def effective_bound(bound: float, length: int, dtype: torch.dtype) -> float:
    """``bound`` less what underflowing products can add to a length-``length`` release."""
    return bound - math.sqrt(length) * 2 * underflow_error(dtype)


def clip_factors(
    release_norms: torch.Tensor,
    bound: float,
    dropped: torch.Tensor | None,
    dtype: torch.dtype,
    length: int,
) -> torch.Tensor:
    """Factors ``s`` in ``dtype`` with ``s * release_norms <= bound`` for every row.

    ``release_norms`` (float64) bound the norm of each row's release per unit of factor (see
    ``scaled_release_norm``); ``length`` is the release's number of entries. A factor is
    ``min(1, bound / norm)`` rounded down into ``dtype``; factors that would be subnormal in
    ``dtype`` are 0, as are the factors of ``dropped`` rows and of rows whose bound is not
    finite. Rows within the bound keep factor 1 (their release is the vector itself)."""
    limit = effective_bound(bound, length, dtype)
    quotient = limit / release_norms.clamp_min(torch.finfo(torch.float64).tiny)
    # the division rounds by at most u64: every factor must stay below this ceiling
    ceiling = quotient * (1 - 2 * U64)
    factors = quotient.clamp_max(1.0).to(dtype)
    # rounding to nearest may have gone up; one step down is enough for a normal float
    rounded_up = factors.double() > ceiling
    factors = torch.where(rounded_up, torch.nextafter(factors, torch.zeros_like(factors)), factors)
    factors = torch.where(ceiling >= 1, torch.ones_like(factors), factors)
    bad = (
        ~torch.isfinite(release_norms)
        | (factors < torch.finfo(dtype).smallest_normal)  # flushed: subnormal factors
        | (factors.double() > ceiling)
    )
    if dropped is not None:
        bad |= dropped
    return factors.masked_fill(bad, 0.0)


@contextlib.contextmanager
def ieee_matmul() -> Iterator[None]:
    """Full-precision float32 matrix products (no TF32 or bfloat16 shortcuts on either
    backend) while the bounds above are relied on; the settings are restored afterwards."""
    backends = [torch.backends.cuda.matmul, getattr(torch.backends.mkldnn, "matmul", None)]
    backends = [b for b in backends if hasattr(b, "fp32_precision")]
    if not backends:  # torch before 2.9 has only the legacy switch
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(previous)
        return
    previous = [b.fp32_precision for b in backends]
    for b in backends:
        b.fp32_precision = "ieee"
    try:
        yield
    finally:
        for b, value in zip(backends, previous, strict=True):
            b.fp32_precision = value
