"""The built-in tasks: examples of the task interface (``gep_fed.data.task.Task``).

- ``digits`` (default, offline): scikit-learn's bundled handwritten digits (8x8); anchors are
  random patches of scikit-learn's bundled photographs. Nothing to download.
- ``mnist``: the fixed split of ``<data-dir>/mnist`` (8,000 private, 2,000 server test);
  anchors from ``<data-dir>/kmnist``.
- ``fashion-mnist``: the standard split of ``<data-dir>/fashion-mnist`` (60,000 private,
  10,000 server test); anchors from ``<data-dir>/kmnist``; by default ScatterNet features and a
  linear head with the settings that won the standard benchmark's validation
  (``FashionMnistTask.recommended_settings``).
- ``pneumonia`` (or any MedMNIST file via the ``medmnist-path`` option, task ``medmnist``):
  train split private, test split for the server; anchors from KMNIST when present, else
  photograph patches.
- ``cifar10``: CIFAR-10 binary batches 1-2 (20,000 private images) and batch 5 (server test),
  read from ``<data-dir>/cifar10``; anchors are Tiny-ImageNet's 32x32 validation images; by
  default ScatterNet + linear with the settings that won the standard benchmark's validation,
  or ResNet20 with GroupNorm (``model="resnet20"``, the GEP paper's CIFAR model).

Each reads a deployed site's ``.npz`` file (``images``, ``labels``, or a MedMNIST file) with
``site_dataset``. The model is chosen by the run config's ``model`` ("auto": an MLP for
digits, ScatterNet + linear for fashion-mnist, the MNIST CNN otherwise; "cnn", "mlp",
"linear", "scatter-linear", "scatter-cnn", "scatter-cnn-w2", "scatter-cnn-w4"). The
ScatterNet models train on features computed once per data set by a fixed, data-free
transform (``gep_fed.data.scatternet``): no privacy cost, and the features of the built-in
data and public anchors are cached on disk; a deployed site's features are computed in memory
and never cached.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import ClassVar

import numpy as np
from torch import nn
from torch.utils.data import Dataset

from gep_fed.data.augment import crop_and_flip
from gep_fed.data.datasets import (
    MNIST_MEAN,
    MNIST_STD,
    ArrayDataset,
    load_digits,
    load_kmnist,
    load_medmnist,
    load_mnist,
    load_site_file,
    mnist_split,
    sample_photo_patches,
)
from gep_fed.data.formats import Cifar10Dataset, DataError, ImageDataset, ImageTransform, NpzDataset
from gep_fed.data.models import MLP, MnistCNN, resnet20_gn
from gep_fed.data.task import (
    SMALL_IMAGE_RECIPE,
    ArrayImageDataset,
    FeatureDataset,
    Task,
    TaskSettings,
)
from gep_fed.mechanisms.contract import (
    DEFAULT_BASIS_REFRESH,
    DEFAULT_CLIP_EMBEDDING,
    DEFAULT_CLIP_NORM,
    DEFAULT_CLIP_RESIDUAL,
    DEFAULT_NUM_ANCHORS,
    DEFAULT_NUM_BASIS,
)
from gep_fed.mechanisms.multiplicity import Augment

# The ScatterNet CNN at the widths the CIFAR-10 sweep measured (56k, 155k, 477k parameters
# on CIFAR-10's features): DP-SGD's best private model there was width 4, GEP's the linear head.
SCATTER_CNN_WIDTHS = {"scatter-cnn": 1, "scatter-cnn-w2": 2, "scatter-cnn-w4": 4}
SCATTER_MODELS = ("scatter-linear", *SCATTER_CNN_WIDTHS)
ARCHITECTURES = ("auto", "cnn", "mlp", "linear", *SCATTER_MODELS)
# Normalisation constants are declared, never measured on private data.
GENERIC_MEAN, GENERIC_STD = 0.5, 0.5


def scatter_dataset(
    read_images: Callable[[], np.ndarray] | np.ndarray, labels: np.ndarray, cache: bool
) -> FeatureDataset:
    """The ScatterNet features of ``read_images()``, or of ``read_images`` itself when it is
    an array of images (``uint8``, ``(N, H, W)`` or ``(N, H, W, C)``).

    ``cache=True`` (the task's own, built-in or public data sets): stored on disk and computed
    on the first example read, so a server that only counts the pooled data never loads them.
    ``cache=False`` (a deployed site's private file): computed now, in memory, never stored,
    and once: ``DataLoader`` workers share the result instead of each computing it."""
    if not callable(read_images):
        images = np.asarray(read_images)

        def read_images() -> np.ndarray:
            return images

    def features():
        from gep_fed.data.scatternet import scatter_cache_dir, scatter_features

        return scatter_features(read_images(), cache_dir=scatter_cache_dir() if cache else None)

    return FeatureDataset(features if cache else features(), labels)


def scatter_model(
    architecture: str, num_classes: int, image_size: Sequence[int], channels: int
) -> nn.Module:
    """Tramer & Boneh's linear head or CNN (``architecture`` in ``SCATTER_MODELS``) on the
    ScatterNet features of ``image_size`` images with ``channels`` channels."""
    from gep_fed.data.scatternet import ScatterNet, scatter_cnn, scatter_linear

    in_shape = ScatterNet.shape_for(image_size, channels)
    if architecture == "scatter-linear":
        return scatter_linear(num_classes, in_shape=in_shape)
    return scatter_cnn(num_classes, in_shape=in_shape, width=SCATTER_CNN_WIDTHS[architecture])


class ArrayTask(Task):
    """A built-in task whose data fit in memory as ``uint8`` arrays (the subclasses load
    them). ``image_shape`` is ``(H, W)`` or ``(H, W, C)``.

    Digits and MNIST run ``FederationConfig``'s own defaults (those of the README's main
    job); PneumoniaMNIST / MedMNIST recommend the small-image recipe."""

    default_model = "cnn"
    models = ARCHITECTURES
    recommended_settings: ClassVar[Mapping[str, object]] = MappingProxyType({})

    def __init__(
        self,
        settings: TaskSettings,
        train: ArrayDataset,
        test: ArrayDataset,
        public: np.ndarray,
        mean: float,
        std: float,
        validation: ArrayDataset | None = None,
    ) -> None:
        super().__init__(settings)
        if settings.model not in ARCHITECTURES:
            raise ValueError(
                f"model must be one of {list(ARCHITECTURES)} for task "
                f"{type(self).__name__}, got {settings.model!r}"
            )
        self.train = (train.images, train.labels)
        self.test = (test.images, test.labels)
        self.validation = None if validation is None else (validation.images, validation.labels)
        self.mean, self.std = mean, std
        self.image_shape = tuple(train.images.shape[1:])
        if len(self.image_shape) == 3 and public.ndim == 3:  # RGB task, grey anchors
            public = np.repeat(public[..., None], self.image_shape[2], axis=3)
        self.public = public
        self.num_classes = max(train.num_classes, test.num_classes)

    @property
    def architecture(self) -> str:
        model = self.settings.model
        return self.default_model if model == "auto" else model

    def build_model(self) -> nn.Module:
        channels = self.image_shape[2] if len(self.image_shape) == 3 else 1
        if self.architecture in SCATTER_MODELS:
            return scatter_model(
                self.architecture, self.num_classes, self.image_shape[:2], channels
            )
        if self.architecture == "cnn":
            return MnistCNN(channels, self.num_classes, image_size=self.image_shape[0])
        hidden = (64,) if self.architecture == "mlp" else ()
        return MLP(int(np.prod(self.image_shape)), self.num_classes, hidden=hidden)

    def _dataset(self, images: np.ndarray, labels: np.ndarray, cache: bool = True) -> Dataset:
        """Pixels, or the ScatterNet features of the images (computed once; cached on disk
        for the task's own data sets only, ``cache=False`` for a site's file)."""
        if self.architecture in SCATTER_MODELS:
            return scatter_dataset(lambda: images, labels, cache)
        return ArrayImageDataset(images, labels, self.mean, self.std)

    def train_dataset(self) -> Dataset:
        return self._dataset(*self.train)

    def eval_dataset(self) -> Dataset:
        return self._dataset(*self.test)

    def validation_dataset(self) -> Dataset | None:
        return None if self.validation is None else self._dataset(*self.validation)

    def public_dataset(self) -> Dataset:
        return self._dataset(self.public, np.zeros(len(self.public), dtype=np.int64))

    def site_dataset(self, data_path: str) -> Dataset:
        site = load_site_file(data_path)
        if tuple(site.images.shape[1:]) != self.image_shape:
            raise DataError(
                f"{data_path}: images have shape {tuple(site.images.shape[1:])}, task "
                f"{type(self).__name__} expects {self.image_shape}"
            )
        # labels are checked example by example (``CheckedExamples``): one outside the task's
        # classes is dropped from every sample, and ``gep-fed site check`` names it
        return self._dataset(site.images, site.labels, cache=False)


class DigitsTask(ArrayTask):
    """scikit-learn's digits: 1,437 private (split seeded) and 360 server test images; 2,000
    photograph patches as anchors."""

    default_model = "mlp"

    def __init__(self, settings: TaskSettings | None = None) -> None:
        settings = settings or TaskSettings()
        ds = load_digits()
        perm = np.random.default_rng(settings.seed).permutation(len(ds))
        cut = int(0.8 * len(ds))
        public = sample_photo_patches(settings.num_public, 8, seed=settings.seed)
        train, test = ds.subset(perm[:cut]), ds.subset(perm[cut:])
        super().__init__(settings, train, test, public, GENERIC_MEAN, GENERIC_STD)


class MnistTask(ArrayTask):
    """MNIST's fixed split (8,000 private, 2,000 server test) with KMNIST anchors."""

    def __init__(self, settings: TaskSettings | None = None) -> None:
        settings = settings or TaskSettings()
        data_dir = Path(settings.data_dir)
        train, test = mnist_split(load_mnist(data_dir / "mnist"))
        kmnist = load_kmnist(data_dir / "kmnist")
        rng = np.random.default_rng(settings.seed)
        public = kmnist.images[rng.permutation(len(kmnist))[: settings.num_public]]
        super().__init__(settings, train, test, public, MNIST_MEAN, MNIST_STD)


def scatter_linear_winner(
    sample_rate: float, rounds: int, lr: float, **settings: object
) -> Mapping[str, object]:
    """A task's recommended settings: ScatterNet + linear with GEP's step that won on
    validation in ``benchmarks/standard.py``: its own batch, epochs and lr, and the step every
    data set chose (``GEPConfig``'s defaults: S1 = 0.1, S2 = 0.05, GP's S = 0.1, k = 100 from
    1,000 anchors, a new subspace every 20 steps), server momentum 0.9 as the benchmark's SGD.
    Client mode takes one local step of lr 1 per round, so the server's step moves the model
    as far per private step as in central mode."""
    return MappingProxyType(
        {
            "model": "scatter-linear",
            "sample_rate": sample_rate,
            "rounds": rounds,
            "clip_embedding": DEFAULT_CLIP_EMBEDDING,
            "clip_residual": DEFAULT_CLIP_RESIDUAL,
            "clip_norm": DEFAULT_CLIP_NORM,
            "num_basis": DEFAULT_NUM_BASIS,
            "num_anchors": DEFAULT_NUM_ANCHORS,
            "basis_refresh": DEFAULT_BASIS_REFRESH,
            "server_lr": lr,
            "server_momentum": 0.9,
            "local_steps": 1,
            "local_lr": 1.0,
            "local_momentum": 0.0,
            **settings,
        }
    )


FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530  # the published constants, declared


class FashionMnistTask(ArrayTask):
    """Fashion-MNIST's standard split (60,000 private, 10,000 server test) with KMNIST anchors.

    Defaults: ScatterNet + linear head and GEP's setting that won on validation in
    ``benchmarks/standard.py`` (Fashion-MNIST, epsilon 3: batch 4,096 of 60,000, i.e.
    q = 1/15, for 20 epochs = 300 steps, lr 8 with momentum 0.9, S1 = 0.1, S2 = 0.05,
    k = 100 from 1,000 of 2,000 KMNIST anchors, a new subspace every 20 steps; GP's winning
    clip S = 0.1).
    """

    default_model = "scatter-linear"
    recommended_settings: ClassVar[Mapping[str, object]] = scatter_linear_winner(
        sample_rate=1 / 15, rounds=300, lr=8.0, num_public=2000
    )

    def __init__(self, settings: TaskSettings | None = None) -> None:
        settings = settings or TaskSettings()
        data_dir = Path(settings.data_dir)
        root = data_dir / "fashion-mnist"
        train, test = load_mnist(root, "train"), load_mnist(root, "test")
        kmnist = load_kmnist(data_dir / "kmnist")
        rng = np.random.default_rng(settings.seed)
        public = kmnist.images[rng.permutation(len(kmnist))[: settings.num_public]]
        super().__init__(settings, train, test, public, FASHION_MNIST_MEAN, FASHION_MNIST_STD)


class MedMnistTask(ArrayTask):
    """A single-label MedMNIST file (option ``medmnist-path``; default PneumoniaMNIST in the
    data folder): train split private, test split for the server's evaluation, validation
    split for keeping the best model, KMNIST or photograph-patch anchors resized to the
    images. Recommends what a small image task should start from (``SMALL_IMAGE_RECIPE``,
    chosen on five small development sets, PneumoniaMNIST among them)."""

    recommended_settings: ClassVar[Mapping[str, object]] = SMALL_IMAGE_RECIPE

    def __init__(self, settings: TaskSettings | None = None) -> None:
        settings = settings or TaskSettings()
        data_dir = Path(settings.data_dir)
        path = settings.options.get("medmnist-path") or data_dir / "medmnist" / "pneumoniamnist.npz"
        splits = load_medmnist(path)
        size = splits["train"].images.shape[1]
        rng = np.random.default_rng(settings.seed)
        try:
            kmnist = load_kmnist(data_dir / "kmnist")
            chosen = kmnist.images[rng.permutation(len(kmnist))[: settings.num_public]]
            public = _resize(chosen, size)
        except DataError:
            public = sample_photo_patches(settings.num_public, size, seed=settings.seed)
        super().__init__(
            settings,
            splits["train"],
            splits["test"],
            public,
            GENERIC_MEAN,
            GENERIC_STD,
            validation=splits["val"],
        )


CIFAR_MEAN = (0.4914, 0.4822, 0.4465)  # the commonly published CIFAR-10 constants, declared
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class Cifar10Task(Task):
    """CIFAR-10 (batches 1-2 private, batch 5 for the server) with Tiny-ImageNet anchors.

    Models: "scatter-linear" ("auto"; ScatterNet features of the pixels / 255 and a linear
    head, with GEP's step that won on validation in ``benchmarks/standard.py``: batch 2,048
    of 20,000, i.e. q = 1/10, for 30 epochs = 300 steps, lr 4 with momentum 0.9, S1 = 0.1,
    S2 = 0.05, k = 100 from 1,000 anchors, a new subspace every 20 steps; GP's S = 0.1),
    "scatter-cnn" (Tramer & Boneh's CNN on the same features, 56,394 parameters; at width 2
    or 4 "scatter-cnn-w2" or "scatter-cnn-w4", 155,530 or 477,450), "resnet20"
    (ResNet20 with GroupNorm, the GEP paper's model, on normalised pixels; needs a GPU to
    train well) or "cnn" (the small MNIST-style CNN on 32x32x3).
    """

    default_model = "scatter-linear"
    models = ("auto", *SCATTER_MODELS, "resnet20", "cnn")
    recommended_settings: ClassVar[Mapping[str, object]] = scatter_linear_winner(
        sample_rate=1 / 10, rounds=300, lr=4.0
    )

    def __init__(self, settings: TaskSettings | None = None) -> None:
        super().__init__(settings)
        if self.settings.model not in self.models:
            raise ValueError(
                f"model must be auto (scatter-linear), {', '.join(SCATTER_MODELS)}, resnet20 "
                f"or cnn for task cifar10, got {self.settings.model!r}"
            )
        self.architecture = (
            self.default_model if self.settings.model == "auto" else self.settings.model
        )
        self.transform = ImageTransform(mean=CIFAR_MEAN, std=CIFAR_STD)
        root = Path(self.settings.data_dir) / "cifar10" / "cifar-10-batches-bin"
        self.batches = {b: root / f"data_batch_{b}.bin" for b in (1, 2, 5)}

    def build_model(self) -> nn.Module:
        if self.architecture in SCATTER_MODELS:
            return scatter_model(self.architecture, 10, (32, 32), 3)
        if self.architecture == "cnn":
            return MnistCNN(3, 10, image_size=32)
        return resnet20_gn(num_classes=10)

    def augmentation(self) -> Augment | None:
        """Random 4-pixel crops and left-right flips of the images (De et al. 2022), for the
        models on pixels; None for the ScatterNet models, which train on features computed
        once."""
        return None if self.architecture in SCATTER_MODELS else crop_and_flip

    def _served(self, dataset: ImageDataset, cache: bool = True) -> Dataset:
        """The images as they are, or their ScatterNet features (computed once; cached on
        disk for the task's own data sets only)."""
        if self.architecture not in SCATTER_MODELS:
            return dataset
        return scatter_dataset(dataset.uint8_images, dataset.targets(), cache)

    def train_dataset(self) -> Dataset:
        return self._served(Cifar10Dataset([self.batches[1], self.batches[2]], self.transform))

    def eval_dataset(self) -> Dataset:
        return self._served(Cifar10Dataset([self.batches[5]], self.transform))

    def site_dataset(self, data_path: str) -> Dataset:
        path = Path(data_path)
        files = sorted(path.glob("*.bin")) if path.is_dir() else [path]
        return self._served(Cifar10Dataset(files, self.transform), cache=False)

    def public_dataset(self) -> Dataset:
        path = Path(self.settings.data_dir) / "tinyimagenet" / "tinyimagenet_val_32x32.npz"
        public = NpzDataset(path, self.transform, images_key="x", labels_key="y", num_classes=200)
        return self._served(public)


def _resize(images: np.ndarray, size: int) -> np.ndarray:
    import torch

    if images.shape[1] == size:
        return images
    x = torch.from_numpy(images).float().unsqueeze(1)
    out = torch.nn.functional.interpolate(x, size=(size, size), mode="area")
    return out.squeeze(1).round().clamp(0, 255).to(torch.uint8).numpy()
