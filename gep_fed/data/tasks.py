"""Tasks: a private data set, the server's evaluation set, public anchors and a model.

- ``digits`` (default, offline): scikit-learn's bundled handwritten digits (8x8); anchors are
  random patches of scikit-learn's bundled photographs. Nothing to download.
- ``mnist``: the fixed split of ``<data-dir>/mnist`` (8,000 private, 2,000 server test);
  anchors from ``<data-dir>/kmnist``.
- ``pneumonia`` (or any MedMNIST file via ``medmnist-path``): train split private, test split
  for the server; anchors from KMNIST when present, else photograph patches.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gep_fed.data.datasets import (
    MNIST_MEAN,
    MNIST_STD,
    ArrayDataset,
    DataError,
    load_digits,
    load_kmnist,
    load_medmnist,
    load_mnist,
    mnist_split,
    sample_photo_patches,
    to_tensor,
)
from gep_fed.data.models import MLP, MnistCNN

TASKS = ("digits", "mnist", "pneumonia", "medmnist")
MODELS = ("cnn", "mlp", "linear")
# Normalisation constants are declared, never measured on private data.
GENERIC_MEAN, GENERIC_STD = 0.5, 0.5


@dataclass(frozen=True)
class ModelSpec:
    """The architecture and input preprocessing, sent to every site with each round."""

    kind: str
    image_shape: tuple[int, ...]
    num_classes: int
    mean: float
    std: float

    def __post_init__(self) -> None:
        if self.kind not in MODELS:
            raise ValueError(f"model must be one of {list(MODELS)}, got {self.kind!r}")

    @property
    def channels(self) -> int:
        return self.image_shape[2] if len(self.image_shape) == 3 else 1

    def build(self) -> nn.Module:
        if self.kind in ("mlp", "linear"):
            hidden = (64,) if self.kind == "mlp" else ()
            return MLP(int(np.prod(self.image_shape)), self.num_classes, hidden=hidden)
        return MnistCNN(self.channels, self.num_classes, image_size=self.image_shape[0])

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "image_shape": list(self.image_shape)})

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        try:
            data = json.loads(text)
            data["image_shape"] = tuple(int(d) for d in data["image_shape"])
            return cls(**data)
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"malformed model spec {text!r}: {err}") from err

    def check_images(self, images: np.ndarray, source: str) -> None:
        """Raise ``DataError`` naming ``source`` if its images do not fit this model."""
        if tuple(images.shape[1:]) != self.image_shape:
            raise DataError(
                f"{source}: images have shape {tuple(images.shape[1:])}, the federation's "
                f"model expects {self.image_shape}"
            )

    def tensor(self, images: np.ndarray) -> torch.Tensor:
        return to_tensor(images, self.mean, self.std)


@dataclass(frozen=True)
class TaskData:
    """Everything a simulation needs. ``public`` has no labels: anchors get random ones."""

    name: str
    train: ArrayDataset
    test: ArrayDataset
    public: np.ndarray
    mean: float
    std: float

    @property
    def num_classes(self) -> int:
        return max(self.train.num_classes, self.test.num_classes)

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.train.images.shape[1:])

    def tensors(self, ds: ArrayDataset) -> tuple[torch.Tensor, torch.Tensor]:
        return to_tensor(ds.images, self.mean, self.std), torch.from_numpy(ds.labels)

    def public_tensor(self) -> torch.Tensor:
        images = self.public
        if len(self.image_shape) == 3 and images.ndim == 3:  # RGB task, grey anchors
            images = np.repeat(images[..., None], self.image_shape[2], axis=3)
        return to_tensor(images, self.mean, self.std)

    def model_spec(self, kind: str = "cnn") -> ModelSpec:
        return ModelSpec(kind, self.image_shape, self.num_classes, self.mean, self.std)


def _resize_public(images: np.ndarray, size: int) -> np.ndarray:
    if images.shape[1] == size:
        return images
    x = torch.from_numpy(images).float().unsqueeze(1)
    out = torch.nn.functional.interpolate(x, size=(size, size), mode="area")
    return out.squeeze(1).round().clamp(0, 255).to(torch.uint8).numpy()


def load_task(
    name: str = "digits",
    data_dir: str | Path = "../shared/data",
    num_public: int = 2000,
    medmnist_path: str | Path | None = None,
    seed: int = 0,
) -> TaskData:
    """Load a task's data. ``seed`` fixes the digits split and the public sample (public
    randomness only)."""
    data_dir = Path(data_dir)
    rng = np.random.default_rng(seed)
    if name == "digits":
        ds = load_digits()
        perm = rng.permutation(len(ds))
        cut = int(0.8 * len(ds))
        public = sample_photo_patches(num_public, 8, seed=seed)
        train, test = ds.subset(perm[:cut]), ds.subset(perm[cut:])
        return TaskData(name, train, test, public, GENERIC_MEAN, GENERIC_STD)
    if name == "mnist":
        train, test = mnist_split(load_mnist(data_dir / "mnist"))
        kmnist = load_kmnist(data_dir / "kmnist")
        public = kmnist.images[rng.permutation(len(kmnist))[:num_public]]
        return TaskData(name, train, test, public, MNIST_MEAN, MNIST_STD)
    if name in ("pneumonia", "medmnist"):
        path = (
            Path(medmnist_path) if medmnist_path else data_dir / "medmnist" / "pneumoniamnist.npz"
        )
        splits = load_medmnist(path)
        size = splits["train"].images.shape[1]
        try:
            kmnist = load_kmnist(data_dir / "kmnist")
            public = _resize_public(kmnist.images[rng.permutation(len(kmnist))[:num_public]], size)
        except DataError:
            public = sample_photo_patches(num_public, size, seed=seed)
        return TaskData(name, splits["train"], splits["test"], public, GENERIC_MEAN, GENERIC_STD)
    raise ValueError(f"task must be one of {list(TASKS)}, got {name!r}")
