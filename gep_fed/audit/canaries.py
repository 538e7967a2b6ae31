"""The audit's canaries: gradients of known direction, each secretly included or not, added to
a trainer's samples and scored against its noisy releases. ``GradientCanaries`` is a release
observer (``gep_fed.mechanisms.observer``) that adds rows: it belongs in an audit's trainers
(``gep_fed.audit.harness``), never in a real run. See ``gep_fed.audit``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from gep_fed.audit.bounds import Guesses, best_guesses, fitted_mu_lower_bound
from gep_fed.mechanisms.mechanism import Mechanism
from gep_fed.mechanisms.observer import NoisyRelease, ReleaseObserver
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.mechanisms.subspace import AnchorSubspace

# Canaries that cover what each mechanism releases.
CANARY_KINDS = {
    "gep": ("embedding", "residual", "both"),  # S1 and its noise, S2 and its, both at once
    "bgep": ("embedding",),
    "gp": ("gradient",),
}
CANARY_NORM_FACTOR = 2.0


class GradientCanaries(ReleaseObserver):
    """``m`` canary gradients for ``mechanism``, their secret inclusion, and their scores.

    A release observer that adds rows: attached to a trainer, the included canaries join
    each of its samples (``extra_rows``) and every noisy release adds to the scores
    (``on_release``).

    Args:
        count: m, the number of canaries (half of them, in expectation, are included).
        size: p, the number of parameters (a canary is a ``(p,)`` gradient).
        mechanism: the mechanism whose clip norms the canaries exceed (x2), and whose noise
            the scores are divided by.
        kinds: canary kinds (``CANARY_KINDS``), assigned in turn; default: all the
            mechanism releases.
        generator: seeds the canaries, their inclusion and their sampling (an audit is an
            experiment: fixed seeds make it repeatable).
    """

    adds_rows = True

    def __init__(
        self,
        count: int,
        size: int,
        mechanism: Mechanism,
        kinds: Sequence[str] | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        kinds = tuple(kinds or CANARY_KINDS[mechanism.name])
        unknown = set(kinds) - set(CANARY_KINDS[mechanism.name])
        if unknown or count < 2:
            raise ValueError(
                f"{mechanism.name} audits need >= 2 canaries of kinds "
                f"{CANARY_KINDS[mechanism.name]}, got {count} of {kinds}"
            )
        self.mechanism = mechanism
        self.generator = generator or torch.Generator().manual_seed(0)
        self.kind = np.array([kinds[i % len(kinds)] for i in range(count)])
        self.included = (torch.rand(count, generator=self.generator) < 0.5).numpy()
        self.directions = _spread(count, size, self.generator)
        self.scores = np.zeros(count)
        self.steps = 0
        self.subsampled = False  # any release at q < 1: the scores are no longer Gaussian
        self._sampler = PoissonSampler(int(self.included.sum()), 1.0, 1, self.generator)
        self._members = torch.from_numpy(np.flatnonzero(self.included))
        self._coords: torch.Tensor | None = None  # unit embedding coordinates (m, k), fixed
        self._embedding: torch.Tensor | None = None  # this step's, zero for residual canaries
        self._residual: torch.Tensor | None = None  # this step's unit residuals (m, p)

    @property
    def count(self) -> int:
        return len(self.kind)

    def _prepare(self, subspace: AnchorSubspace | None) -> None:
        """Each canary's unit embedding and residual directions for this step's subspace."""
        if subspace is None:
            self._embedding, self._residual = None, self.directions
            return
        if self._coords is None or self._coords.shape[1] != subspace.num_basis:
            self._coords = _spread(self.count, subspace.num_basis, self.generator)
        coords = self._coords.to(subspace.device)
        directions = self.directions.to(subspace.device)
        residual = _unit(directions - subspace.lift(subspace.embed(directions)))
        uses_embedding = torch.from_numpy(np.isin(self.kind, ("embedding", "both")))
        uses_residual = torch.from_numpy(np.isin(self.kind, ("residual", "both")))
        self._embedding = coords * uses_embedding[:, None].to(coords)
        self._residual = residual * uses_residual[:, None].to(residual)

    def extra_rows(self, subspace: AnchorSubspace | None, sample_rate: float) -> torch.Tensor:
        """The gradients of the included canaries that this step's Poisson sample (rate q,
        as for every example) takes, at twice their clip norms."""
        self._prepare(subspace)
        self._sampler.sample_rate = sample_rate
        members = self._members[self._sampler.sample()]
        norms = _clip_norms(self.mechanism)
        rows = self._residual[members] * (CANARY_NORM_FACTOR * norms[1])
        if self._embedding is not None:
            rows = rows + subspace.lift(self._embedding[members]) * (CANARY_NORM_FACTOR * norms[0])
        return rows

    def on_release(self, release: NoisyRelease) -> None:
        """Add one noisy release to every canary's score (white box).

        The step's statistic ``z`` is the release's inner product with the canary, each
        component divided by its noise std: ``N(c / sigma, c)`` if the canary was sampled
        (``c`` components at their clip norms), else ``N(0, c)`` (interference aside). The
        score adds the log likelihood ratio of "included" (sampled with probability q) to
        "excluded": ``log(1 - q + q exp(z / sigma - c / (2 sigma^2)))``, the most powerful
        test of inclusion under Poisson sampling.
        """
        sums, noise_multiplier = release.sums, release.noise_multiplier
        clip_e, clip_r = _clip_norms(self.mechanism)  # the noise std is sigma x the clip norm
        std_e, std_r = noise_multiplier * clip_e, noise_multiplier * clip_r
        z = torch.zeros(self.count, dtype=torch.float64)
        if sums.embedding is not None and self._embedding is not None:
            z += (self._embedding.double() @ sums.embedding.double().cpu()) / std_e
        if sums.residual is not None:
            z += (self._residual.double() @ sums.residual.double().cpu()) / std_r
        components = torch.from_numpy(np.where(self.kind == "both", 2.0, 1.0))
        log_ratio = z / noise_multiplier - components / (2 * noise_multiplier**2)
        q = release.sample_rate
        if q < 1:
            step = torch.logaddexp(torch.full_like(z, math.log1p(-q)), math.log(q) + log_ratio)
        else:
            step = log_ratio
        self.scores += step.numpy()
        self.steps += 1
        self.subsampled |= q < 1

    def guesses(self, delta: float, confidence: float = 0.95) -> Guesses:
        """The guesses' bounds, and the Gaussian fit (q = 1 only) of each canary kind, the
        largest kept after a Bonferroni correction over the kinds."""
        found = best_guesses(self.scores, self.included, delta, confidence)
        if self.subsampled or not self.steps:
            return found
        kinds = np.unique(self.kind)
        level = 1.0 - (1.0 - confidence) / len(kinds)
        fitted = max(
            fitted_mu_lower_bound(self.scores[self.kind == k], self.included[self.kind == k], level)
            for k in kinds
        )
        return replace(found, fitted_mu_lower_bound=fitted)


def _spread(count: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` unit directions in ``size`` dimensions: orthonormal when they fit (then one
    canary's release does not leak into another's score), else random."""
    rows = torch.randn(count, size, generator=generator)
    if count <= size:
        return torch.linalg.qr(rows.T).Q.T.contiguous()
    return _unit(rows)


def _unit(rows: torch.Tensor) -> torch.Tensor:
    return rows / torch.linalg.vector_norm(rows, dim=1, keepdim=True).clamp_min(1e-30)


def _clip_norms(mechanism: Mechanism) -> tuple[float, float]:
    """(embedding, residual-or-gradient) clip norms."""
    if mechanism.name == "gp":
        return 0.0, mechanism.clip_norm
    if mechanism.name == "bgep":
        return mechanism.clip_embedding, 0.0
    return mechanism.clip_embedding, mechanism.clip_residual
