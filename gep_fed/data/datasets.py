"""Data sets: loaders with clear errors, and the fixed splits the experiments use.

Private data: MNIST (IDX files, e.g. ``../shared/data/mnist``, or torchvision's download where
there is internet), any MedMNIST ``<flag>.npz``, scikit-learn's bundled digits (the offline
default). Public anchor data: KMNIST npz, or random patches of scikit-learn's bundled sample
photographs. Every loader returns ``uint8``-range images as numpy arrays; ``to_tensor`` makes
normalised ``(N, C, H, W)`` float tensors.
"""

from __future__ import annotations

import gzip
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC = 0x00000803, 0x00000801
MEDMNIST_KEYS = tuple(f"{s}_{k}" for s in ("train", "val", "test") for k in ("images", "labels"))


class DataError(ValueError):
    """A data file is missing, unreadable or not in the expected format (named in the message)."""


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


def _read(path: Path) -> bytes:
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise DataError(f"cannot read {path}: {err}") from err


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (MNIST format, optionally gzipped) as a ``uint8`` array."""
    path = Path(path)
    raw = _read(path)
    if len(raw) < 8:
        raise DataError(f"{path} is too short to be an IDX file ({len(raw)} bytes)")
    magic = int.from_bytes(raw[:4], "big")
    if magic not in (IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC):
        raise DataError(
            f"{path} has magic number {magic:#010x}; expected an IDX file of unsigned bytes "
            f"({IDX_IMAGES_MAGIC:#010x} for images, {IDX_LABELS_MAGIC:#010x} for labels)"
        )
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims))
    if len(raw) - offset != expected:
        raise DataError(
            f"{path} declares shape {dims} ({expected} bytes of data) but holds "
            f"{len(raw) - offset}; the file is truncated or damaged"
        )
    return np.frombuffer(raw, np.uint8, offset=offset).reshape(dims)


def load_mnist(root: str | Path, split: str = "test", download: bool = False) -> ArrayDataset:
    """MNIST from a folder of the original IDX files (``root/MNIST/raw`` or ``root``).

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
            x, y = read_idx(img), read_idx(lab)
            if x.ndim != 3 or y.ndim != 1:
                raise DataError(f"{img} / {lab}: expected (N, 28, 28) images and (N,) labels")
            return ArrayDataset(x, y.astype(np.int64))
    if download:
        import torchvision

        ds = torchvision.datasets.MNIST(str(root), train=split == "train", download=True)
        return ArrayDataset(ds.data.numpy(), ds.targets.numpy().astype(np.int64))
    raise DataError(
        f"no MNIST {split} files ({prefix}-images-idx3-ubyte[.gz] and {prefix}-labels-"
        f"idx1-ubyte[.gz]) in {root} or {root / 'MNIST' / 'raw'}"
    )


def _load_npz(path: Path) -> np.lib.npyio.NpzFile:
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise DataError(f"cannot read {path} as a numpy .npz archive: {err}") from err


def _npz_array(npz, path: Path, key: str) -> np.ndarray:
    if key not in npz.files:
        raise DataError(f"{path} has no array {key!r} (it has {sorted(npz.files)})")
    try:
        return npz[key]
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise DataError(f"{path}: array {key!r} is damaged: {err}") from err


def load_kmnist(root: str | Path) -> ArrayDataset:
    """KMNIST test set from ``kmnist-test-imgs.npz`` and ``kmnist-test-labels.npz`` (key arr_0)."""
    root = Path(root)
    img_path, lab_path = root / "kmnist-test-imgs.npz", root / "kmnist-test-labels.npz"
    x = _npz_array(_load_npz(img_path), img_path, "arr_0")
    y = _npz_array(_load_npz(lab_path), lab_path, "arr_0")
    if x.ndim != 3:
        raise DataError(f"{img_path}: expected (N, H, W) images, got shape {x.shape}")
    return ArrayDataset(x, y.astype(np.int64))


def load_medmnist(path: str | Path) -> dict[str, ArrayDataset]:
    """Any MedMNIST ``<flag>.npz``: {"train", "val", "test"} with grey (N, H, W) or RGB
    (N, H, W, 3) images and labels of shape (N, 1) (single-label tasks)."""
    path = Path(path)
    npz = _load_npz(path)
    out = {}
    for split in ("train", "val", "test"):
        x = _npz_array(npz, path, f"{split}_images")
        y = _npz_array(npz, path, f"{split}_labels")
        if x.ndim not in (3, 4) or (x.ndim == 4 and x.shape[-1] != 3):
            raise DataError(f"{path}: {split}_images has shape {x.shape}; expected (N,H,W[,3])")
        if y.ndim == 2 and y.shape[1] != 1:
            raise DataError(
                f"{path}: {split}_labels has shape {y.shape}; only single-label tasks (N, 1) "
                "are supported"
            )
        out[split] = ArrayDataset(x, y.reshape(-1).astype(np.int64))
    return out


def load_digits() -> ArrayDataset:
    """scikit-learn's bundled handwritten digits: 1,797 8x8 images in 0..255, 10 classes."""
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    images = np.clip(d.images * (255.0 / 16.0), 0, 255).astype(np.uint8)
    return ArrayDataset(images, d.target.astype(np.int64))


def sample_photo_patches(count: int, size: int, seed: int = 0) -> np.ndarray:
    """``count`` random grey ``size x size`` patches of scikit-learn's two bundled photographs.

    Unrelated to any private data set, so usable as public anchors (with random labels).
    Each patch is cut at a random scale and downsampled, so it looks like a coarse image.
    """
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
    return out


def to_tensor(images: np.ndarray, mean: float | None = None, std: float | None = None):
    """``uint8`` images to float ``(N, C, H, W)`` tensors, standardised by ``mean`` and ``std``
    (of [0, 1] pixel values; default: the images' own)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)
    x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
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
    """A site's data file: ``.npz`` with ``images`` and ``labels``, or MedMNIST layout."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            keys = set(npz.files)
            if {"images", "labels"} <= keys:
                images, labels = npz["images"], npz["labels"]
            elif {"train_images", "train_labels"} <= keys:
                images, labels = npz["train_images"], npz["train_labels"]
            else:
                raise DataError(
                    f"{path} has arrays {sorted(keys)}; expected 'images' and 'labels' (or a "
                    "MedMNIST file with 'train_images' and 'train_labels')"
                )
    except FileNotFoundError as err:
        raise DataError(f"site data file {path} does not exist") from err
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise DataError(f"cannot read site data file {path}: {err}") from err
    if images.dtype != np.uint8 or images.ndim not in (3, 4):
        raise DataError(
            f"{path}: images must be uint8 (N, H, W[, C]), got {images.dtype}{images.shape}"
        )
    labels = labels.reshape(-1)
    if not np.issubdtype(labels.dtype, np.integer) or (labels < 0).any():
        raise DataError(f"{path}: labels must be non-negative integers")
    return ArrayDataset(images, labels.astype(np.int64))
