"""Data sets held in memory: the shared and bundled data sets, and the fixed splits the
experiments use. Each file format has one reader, in ``gep_fed.data.formats``; the loaders
here read whole files through them.

Private data: MNIST (IDX files, e.g. ``../shared/data/mnist``, or torchvision's download where
there is internet), any MedMNIST ``<flag>.npz``, scikit-learn's bundled digits (the offline
default). Public anchor data: KMNIST npz, or random patches of scikit-learn's bundled sample
photographs. Every loader returns ``uint8``-range images as numpy arrays; ``to_tensor`` makes
normalised ``(N, C, H, W)`` float tensors.
"""

from __future__ import annotations

import functools
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gep_fed.data.formats import (
    DataError,
    IdxDataset,
    ImageDataset,
    MedMNISTDataset,
    NpzDataset,
    npz_member,
)

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


@dataclass(frozen=True)
class ArrayDataset:
    """Images ``(N, H, W)`` or ``(N, H, W, C)`` and integer labels ``(N,)``."""

    images: np.ndarray
    labels: np.ndarray

    def __post_init__(self) -> None:
        if len(self.images) != len(self.labels):
            raise DataError(f"{len(self.images)} images but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, index: np.ndarray) -> ArrayDataset:
        return ArrayDataset(self.images[index], self.labels[index])

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1 if len(self.labels) else 0

    @classmethod
    def of(cls, reader: ImageDataset) -> ArrayDataset:
        """Every image and label of one of ``gep_fed.data.formats``' readers, in memory."""
        if reader.multi_label:
            raise DataError("multi-label data cannot be held as class-index labels")
        images = np.array(reader.uint8_images())  # in memory, detached from the file
        if images.ndim == 4 and images.shape[-1] == 1:
            images = images[..., 0]
        return cls(images, reader.targets())


def load_mnist(root: str | Path, split: str = "test", download: bool = False) -> ArrayDataset:
    """MNIST from a folder of the original IDX files (``root/MNIST/raw`` or ``root``), read by
    ``IdxDataset``.

    ``split`` is "train" or "test" (``t10k``). With ``download=True`` and no files present,
    torchvision downloads them (needs internet).
    """
    if split not in ("train", "test"):
        raise DataError(f"MNIST split must be 'train' or 'test', got {split!r}")
    root = Path(root)
    prefix = "t10k" if split == "test" else "train"
    for folder in (root / "MNIST" / "raw", root):
        images = [folder / f"{prefix}-images-idx3-ubyte{ext}" for ext in (".gz", "")]
        labels = [folder / f"{prefix}-labels-idx1-ubyte{ext}" for ext in (".gz", "")]
        img = next((p for p in images if p.exists()), None)
        lab = next((p for p in labels if p.exists()), None)
        if img and lab:
            return ArrayDataset.of(IdxDataset(img, lab))
    if download:
        import torchvision

        ds = torchvision.datasets.MNIST(str(root), train=split == "train", download=True)
        return ArrayDataset(ds.data.numpy(), ds.targets.numpy().astype(np.int64))
    raise DataError(
        f"no MNIST {split} files ({prefix}-images-idx3-ubyte[.gz] and {prefix}-labels-"
        f"idx1-ubyte[.gz]) in {root} or {root / 'MNIST' / 'raw'}"
    )


def load_kmnist(root: str | Path) -> ArrayDataset:
    """KMNIST test set from ``kmnist-test-imgs.npz`` and ``kmnist-test-labels.npz`` (key arr_0)."""
    root = Path(root)
    img_path, lab_path = root / "kmnist-test-imgs.npz", root / "kmnist-test-labels.npz"
    x = np.asarray(npz_member(img_path, "arr_0", lazy=False))
    y = np.asarray(npz_member(lab_path, "arr_0", lazy=False))
    if x.ndim != 3:
        raise DataError(f"{img_path}: expected (N, H, W) images, got shape {x.shape}")
    return ArrayDataset(x, y.astype(np.int64))


def load_medmnist(path: str | Path) -> dict[str, ArrayDataset]:
    """Any single-label MedMNIST ``<flag>.npz`` (grey ``(N, H, W)`` or RGB ``(N, H, W, 3)``
    images, labels ``(N, 1)``): {"train", "val", "test"}, each read by ``MedMNISTDataset``."""
    out = {}
    for split in ("train", "val", "test"):
        reader = MedMNISTDataset(path, split)
        if reader.multi_label:
            raise DataError(
                f"{path}: {split}_labels hold {reader.num_classes} labels per example; only "
                "single-label tasks (N, 1) are supported here"
            )
        out[split] = ArrayDataset.of(reader)
    return out


def load_digits() -> ArrayDataset:
    """scikit-learn's bundled handwritten digits: 1,797 8x8 images in 0..255, 10 classes
    (the caller's own copy)."""
    images, labels = _digits()
    return ArrayDataset(images.copy(), labels.copy())


# Read once per process: parsing scikit-learn's CSV takes 20 ms, and a simulation builds
# the task once per site (the test suite, hundreds of times).
@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    images = np.clip(d.images * (255.0 / 16.0), 0, 255).astype(np.uint8)
    return _read_only(images), _read_only(d.target.astype(np.int64))


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def sample_photo_patches(count: int, size: int, seed: int = 0) -> np.ndarray:
    """``count`` random grey ``size x size`` patches of scikit-learn's two bundled photographs.

    Unrelated to any private data set, so usable as public anchors (with random labels).
    Each patch is cut at a random scale and downsampled, so it looks like a coarse image.
    The caller's own copy.
    """
    return _photo_patches(count, size, seed).copy()


# Cut once per process and arguments: 2,000 patches take 60 ms, once per site built.
@functools.lru_cache(maxsize=8)
def _photo_patches(count: int, size: int, seed: int) -> np.ndarray:
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(seed)
    photos = [img.mean(axis=2).astype(np.float32) for img in load_sample_images().images]
    out = np.empty((count, size, size), dtype=np.uint8)
    for i in range(count):
        photo = photos[rng.integers(len(photos))]
        scale = int(rng.integers(2, 12))
        window = size * scale
        top = rng.integers(photo.shape[0] - window)
        left = rng.integers(photo.shape[1] - window)
        patch = photo[top : top + window, left : left + window]
        out[i] = patch.reshape(size, scale, size, scale).mean(axis=(1, 3)).astype(np.uint8)
    return _read_only(out)


def to_tensor(images: np.ndarray, mean: float | None = None, std: float | None = None):
    """``uint8`` images to float ``(N, C, H, W)`` tensors, standardised by ``mean`` and ``std``
    (of [0, 1] pixel values; default: the images' own)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)
    # (N, C, H, W) in the default memory format: the permuted view alone is channels-last
    x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2).contiguous()
    mean = float(x.mean()) if mean is None else mean
    std = float(x.std()) if std is None else std
    return (x - mean) / max(std, 1e-8)


def mnist_split(dataset: ArrayDataset) -> tuple[ArrayDataset, ArrayDataset]:
    """The project's fixed split of the 10,000 MNIST test images: 8,000 train, 2,000 test,
    by ``numpy.random.default_rng(0).permutation(10000)``."""
    if len(dataset) != 10_000:
        raise DataError(f"the fixed MNIST split needs the 10,000-image set, got {len(dataset)}")
    perm = np.random.default_rng(0).permutation(10_000)
    return dataset.subset(perm[:8000]), dataset.subset(perm[8000:])


def validation_split(
    dataset: ArrayDataset, fraction: float = 0.25, seed: int = 1
) -> tuple[ArrayDataset, ArrayDataset]:
    """Carve a validation set out of a training set (for choosing hyperparameters)."""
    perm = np.random.default_rng(seed).permutation(len(dataset))
    cut = round(len(dataset) * (1 - fraction))
    return dataset.subset(perm[:cut]), dataset.subset(perm[cut:])


def load_site_file(path: str | Path) -> ArrayDataset:
    """A site's data file, read whole: ``.npz`` with ``images`` and ``labels`` (``NpzDataset``),
    or a MedMNIST file (its train split, ``MedMNISTDataset``)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"site data file {path} does not exist")
    try:
        with zipfile.ZipFile(path) as zf:
            keys = {n.removesuffix(".npy") for n in zf.namelist()}
    except (OSError, zipfile.BadZipFile) as err:
        raise DataError(f"cannot read site data file {path}: {err}") from err
    if {"images", "labels"} <= keys:
        return ArrayDataset.of(NpzDataset(path))
    if {"train_images", "train_labels"} <= keys:
        return ArrayDataset.of(MedMNISTDataset(path, "train"))
    raise DataError(
        f"{path} has arrays {sorted(keys)}; expected 'images' and 'labels' (or a MedMNIST file "
        "with 'train_images' and 'train_labels')"
    )
