"""GEP's subspace refreshed from the previous one (issue 54: a cheap refresh), for the
benchmarks: a ``GEPStep`` whose refresh starts the power method from the last basis
(``compute_anchor_subspace(..., previous=...)``), optionally carrying the previous refreshes'
anchor covariance (``memory``) so that a refresh can use fewer anchors.

The library's ``GEPStep`` does not expose this yet (its configuration, ``GEPConfig``, has no
field for it); ``warm_steps(memory)`` swaps this step into ``gep_fed.training`` for the
duration of one run. Public data only: no privacy cost. A run resumed from a checkpoint
restarts the warm chain cold (the previous basis is not in the step's saved state). A chain
with memory starts with one refresh on all the held anchors (its basis size is set there),
then uses the configured number per refresh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import gep_fed.training
from gep_fed.mechanisms.anchors import AnchorResult, compute_anchor_subspace
from gep_fed.mechanisms.step import GEPStep


class WarmGEPStep(GEPStep):
    """``GEPStep`` whose refresh starts from the previous refresh's basis."""

    memory: float = 0.0

    def refresh_subspace(self, measure: bool = False) -> AnchorResult:
        if self.public_inputs is None:
            raise ValueError("no public data: pass public_inputs or call set_subspace")
        previous = getattr(self, "_warm", None)
        config = self.config
        if previous is None and self.memory:
            # a memory chain starts on all the held anchors: its basis size is set there
            config = replace(config, num_anchors=None)
        result = compute_anchor_subspace(
            self.model,
            self.public_inputs,
            self.layout,
            config,
            loss_fn=self.loss_fn,
            public_labels=self.public_labels,
            generator=self.generator,
            measure=measure,
            previous=previous,
            memory=self.memory,
        )
        self._warm = result.warm
        self.subspace = self._anchor_subspace = result.subspace
        if self.config.clip_quantile is not None:
            self.mechanism = self.config.contract.build_mechanism(
                result.clip_embedding, result.clip_residual
            )
        self._steps_since_refresh = 0
        return result


def warm_step_class(memory: float) -> type[WarmGEPStep]:
    return type("WarmGEPStep", (WarmGEPStep,), {"memory": float(memory)})


@contextlib.contextmanager
def warm_steps(memory: float | None) -> Iterator[None]:
    """Within the block, ``train_private`` refreshes warm (``memory``: see the module);
    None: the library's own step."""
    if memory is None:
        yield
        return
    original = gep_fed.training.GEPStep
    gep_fed.training.GEPStep = warm_step_class(memory)
    try:
        yield
    finally:
        gep_fed.training.GEPStep = original
