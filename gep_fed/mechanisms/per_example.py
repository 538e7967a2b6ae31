"""Per-example gradients, in chunks of bounded size, by one of two engines.

Differential privacy bounds each example's influence, so every private gradient must be
computed per example before it is clipped. The layer engine (``layer_gradients``) gets them
from one batched backward pass and each layer's rule; ``torch.func.vmap(grad(...))`` serves any
model whose forward treats examples independently, and serves the models the layer engine
cannot (a hooked layer's output modified in place). Both give the same matrix, up to float
rounding; the clip bounds are computed on whichever matrix is used.
"""

from __future__ import annotations

import math
import warnings
import weakref

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from gep_fed.mechanisms.factored import PerExampleGradients, ghost_pays
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.layer_gradients import (
    LayerEngineUnavailable,
    LossFn,
    factor_shapes,
    layer_gradients,
)

ENGINES = ("layers", "vmap")

# Layers whose output for one example depends on the other examples of the batch (or that
# update running statistics from the whole batch): per-example gradients do not exist for them.
_CROSS_EXAMPLE_LAYERS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)


# Models the layer engine refused once (the reason was warned then): served by torch.func.
_UNHOOKABLE: weakref.WeakSet[nn.Module] = weakref.WeakSet()

# model -> {(input shape, layout): the weights whose norms are ghost norms} (architecture only)
_GHOST_PLANS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


class IncompatibleModelError(ValueError):
    """The model mixes examples within a batch, so per-example clipping cannot bound privacy."""


def validate_model(model: nn.Module) -> None:
    """Refuse models whose forward pass mixes examples.

    Raises:
        IncompatibleModelError: naming every offending layer and how to fix it.
    """
    bad = []
    for name, module in model.named_modules():
        if isinstance(module, _CROSS_EXAMPLE_LAYERS):
            bad.append(f"{name or '<root>'} ({type(module).__name__})")
        elif isinstance(module, nn.modules.instancenorm._InstanceNorm) and (
            module.track_running_stats
        ):
            bad.append(f"{name} ({type(module).__name__} with track_running_stats=True)")
    if bad:
        raise IncompatibleModelError(
            "these layers mix examples within a batch, so a per-example gradient (and with it "
            f"the privacy guarantee) is undefined: {', '.join(bad)}. Replace BatchNorm with "
            "GroupNorm: `model = gep_fed.batchnorm_to_groupnorm(model)`, or set "
            "track_running_stats=False on instance norms."
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise IncompatibleModelError("the model has no trainable parameters")


def batchnorm_to_groupnorm(model: nn.Module, max_groups: int = 32) -> nn.Module:
    """Replace every BatchNorm layer of ``model`` (in place) with a GroupNorm of the same width.

    The number of groups is the largest divisor of the channel count that is at most
    ``max_groups``. Returns the model for chaining.
    """
    for name, child in model.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            channels = child.num_features
            groups = max(g for g in range(1, min(max_groups, channels) + 1) if channels % g == 0)
            setattr(model, name, nn.GroupNorm(groups, channels, affine=child.affine))
        else:
            batchnorm_to_groupnorm(child, max_groups)
    return model


def per_example_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    layout: ParameterLayout,
    max_chunk: int = 128,
    engine: str = "layers",
) -> torch.Tensor:
    """Return the ``(batch, p)`` matrix of per-example gradients, columns in ``layout`` order.

    Args:
        model: the model at the parameters to differentiate at; its parameters are read, not
            changed.
        loss_fn: ``loss_fn(outputs, targets)`` for a batch of one example (mean reduction is fine).
        inputs, targets: the examples; the first dimension indexes examples and may be 0.
        layout: which parameters, and in which order, form the flattened gradient.
        max_chunk: at most this many examples are differentiated at once, bounding peak memory
            to roughly ``max_chunk`` times the memory of one backward pass.
        engine: "layers" (layer rules, ``torch.func`` for layers without one; the whole model
            goes to "vmap" when its layers cannot be hooked) or "vmap" (``torch.func`` only).
    """
    if max_chunk < 1:
        raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    params = {name: p.detach() for name, p in model.named_parameters() if name in layout.index}
    frozen = {name: p.detach() for name, p in model.named_parameters() if name not in params}
    buffers = {name: b for name, b in model.named_buffers()}
    device = next(iter(params.values())).device
    out = torch.empty(inputs.shape[0], layout.size, dtype=torch.float32, device=device)
    if inputs.shape[0] == 0:
        return out

    def example_loss(p, x, y):
        state = {**p, **frozen, **buffers}
        output = functional_call(model, state, (x.unsqueeze(0),))
        return loss_fn(output, y.unsqueeze(0))

    grad_fn = vmap(grad(example_loss), in_dims=(None, 0, 0), randomness="different")
    for start in range(0, inputs.shape[0], max_chunk):
        stop = min(start + max_chunk, inputs.shape[0])
        if engine == "layers" and model not in _UNHOOKABLE:
            try:
                layer_gradients(
                    model, loss_fn, inputs[start:stop], targets[start:stop], layout, out[start:stop]
                )
                continue
            except LayerEngineUnavailable as err:
                _UNHOOKABLE.add(model)
                warnings.warn(
                    f"per-example gradients by torch.func for this model: {err}", stacklevel=2
                )
        grads = grad_fn(params, inputs[start:stop], targets[start:stop])
        chunk = out[start:stop]
        for name, cols in layout.slices():
            chunk[:, cols] = grads[name].reshape(stop - start, -1)
    return out


def factored_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    layout: ParameterLayout,
    factored: frozenset[str],
) -> PerExampleGradients | None:
    """The per-example gradients of one chunk with the weights ``factored`` kept as factors
    (``gep_fed.mechanisms.factored``), by the layer engine; None for a model it cannot serve
    (then ``per_example_gradients`` serves it)."""
    if model in _UNHOOKABLE:
        return None
    size = layout.size - sum(math.prod(layout.shapes[layout.names.index(n)]) for n in factored)
    device = next(p for p in model.parameters() if p.requires_grad).device
    dense = torch.empty(inputs.shape[0], size, dtype=torch.float32, device=device)
    try:
        factors = layer_gradients(model, loss_fn, inputs, targets, layout, dense, factored)
    except LayerEngineUnavailable as err:
        _UNHOOKABLE.add(model)
        warnings.warn(f"per-example gradients by torch.func for this model: {err}", stacklevel=2)
        return None
    return PerExampleGradients(layout, dense, factors)


def planned_ghost_weights(
    model: nn.Module, example: torch.Tensor, layout: ParameterLayout
) -> frozenset[str]:
    """The weights whose per-example norms cost less as ghost norms than from materialised
    gradients (``factored.ghost_pays``), for inputs shaped like ``example``: GP keeps them
    as factors. Planned once per model, input shape and layout."""
    plans = _GHOST_PLANS.setdefault(model, {})
    key = (tuple(example.shape[1:]), example.dtype, layout.names)
    if key not in plans:
        shapes = factor_shapes(model, example[:1], layout)
        plans[key] = frozenset(n for n, shape in shapes.items() if ghost_pays(shape))
    return plans[key]
