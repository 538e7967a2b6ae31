"""A hospital's own task: chest X-rays (PneumoniaMNIST, 28 x 28 grey) stored as PNG folders.

This is the ``task.py`` a hospital federation writes; it lives outside ``gep_fed`` and is
named in the run config as ``task = "examples.hospital.task:ChestXrayFolders"``.

- A deployed site reads its own ``data-path``: an ImageFolder layout with the class folders
  ``normal/`` and ``pneumonia/`` of PNG files (``deploy/make_site_data.py --format png`` writes
  one per site from PneumoniaMNIST's train split).
- The server evaluates on PneumoniaMNIST's test split from its data folder, keeps the best
  round's model by its validation split (``gep-fed tune`` chooses by it too; neither is a
  site's data), and its anchors are public photograph patches (no medical data).
- Its own model is a small CNN; ``--model scatter-linear`` or ``public-pretrained`` runs the
  same task on a feature front instead (``gep_fed.data.fronts``), and ``candidates.toml``
  beside this file is the first run's private selection among them (docs/tasks.md).
- A simulation partitions the train split.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn
from torch.utils.data import Dataset

from gep_fed.data.datasets import sample_photo_patches
from gep_fed.data.formats import ImageFolderDataset, ImageTransform, MedMNISTDataset
from gep_fed.data.models import MnistCNN
from gep_fed.data.task import ArrayImageDataset, Task

CLASSES = ("normal", "pneumonia")
MEAN, STD = 0.5, 0.5  # declared, never measured on a hospital's images
TRANSFORM = ImageTransform(size=(28, 28), channels=1, mean=MEAN, std=STD)


class ChestXrayFolders(Task):
    kind = "multiclass"

    @property
    def medmnist_file(self) -> Path:
        return Path(self.settings.data_dir) / "medmnist" / "pneumoniamnist.npz"

    def build_model(self) -> nn.Module:
        return MnistCNN(1, len(CLASSES), image_size=28)

    def site_dataset(self, data_path: str) -> Dataset:
        return ImageFolderDataset(data_path, TRANSFORM, classes=CLASSES)

    def train_dataset(self) -> Dataset:
        return MedMNISTDataset(self.medmnist_file, "train", TRANSFORM)

    def eval_dataset(self) -> Dataset:
        return MedMNISTDataset(self.medmnist_file, "test", TRANSFORM)

    def validation_dataset(self) -> Dataset:
        return MedMNISTDataset(self.medmnist_file, "val", TRANSFORM)

    def public_dataset(self) -> Dataset:
        patches = sample_photo_patches(self.settings.num_public, 28, seed=self.settings.seed)
        return ArrayImageDataset(patches, np.zeros(len(patches), np.int64), MEAN, STD)
