"""Lazy data sets for sites that bring their own data at real image sizes.

A site must never hold its whole data set in memory. Every class here is a torch ``Dataset`` that
decodes one image per ``__getitem__``; only the labels, the list of files and the files' layout
are read up front. What each format holds in memory:

========================  =================================================================
format                    held in memory
========================  =================================================================
``ImageFolderDataset``    the file paths and their class indices
``DicomFolderDataset``    the file paths and their class indices
``NpzDataset``            the labels; images are memory-mapped when the archive stores them
                          uncompressed (``np.savez``), else the images array is decompressed
                          once (``np.savez_compressed``, the MedMNIST files): fine for small data
``MedMNISTDataset``       as ``NpzDataset`` (MedMNIST files are compressed: one split's images)
``IdxDataset``            the labels; images are memory-mapped from a raw IDX file, while a
                          ``.gz`` file is decompressed into memory once (gzip has no random
                          access: 47 MB for the MNIST training images)
``Cifar10Dataset``        the labels; the 3,073-byte records are memory-mapped
========================  =================================================================

Memory maps pickle as their description (path, offset, shape), so DataLoader workers map the file
themselves instead of receiving a copy of the data.

Every data set follows the contract of ``ImageDataset``. Pixels become tensors through a declared
``ImageTransform``: the normalisation constants are given by the user, never measured on private
data (statistics of a site's images would be an unaccounted release of private information).
"""

from __future__ import annotations

import gzip
import operator
import zipfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

# ITU-R 601-2 luma weights: the ones PIL's convert("L") uses, so RGB->grey agrees with PIL.
_LUMA = (0.299, 0.587, 0.114)
_GREY_MODES = ("1", "L", "LA")
CIFAR10_RECORD = 3073  # 1 label byte + 3 x 32 x 32 pixel bytes (red, green, blue planes)
MEDMNIST_SPLITS = ("train", "val", "test")
IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC = 0x00000803, 0x00000801


class DataError(ValueError):
    """A data file is missing, unreadable or not in the expected format (named in the message)."""


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


def _floats(value: float | Sequence[float], name: str) -> tuple[float, ...]:
    out = (float(value),) if np.ndim(value) == 0 else tuple(float(v) for v in value)
    if len(out) not in (1, 3):
        raise ValueError(f"ImageTransform.{name} needs 1 or 3 values, got {len(out)}")
    return out


@dataclass(frozen=True)
class ImageTransform:
    """A declared mapping from a ``uint8`` image to a float32 ``(C, H, W)`` tensor.

    Steps, in order: scale to [0, 1]; ``channels`` (1 or 3) converts RGB to grey (ITU-R 601-2
    luma, as PIL) or repeats grey three times; ``size`` ``(H, W)`` resizes (bilinear,
    antialiased, so downsampling a large scan does not alias); ``(x - mean) / std`` per channel;
    then ``extra``, any callable on the float tensor (augmentation, cropping, ...).

    ``mean`` and ``std`` are DECLARED, one value or one per output channel, in the [0, 1] pixel
    scale (e.g. ``MNIST_MEAN``/``MNIST_STD`` from ``gep_fed.data.datasets``). They are never
    measured on the site's data: that would release private statistics outside the privacy
    accounting, and different sites would normalise differently. The defaults (0, 1) keep
    pixels in [0, 1]. ``None`` for ``size``/``channels`` keeps each image's own; the folder data
    sets then insist that every image matches the first one.

    For DataLoader workers started by spawn/forkserver, ``extra`` must be picklable (a
    module-level function, not a lambda).
    """

    size: tuple[int, int] | None = None
    channels: int | None = None
    mean: float | Sequence[float] = 0.0
    std: float | Sequence[float] = 1.0
    extra: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.size is not None:
            size = tuple(int(s) for s in self.size)
            if len(size) != 2 or min(size) < 1:
                raise ValueError(f"ImageTransform.size must be (height, width), got {self.size}")
            object.__setattr__(self, "size", size)
        if self.channels not in (None, 1, 3):
            raise ValueError(f"ImageTransform.channels must be 1, 3 or None, got {self.channels}")
        mean, std = _floats(self.mean, "mean"), _floats(self.std, "std")
        if min(std) <= 0:
            raise ValueError(f"ImageTransform.std must be positive, got {std}")
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        """``image``: ``uint8`` ``(H, W)`` or ``(H, W, C)`` with C 1 or 3."""
        if image.dtype != np.uint8 or image.shape[2:] not in ((), (1,), (3,)) or image.ndim < 2:
            raise ValueError(
                f"expected a uint8 (H, W) or (H, W, 1|3) image, got {image.dtype} {image.shape}"
            )
        x = torch.from_numpy(np.array(image, dtype=np.float32)).div_(255.0)
        x = x.unsqueeze(0) if x.ndim == 2 else x.permute(2, 0, 1)
        # Grey before resizing and RGB after it: both steps then work on one channel.
        if self.channels == 1 and x.shape[0] == 3:
            x = torch.tensordot(torch.tensor(_LUMA), x, dims=1).unsqueeze(0)
        if self.size is not None and tuple(x.shape[1:]) != self.size:
            from torchvision.transforms.v2 import functional as TF  # 1.6 s: only to resize

            x = TF.resize(x, list(self.size), antialias=True)
        if self.channels == 3 and x.shape[0] == 1:
            x = x.expand(3, -1, -1)
        if max(len(self.mean), len(self.std)) > x.shape[0]:
            raise ValueError(
                f"ImageTransform has {len(self.mean)} means and {len(self.std)} stds for an "
                f"image of {x.shape[0]} channel(s); declare channels=3 or one value"
            )
        mean = torch.tensor(self.mean).view(-1, 1, 1)
        std = torch.tensor(self.std).view(-1, 1, 1)
        x = (x - mean) / std
        return self.extra(x) if self.extra is not None else x


class ImageDataset(Dataset, ABC):
    """The contract every data set in this module follows.

    - ``len(ds)``; ``ds[i] -> (x, y)``: ``x`` float32 ``(C, H, W)`` after ``ds.transform``;
      ``y`` an int64 scalar tensor (class index), or for multi-label data (``ds.multi_label``)
      a float32 ``(num_classes,)`` tensor of 0/1.
    - ``ds.targets()``: every label as a numpy array, without decoding any image (for
      partitioning and checks).
    - ``ds.num_classes``: the number of classes, or of labels for multi-label data.
    - Only ``ds[i]`` decodes an image, one at a time; nothing reads every image up front.
    """

    def __init__(
        self,
        transform: ImageTransform | None,
        targets: np.ndarray,
        num_classes: int,
        multi_label: bool = False,
    ) -> None:
        self.transform = ImageTransform() if transform is None else transform
        self._targets = targets
        self.num_classes = num_classes
        self.multi_label = multi_label

    def __len__(self) -> int:
        return len(self._targets)

    def targets(self) -> np.ndarray:
        """int64 ``(N,)`` class indices, or float32 ``(N, num_classes)`` 0/1 multi-labels."""
        return self._targets.copy()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        i, n = operator.index(index), len(self)
        i = i + n if i < 0 else i
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for {n} examples")
        return self.transform(self._image(i)), torch.tensor(self._targets[i])

    def uint8_images(self) -> np.ndarray:
        """Every image decoded, before the transform, as one ``uint8`` ``(N, H, W[, C])``
        array (for a fixed front end computed once, e.g. ScatterNet features): reads the
        whole data set into memory, so for data sets that fit."""
        return np.stack([self._image(i) for i in range(len(self))])

    @abstractmethod
    def _image(self, i: int) -> np.ndarray:
        """Example ``i`` decoded now, as ``uint8`` ``(H, W)`` or ``(H, W, C)``."""


def _targets(
    labels: np.ndarray, source: str, num_classes: int | None
) -> tuple[np.ndarray, int, bool]:
    """Checked labels, the class count and whether they are multi-label.

    ``(N,)`` or ``(N, 1)`` integers are class indices in ``0..num_classes-1`` (``num_classes``
    declared, else the largest label + 1); ``(N, L)`` with L > 1 are 0/1 multi-labels.
    """
    if labels.ndim == 2 and labels.shape[1] > 1:
        if not np.isin(labels, (0, 1)).all():
            raise DataError(f"{source}: multi-label targets {labels.shape} must all be 0 or 1")
        if num_classes is not None and labels.shape[1] != num_classes:
            raise DataError(
                f"{source}: {labels.shape[1]} labels per example; expected {num_classes}"
            )
        return labels.astype(np.float32), labels.shape[1], True
    if labels.ndim == 2:
        labels = labels[:, 0]
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"{source}: expected integer class labels (N,) or (N, 1), got "
            f"{labels.dtype} {labels.shape}"
        )
    labels = labels.astype(np.int64)
    declared = num_classes is not None
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if len(labels) else 0
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if len(bad):
        raise DataError(
            f"{source}: label {labels[bad[0]]} of example {bad[0]} is outside 0..{num_classes - 1}"
            f" ({'declared' if declared else 'inferred'} num_classes={num_classes})"
        )
    return labels, num_classes, False


class _Mapped:
    """A read-only ``np.memmap`` of part of a file, indexable like an array.

    Pickles as its description, so a DataLoader worker maps the file itself rather than
    receiving a copy of the data (pickling an ``np.memmap`` copies all of it).
    """

    def __init__(self, path: Path, dtype, offset: int, shape: tuple[int, ...], order="C"):
        self.path, self.dtype, self.offset = path, np.dtype(dtype), offset
        self.shape, self.order = tuple(shape), order
        self._array: np.memmap | None = self._map()

    def _map(self) -> np.memmap:
        try:
            return np.memmap(self.path, self.dtype, "r", self.offset, self.shape, self.order)
        except (OSError, ValueError) as err:
            raise DataError(f"cannot map {self.path} as {self.dtype}{self.shape}: {err}") from err

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        if self._array is None:
            self._array = self._map()
        return self._array[index]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_array": None}


def _stored_npy(path: Path, header_offset: int) -> _Mapped | None:
    """An uncompressed ``.npy`` member of a zip, mapped in place; None where that is not simple."""
    with open(path, "rb") as fh:
        fh.seek(header_offset)
        local = fh.read(30)  # the zip local file header: name and extra-field lengths at 26, 28
        if local[:4] != b"PK\x03\x04":
            return None
        skip = int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
        fh.seek(header_offset + 30 + skip)
        version = np.lib.format.read_magic(fh)
        if version not in ((1, 0), (2, 0)):
            return None
        read = np.lib.format.read_array_header_1_0
        if version == (2, 0):
            read = np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(fh)
        if dtype.hasobject or 0 in shape:
            return None
        return _Mapped(path, dtype, fh.tell(), shape, "F" if fortran else "C")


def npz_member(path: Path, key: str, *, lazy: bool) -> np.ndarray | _Mapped:
    """Array ``key`` of an ``.npz``: mapped when ``lazy`` and stored uncompressed, else loaded."""
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n.removesuffix(".npy") for n in zf.namelist()]
            if key not in names:
                raise DataError(f"{path} has no array {key!r} (it has {sorted(names)})")
            info = zf.getinfo(f"{key}.npy")
            if lazy and info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 1:
                mapped = _stored_npy(path, info.header_offset)
                if mapped is not None:
                    return mapped
            with zf.open(info) as fh:
                return np.lib.format.read_array(fh, allow_pickle=False)
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise DataError(f"cannot read array {key!r} of {path} (a .npz archive): {err}") from err


def _check_images(shape: tuple[int, ...], dtype: np.dtype, source: str) -> None:
    if dtype != np.uint8 or len(shape) not in (3, 4) or shape[3:] not in ((), (1,), (3,)):
        raise DataError(
            f"{source}: expected uint8 images (N, H, W) or (N, H, W, 1|3), got {dtype}{shape}"
        )


class _ArrayImages(ImageDataset):
    """Images from an indexable ``(N, H, W[, C])`` uint8 array (loaded or memory-mapped)."""

    def __init__(self, images, labels, source, transform, num_classes):
        _check_images(images.shape, images.dtype, source)
        if len(images) != len(labels):
            raise DataError(f"{source}: {len(images)} images but {len(labels)} labels")
        targets, num_classes, multi = _targets(np.asarray(labels), source, num_classes)
        super().__init__(transform, targets, num_classes, multi)
        self._images = images

    def _image(self, i: int) -> np.ndarray:
        return np.asarray(self._images[i])

    def uint8_images(self) -> np.ndarray:
        return np.asarray(self._images[:])


class NpzDataset(_ArrayImages):
    """A site file ``.npz`` with uint8 images ``(N, H, W[, C])`` and integer labels.

    Labels ``(N,)`` or ``(N, 1)`` are class indices, checked against ``num_classes`` (declared,
    else the largest label + 1: declare it so every site agrees); ``(N, L)`` 0/1 labels are
    multi-label. In memory: the labels; the images array is memory-mapped when the archive
    stores it uncompressed (``np.savez``), and decompressed once when it is compressed
    (``np.savez_compressed``): fine for small data, use an uncompressed file for large data.
    """

    def __init__(
        self,
        path: str | Path,
        transform: ImageTransform | None = None,
        *,
        images_key: str = "images",
        labels_key: str = "labels",
        num_classes: int | None = None,
    ) -> None:
        self.path = Path(path)
        images = npz_member(self.path, images_key, lazy=True)
        labels = npz_member(self.path, labels_key, lazy=False)
        source = f"{self.path} ({images_key!r}, {labels_key!r})"
        super().__init__(images, labels, source, transform, num_classes)


class MedMNISTDataset(NpzDataset):
    """One split of any MedMNIST ``<flag>.npz`` (keys ``train_images``, ``train_labels``, ...).

    Single-label files (labels ``(N, 1)``) give class indices; multi-label files such as
    chestmnist (labels ``(N, 14)``) give float 0/1 targets and ``num_classes`` = 14. Unless
    declared, ``num_classes`` is the largest label in all three splits + 1, so the splits agree
    even when one lacks a class. In memory: the labels and, as MedMNIST files are compressed,
    this split's images array (decompressed once; 28x28 to 224x224 images).
    """

    def __init__(
        self,
        path: str | Path,
        split: str = "train",
        transform: ImageTransform | None = None,
        *,
        num_classes: int | None = None,
    ) -> None:
        if split not in MEDMNIST_SPLITS:
            raise DataError(f"MedMNIST split must be one of {MEDMNIST_SPLITS}, got {split!r}")
        path = Path(path)
        if num_classes is None:
            labels = [npz_member(path, f"{s}_labels", lazy=False) for s in MEDMNIST_SPLITS]
            if labels[0].ndim == 2 and labels[0].shape[1] > 1:
                num_classes = labels[0].shape[1]
            elif all(np.issubdtype(y.dtype, np.integer) for y in labels):
                num_classes = max((int(y.max()) + 1 for y in labels if y.size), default=0)
        super().__init__(
            path,
            transform,
            images_key=f"{split}_images",
            labels_key=f"{split}_labels",
            num_classes=num_classes,
        )
        self.split = split


def _idx(path: Path, ndim: int) -> np.ndarray | _Mapped:
    """An IDX file of ``ndim`` dimensions: mapped when raw, decompressed in memory when gzipped."""
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    with open(path, "rb") as fh:
        head = fh.read(4)
        dims_raw = fh.read(4 * head[3]) if len(head) == 4 else b""
    if head[:2] == b"\x1f\x8b":
        array = read_idx(path)
    else:
        magic = int.from_bytes(head, "big")
        if len(head) < 4 or magic not in (IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC):
            raise DataError(
                f"{path} has magic number {magic:#010x}; expected an IDX file of unsigned bytes "
                f"({IDX_IMAGES_MAGIC:#010x} for images, {IDX_LABELS_MAGIC:#010x} for labels)"
            )
        dims = tuple(int.from_bytes(dims_raw[j : j + 4], "big") for j in range(0, head[3] * 4, 4))
        offset, size = 4 + 4 * head[3], path.stat().st_size
        if len(dims_raw) < 4 * head[3] or size - offset != int(np.prod(dims)):
            raise DataError(
                f"{path} declares shape {list(dims)} ({int(np.prod(dims))} bytes of data) but "
                f"holds {size - offset}; the file is truncated or damaged"
            )
        array = _Mapped(path, np.uint8, offset, dims)
    if len(array.shape) != ndim:
        kind = "images (N, H, W)" if ndim == 3 else "labels (N,)"
        raise DataError(f"{path} has shape {list(array.shape)}; expected IDX {kind}")
    return array


class IdxDataset(_ArrayImages):
    """MNIST-style IDX files (images ``(N, H, W)`` magic 0x803, labels ``(N,)`` magic 0x801).

    In memory: the labels. A raw images file is memory-mapped; a ``.gz`` one is decompressed
    into memory once, as gzip allows no random access (decompress it on disk for large data).
    ``num_classes``: declared, else the largest label + 1.
    """

    def __init__(
        self,
        images_path: str | Path,
        labels_path: str | Path,
        transform: ImageTransform | None = None,
        *,
        num_classes: int | None = None,
    ) -> None:
        self.images_path, self.labels_path = Path(images_path), Path(labels_path)
        images = _idx(self.images_path, 3)
        labels = np.asarray(_idx(self.labels_path, 1)[:])
        source = f"{self.images_path} / {self.labels_path}"
        super().__init__(images, labels, source, transform, num_classes)


class Cifar10Dataset(ImageDataset):
    """CIFAR-10 binary batches: records of 1 label byte + 3,072 pixel bytes (R, G, B planes).

    ``batch_files``: one path or several, read in order. In memory: the labels (one byte per
    example, read through the map); the records stay memory-mapped. ``num_classes`` is 10 unless
    declared (the CIFAR-100 binary format, with two label bytes, is a different format).
    """

    def __init__(
        self,
        batch_files: str | Path | Sequence[str | Path],
        transform: ImageTransform | None = None,
        *,
        num_classes: int = 10,
    ) -> None:
        single = isinstance(batch_files, str | Path)
        self.files = [Path(batch_files)] if single else [Path(f) for f in batch_files]
        if not self.files:
            raise DataError("no CIFAR-10 batch files given")
        self._records, labels = [], []
        for path in self.files:
            if not path.is_file():
                raise DataError(f"data file {path} does not exist")
            size = path.stat().st_size
            if size == 0 or size % CIFAR10_RECORD:
                raise DataError(
                    f"{path} has {size} bytes, not a whole number of {CIFAR10_RECORD}-byte "
                    "CIFAR-10 records (1 label byte + 3,072 pixel bytes)"
                )
            records = _Mapped(path, np.uint8, 0, (size // CIFAR10_RECORD, CIFAR10_RECORD))
            labels.append(_targets(np.array(records[:, 0]), str(path), num_classes)[0])
            self._records.append(records)
        self._starts = np.cumsum([0] + [len(r) for r in self._records])
        super().__init__(transform, np.concatenate(labels), num_classes)

    def _image(self, i: int) -> np.ndarray:
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        record = self._records[k][i - self._starts[k]]
        return record[1:].reshape(3, 32, 32).transpose(1, 2, 0)


def _files(folder: Path, extensions: tuple[str, ...]) -> list[Path]:
    """The files under ``folder`` (recursively) with one of ``extensions``, sorted."""
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in extensions and p.is_file())


# Files tried, in order, for the shape a folder's images must match: the first readable.
SHAPE_REFERENCE_SEARCH = 100

# The most values (height x width x channels) a folder image may have, read from its header
# before any decoding: an image is decoded at full resolution before it is resized (DICOM and
# 16-bit grey are windowed in float64, in place: 10 to 13 bytes a value at the peak), so a
# 9000 x 9000 RGB scan would cost GiBs, and a round sampling it could fail of memory after its
# ledger's record (a failure that tells which files the sample drew). Above it, an image is one
# bad example, named. 40 million: a 6,000 x 6,000 grey scan (a mammogram is about 14 million),
# a 3,600 x 3,600 RGB photograph.
MAX_IMAGE_VALUES = 40_000_000


def _check_size(path: Path, height: int, width: int, channels: int) -> None:
    values = height * width * channels
    if values > MAX_IMAGE_VALUES:
        raise DataError(
            f"{path} is {height}x{width} (HxW) with {channels} channel(s), {values:,} values, "
            f"more than the {MAX_IMAGE_VALUES:,} an image may have "
            "(gep_fed.data.formats.MAX_IMAGE_VALUES): downsample it before it joins the data "
            "folder"
        )


# Image files a class folder may hold that a folder task of other formats would not read.
IMAGE_SUFFIXES = (
    *(".png", ".jpg", ".jpeg", ".jpe", ".jfif", ".tif", ".tiff", ".bmp", ".gif", ".webp"),
    *(".dcm", ".pgm", ".ppm", ".pbm", ".pnm", ".j2k", ".jp2", ".heic", ".avif"),
)


class _FolderDataset(ImageDataset):
    """One sub-folder of ``root`` per class (searched recursively), labels from folder names.

    ``classes``: the class folder names in label order. Declare them: by default they are this
    site's sub-folders holding images, in sorted order (``classes_declared`` False), so a site
    lacking one class would number the others differently from its peers;
    ``class_disagreement`` compares the sites' ``classes`` before round 1. With declared
    classes a site may lack some (their folders missing or empty: ``missing_classes``), and a
    sub-folder holding images that matches no declared class raises ``DataError`` naming it
    and its image count (a folder without images, such as ``notes/``, is ignored). Images
    outside any class folder (in ``root`` itself, or in a hidden folder) raise ``DataError``:
    they have no label. In memory: the file paths and their labels. Unless the transform
    declares ``size`` and ``channels``, every image must match the first file (read from its
    header, once), whatever order items are read in.
    """

    def __init__(self, root, transform, classes, extensions) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            what = (
                "is a file, not a folder of class folders"
                if self.root.exists()
                else "does not exist"
            )
            raise DataError(f"data folder {self.root} {what}")
        extensions = tuple(e.lower() for e in extensions)
        images = (*extensions, *IMAGE_SUFFIXES)
        # images outside any class folder have no label: never left out unseen. Known by a
        # suffix: a suffix-less README or a drive's .fseventsd/ is no image, even where a
        # task reads suffix-less DICOM files in its class folders
        suffixed = tuple(e for e in images if e)
        loose = [p for p in self.root.iterdir() if p.is_file() and p.suffix.lower() in suffixed]
        hidden = [
            p
            for p in self.root.iterdir()
            if p.is_dir() and p.name.startswith(".") and _files(p, suffixed)
        ]
        if loose or hidden:
            where = [f"{len(loose)} image(s) in the folder itself"] if loose else []
            where += [f"images in the hidden folder {p.name!r}" for p in hidden]
            raise DataError(
                f"{self.root}: {'; '.join(where)}, outside any class folder, so without a "
                "label: move each into its class's folder, or out of the data folder"
            )
        folders = sorted(
            p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
        )
        self.classes_declared = classes is not None
        if classes is None:
            # a folder without images (``notes/``, an empty ``archive/``) is no class: counted,
            # it would shift the labels of every class after it
            classes = [name for name in folders if _files(self.root / name, images)]
            if not classes:
                raise DataError(
                    f"{self.root} has no class folders holding images (one sub-folder per class)"
                )
        self.classes = list(classes)
        # A folder of images that matches no declared class (a misspelt "clas3") is fatal,
        # never left out: unlike one corrupt example, which a run drops silently, it is the
        # site's layout disagreeing with the task, found before round 1 (``gep-fed site
        # check``, a simulation's check), and leaving it out would shrink a class unseen.
        unknown = {}
        for name in folders:
            if name not in self.classes:
                count = len(_files(self.root / name, extensions))
                if count:
                    unknown[name] = count
        if unknown:
            found = "; ".join(f"folder {n!r} holds {c} image(s)" for n, c in unknown.items())
            raise DataError(
                f"{self.root}: {found}, but no declared class has that name (the classes: "
                f"{', '.join(self.classes)}): rename each folder to its class, or move it out "
                "of the data folder"
            )
        self.files: list[Path] = []
        labels: list[int] = []
        # A site may lack a class (no cases of a rare one): its folder may be missing or
        # empty. The labels keep the declared numbering, so the site agrees with its peers.
        self.missing_classes: list[str] = []
        # each class folder walked once: the files read, and images of other formats
        listed = {
            name: _files(self.root / name, (*extensions, *IMAGE_SUFFIXES))
            if (self.root / name).is_dir()
            else []
            for name in self.classes
        }
        unread = {
            name: [p for p in files if p.suffix.lower() not in extensions]
            for name, files in listed.items()
        }
        unread = {name: files for name, files in unread.items() if files}
        if unread:  # left out, they would shrink a class unseen
            found = "; ".join(
                f"folder {n!r} holds {len(f)} ({', '.join(sorted({p.suffix for p in f}))})"
                for n, f in unread.items()
            )
            raise DataError(
                f"{self.root}: image files this task does not read ({'/'.join(extensions)} "
                f"only): {found}: convert them, or move them out of the data folder"
            )
        for label, name in enumerate(self.classes):
            found = [p for p in listed[name] if p.suffix.lower() in extensions]
            if not found:
                self.missing_classes.append(name)
            self.files += found
            labels += [label] * len(found)
        if not self.files:
            raise DataError(
                f"{self.root} holds no {'/'.join(extensions)} files in any class folder "
                f"({', '.join(self.classes)})"
            )
        super().__init__(transform, np.asarray(labels, np.int64), len(self.classes))
        self._reference: tuple[Path, tuple[int, int, int]] | None = None

    @abstractmethod
    def _header(self, path: Path) -> tuple[int, int, int]:
        """``(H, W, C)`` of the file's image, from its header without decoding the pixels."""

    @abstractmethod
    def _decode(self, path: Path) -> np.ndarray:
        """The file's image as ``uint8`` ``(H, W)`` or ``(H, W, C)``."""

    def _image(self, i: int) -> np.ndarray:
        image = self._decode(self.files[i])
        channels = image.shape[2] if image.ndim == 3 else 1
        self._check_shape(self.files[i], (*image.shape[:2], channels))
        return image

    def _check_shape(self, path: Path, shape: tuple[int, int, int]) -> None:
        size, channels = self.transform.size, self.transform.channels
        if size is not None and channels is not None:
            return
        if self._reference is None:
            self._reference = self._first_readable()
        first, expected = self._reference
        if size is None and shape[:2] != expected[:2]:
            raise DataError(
                f"{path} is {shape[0]}x{shape[1]} (HxW) but the expected size is "
                f"{expected[0]}x{expected[1]} (that of {first}); declare "
                "ImageTransform(size=...) to resize images of mixed sizes"
            )
        if channels is None and shape[2] != expected[2]:
            raise DataError(
                f"{path} has {shape[2]} channel(s) but the expected number is {expected[2]} "
                f"(that of {first}); declare ImageTransform(channels=...) to convert"
            )

    def _first_readable(self) -> tuple[Path, tuple[int, int, int]]:
        """The first file whose header reads, and its shape: what the others must match. An
        unreadable first file is one bad example, as any other is (taking its shape, every
        example failed: a site whose first file went bad could not answer a round)."""
        first_error = None
        for path in self.files[:SHAPE_REFERENCE_SEARCH]:
            try:
                return path, self._header(path)
            except DataError as err:
                first_error = first_error or err
        raise DataError(
            f"none of the first {min(len(self.files), SHAPE_REFERENCE_SEARCH)} files under "
            f"{self.root} can be read (the first: {first_error}): check the data folder"
        )

    def check(self) -> None:
        """Read every file's header (no pixel decoding) and raise ``DataError`` naming the first
        unreadable file, or the first whose size or channels differ from the first readable
        file's where the transform does not resize or convert them."""
        for path in self.files:
            self._check_shape(path, self._header(path))


_PIL_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)


def _pil_channels(mode: str) -> int:
    return 1 if mode in _GREY_MODES or mode == "I" or mode.startswith("I;16") else 3


def _pil_array(image: Image.Image) -> np.ndarray:
    if image.mode == "I" or image.mode.startswith("I;16"):
        # 16-bit grey (e.g. exported scans): scaled by its bit depth, not by measured statistics.
        wide = np.asarray(image, dtype=np.float64)  # one float64 copy, scaled in place
        np.clip(wide, 0, 65535, out=wide)
        wide /= 257.0
        return np.round(wide, out=wide).astype(np.uint8)
    return np.asarray(image.convert("L" if image.mode in _GREY_MODES else "RGB"))


class ImageFolderDataset(_FolderDataset):
    """torchvision's ImageFolder layout: ``root/<class>/<image>``, decoded with PIL.

    Images are grey (modes 1, L, LA; 16-bit grey is scaled by its bit depth, 65535 -> 255) or
    RGB (every other mode, converted). An unreadable or corrupt image raises ``DataError``
    naming the file when that item is read; ``check()`` finds them all up front cheaply.
    See ``_FolderDataset`` for ``classes`` and the size rule.
    """

    def __init__(
        self,
        root: str | Path,
        transform: ImageTransform | None = None,
        classes: Sequence[str] | None = None,
        extensions: Sequence[str] = (".png", ".jpg", ".jpeg"),
    ) -> None:
        super().__init__(root, transform, classes, extensions)

    def _header(self, path: Path) -> tuple[int, int, int]:
        try:
            with Image.open(path) as image:
                shape = (image.height, image.width, _pil_channels(image.mode))
                image.verify()  # checks the file's structure (PNG chunk CRCs) without decoding
        except _PIL_ERRORS as err:
            raise DataError(f"{path}: not a readable image ({err})") from err
        _check_size(path, *shape)
        return shape

    def _decode(self, path: Path) -> np.ndarray:
        try:
            with Image.open(path) as image:  # the header only, until the pixels are asked for
                _check_size(path, image.height, image.width, _pil_channels(image.mode))
                return _pil_array(image)
        except DataError:  # the size check's own message, not "cannot decode"
            raise
        except _PIL_ERRORS as err:
            raise DataError(f"{path}: cannot decode image ({err})") from err


def _pydicom():
    try:
        import pydicom
    except ImportError as err:
        raise ImportError(
            "DICOM data needs pydicom: pip install gep-fed[medical] (or pip install pydicom)"
        ) from err
    return pydicom


def _first(value) -> float:
    """The first value of a possibly multi-valued DICOM attribute (e.g. WindowCenter)."""
    return float(value[0]) if isinstance(value, Sequence) else float(value)


class DicomFolderDataset(_FolderDataset):
    """Class folders of single-frame DICOM files (``root/<class>/<file>.dcm``), read with pydicom.

    Grey images: the stored values go through RescaleSlope/RescaleIntercept (when present), then
    to 0..255 by a linear window chosen per ``window``, never from statistics of the data set:

    - ``"file"`` (default): the file's own WindowCenter/WindowWidth (the first pair), else as
      ``"bits"``. Files of one site may carry different windows (e.g. CT lung and soft tissue).
    - ``"bits"``: the full range of the file's stored bit depth (BitsStored, signed or not,
      after rescaling), so raw values map identically in every file of that depth.
    - ``(center, width)``: one declared window for every file, e.g. ``(40, 400)`` for CT soft
      tissue in Hounsfield units: the most consistent choice across files and sites.

    The window follows DICOM's linear VOI function; MONOCHROME1 images are then inverted so
    that bright means dense everywhere. Colour files (3 samples) are scaled by their bit depth.
    Multi-frame files raise ``DataError`` (export volumes as slices). ``extensions=("",)``
    reads files without an extension (common for DICOM). pydicom is imported when
    the data set is built: ``pip install gep-fed[medical]``. See ``_FolderDataset`` for
    ``classes`` and the size rule; ``check()`` reads headers only, so damaged pixel data shows
    when that item is read.
    """

    def __init__(
        self,
        root: str | Path,
        transform: ImageTransform | None = None,
        classes: Sequence[str] | None = None,
        *,
        extensions: Sequence[str] = (".dcm",),
        window: str | Sequence[float] = "file",
    ) -> None:
        _pydicom()
        if isinstance(window, str):
            valid = window in ("file", "bits")
        else:
            window = tuple(float(v) for v in window)
            valid = len(window) == 2 and window[1] >= 1
        if not valid:
            raise ValueError(
                f"window must be 'file', 'bits' or (center, width) with width >= 1, got {window!r}"
            )
        self.window = window
        super().__init__(root, transform, classes, extensions)

    def _read(self, path: Path, *, pixels: bool):
        pydicom = _pydicom()
        errors = (pydicom.errors.InvalidDicomError, OSError, EOFError, AttributeError, KeyError)
        errors += (ValueError, TypeError, RuntimeError, NotImplementedError)
        try:
            # large elements (the pixel data) are read only when asked for, after the check
            ds = pydicom.dcmread(path, stop_before_pixels=not pixels, defer_size="1 MB")
            shape = (int(ds.Rows), int(ds.Columns), int(ds.get("SamplesPerPixel", 1)))
            if int(ds.get("NumberOfFrames", 1) or 1) > 1:  # from the header: no frame decoded
                raise DataError(
                    f"{path} holds {ds.NumberOfFrames} frames; expected one 2-D image "
                    f"{shape} (multi-frame files are not supported: export volumes as slices)"
                )
            _check_size(path, *shape)
            return ds, shape, ds.pixel_array if pixels else None
        except DataError:  # the header's own refusal, not "cannot read"
            raise
        except errors as err:
            what = "pixel data" if pixels else "header"
            raise DataError(f"{path}: cannot read the DICOM {what} ({err})") from err

    def _header(self, path: Path) -> tuple[int, int, int]:
        return self._read(path, pixels=False)[1]

    def _decode(self, path: Path) -> np.ndarray:
        ds, shape, stored = self._read(path, pixels=True)
        if stored.ndim != (2 if shape[2] == 1 else 3):
            raise DataError(
                f"{path} holds pixel data of shape {stored.shape}; expected one 2-D image "
                f"{shape} (multi-frame files are not supported: export volumes as slices)"
            )
        photometric = str(ds.get("PhotometricInterpretation", "MONOCHROME2"))
        bits = int(ds.get("BitsStored", stored.dtype.itemsize * 8))
        if shape[2] == 3:
            if photometric != "RGB" and int(_pydicom().__version__.split(".")[0]) < 3:
                raise DataError(f"{path}: {photometric} colour data needs pydicom>=3 (as RGB)")
            scaled = stored.astype(np.float64)
            scaled /= 2**bits - 1
        else:
            slope = float(ds.get("RescaleSlope", 1.0))
            intercept = float(ds.get("RescaleIntercept", 0.0))
            # one float64 copy, windowed in place (the same operations, in the same order)
            values = stored.astype(np.float64)
            values *= slope
            values += intercept
            window = self.window
            if window == "file" and "WindowCenter" in ds and "WindowWidth" in ds:
                window = (_first(ds.WindowCenter), _first(ds.WindowWidth))
            if isinstance(window, tuple):
                center, width = window
                if width < 1:
                    raise DataError(f"{path}: WindowWidth {width} is below 1")
                # DICOM PS3.3 C.11.2.1.2.1 linear VOI; a width of 1 is a threshold at the center
                values -= center - 0.5
                values /= max(width - 1, 1e-6)
                values += 0.5
                scaled = values
            else:
                low, high = 0, 2**bits - 1
                if int(ds.get("PixelRepresentation", 0)) == 1:  # two's complement
                    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
                # the stored range, rescaled like the values
                low, high = sorted((low * slope + intercept, high * slope + intercept))
                values -= low
                values /= high - low
                scaled = values
        np.clip(scaled, 0.0, 1.0, out=scaled)
        scaled *= 255.0
        image = np.round(scaled, out=scaled).astype(np.uint8)
        return 255 - image if photometric == "MONOCHROME1" else image


def folder_dataset(data) -> _FolderDataset | None:
    """The class-folder data set behind a task's site data (through ``Subset``-like wrappers
    that keep it as ``.dataset``), or None where the data do not come from class folders."""
    for _ in range(8):
        if isinstance(data, _FolderDataset):
            return data
        data = getattr(data, "dataset", None)
        if data is None:
            return None
    return None


def class_disagreement(
    sites: Mapping[str, _FolderDataset], expected: Sequence[str] | None = None
) -> str | None:
    """Where the sites' class folders would label a class differently: None when every site
    has the same ``classes`` in the same order (and ``expected``'s, if given); else the error
    text, naming each differing site with the classes it has and lacks, and the one line of
    code that declares the list (``expected``, else the sites' names sorted)."""
    found = {site: list(data.classes) for site, data in sites.items()}
    if expected is None and len({tuple(v) for v in found.values()}) <= 1:
        return None
    target = (
        list(expected) if expected is not None else sorted({c for v in found.values() for c in v})
    )
    lines = []
    for site, classes in sorted(found.items()):
        if classes == target:
            continue
        lacks = [c for c in target if c not in classes]
        extra = [c for c in classes if c not in target]
        what = "declares" if sites[site].classes_declared else "has folders"
        line = f"  {site}: {what} {', '.join(classes)}"
        if lacks:
            line += f"; lacks {', '.join(lacks)}"
        if extra:
            line += f"; {', '.join(extra)} not in the expected classes"
        if not lacks and not extra:
            line += " (another order)"
        lines.append(line)
    if not lines:
        return None
    first = next(iter(sites.values()))
    bases = (ImageFolderDataset, DicomFolderDataset)
    kind = next((b.__name__ for b in bases if isinstance(first, b)), type(first).__name__)
    listed = ", ".join(f'"{c}"' for c in target)
    head = (
        "the classes differ from the expected ones"
        if expected is not None
        else "the sites' class folders differ, and each numbers its own in sorted order"
    )
    return "\n".join(
        [
            f"{head}, so one class would get different labels at different sites:",
            *lines,
            "declare the classes in the task's site_dataset, so every site labels them alike:",
            f"  {kind}(data_path, transform, classes=[{listed}])",
        ]
    )
