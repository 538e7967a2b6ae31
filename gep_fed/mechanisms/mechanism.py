"""GEP, B-GEP and GP (DP-SGD) behind one interface of three separate calls.

``clipped_sums`` (on the site holding the data), ``add_noise`` (on the site in client-side
mode, on the trusted server in central mode) and ``reconstruct`` (post-processing) are
separate so that the federated modes can run them on different machines.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from gep_fed.accounting.events import PrivacyEvent, calibrate
from gep_fed.mechanisms.clip_bounds import (
    CLIP_BOUND,
    ROW_NORM_BLOCK,
    U64,
    block_row_norms,
    check_dtype,
    clip_factors,
    combine_block_norms,
    gamma,
    ieee_matmul,
    row_norms,
    scaled_release_norm,
    small_row_norms,
    small_row_norms_error,
    unit_roundoff,
)
from gep_fed.mechanisms.factored import PerExampleGradients
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.subspace import AnchorSubspace
from gep_fed.validation import NOISE_MULTIPLIER


@dataclass(frozen=True)
class ClippedSums:
    """One party's contribution to one step: sums of clipped per-example vectors.

    Before ``add_noise`` these are *not* private (``noised`` is False) and must not leave a
    trusted boundary. The true number of examples is deliberately absent: it is private.

    Attributes:
        embedding: ``(k,)`` sum of clipped embeddings (GEP, B-GEP), else None.
        residual: ``(p,)`` sum of clipped residuals (GEP) or clipped gradients (GP), else None.
        noised: whether calibrated Gaussian noise has been added.
        within_clip: the number of examples whose residual was within S2 (a 0-d tensor), only
            from a GEP that counts them for an adaptive S2 (``GEP.count_within_clip``); a
            release of sensitivity 1, noised by ``add_noise`` with its own ``count_noise``.
    """

    embedding: torch.Tensor | None
    residual: torch.Tensor | None
    noised: bool = False
    within_clip: torch.Tensor | None = None

    def __add__(self, other: ClippedSums) -> ClippedSums:
        if self.noised != other.noised:
            raise ValueError("cannot add noised and unnoised sums")
        return ClippedSums(
            _add(self.embedding, other.embedding),
            _add(self.residual, other.residual),
            self.noised,
            _add(self.within_clip, other.within_clip),
        )


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if (a is None) != (b is None):
        raise ValueError("cannot add sums of different mechanisms")
    return None if a is None else a + b


@dataclass(frozen=True)
class PerExampleClipping:
    """What ``clipped_sums`` did to each example (for tests and diagnostics; never released).

    ``embedding`` is the ``(n, k)`` embedding actually used; ``embedding_scale`` and
    ``residual_scale`` the clip factors applied to the embedding and to the residual
    ``g_i - lift(embedding_i)`` (or to ``g_i`` itself for GP). ``dropped`` marks the rows
    with NaN or inf: their clip factors are 0 and they contribute nothing (None: no such row).
    """

    embedding: torch.Tensor | None
    embedding_scale: torch.Tensor | None
    residual_scale: torch.Tensor | None
    dropped: torch.Tensor | None = None


class Mechanism(ABC):
    """A private gradient estimator: clip per example, sum, add noise, reconstruct.

    An instance knows its clip norms and its noise multiplier sigma (build it from a
    ``PrivacyContract``: ``contract.build_mechanism()``), so ``add_noise`` takes neither
    from outside. ``releases`` (how many clipped vectors one step releases) decides the
    accounting; every ``PrivacyEvent`` of a mechanism class is built by ``event`` from it.
    """

    name: ClassVar[str]
    uses_subspace: ClassVar[bool]
    releases: ClassVar[int]
    noise_multiplier: float

    def _check_noise(self) -> None:
        NOISE_MULTIPLIER.check("noise_multiplier", self.noise_multiplier)

    @abstractmethod
    def clip(self, grads: torch.Tensor, subspace: AnchorSubspace | None) -> PerExampleClipping:
        """Clip factors for each row of ``grads`` (no sums)."""

    @abstractmethod
    def sums(
        self, grads: torch.Tensor, subspace: AnchorSubspace | None, clipping: PerExampleClipping
    ) -> ClippedSums:
        """Sum the clipped contributions described by ``clipping``."""

    @abstractmethod
    def noise_stds(self) -> tuple[float | None, float | None]:
        """Standard deviations of the noise on (embedding, residual): sigma times each clip."""

    @classmethod
    def accounting_noise_multiplier(
        cls, noise_multiplier: float, count_noise: float | None = None
    ) -> float:
        """The noise multiplier of the equivalent single Gaussian mechanism of sensitivity 1.

        Releasing ``r`` vectors each clipped to ``S_j`` with noise ``sigma * S_j`` is one Gaussian
        mechanism on the concatenation of ``x_j / S_j``, of L2 sensitivity ``sqrt(r)``. With
        ``count_noise`` (the std of the noise on a count of sensitivity 1, e.g. the examples
        within S2 for an adaptive clip) the concatenation also holds ``count / count_noise *
        sigma``, and the equivalent multiplier is ``(r / sigma^2 + 1 / count_noise^2)^-1/2``.
        """
        if count_noise is None:
            return noise_multiplier / math.sqrt(cls.releases)
        if noise_multiplier == 0 or count_noise == 0:
            return 0.0
        return (cls.releases / noise_multiplier**2 + 1 / count_noise**2) ** -0.5

    @classmethod
    def event(
        cls,
        noise_multiplier: float,
        sample_rate: float,
        steps: int = 1,
        *,
        count_noise: float | None = None,
        party: str = "",
        round: int | None = None,
        placement: str = "local",
    ) -> PrivacyEvent:
        """``steps`` releases of this mechanism class at noise multiplier sigma on Poisson
        samples of rate q, as the accountant composes them (with ``count_noise``: each step
        also releases a noised count of examples within the residual clip). A run's events
        come from its contract (``PrivacyContract.events``); calibration asks this for any
        candidate sigma."""
        return PrivacyEvent.gaussian(
            cls.name,
            noise_multiplier,
            sample_rate,
            steps,
            cls.accounting_noise_multiplier(noise_multiplier, count_noise),
            party=party,
            round=round,
            placement=placement,
        )

    def clipped_sums(
        self, grads: torch.Tensor | PerExampleGradients, subspace: AnchorSubspace | None
    ) -> ClippedSums:
        """Clip each row of ``grads`` (a ``(n, p)`` matrix, ``n`` may be 0, or a chunk with
        some weights kept as factors, for the subspace's Gram groups) and sum."""
        if isinstance(grads, PerExampleGradients):
            if self.uses_subspace and subspace is None:
                raise ValueError(f"{self.name} needs an anchor subspace")
            check_dtype(grads.dtype)
            with ieee_matmul():
                clipping = self.clip(grads, subspace)
                if clipping.dropped is not None:
                    grads = grads.without(clipping.dropped)
                return self.sums(grads, subspace, clipping)
        if grads.ndim != 2:
            raise ValueError(
                f"expected a (n, p) matrix of per-example gradients, got {grads.shape}"
            )
        if self.uses_subspace and subspace is None:
            raise ValueError(f"{self.name} needs an anchor subspace")
        if subspace is not None and grads.shape[1] != subspace.layout.size:
            raise ValueError(
                f"gradients have {grads.shape[1]} columns, layout has {subspace.layout.size}"
            )
        check_dtype(grads.dtype)
        with ieee_matmul():  # the clip bounds assume full float32 products
            clipping = self.clip(grads, subspace)
            if clipping.dropped is not None:  # 0 * NaN is NaN: zero the rows, not the factors
                grads = grads.masked_fill(clipping.dropped[:, None], 0.0)
            return self.sums(grads, subspace, clipping)

    def add_noise(
        self, sums: ClippedSums, noise: NoiseSource, count_noise: float | None = None
    ) -> ClippedSums:
        """Add ``N(0, (sigma * S)^2)`` per coordinate to each released sum, and
        ``N(0, count_noise^2)`` to the count of examples within the clip when there is one."""
        if sums.noised:
            raise ValueError("these sums are already noised")
        std_e, std_r = self.noise_stds()
        emb, res, count = sums.embedding, sums.residual, sums.within_clip
        if emb is not None:
            emb = emb + noise.gaussian(emb, std_e)
        if res is not None:
            res = res + noise.gaussian(res, std_r)
        if count is not None:
            if count_noise is None or not (count_noise > 0 and math.isfinite(count_noise)):
                raise ValueError(
                    "the count of examples within the clip is private: give its noise std "
                    f"(count_noise > 0), got {count_noise!r}"
                )
            count = count + noise.gaussian(count, count_noise)
        return ClippedSums(emb, res, noised=True, within_clip=count)

    def reconstruct(
        self, sums: ClippedSums, subspace: AnchorSubspace | None, expected_batch_size: float
    ) -> torch.Tensor:
        """The gradient estimate ``(lift(embedding) + residual) / (q n)`` as a ``(p,)`` vector.

        Divides by the *expected* batch size ``q n``: the actual count is private.
        """
        if expected_batch_size <= 0:
            raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size}")
        total = None
        if sums.embedding is not None:
            total = subspace.lift(sums.embedding.to(subspace.bases[0].dtype))
        if sums.residual is not None:
            total = sums.residual.to(torch.float32) if total is None else total + sums.residual
        return total / expected_batch_size


def _nonfinite_rows(norms: torch.Tensor) -> torch.Tensor | None:
    """Rows with NaN or inf (any such entry makes the row's float64 norm non-finite, and its
    embedding's too, since inf * 0 is NaN), or None when every row is finite.

    Such an example gets clip factor 0: it contributes nothing, and it is counted nowhere, so
    neither its presence nor the number of such examples is released (an error message
    saying "3 examples overflowed" would be a data-dependent release)."""
    bad = ~torch.isfinite(norms)
    return bad if bool(bad.any()) else None


@dataclass(frozen=True)
class GEP(Mechanism):
    """Gradient Embedding Perturbation: embedding and residual clipped and noised separately.

    Args:
        clip_embedding: S1, the bound on each example's embedding norm; the embedding noise
            has standard deviation ``sigma * S1``.
        clip_residual: S2, the bound on each example's residual norm; the residual noise has
            standard deviation ``sigma * S2``. Accounted as one Gaussian mechanism with noise
            multiplier ``sigma / sqrt(2)``.
        noise_multiplier: sigma (keyword; 0 adds no noise and gives no privacy).
        count_within_clip: also sum how many examples had their residual within S2 (for an
            adaptive S2: ``GEPConfig.residual_quantile``); that count is a third release,
            noised and accounted with its own ``count_noise``.
    """

    clip_embedding: float
    clip_residual: float
    noise_multiplier: float = field(kw_only=True)
    count_within_clip: bool = False
    name: ClassVar[str] = "gep"
    uses_subspace: ClassVar[bool] = True
    releases: ClassVar[int] = 2

    def __post_init__(self) -> None:
        CLIP_BOUND.check("clip_embedding (S1)", self.clip_embedding)
        CLIP_BOUND.check("clip_residual (S2)", self.clip_residual)
        self._check_noise()

    def noise_stds(self):
        sigma = self.noise_multiplier
        return sigma * self.clip_embedding, sigma * self.clip_residual

    def clip(self, grads, subspace):
        dtype, u = grads.dtype, unit_roundoff(grads.dtype)
        p, k = subspace.layout.size, subspace.num_basis
        emb, emb_error, grad_norm = subspace.embed_bounded(grads)
        emb_computed = small_row_norms(emb)
        emb_norm = emb_computed * (1 + small_row_norms_error(k))
        dropped = _nonfinite_rows(grad_norm + emb_norm + emb_error)
        if dropped is not None:
            emb = emb.masked_fill(dropped[:, None], 0.0)
        # Fused residual norm, no (n, p) residual matrix: for the embedding W = B^T g + e as
        # computed, ||g - B W||^2 = ||g||^2 - ||W||^2 + 2 e.W + W^T (B^T B - I) W, each term
        # bounded above (row_norms are upper bounds; ||W||^2 is taken from below).
        emb_low = emb_computed * (1 - small_row_norms_error(k))
        resid2 = (grad_norm**2 - emb_low**2).clamp_min(0)
        resid2 += 2 * emb_error * emb_norm + subspace.orthonormality_error * emb_norm**2
        resid_norm = (resid2 * (1 + 8 * U64)).sqrt() * (1 + 2 * U64)
        # The released residual s (g - B W) is computed as fl(s g) - fl(B fl(s W)): each
        # product rounds by u, the lift by gamma(k_g, u) |B| |s W|, the difference by u.
        lift_error = (u + gamma(max(subspace.dims), u) * (1 + u)) * max(subspace.frobenius_norms)
        release = (1 + u) * (resid_norm + u * grad_norm + lift_error * emb_norm)
        if isinstance(grads, PerExampleGradients):
            # a factored weight's s g is sum_t fl(s d_t) a_t^T, summed with the other
            # examples' (as G^T s is): the products s d_t round by u relative to |d_t||a_t|
            for f in grads.factors.values():
                release = release + u * (1 + u) * f.nu
        return PerExampleClipping(
            embedding=emb,
            embedding_scale=clip_factors(
                scaled_release_norm(emb_norm, dtype), self.clip_embedding, dropped, dtype, k
            ),
            residual_scale=clip_factors(release, self.clip_residual, dropped, dtype, p),
            dropped=dropped,
        )

    def sums(self, grads, subspace, clipping):
        s1, s2, emb = clipping.embedding_scale, clipping.residual_scale, clipping.embedding
        # sum_i s2_i (g_i - B w_i) = G^T s2 - B (W^T s2)
        weighted = (
            grads.weighted_sum(s2) if isinstance(grads, PerExampleGradients) else grads.T @ s2
        )
        residual = weighted - subspace.lift(emb.T @ s2)
        within = None
        if self.count_within_clip:  # scale 1: not shrunk; dropped rows (scale 0) not counted
            within = (s2 >= 1).sum().to(torch.float32)
        return ClippedSums(embedding=emb.T @ s1, residual=residual, within_clip=within)


@dataclass(frozen=True)
class BGEP(Mechanism):
    """B-GEP: releases only the clipped, noised embedding (k numbers); biased, cheap to send.

    Args:
        clip_embedding: S1, the bound on each embedding's norm; noise ``sigma * S1``,
            accounted with noise multiplier ``sigma``. The residual is never computed.
        noise_multiplier: sigma (keyword; 0 adds no noise and gives no privacy).
    """

    clip_embedding: float
    noise_multiplier: float = field(kw_only=True)
    name: ClassVar[str] = "bgep"
    uses_subspace: ClassVar[bool] = True
    releases: ClassVar[int] = 1

    def __post_init__(self) -> None:
        CLIP_BOUND.check("clip_embedding (S1)", self.clip_embedding)
        self._check_noise()

    def noise_stds(self):
        return self.noise_multiplier * self.clip_embedding, None

    def clip(self, grads, subspace):
        if isinstance(grads, PerExampleGradients):
            emb = subspace.embed_bounded(grads)[0]
        else:
            emb = subspace.embed(grads)
        norms = small_row_norms(emb) * (1 + small_row_norms_error(emb.shape[1]))
        dropped = _nonfinite_rows(norms)
        if dropped is not None:
            emb = emb.masked_fill(dropped[:, None], 0.0)
        release = scaled_release_norm(norms, grads.dtype)
        scale = clip_factors(release, self.clip_embedding, dropped, grads.dtype, emb.shape[1])
        return PerExampleClipping(emb, scale, None, dropped)

    def sums(self, grads, subspace, clipping):
        return ClippedSums(embedding=clipping.embedding.T @ clipping.embedding_scale, residual=None)


@dataclass(frozen=True)
class GP(Mechanism):
    """Gradient perturbation (DP-SGD, Abadi et al. 2016): clip each gradient, add noise.

    Args:
        clip_norm: S, the bound on each example's gradient norm; noise ``sigma * S``,
            accounted with noise multiplier ``sigma``.
        noise_multiplier: sigma (keyword; 0 adds no noise and gives no privacy).
    """

    clip_norm: float
    noise_multiplier: float = field(kw_only=True)
    name: ClassVar[str] = "gp"
    uses_subspace: ClassVar[bool] = False
    releases: ClassVar[int] = 1

    def __post_init__(self) -> None:
        CLIP_BOUND.check("clip_norm (S)", self.clip_norm)
        self._check_noise()

    def noise_stds(self):
        return None, self.noise_multiplier * self.clip_norm

    def clip(self, grads, subspace):
        if isinstance(grads, PerExampleGradients):  # ghost norms for the factored weights
            u = unit_roundoff(grads.dtype)
            blocks = [block_row_norms(grads.dense, ROW_NORM_BLOCK)]
            extra = 0.0
            for f in grads.factors.values():
                blocks.append(f.norm_bounds[:, None])
                extra = extra + u * (1 + u) * f.nu  # fl(s d_t) a_t^T, as in GEP's release
            norms = combine_block_norms(torch.cat(blocks, 1))
            release = scaled_release_norm(norms, grads.dtype) + extra
            length = grads.layout.size
        else:
            norms = row_norms(grads)
            release = scaled_release_norm(norms, grads.dtype)
            length = grads.shape[1]
        dropped = _nonfinite_rows(release)
        scale = clip_factors(release, self.clip_norm, dropped, grads.dtype, length)
        return PerExampleClipping(None, None, scale, dropped)

    def sums(self, grads, subspace, clipping):
        scale = clipping.residual_scale
        if isinstance(grads, PerExampleGradients):
            return ClippedSums(embedding=None, residual=grads.weighted_sum(scale))
        return ClippedSums(embedding=None, residual=grads.T @ scale)


MECHANISM_CLASSES: dict[str, type[Mechanism]] = {m.name: m for m in (GEP, BGEP, GP)}


def mechanism_class(name: str) -> type[Mechanism]:
    """The mechanism called ``name`` ("gep", "bgep" or "gp")."""
    if name not in MECHANISM_CLASSES:
        raise ValueError(f"mechanism must be one of {sorted(MECHANISM_CLASSES)}, got {name!r}")
    return MECHANISM_CLASSES[name]


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    mechanism: str | type[Mechanism] = "gep",
    tol: float = 1e-4,
    count_noise: float | None = None,
) -> float:
    """The smallest sigma (up to ``tol``) whose RDP epsilon after ``steps`` releases of
    ``mechanism`` on Poisson samples of rate ``sample_rate`` is <= ``target_epsilon``.

    ``sigma`` is the mechanism's own noise multiplier (for GEP, before the sqrt(2) of its two
    releases). ``count_noise``: each step also releases a count of sensitivity 1 with this
    noise std (adaptive S2), so sigma grows to keep the total within the target. Raises
    ``ImpossibleTargetError`` when no sigma up to 1e4 reaches the target.
    """
    cls = mechanism_class(mechanism) if isinstance(mechanism, str) else mechanism

    def event_for(sigma: float) -> PrivacyEvent:
        return cls.event(sigma, sample_rate, steps, count_noise=count_noise)

    # Keyed by the release at sigma = 1, which fixes every sigma's (q, steps, how many
    # vectors a step releases, the count's noise).
    key = (target_epsilon, delta, tol, cls, event_for(1.0))
    if key not in _CALIBRATED:
        if len(_CALIBRATED) >= 256:
            _CALIBRATED.pop(next(iter(_CALIBRATED)))
        _CALIBRATED[key] = calibrate(target_epsilon, delta, event_for, tol)
    return _CALIBRATED[key]


# A pure function, asked again by every resolution of the same run's settings (a tuning
# resolves each trial's several times): about a second each at hundreds of steps.
_CALIBRATED: dict[tuple, float] = {}
