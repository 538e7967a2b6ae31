"""A user's own task, written outside ``gep_fed`` as a hospital would write its ``task.py``.

Two findings per image (multi-label, BCE per finding): "the digit is even" and "the digit is at
least 5", on scikit-learn's digits, with the user's own model and dataset classes.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from gep_fed.data.augment import crop_and_flip
from gep_fed.data.builtin_tasks import Cifar10Task, DigitsTask
from gep_fed.data.datasets import sample_photo_patches
from gep_fed.data.task import Task, TaskSettings


class FindingsDataset(Dataset):
    def __init__(self, images: np.ndarray, digits: np.ndarray) -> None:
        self.images = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
        findings = np.stack([digits % 2 == 0, digits >= 5], axis=1).astype(np.float32)
        self.findings = torch.from_numpy(findings)

    def __len__(self) -> int:
        return len(self.findings)

    def __getitem__(self, i):
        return self.images[i], self.findings[i]

    def targets(self) -> np.ndarray:
        return (self.findings[:, 0] * 2 + self.findings[:, 1]).long().numpy()


class TwoFindingsTask(Task):
    kind = "multilabel"

    def __init__(self, settings: TaskSettings | None = None) -> None:
        super().__init__(settings)
        from sklearn.datasets import load_digits  # here: collecting the tests stays light

        digits = load_digits()
        perm = np.random.default_rng(self.settings.seed).permutation(len(digits.target))
        self.train_idx, self.test_idx = perm[:1400], perm[1400:]
        self.images, self.digits = digits.images, digits.target

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 2))

    def train_dataset(self) -> Dataset:
        return FindingsDataset(self.images[self.train_idx], self.digits[self.train_idx])

    def eval_dataset(self) -> Dataset:
        return FindingsDataset(self.images[self.test_idx], self.digits[self.test_idx])

    def public_dataset(self) -> Dataset:
        patches = sample_photo_patches(self.settings.num_public, 8, seed=self.settings.seed)
        return FindingsDataset(patches / 255.0 * 16.0, np.zeros(len(patches), dtype=np.int64))


class DigitsWithValidation(DigitsTask):
    """The digits task with a validation set carved out of the private pool before it is
    partitioned (the sites never see it), for keeping the best model."""

    def __init__(self, settings: TaskSettings | None = None) -> None:
        super().__init__(settings)
        images, labels = self.train
        self.train, self.validation = (images[:1100], labels[:1100]), (images[1100:], labels[1100:])


def shift_by_copy(images: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in for a random augmentation: the rows alternate between the
    image and the image brightened by 0.5 (an example's two copies are consecutive rows)."""
    return images + 0.5 * (torch.arange(len(images)) % 2).to(images).view(-1, 1, 1, 1)


def logged_crop_and_flip(images: torch.Tensor) -> torch.Tensor:
    """One-pixel crops and flips of the 8x8 digits; each call's row count is appended to the
    file named by ``GEP_FED_TEST_AUGMENTATION_LOG`` (set by a test: the simulated sites run
    in other processes)."""
    log = os.environ.get("GEP_FED_TEST_AUGMENTATION_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{len(images)}\n")
    return crop_and_flip(images, padding=1)


class AugmentedDigits(DigitsTask):
    """The digits task with an augmentation (``logged_crop_and_flip``)."""

    def augmentation(self):
        return logged_crop_and_flip


class BrokenEvaluation(DigitsTask):
    """A task whose evaluation data fails inside its own code."""

    def eval_dataset(self):
        raise TypeError("broken inside")


class Cifar10ShortEvaluation(Cifar10Task):
    """The CIFAR-10 worked example whose server evaluates on the first 500 of its 10,000
    images: ResNet20 on all of them took 25 of a one-round test's 34 s on one CPU thread."""

    def eval_dataset(self) -> Dataset:
        return Subset(super().eval_dataset(), range(500))
