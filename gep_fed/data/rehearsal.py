"""A task rehearsed on its server's own validation data: no site's data, no site's budget.

A private selection that trains its candidates on the sites' data spends their budget on
every trial. A rehearsal spends none: the server cuts its own validation data (which holds no
site's data, ``Task.validation_dataset``) into folds, and a rehearsal task trains on all the
folds but one, as a simulation's pooled data, and validates on the one left out. Nothing else
of the task changes (its model, public data, loss and metrics), so a candidate's rehearsal is
the same federated run as its real one, on other data (``gep_fed.flower.tuning``).

A rehearsal task is named ``rehearsal:<fold>/<folds>:<task>``; ``gep_fed.data.registry``
resolves the name to the class ``rehearsal_task`` builds (the same in every process).
"""

from __future__ import annotations

import functools
import re

import numpy as np
from torch.utils.data import Dataset, Subset

from gep_fed.data.task import Task, dataset_targets

PREFIX = "rehearsal"
# ``rehearsal:<fold>/<folds>:``: a fold's digits, which no module's class name has
_NAME = re.compile(rf"{PREFIX}:(\d+)/(\d+):(.+)")


def rehearsal_task_name(task: str, fold: int, folds: int) -> str:
    """The name of ``task``'s rehearsal that validates on fold ``fold`` (0-based) of
    ``folds``."""
    return f"{PREFIX}:{fold}/{folds}:{task}"


def parse_rehearsal_name(name: str) -> tuple[int, int, str] | None:
    """(fold, folds, task) of a rehearsal task's name; None for any other name (a user's
    module named ``rehearsal`` resolves as before)."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    fold, folds = int(match[1]), int(match[2])
    if not (folds >= 2 and 0 <= fold < folds):
        raise ValueError(f"task {name!r}: a rehearsal's fold must be one of 0..folds-1, folds >= 2")
    return fold, folds, match[3]


class _SubsetWithTargets(Subset):
    """A subset that keeps its labels readable in one call (partitions by label use them),
    read once."""

    def targets(self) -> np.ndarray:
        if not hasattr(self, "_targets"):
            self._targets = dataset_targets(self.dataset)[np.asarray(self.indices, np.int64)]
        return self._targets


@functools.cache
def rehearsal_task(task: type[Task], fold: int, folds: int) -> type[Task]:
    """``task`` rehearsed on its server's validation data: its pooled training data the
    validation folds other than ``fold``, its validation (and evaluation) data fold ``fold``.
    The folds are a permutation by the run's public seed, cut into ``folds`` near-equal
    parts. It reads no site's data: ``train_dataset`` and ``site_dataset`` of ``task`` are
    never called."""

    class RehearsalTask(task):
        def _folds(self) -> tuple[Dataset, Dataset]:
            if not hasattr(self, "_rehearsal_folds"):
                validation = task.validation_dataset(self)
                if validation is None:
                    raise ValueError(
                        f"{task.__name__} has no validation data (Task.validation_dataset) "
                        "to rehearse on"
                    )
                count = len(validation)
                if count < 2 * folds:
                    raise ValueError(
                        f"{task.__name__}'s validation data holds {count} example(s): too few "
                        f"for {folds} folds of at least 2"
                    )
                order = np.random.default_rng(self.settings.seed).permutation(count)
                parts = np.array_split(order, folds)
                held = np.sort(parts[fold])
                trained = np.sort(np.concatenate([p for i, p in enumerate(parts) if i != fold]))
                self._rehearsal_folds = (
                    _SubsetWithTargets(validation, trained.tolist()),
                    _SubsetWithTargets(validation, held.tolist()),
                )
            return self._rehearsal_folds

        def train_dataset(self) -> Dataset:
            return self._folds()[0]

        def validation_dataset(self) -> Dataset:
            return self._folds()[1]

        def eval_dataset(self) -> Dataset:
            return self._folds()[1]

        def site_dataset(self, data_path: str) -> Dataset:
            raise NotImplementedError(
                "a rehearsal runs on the server's validation data only, never a site's data"
            )

    RehearsalTask.__name__ = RehearsalTask.__qualname__ = f"Rehearsal{task.__name__}"
    return RehearsalTask
