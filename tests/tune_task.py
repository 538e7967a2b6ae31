"""Digits with a validation split for ``gep-fed tune``: the server's 360 held-out images
split in two, 180 to validate on and 180 to test on (the sites' data is the digits task's)."""

from __future__ import annotations

from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.task import TaskSettings


class ValidatedDigits(DigitsTask):
    def __init__(self, settings: TaskSettings | None = None) -> None:
        super().__init__(settings)
        images, labels = self.test
        half = len(labels) // 2
        self.validation = (images[:half], labels[:half])
        self.test = (images[half:], labels[half:])
