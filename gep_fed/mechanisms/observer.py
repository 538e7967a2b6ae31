"""Release observers: hooks at the two points of a private step that an experiment may watch.

A trainer (``GEPStep``, ``LangevinTrainer``, ``Site``, ``FederationServer``) takes its
observers once, as the keyword argument ``observers``, and calls each of them at two points
of every release it makes:

1. ``extra_rows(subspace, sample_rate)``, before the clipped sums are formed: per-example
   gradients to *add* to this step's sample. They are clipped and summed like the data's own
   gradients, and then noised with them.
2. ``on_release(release)``, after the noise: the noisy release as it leaves the mechanism,
   with what it takes to read it (``NoisyRelease``: noise multiplier, sample rate,
   mechanism). This point is post-processing of a private release and costs no privacy.

The first point changes what is released: the sums are no longer those of the data alone,
and rows that depend on the private data would void the guarantee the ledger records. So it
is visible in the type: a ``ReleaseObserver`` subclass that overrides ``extra_rows`` must
declare ``adds_rows = True`` (or the class cannot be defined), and every trainer's
``observers.adds_rows`` says whether one is attached. **An observer that adds rows is for
experiments on the mechanism (e.g. measuring what a run leaks) and must never be attached in
a real run.** Nothing in configuration, the run config, the wire or the Flower apps can
attach an observer: only code that builds a trainer itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from gep_fed.mechanisms.mechanism import ClippedSums, Mechanism
from gep_fed.mechanisms.subspace import AnchorSubspace


@dataclass(frozen=True)
class NoisyRelease:
    """One release after its noise, as an observer sees it.

    Attributes:
        sums: the noisy sums (the release itself).
        noise_multiplier: sigma; ``mechanism.noise_stds()`` is the noise std
            of each component.
        sample_rate: q, the Poisson rate at which each example (and each added row) joined
            the sample.
        mechanism: the mechanism that clipped and noised the sums (its clip norms).
    """

    sums: ClippedSums
    noise_multiplier: float
    sample_rate: float
    mechanism: Mechanism


class ReleaseObserver:
    """Base class of the observers of a trainer's releases: both hooks do nothing.

    Override ``on_release`` to watch the noisy releases (post-processing: harmless). Override
    ``extra_rows`` only together with ``adds_rows = True``: such an observer changes the
    private sums, and must never be attached in a real run.
    """

    adds_rows: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.extra_rows is not ReleaseObserver.extra_rows and not cls.adds_rows:
            raise TypeError(
                f"{cls.__name__} overrides extra_rows: declare adds_rows = True (it changes "
                "the private sums, so it must never be attached in a real run)"
            )

    def extra_rows(
        self, subspace: AnchorSubspace | None, sample_rate: float
    ) -> torch.Tensor | None:
        """``(r, p)`` per-example gradients to add to this step's sample (its subspace, and
        the rate at which the data's examples were sampled), or None for none."""
        return None

    def on_release(self, release: NoisyRelease) -> None:
        """Called with every noisy release, once its noise is added."""


class Observers:
    """The observers attached to one trainer, called in the order given."""

    def __init__(self, observers: Iterable[ReleaseObserver] = ()) -> None:
        self._all = tuple(observers)
        for observer in self._all:
            if not isinstance(observer, ReleaseObserver):
                raise TypeError(f"not a ReleaseObserver: {type(observer).__name__}")

    def __iter__(self) -> Iterator[ReleaseObserver]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    @property
    def adds_rows(self) -> bool:
        """Whether an attached observer may add rows to the private sums (an experiment)."""
        return any(o.adds_rows for o in self._all)

    def rows(self, subspace: AnchorSubspace | None, sample_rate: float) -> torch.Tensor | None:
        """Every observer's extra rows, stacked (None when none adds any)."""
        rows = [r for o in self._all if (r := o.extra_rows(subspace, sample_rate)) is not None]
        if len(rows) <= 1:
            return rows[0] if rows else None
        return torch.cat([r.to(rows[0]) for r in rows])

    def notify(self, release: NoisyRelease) -> None:
        for observer in self._all:
            observer.on_release(release)


__all__ = ["NoisyRelease", "Observers", "ReleaseObserver"]
