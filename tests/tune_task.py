"""Digits with a validation split for ``gep-fed tune``: the server's 360 held-out images
split in two, 180 to validate on and 180 to test on (the sites' data is the digits task's)."""

from __future__ import annotations

from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.task import TaskSettings

# How the tuning tests name this task, and their small trials' settings (q = 1 keeps each
# trial's calibration fast: no subsampling to account).
TUNE_TASK = "tune_task:ValidatedDigits"
SMALL_TRIAL = dict(
    task=TUNE_TASK, num_public=100, num_basis=8, rounds=2, local_steps=2, sample_rate=1.0
)


class ValidatedDigits(DigitsTask):
    def __init__(self, settings: TaskSettings | None = None) -> None:
        super().__init__(settings)
        images, labels = self.test
        half = len(labels) // 2
        self.validation = (images[:half], labels[:half])
        self.test = (images[half:], labels[half:])
