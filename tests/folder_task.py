"""A hospital's own task over PNG class folders (one per site), as ``docs/tasks.md`` builds
one: scikit-learn's digits written as 8x8 grey PNGs, classes "0".."9" declared. With the
environment variable ``FOLDER_TASK_READS`` set, every image a site reads is appended to that
file (a test counts the reads of the Ray workers)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image
from torch import nn
from torch.utils.data import Dataset

from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.datasets import load_digits
from gep_fed.data.formats import ImageFolderDataset, ImageTransform

CLASSES = [str(c) for c in range(10)]
TRANSFORM = ImageTransform(channels=1, mean=0.5, std=0.5)


class CountedFolders(ImageFolderDataset):
    def _decode(self, path: Path) -> np.ndarray:
        reads = os.environ.get("FOLDER_TASK_READS")
        if reads:
            with open(reads, "a") as fh:
                fh.write(f"{path}\n")
        return super()._decode(path)


class FolderDigits(DigitsTask):
    """The digits task (its server data, anchors and model), each site's data a folder."""

    def site_dataset(self, data_path: str) -> Dataset:
        return CountedFolders(data_path, TRANSFORM, classes=CLASSES)


class InferredFolderDigits(DigitsTask):
    """As ``FolderDigits`` but declaring no class list: each site's classes are its folders."""

    def site_dataset(self, data_path: str) -> Dataset:
        return ImageFolderDataset(data_path, TRANSFORM)


class BatchNormDigits(DigitsTask):
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.Linear(16, 10))


class NoEvaluation(DigitsTask):
    eval_dataset = None  # a task that forgot its evaluation data


def write_site_folders(root: Path, sizes: dict[str, int], lacking: dict[str, list[int]] = ()):
    """PNG class folders for each site (``sizes[name]`` images, disjoint), without the
    classes in ``lacking[name]``; returns ``{name: folder}``."""
    data = load_digits()
    lacking = dict(lacking)
    folders, start = {}, 0
    for name, size in sizes.items():
        folder = root / name
        taken = 0
        for i in range(start, len(data)):
            if taken == size:
                break
            label = int(data.labels[i])
            if label in lacking.get(name, []):
                continue
            (folder / str(label)).mkdir(parents=True, exist_ok=True)
            Image.fromarray(data.images[i]).save(folder / str(label) / f"{i}.png")
            taken += 1
            start = i + 1
        folders[name] = str(folder)
    return folders
