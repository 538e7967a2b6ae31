"""Feature fronts: a fixed front end that carries to any image task, and a small private head.

``model = "scatter-linear"`` (``scatter-cnn``, ``scatter-cnn-w2``, ``scatter-cnn-w4``) or
``"public-pretrained"`` on a task that does not build that model itself: ``build_task``
wraps the task in a ``FrontedTask``, with no change to the task's file. Every example the
task serves (a site's private data, the pooled training data, the server's evaluation,
validation and public data) passes, as the task's own transform leaves it, through:

1. a declared resize: bilinear with antialiasing to the public examples' size, each side
   capped at ``FRONT_SIZE`` and rounded down to a multiple of 4 (the size is read from the
   public data, never from a site's);
2. the front, fixed before any private example is seen:

   - ``scatter-*``: the ScatterNet transform (Tramer & Boneh 2021), data-free;
   - ``public-pretrained``: a small CNN trained on the task's **public** data only, by
     predicting each image's rotation (0, 90, 180, 270 degrees: no labels are needed), with
     public randomness, then frozen.

The features are computed once per data set and process, in memory, and never written to
disk (a deployed site's features stay where its data are). The model that trains, and
whose gradients are clipped, noised and released, is the head only: the ScatterNet models of
``gep_fed.data.scatternet``, or a linear layer on the pretrained features standardised with
public statistics. Privacy: a front is a fixed function of the example (and of public data),
so the mechanism's guarantee is unchanged; what a front costs is only accuracy.

A site trains the pretrained front itself, from the task's public data, with the run's
public seed: its public data must be readable where the site runs (the worked example's
photograph patches are generated locally).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from gep_fed.data.formats import DataError
from gep_fed.data.task import Task, TaskSettings

SCATTER_FRONTS = ("scatter-linear", "scatter-cnn", "scatter-cnn-w2", "scatter-cnn-w4")
PRETRAINED_FRONT = "public-pretrained"
FRONT_MODELS = (*SCATTER_FRONTS, PRETRAINED_FRONT)
# The largest side a front sees: larger images are reduced to it (cost and head size grow
# with the area; ScatterNet's 81 channels per input channel at a quarter of each side).
FRONT_SIZE = 32
# The pretrained front: its width, and its training on the public data.
PRETRAIN_CHANNELS = (32, 64, 64)
PRETRAIN_EPOCHS = 15
PRETRAIN_BATCH = 128
PRETRAIN_LR = 1e-3
# Fronted data sets and pretrained fronts kept in this process's memory (never on disk), by
# the digest of their inputs: a simulation's server and sites, and a tuning's trials, read
# the same examples through the same front once.
MEMORY_ENTRIES = 6
_features_memo: OrderedDict[str, tuple[torch.Tensor, dict[int, str]]] = OrderedDict()
_extractor_memo: OrderedDict[str, nn.Module] = OrderedDict()


def _remember(memo: OrderedDict, key: str, value):
    memo[key] = value
    while len(memo) > MEMORY_ENTRIES:
        memo.popitem(last=False)
    return value


def build_task(cls: type[Task], settings: TaskSettings) -> Task:
    """The task ``cls`` with ``settings``; a front model that ``cls`` does not build itself
    (``Task.models``) wraps the task built with its own model (``FrontedTask``)."""
    if settings.model in FRONT_MODELS and settings.model not in cls.models:
        return FrontedTask(cls(replace(settings, model="auto")), settings.model)
    return cls(settings)


def front_size(height: int, width: int) -> tuple[int, int]:
    """The declared size a front resizes to: each side capped at ``FRONT_SIZE``, rounded
    down to a multiple of 4 (at least 8)."""
    return tuple(max(8, min(side, FRONT_SIZE) // 4 * 4) for side in (height, width))


def resize(x: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """``(N, C, H, W)`` to ``(N, C, *size)``: bilinear with antialiasing (the declared
    resize of every example a front sees)."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=tuple(size), mode="bilinear", antialias=True, align_corners=False)


class FrontDataset(Dataset):
    """An inner data set's examples through a front, computed once, on the first read.

    An example the inner data set cannot read, that is not a (C, H, W) image, or of another
    channel count than the front's, keeps its error: reading it raises ``DataError`` (a
    site's ``CheckedExamples`` then leaves it out of every sample and its site check names
    it)."""

    def __init__(
        self, inner: Dataset, front: Callable[[list[torch.Tensor]], torch.Tensor], name: str
    ) -> None:
        self.inner, self.front, self.name = inner, front, name
        self._features: torch.Tensor | None = None
        self._labels: list[torch.Tensor] = []
        self._errors: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.inner)

    def _compute(self) -> torch.Tensor:
        if self._features is not None:
            return self._features
        rows, kept = [], []
        self._labels, self._errors = [], {}
        for i in range(len(self.inner)):
            try:
                x, y = self.inner[i]
                x, label = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y)
            except Exception as err:  # kept, and raised when the example is read
                self._labels.append(torch.tensor(-1))
                self._errors[i] = f"cannot be read: {err}"
                continue
            if x.ndim != 3 or x.numel() == 0:  # one example's error, as an unreadable one's
                self._labels.append(torch.tensor(-1))
                self._errors[i] = f"is not a (C, H, W) image a front takes: shape {tuple(x.shape)}"
                continue
            rows.append(x)
            self._labels.append(label)
            kept.append(i)
        digest = hashlib.sha256(f"{self.name} {kept}".encode())
        for x in rows:
            digest.update(f"{tuple(x.shape)}".encode())
            digest.update(x.numpy().tobytes())
        key = digest.hexdigest()
        if key not in _features_memo:
            _remember(_features_memo, key, self._through_front(rows, kept))
        features, errors = _features_memo[key]
        self._errors.update(errors)
        self._features = features
        return features

    def _through_front(
        self, rows: list[torch.Tensor], kept: list[int]
    ) -> tuple[torch.Tensor, dict[int, str]]:
        if not rows:
            raise DataError("no example of the data set can be read")
        features, errors = None, {}
        for start in range(0, len(rows), 256):
            out = self.front(rows[start : start + 256])
            if features is None:
                features = torch.zeros(len(self.inner), *out.shape[1:])
            for offset, row in enumerate(out):
                index = kept[start + offset]
                if torch.isnan(row).all():
                    errors[index] = "its channels do not match the front's"
                features[index] = row
        return features, errors

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        features = self._compute()
        if i in self._errors:
            raise DataError(f"example {i} {self._errors[i]}")
        return features[i], self._labels[i]

    def targets(self) -> np.ndarray:
        if hasattr(self.inner, "targets") and callable(self.inner.targets):
            return np.asarray(self.inner.targets())
        self._compute()
        if self._errors:
            first = min(self._errors)
            raise DataError(f"example {first} {self._errors[first]}: no label to partition by")
        return np.asarray([np.asarray(y) for y in self._labels])


class FrontedTask(Task):
    """A task's data through a feature front, with a small head as its model (see the
    module's docstring). Loss, metrics and kind are the inner task's."""

    def __init__(self, inner: Task, model: str) -> None:
        if model not in FRONT_MODELS:
            raise ValueError(f"model must be one of {list(FRONT_MODELS)}, got {model!r}")
        self.kind = inner.kind
        super().__init__(replace(inner.settings, model=model))
        self.inner, self.architecture = inner, model
        public = inner.public_dataset()
        if not len(public):
            raise DataError(f"{type(inner).__name__}.public_dataset() holds no examples")
        x0, _ = public[0]
        x0 = torch.as_tensor(x0, dtype=torch.float32)
        if x0.ndim != 3:
            raise DataError(
                f"model {model!r} takes image tasks ((C, H, W) inputs); "
                f"{type(inner).__name__} serves shape {tuple(x0.shape)}"
            )
        self.channels, self.size = int(x0.shape[0]), front_size(*x0.shape[1:])
        with torch.no_grad():
            outputs = inner.build_model().eval()(x0.unsqueeze(0))
        self.num_outputs = int(outputs.shape[-1]) if outputs.ndim > 1 else 1
        self._public_inner = public
        self._extractor: nn.Module | None = None
        self._public_features: torch.Tensor | None = None

    # -- the front ---------------------------------------------------------------------

    def _images(self, batch: list[torch.Tensor]) -> torch.Tensor:
        """A batch resized; an example of other channels becomes NaN (an error, kept)."""
        out = torch.full((len(batch), self.channels, *self.size), float("nan"))
        for i, x in enumerate(batch):
            if x.shape[0] == self.channels:
                out[i] = resize(x.unsqueeze(0), self.size)[0]
        return out

    def _front(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x = self._images(batch)
        bad = torch.isnan(x).flatten(1).any(1)
        x[bad] = 0.0
        with torch.no_grad():
            if self.architecture in SCATTER_FRONTS:
                from gep_fed.data.scatternet import scatter_features

                out = scatter_features(x, cache_dir=None)
            else:
                out = self.extractor()(x)
        out[bad] = float("nan")
        return out

    def extractor(self) -> nn.Module:
        """The pretrained front: trained on the public data once per process, then frozen."""
        if self._extractor is None:
            self._extractor = _extractor_memo.get(self._extractor_key())
        if self._extractor is None:
            rows = []
            for i in range(len(self._public_inner)):
                try:
                    x = torch.as_tensor(self._public_inner[i][0], dtype=torch.float32)
                except Exception as err:
                    raise DataError(f"public example {i} cannot be read: {err}") from err
                if x.shape[0] != self.channels:
                    raise DataError(
                        f"public example {i} has {x.shape[0]} channel(s), the first has "
                        f"{self.channels}"
                    )
                rows.append(resize(x.unsqueeze(0), self.size)[0])
            images = torch.stack(rows)
            self._extractor = _remember(
                _extractor_memo,
                self._extractor_key(),
                pretrain_on_rotations(images, seed=self.settings.seed),
            )
        return self._extractor

    def _extractor_key(self) -> str:
        """What decides the pretrained front: the public examples, their size, the seed."""
        if getattr(self, "_key", None) is None:
            digest = hashlib.sha256(f"{self.size} {self.settings.seed}".encode())
            for i in range(len(self._public_inner)):
                try:
                    x = torch.as_tensor(self._public_inner[i][0], dtype=torch.float32)
                except Exception:  # named when the front is trained
                    digest.update(f"unreadable {i}".encode())
                    continue
                digest.update(x.numpy().tobytes())
            self._key = digest.hexdigest()
        return self._key

    def _served(self, dataset: Dataset) -> Dataset:
        name = f"{self.architecture} {self.channels} {self.size}"
        if self.architecture == PRETRAINED_FRONT:
            name += f" {self._extractor_key()}"
        return FrontDataset(dataset, self._front, name)

    # -- the task ----------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        if self.architecture in SCATTER_FRONTS:
            from gep_fed.data.builtin_tasks import scatter_model

            return scatter_model(self.architecture, self.num_outputs, self.size, self.channels)
        from gep_fed.data.scatternet import PublicStandardize

        if self._public_features is None:
            public = self._served(self._public_inner)
            self._public_features = torch.stack([public[i][0] for i in range(len(public))])
        dim = int(self._public_features.shape[1])
        return nn.Sequential(
            PublicStandardize(self._public_features), nn.Linear(dim, self.num_outputs)
        )

    def train_dataset(self) -> Dataset:
        return self._served(self.inner.train_dataset())

    def site_dataset(self, data_path: str) -> Dataset:
        return self._served(self.inner.site_dataset(data_path))

    def eval_dataset(self) -> Dataset:
        return self._served(self.inner.eval_dataset())

    def validation_dataset(self) -> Dataset | None:
        validation = self.inner.validation_dataset()
        return None if validation is None else self._served(validation)

    def public_dataset(self) -> Dataset:
        return self._served(self._public_inner)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.inner.loss(outputs, targets)

    def metrics(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        return self.inner.metrics(logits, targets)


class RotationFront(nn.Module):
    """Three conv - GroupNorm - ReLU blocks, each halving the size, then a global average:
    a ``PRETRAIN_CHANNELS[-1]``-dimensional feature per image."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        layers, cin = [], channels
        for cout in PRETRAIN_CHANNELS:
            layers += [
                nn.Conv2d(cin, cout, 3, padding=1),
                nn.GroupNorm(8, cout),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            cin = cout
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def pretrain_on_rotations(images: torch.Tensor, seed: int) -> nn.Module:
    """A ``RotationFront`` trained to tell each public image's rotation (4 classes), with
    the public ``seed``; returned frozen, in eval mode. Square images only (a rotation by 90
    degrees keeps the shape)."""
    if images.shape[-1] != images.shape[-2]:
        raise DataError(f"the pretrained front needs square images, got {tuple(images.shape[-2:])}")
    generator = torch.Generator().manual_seed(_seed_of(seed))
    with torch.random.fork_rng():
        torch.manual_seed(_seed_of(seed))
        net = RotationFront(images.shape[1])
    head = nn.Linear(PRETRAIN_CHANNELS[-1], 4)
    with torch.random.fork_rng():
        torch.manual_seed(_seed_of(seed) + 1)
        head.reset_parameters()
    optimizer = torch.optim.Adam([*net.parameters(), *head.parameters()], lr=PRETRAIN_LR)
    with torch.enable_grad():  # also when the first read of a data set is under no_grad
        _fit_rotations(net, head, optimizer, images, generator)
    net.eval()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def _fit_rotations(net, head, optimizer, images, generator) -> None:
    for _ in range(PRETRAIN_EPOCHS):
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(images), PRETRAIN_BATCH):
            x = images[order[start : start + PRETRAIN_BATCH]]
            turns = torch.randint(0, 4, (len(x),), generator=generator)
            rotated = torch.stack(
                [torch.rot90(img, int(k), dims=(1, 2)) for img, k in zip(x, turns, strict=True)]
            )
            loss = F.cross_entropy(head(net(rotated)), turns)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def _seed_of(seed: int) -> int:
    """The front's own public seed, apart from the run's other uses of ``seed``."""
    digest = hashlib.sha256(f"gep-fed public-pretrained front {seed}".encode()).digest()
    return int.from_bytes(digest[:4], "big")
