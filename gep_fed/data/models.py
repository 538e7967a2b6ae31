"""Models whose forward treats examples independently (no BatchNorm).

``MnistCNN``: the GEP paper's MNIST model (two conv layers with max-pooling, one linear).
``resnet20_gn``: ResNet20 for 32x32 RGB with GroupNorm instead of BatchNorm, as in the paper.
``MLP``: a small multilayer perceptron for tabular or flattened inputs.
``build_model``: any of these, or any torchvision classifier with GroupNorm, by name.
``load_pretrained``: a local state dict (BatchNorm checkpoints included) into such a model.
``fine_tune``: train the classification head only, or everything.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class MnistCNN(nn.Module):
    """conv5x5(16) - maxpool - conv5x5(32) - maxpool - linear, for 28x28 inputs (28,938 params)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc = nn.Linear(32 * (image_size // 4) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.tanh(self.conv1(x)), 2)
        x = F.max_pool2d(torch.tanh(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    """Fully connected layers with tanh; ``hidden=()`` gives logistic regression."""

    def __init__(self, in_features: int, num_classes: int, hidden: tuple[int, ...] = (64,)) -> None:
        super().__init__()
        widths = [in_features, *hidden]
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.out = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(16, channels), channels)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = _norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = _norm(cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20GN(nn.Module):
    """ResNet20 (3 stages of 3 basic blocks, widths 16/32/64) with GroupNorm."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.norm1 = _norm(16)
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            blocks = []
            for i in range(3):
                blocks.append(_BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = layers
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def resnet20_gn(in_channels: int = 3, num_classes: int = 10) -> ResNet20GN:
    return ResNet20GN(in_channels, num_classes)


# -- building models by name ----------------------------------------------------------------

TORCHVISION_PREFIX = "torchvision:"
BUILT_IN_MODELS = ("resnet20_gn", "cnn", "mlp", "linear")

# Where a torchvision classifier keeps the convolution that reads the image, in the order
# tried: ResNet/ResNeXt/Wide ResNet (conv1), MobileNet/EfficientNet/ConvNeXt/Swin
# (features[0][0]), VGG/AlexNet/SqueezeNet (features[0]), DenseNet (features.conv0), RegNet
# (stem[0]), ViT (conv_proj), ShuffleNet (conv1[0]), GoogLeNet (conv1.conv), Inception v3
# (Conv2d_1a_3x3.conv), MNASNet (layers[0]), MaxViT (stem[0][0]).
_INPUT_CONV_PATHS = (
    "conv1",
    "features.0.0",
    "features.0",
    "features.conv0",
    "stem.0",
    "conv_proj",
    "conv1.0",
    "conv1.conv",
    "Conv2d_1a_3x3.conv",
    "layers.0",
    "stem.0.0",
)


def torchvision_model_names() -> list[str]:
    """The torchvision classification models ``build_model`` accepts (``"torchvision:<name>"``)."""
    import torchvision

    return list(torchvision.models.list_models(module=torchvision.models))


def build_model(name: str, num_classes: int, in_channels: int = 3, **kwargs) -> nn.Module:
    """Build a model by name, ready for per-example gradients (no BatchNorm), random init.

    Args:
        name: ``"torchvision:<name>"`` for any torchvision classification model
            (``torchvision_model_names()``; built with ``weights=None``, so nothing is
            downloaded, and every BatchNorm replaced by GroupNorm with
            ``batchnorm_to_groupnorm``), or one of ``"resnet20_gn"``, ``"cnn"`` (``MnistCNN``),
            ``"mlp"`` or ``"linear"`` (``MLP`` without hidden layers).
        num_classes: width of the output layer.
        in_channels: channels of the input images. A torchvision model's first convolution
            is rebuilt (freshly initialised) for ``in_channels != 3`` when it is at one of the
            usual places (``conv1``, ``features[0][0]``, ... : ``_INPUT_CONV_PATHS``, which
            covers every torchvision classifier); otherwise the model is refused. Ignored by
            ``"mlp"`` and ``"linear"``.
        kwargs: passed to the constructor: torchvision's builder (e.g. ``image_size=32`` for
            ViT), ``MnistCNN`` (``image_size``), ``MLP`` (``in_features``, required, and
            ``hidden``). ``max_groups`` (torchvision only) bounds the GroupNorm group count.

    torchvision's ``StochasticDepth`` (EfficientNet, ConvNeXt, Swin, MaxViT) is replaced by
    ``PerExampleStochasticDepth``, the same computation in a form ``torch.func.vmap`` accepts.
    Load pretrained weights from a local file with ``load_pretrained`` and choose what trains
    with ``fine_tune``.

    Raises:
        ValueError: an unknown name (the message lists the accepted ones), a torchvision name
            that is not a classification model, or an input convolution that cannot be adapted.
    """
    if not isinstance(name, str):
        raise ValueError(f"model name must be a string, got {name!r}")
    if name.startswith(TORCHVISION_PREFIX):
        return _build_torchvision(name[len(TORCHVISION_PREFIX) :], num_classes, in_channels, kwargs)
    if name == "resnet20_gn":
        return resnet20_gn(in_channels, num_classes, **kwargs)
    if name == "cnn":
        return MnistCNN(in_channels, num_classes, **kwargs)
    if name in ("mlp", "linear"):
        if "in_features" not in kwargs:
            raise ValueError(f"model {name!r} needs in_features= (the flattened input size)")
        if name == "linear":
            if kwargs.get("hidden", ()):
                raise ValueError("model 'linear' has no hidden layers; use 'mlp' with hidden=")
            kwargs = {**kwargs, "hidden": ()}
        return MLP(num_classes=num_classes, **kwargs)
    raise ValueError(
        f"unknown model {name!r}; accepted: {', '.join(repr(m) for m in BUILT_IN_MODELS)}, or "
        f"'{TORCHVISION_PREFIX}<name>' for a torchvision classification model "
        f"({', '.join(torchvision_model_names())})"
    )


def _build_torchvision(name: str, num_classes: int, in_channels: int, kwargs: dict) -> nn.Module:
    import torchvision

    from gep_fed.mechanisms.per_example import batchnorm_to_groupnorm, validate_model

    available = torchvision_model_names()
    if name not in available:
        raise ValueError(
            f"{TORCHVISION_PREFIX + name!r} is not a torchvision classification model; "
            f"accepted: {', '.join(available)}"
        )
    kwargs = dict(kwargs)
    max_groups = kwargs.pop("max_groups", 32)
    if "weights" in kwargs:
        raise ValueError(
            "build_model always builds with weights=None (offline); load pretrained weights "
            "from a local file with load_pretrained(model, path)"
        )
    if name in ("googlenet", "inception_v3"):
        # Their auxiliary heads return a tuple in training mode, which no loss takes.
        kwargs.setdefault("aux_logits", False)
        kwargs.setdefault("init_weights", True)
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
    batchnorm_to_groupnorm(model, max_groups)
    _replace_stochastic_depth(model)
    if in_channels != 3:
        _adapt_input_conv(model, name, in_channels)
    validate_model(model)
    return model


class PerExampleStochasticDepth(nn.Module):
    """torchvision's ``StochasticDepth`` drawn with an out-of-place ``torch.rand``.

    Same computation (drop the residual branch with probability ``p``, per example for mode
    "row", per batch for "batch"; scale survivors by ``1 / (1 - p)``), but usable inside
    ``torch.func.vmap``: torchvision's in-place ``bernoulli_`` on an unbatched tensor is
    refused there, so EfficientNet, ConvNeXt, Swin and MaxViT could not give per-example
    gradients. Under ``per_example_gradients`` each example draws its own mask.
    """

    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"drop probability must be in [0, 1], got {p}")
        if mode not in ("row", "batch"):
            raise ValueError(f"mode must be 'row' or 'batch', got {mode!r}")
        self.p, self.mode = p, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        survival = 1.0 - self.p
        size = [x.shape[0] if self.mode == "row" else 1] + [1] * (x.ndim - 1)
        keep = (torch.rand(size, dtype=x.dtype, device=x.device) < survival).to(x.dtype)
        return x * keep / survival if survival > 0 else x * keep

    def extra_repr(self) -> str:
        return f"p={self.p}, mode={self.mode}"


def _replace_stochastic_depth(model: nn.Module) -> None:
    from torchvision.ops import StochasticDepth

    for name, child in model.named_children():
        if isinstance(child, StochasticDepth):
            setattr(model, name, PerExampleStochasticDepth(child.p, child.mode))
        else:
            _replace_stochastic_depth(child)


def _adapt_input_conv(model: nn.Module, name: str, in_channels: int) -> None:
    if in_channels < 1:
        raise ValueError(f"in_channels must be >= 1, got {in_channels}")
    for path in _INPUT_CONV_PATHS:
        try:
            conv = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(conv, nn.Conv2d) and conv.in_channels == 3 and conv.groups == 1:
            new = nn.Conv2d(
                in_channels,
                conv.out_channels,
                conv.kernel_size,
                conv.stride,
                conv.padding,
                conv.dilation,
                bias=conv.bias is not None,
                padding_mode=conv.padding_mode,
            )
            parent_path, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent_path) if parent_path else model, child, new)
            return
    raise ValueError(
        f"cannot adapt {TORCHVISION_PREFIX}{name} to in_channels={in_channels}: its first "
        f"convolution is not a 3-channel Conv2d at any of {list(_INPUT_CONV_PATHS)}. Build it "
        "with in_channels=3 and repeat the image's channels (x.expand(-1, 3, -1, -1))"
    )


# -- pretrained weights ---------------------------------------------------------------------

_BN_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class LoadReport:
    """What ``load_pretrained`` did with each entry of the file and of the model.

    Attributes:
        loaded: model entries set from the file (shape and name equal).
        adapted: input-convolution weights converted to the model's channel count (summed
            over the file's channels for one channel, else their mean repeated).
        dropped: BatchNorm statistics (``running_mean``, ``running_var``,
            ``num_batches_tracked``) whose layer is a GroupNorm in the model: GroupNorm
            normalises each example with its own statistics and has no use for them.
        unexpected: file entries the model has no place for (not loaded).
        missing: model entries the file does not have (left as they were).
        mismatched: ``name: file shape -> model shape`` for entries with the wrong shape (not
            loaded, left as initialised), e.g. a 1000-class ImageNet head into a 10-class
            model.
    """

    loaded: tuple[str, ...]
    adapted: tuple[str, ...]
    dropped: tuple[str, ...]
    unexpected: tuple[str, ...]
    missing: tuple[str, ...]
    mismatched: tuple[str, ...]

    @property
    def complete(self) -> bool:
        """Every model entry came from the file and every file entry was used or dropped."""
        return not (self.unexpected or self.missing or self.mismatched)

    def summary(self) -> str:
        lines = [
            f"loaded {len(self.loaded)} entries, adapted {len(self.adapted)}, dropped "
            f"{len(self.dropped)} BatchNorm statistics (GroupNorm has none)"
        ]
        for label, names in (
            ("adapted to the model's input channels", self.adapted),
            ("dropped BatchNorm statistics", self.dropped),
            ("unexpected (in the file, not in the model; not loaded)", self.unexpected),
            ("missing (in the model, not in the file; left as initialised)", self.missing),
            ("shape mismatch (not loaded)", self.mismatched),
        ):
            if names:
                lines.append(f"{label}: {', '.join(names)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def load_pretrained(model: nn.Module, path: str | Path, strict: bool = True) -> LoadReport:
    """Load a state dict from a local file into ``model``; returns what was loaded and not.

    Offline: ``path`` must be a file on this machine (``torch.save`` of a state dict, or of a
    checkpoint dict holding one under ``"state_dict"`` or ``"model"``; a ``"module."`` prefix
    from ``DataParallel`` is removed). It is read with ``weights_only=True``.

    A state dict of a BatchNorm model (e.g. a torchvision checkpoint) loads into the model
    ``build_model`` made from it: each BatchNorm's ``weight`` and ``bias`` become the affine
    ``weight`` and ``bias`` of the GroupNorm at the same name, and its ``running_mean``,
    ``running_var`` and ``num_batches_tracked`` are dropped (listed in ``report.dropped``).
    GroupNorm normalises differently from BatchNorm, so the loaded network is a starting point
    for fine-tuning, not a copy of the original's predictions. A 3-channel input convolution
    is adapted to a model built with other ``in_channels`` (``report.adapted``).

    Privacy: the file must not be derived from any site's private data. Pretrained weights
    are public inputs like the architecture; nothing about them is accounted.

    Args:
        strict: if True, refuse (``ValueError``, the model unchanged) a file that leaves
            any model entry missing, has entries the model lacks, or has entries of the wrong
            shape (apart from the dropped BatchNorm statistics). If False, load what fits and
            report the rest; e.g. ``strict=False`` to keep a freshly initialised head when
            the file's classifier has another number of classes.
    """
    if "://" in str(path) or not Path(path).is_file():
        raise ValueError(
            f"load_pretrained reads a local file (nothing is downloaded); {str(path)!r} is not one"
        )
    path = Path(path)
    state = _unwrap_state_dict(torch.load(path, map_location="cpu", weights_only=True), path)
    target = model.state_dict()
    modules = dict(model.named_modules())
    loaded, adapted, dropped, unexpected, mismatched, to_load = [], [], [], [], [], {}
    for key, value in state.items():
        owner, _, leaf = key.rpartition(".")
        if key not in target:
            if leaf in _BN_STATISTICS and isinstance(modules.get(owner), nn.GroupNorm):
                dropped.append(key)
            else:
                unexpected.append(key)
            continue
        want = target[key]
        if tuple(value.shape) == tuple(want.shape):
            to_load[key] = value
            loaded.append(key)
        elif _is_input_conv_weight(value, want, modules.get(owner)):
            to_load[key] = _adapt_conv_weight(value, want.shape[1])
            adapted.append(key)
        else:
            mismatched.append(f"{key}: {tuple(value.shape)} -> {tuple(want.shape)}")
    missing = [key for key in target if key not in state]
    report = LoadReport(*map(tuple, (loaded, adapted, dropped, unexpected, missing, mismatched)))
    if strict and not report.complete:
        raise ValueError(
            f"{path} does not match the model (strict=True; nothing was loaded):\n"
            f"{report.summary()}\nPass strict=False to load what fits."
        )
    model.load_state_dict(to_load, strict=False)
    return report


def _unwrap_state_dict(obj, path: Path) -> dict[str, torch.Tensor]:
    if isinstance(obj, Mapping) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise ValueError(f"{path} holds no state dict (a mapping of names to tensors)")
    if obj and all(k.startswith("module.") for k in obj):
        obj = {k[len("module.") :]: v for k, v in obj.items()}
    return dict(obj)


def _is_input_conv_weight(value: torch.Tensor, want: torch.Tensor, module) -> bool:
    return (
        isinstance(module, nn.Conv2d)
        and module.groups == 1
        and value.ndim == 4
        and value.shape[1] == 3
        and value.shape[0] == want.shape[0]
        and value.shape[2:] == want.shape[2:]
    )


def _adapt_conv_weight(weight: torch.Tensor, channels: int) -> torch.Tensor:
    if channels == 1:
        return weight.sum(1, keepdim=True)
    return weight.mean(1, keepdim=True).repeat(1, channels, 1, 1)


# -- what trains ----------------------------------------------------------------------------


def fine_tune(model: nn.Module, trainable: str, head: str | None = None) -> nn.Module:
    """Choose which parameters train: ``"head"`` (the classification head only) or ``"all"``.

    Sets ``requires_grad`` in place and returns the model. The head is the module named
    ``head`` (e.g. ``"fc"``, ``"classifier.3"``) or, by default, the last ``nn.Linear``
    registered in the model (torchvision's ``fc``/``classifier``/``heads``, ``MnistCNN.fc``,
    ``MLP.out``). Call it before building a ``GEPStep`` or a federation's parameter layout,
    identically at the server and every site: the layout is fixed when it is built.

    Privacy: frozen parameters (``requires_grad=False``) are not released. They are not in
    the parameter layout (``ParameterLayout.from_model`` lays out trainable parameters only),
    so they are not in the per-example gradients, the clipping norm, the anchor subspace or
    the noise; no update of them leaves a site, and they never change. They must therefore
    be public (random initialisation, or pretrained on public data), never fitted to private
    data outside the accounted steps. The accounting is per released step and unchanged:
    each step releases one noisy vector (GEP: embedding and residual) of the trainable
    parameters at the same noise multiplier and sample rate, so epsilon is the same as for
    the full model. Freezing reduces the dimension that noise is spread over (better utility),
    not the privacy cost.
    """
    if trainable not in ("head", "all"):
        raise ValueError(f"trainable must be 'head' or 'all', got {trainable!r}")
    if trainable == "all":
        if head is not None:
            raise ValueError("head= selects the trainable module for trainable='head' only")
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    module = _find_head(model, head)
    head_params = list(module.parameters())
    if not head_params:
        raise ValueError(f"the head {head!r} has no parameters to train")
    for p in model.parameters():
        p.requires_grad_(False)
    for p in head_params:
        p.requires_grad_(True)
    return model


def _find_head(model: nn.Module, head: str | None) -> nn.Module:
    if head is not None:
        try:
            return model.get_submodule(head)
        except AttributeError:
            names = [n for n, m in model.named_modules() if n and list(m.parameters(False))]
            raise ValueError(
                f"the model has no module {head!r}; modules with parameters: {names}"
            ) from None
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear to take as the classification head; "
            "name the head module with head= (e.g. head='classifier.1')"
        )
    return linears[-1]
