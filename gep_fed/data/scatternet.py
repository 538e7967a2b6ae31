"""ScatterNet features as an optional, frozen front end (Tramer & Boneh, ICLR 2021).

Tramer & Boneh, "Differentially Private Learning Needs Better Features (or Much More Data)",
train linear models (and small CNNs) with DP-SGD on the scattering transform of Oyallon &
Mallat: ``Scattering2D(J=2, L=8)`` maps a 28x28 grey image to 81 x 7 x 7 coefficients and a
32x32 RGB image to 3 x 81 = 243 x 8 x 8. The transform is a fixed cascade of wavelet
convolutions and moduli:

- it has **no trainable parameters** and **no statistics measured on data**, so applying it
  to every example costs no privacy, and computing it **once** for a whole data set (then
  training on the stored features) releases exactly what training on the images would;
- the images are scaled to [0, 1] by the declared constant 1/255 before the transform (no
  mean or variance is measured on any data set).

Normalisation of the features (choose one; none uses private statistics):

- ``GroupNorm`` per example (``scatter_linear``/``scatter_cnn`` with ``groups``, the default,
  as Tramer & Boneh's ``input_norm="GroupNorm"``): each example is normalised with its own
  mean and variance over groups of channels, so nothing is shared between examples;
- ``PublicStandardize``: per-channel mean and variance measured on *public* data (e.g. the
  GEP anchors), a replacement for Tramer & Boneh's "data normalization", which measures them on
  the private training set and must then be noised and accounted. Nothing here measures them
  on private data.

kymatio is a dependency of gep-fed (imported only when features are computed).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gep_fed.files import write_atomically

SCATTER_INSTALL = "pip install 'kymatio>=0.3'"
DEFAULT_J, DEFAULT_L = 2, 8


def scattering_channels(J: int = DEFAULT_J, L: int = DEFAULT_L) -> int:
    """Coefficients per input channel: ``1 + J L + L^2 J (J - 1) / 2`` (81 for J=2, L=8)."""
    return 1 + J * L + L * L * J * (J - 1) // 2


def _scattering_class():
    """kymatio's torch ``Scattering2D``, imported lazily with an error that says what to do.

    The 2-D front end is imported directly: ``kymatio.torch`` also imports the 3-D one, which
    fails with SciPy >= 1.15 (``scipy.special.sph_harm`` was removed) in kymatio 0.3.0.
    """
    if importlib.util.find_spec("kymatio") is None:
        raise ImportError(
            f"ScatterNet features need kymatio (a gep-fed dependency): {SCATTER_INSTALL}"
        )
    try:
        from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D
    except ImportError as err:  # pragma: no cover - a broken kymatio install
        raise ImportError(
            f"kymatio is installed but its 2-D torch front end cannot be imported ({err}); "
            f"reinstall it: {SCATTER_INSTALL}"
        ) from err
    return ScatteringTorch2D


class ScatterNet(nn.Module):
    """The frozen scattering transform of ``(N, C, H, W)`` images in [0, 1].

    Output: ``(N, C * scattering_channels(J, L), H / 2^J, W / 2^J)``. The wavelet filters are
    buffers, not parameters: nothing here is trained, and ``forward`` runs without autograd.
    """

    def __init__(
        self,
        image_size: int | Sequence[int] = 28,
        in_channels: int = 1,
        J: int = DEFAULT_J,
        L: int = DEFAULT_L,
    ) -> None:
        super().__init__()
        size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        if len(size) != 2 or any(s % 2**J for s in size):
            raise ValueError(f"image_size {size} must be two sizes divisible by 2^J = {2**J}")
        self.image_size, self.in_channels, self.J, self.L = size, in_channels, J, L
        self.scattering = _scattering_class()(J=J, shape=size, L=L)
        for p in self.parameters():  # kymatio registers filters as buffers; be sure anyway
            p.requires_grad_(False)

    @property
    def output_shape(self) -> tuple[int, int, int]:
        return self.shape_for(self.image_size, self.in_channels, self.J, self.L)

    @staticmethod
    def shape_for(
        image_size: Sequence[int], in_channels: int = 1, J: int = DEFAULT_J, L: int = DEFAULT_L
    ) -> tuple[int, int, int]:
        """The features' ``(C, h, w)`` for images of ``image_size`` (without building the
        filters)."""
        h, w = (s // 2**J for s in image_size)
        return (in_channels * scattering_channels(J, L), h, w)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1] != self.in_channels or tuple(x.shape[2:]) != self.image_size:
            raise ValueError(
                f"expected (N, {self.in_channels}, {self.image_size[0]}, {self.image_size[1]}) "
                f"images, got {tuple(x.shape)}"
            )
        out = self.scattering(x.float().contiguous())  # (N, C, K, h, w)
        return out.reshape(x.shape[0], *self.output_shape)


@functools.lru_cache(maxsize=8)
def _cached_net(size: tuple[int, int], in_channels: int, J: int, L: int) -> ScatterNet:
    """Building the filter bank takes a while: one ``ScatterNet`` per shape (it is fixed)."""
    return ScatterNet(size, in_channels, J, L)


def images_to_unit(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``uint8`` images ``(N, H, W)`` or ``(N, H, W, C)`` to float ``(N, C, H, W)`` in [0, 1]
    by the declared constant 1/255 (nothing is measured). A float ``(N, C, H, W)`` tensor is
    returned as it is."""
    if isinstance(images, torch.Tensor) and images.is_floating_point():
        if images.ndim != 4:
            raise ValueError(f"float images must be (N, C, H, W), got {tuple(images.shape)}")
        return images.float()
    array = images.numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    if array.dtype != np.uint8:
        raise ValueError(f"expected uint8 images or a float (N, C, H, W) tensor, got {array.dtype}")
    x = torch.from_numpy(np.array(array, copy=True)).float().div_(255.0)
    if x.ndim == 3:
        return x.unsqueeze(1)
    if x.ndim == 4:
        return x.permute(0, 3, 1, 2).contiguous()
    raise ValueError(f"expected (N, H, W) or (N, H, W, C) images, got shape {array.shape}")


def scatter_cache_dir() -> Path:
    """Where features of public and built-in data sets are cached: ``$GEP_FED_CACHE/scatter``
    (default ``~/.cache/gep-fed/scatter``)."""
    root = os.environ.get("GEP_FED_CACHE") or Path.home() / ".cache" / "gep-fed"
    return Path(root) / "scatter"


def _fingerprint(x: torch.Tensor, J: int, L: int) -> str:
    h = hashlib.sha256()
    h.update(f"scatter-v1 J={J} L={L} shape={tuple(x.shape)}".encode())
    h.update(x.numpy().tobytes())
    return h.hexdigest()[:20]


def scatter_features(
    images: np.ndarray | torch.Tensor,
    *,
    J: int = DEFAULT_J,
    L: int = DEFAULT_L,
    batch_size: int = 500,
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """ScatterNet features of a whole data set, computed once: ``(N, C*81, H/4, W/4)`` float32.

    ``images``: ``uint8`` ``(N, H, W)`` / ``(N, H, W, C)`` (scaled by 1/255) or float
    ``(N, C, H, W)``. With ``cache_dir`` the features are stored there under a hash of the
    pixels and (J, L) and read back on the next call. The transform is fixed and data-free, so
    precomputing costs no privacy.
    """
    x = images_to_unit(images)
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"scatter-{_fingerprint(x, J, L)}.pt"
        if path.exists():  # mapped, not read: many simulated sites share one copy in memory
            return torch.load(path, weights_only=True, mmap=True)
    net = _cached_net(tuple(x.shape[2:]), x.shape[1], J, L)
    out = torch.empty(x.shape[0], *net.output_shape, dtype=torch.float32)
    starts = range(0, x.shape[0], batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="scattering")
    for start in starts:
        out[start : start + batch_size] = net(x[start : start + batch_size])
    if path is not None:  # another process computing the same features at once: both succeed
        write_atomically(path, lambda fh: torch.save(out, fh))
    return out


class PublicStandardize(nn.Module):
    """Per-channel standardisation with statistics measured on **public** data only.

    Tramer & Boneh's "data normalization" measures these on the private training set, which
    is a release (to be noised and accounted). Measuring them on public features (e.g. the
    anchors) costs nothing. Channels with (near) zero public variance are zeroed.
    """

    def __init__(self, public_features: torch.Tensor, eps: float = 1e-5) -> None:
        super().__init__()
        dims = [0, *range(2, public_features.ndim)]
        mean = public_features.mean(dim=dims)
        var = public_features.var(dim=dims)
        self.register_buffer("mean", mean)
        self.register_buffer("inv_std", torch.where(var > eps, (var + eps).rsqrt(), 0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        view = [1, -1] + [1] * (x.ndim - 2)
        return (x - self.mean.view(view)) * self.inv_std.view(view)


def _feature_norm(
    channels: int, groups: int | None, public_features: torch.Tensor | None
) -> nn.Module:
    if public_features is not None:
        if groups is not None:
            raise ValueError("give either groups (per-example GroupNorm) or public_features")
        return PublicStandardize(public_features)
    if groups is None:
        return nn.Identity()
    if channels % groups:
        raise ValueError(f"groups={groups} must divide the {channels} feature channels")
    return nn.GroupNorm(groups, channels, affine=False)


def scatter_linear(
    num_classes: int = 10,
    in_shape: Sequence[int] = (81, 7, 7),
    groups: int | None = 27,
    public_features: torch.Tensor | None = None,
) -> nn.Sequential:
    """Tramer & Boneh's ScatterNet + linear model on precomputed features of ``in_shape``.

    ``GroupNorm(groups, C, affine=False)`` (per example: no trainable or data-dependent
    state), or ``PublicStandardize`` when ``public_features`` are given (then
    ``groups=None``), or nothing (``groups=None``); then ``Linear(C*h*w, num_classes)``, the
    only trainable layer (39,700 parameters for 81 x 7 x 7 and 10 classes).
    """
    c, h, w = in_shape
    return nn.Sequential(
        _feature_norm(c, groups, public_features),
        nn.Flatten(),
        nn.Linear(c * h * w, num_classes),
    )


def scatter_cnn(
    num_classes: int = 10,
    in_shape: Sequence[int] = (81, 7, 7),
    groups: int | None = 27,
    public_features: torch.Tensor | None = None,
    width: int = 1,
) -> nn.Sequential:
    """Tramer & Boneh's small tanh CNN on ScatterNet features (their MNIST/Fashion-MNIST
    ``MNIST_CNN`` for scattered input): normalisation as in ``scatter_linear``, conv3x3/2 -
    tanh - conv3x3 - tanh - linear(hidden) - tanh - linear. No BatchNorm. ``width`` scales
    the channels (16, 32) and the hidden layer (32), as the CIFAR-10 dimension sweep does."""
    c, h, w = in_shape
    c1, c2, hidden = 16 * width, 32 * width, 32 * width
    oh, ow = (h + 1) // 2, (w + 1) // 2
    return nn.Sequential(
        _feature_norm(c, groups, public_features),
        nn.Conv2d(c, c1, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv2d(c1, c2, 3, stride=1, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(c2 * oh * ow, hidden),
        nn.Tanh(),
        nn.Linear(hidden, num_classes),
    )
