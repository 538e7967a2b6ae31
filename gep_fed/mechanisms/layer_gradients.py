"""Per-example gradients layer by layer, from each layer's inputs and output gradients.

One batched forward and one batched backward give every layer's inputs ``a`` and the
gradients ``b`` of the summed per-example losses with respect to its outputs; a layer rule
turns them into the layer's per-example gradients (for a linear layer ``g_i = b_i^T a_i``).
The rules are Opacus's (``opacus.grad_sample``, a maintained library): Linear, Conv, the
norm layers, Embedding and others. A layer that owns parameters and has no rule is
differentiated alone with ``torch.func`` (Opacus's fallback), and ``fallback_layers`` names it.

A batched pass gives per-example gradients only if no operation mixes examples: a batch
statistic would make one example's "gradient" depend on the others, and its clip would no
longer bound one example's influence. ``per_example.validate_model`` refuses the layers known
to mix (BatchNorm); for any other model, before its first batch of each input shape, a probe
on public random inputs checks that each example's output stays the same when the other
examples of its batch are replaced (every position of a batch of three), and a model that
fails is left to ``torch.func``, which differentiates each example alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.func import vmap

from gep_fed.mechanisms.factored import LayerFactors, dense_index, factorable
from gep_fed.mechanisms.groups import ParameterLayout

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Rule = Callable[[nn.Module, list[torch.Tensor], torch.Tensor], dict[nn.Parameter, torch.Tensor]]


def _opacus() -> tuple[dict[type, Rule], Rule]:
    """Opacus's layer rules by layer type and its ``torch.func`` fallback, imported when a
    model is first served: importing Opacus takes most of a second, which the command line's
    help and errors need not pay."""
    from opacus.grad_sample.functorch import ft_compute_per_sample_gradient
    from opacus.grad_sample.grad_sample_module import GradSampleModule

    return GradSampleModule.GRAD_SAMPLERS, ft_compute_per_sample_gradient


class LayerEngineUnavailable(RuntimeError):
    """This model cannot be served layer by layer (a hooked layer's output is changed in place)."""


@dataclass(frozen=True)
class ServedLayer:
    """A module whose parameters one rule differentiates (with all its sub-modules' when
    ``rule`` is the ``torch.func`` fallback)."""

    name: str
    module: nn.Module
    rule: Rule
    fallback: bool


def _owns_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def _served_layers(model: nn.Module) -> Iterator[ServedLayer]:
    """Opacus's walk: a module with a rule is served by it; one that owns parameters without
    a rule is served whole by ``torch.func`` (its sub-modules included)."""

    rules, fallback = _opacus()

    def walk(name: str, module: nn.Module) -> Iterator[ServedLayer]:
        rule = rules.get(type(module))
        if rule is not None and any(p.requires_grad for p in module.parameters()):
            yield ServedLayer(name, module, rule, fallback=False)
            return
        if _owns_trainable(module):
            yield ServedLayer(name or "<root>", module, fallback, True)
            return
        for child_name, child in module.named_children():
            yield from walk(f"{name}.{child_name}" if name else child_name, child)

    yield from walk("", model)


# model -> (its parameters' and buffers' versions, the input shapes the probe passed at them):
# the weights come from the server, and a mixing operation may be gated by a weight (a batch
# statistic scaled by 0), so a pass holds only until a parameter or buffer changes.
_SEPARATE: WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], set[tuple]]] = WeakKeyDictionary()


def check_examples_kept_apart(model: nn.Module, like: torch.Tensor) -> None:
    """Raise ``LayerEngineUnavailable`` if any example's output in a batch of three changes
    when the other two are replaced, on public random inputs shaped like ``like``.

    Three batches ``(a0, a1, a2)``, ``(a0, b1, b2)`` and ``(c0, a1, b2)``: every two of them
    hold one example at the same position and differ at the other two, so each position is
    compared once, against a batch where both of its neighbours changed (an example that
    reads the one before it, or only the last one reading another, is caught). All passes
    have the same shapes and RNG seed, so dropout masks and the like agree. Checked once per
    model, input shape and state of its weights (any in-place change of a parameter or
    buffer, a loaded round or an optimiser step, checks again)."""
    key = (tuple(like.shape[1:]), like.dtype, like.device)
    versions = tuple(t._version for t in (*model.parameters(), *model.buffers()))
    held_versions, passed = _SEPARATE.get(model, ((), set()))
    if held_versions == versions and key in passed:
        return
    shape = (3, *like.shape[1:])
    if like.is_floating_point():
        draw = torch.Generator().manual_seed(0)
        a, b, c = (torch.randn(shape, generator=draw).to(like) for _ in range(3))
        batches = (a, torch.cat([a[:1], b[1:]]), torch.cat([c[:1], a[1:2], b[2:]]))
    else:  # indices 0 and 1 only: (0, 1, 1), (0, 0, 0) and (1, 1, 0)
        rows = torch.tensor([[0, 1, 1], [0, 0, 0], [1, 1, 0]])
        view = (3, *[1] * (like.ndim - 1))
        batches = tuple(r.reshape(view).expand(shape).to(like) for r in rows)
    devices = [like.device] if like.device.type == "cuda" else []
    outputs = []
    with torch.no_grad(), torch.random.fork_rng(devices):
        for batch in batches:
            if like.device.type == "cpu":
                # the generator forked and the only one a CPU pass draws from (seeding every
                # device costs a stack trace per device before CUDA starts: 2 ms a step)
                torch.default_generator.manual_seed(0)
            else:
                torch.manual_seed(0)
            outputs.append(model(batch))
    if not all(isinstance(out, torch.Tensor) for out in outputs):
        raise LayerEngineUnavailable("the model's output is not a tensor")
    if any(out.ndim == 0 or out.shape[0] != 3 for out in outputs):
        raise LayerEngineUnavailable("the model's output does not hold one row per example")
    # (batch, batch, the position they share)
    for first, second, position in ((0, 1, 0), (0, 2, 1), (1, 2, 2)):
        mine, theirs = outputs[first][position], outputs[second][position]
        # non-finite outputs (weights a server made huge) compare as equal where both are: an
        # error here would tell whether the private sample was empty, which the probe is not
        finite = mine[torch.isfinite(mine)]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
        atol = 1e-6 * (1 + scale)
        if not torch.allclose(mine, theirs, rtol=1e-4, atol=atol, equal_nan=True):
            raise LayerEngineUnavailable(
                "one example's output depends on the other examples of its batch (a batch "
                "statistic?): each example is differentiated alone instead"
            )
    _SEPARATE[model] = (versions, (passed if held_versions == versions else set()) | {key})


def fallback_layers(model: nn.Module) -> list[str]:
    """The layers with trainable parameters and no layer rule: each is differentiated alone
    with ``torch.func`` (slower). Write a rule with ``opacus.grad_sample.register_grad_sampler``
    to serve one layer by layer."""
    return [f"{s.name} ({type(s.module).__name__})" for s in _served_layers(model) if s.fallback]


def layer_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    layout: ParameterLayout,
    out: torch.Tensor,
    factored: frozenset[str] = frozenset(),
) -> dict[str, LayerFactors]:
    """Write the per-example gradients of ``inputs`` into ``out`` (``(n, layout.size)``).

    ``loss_fn`` is applied to each example alone (vmapped), so a mean-reduced loss gives the
    per-example loss, exactly as ``torch.func``'s per-example gradients see it. The model's
    ``.grad`` is left untouched.

    ``factored`` names weights of ``factorable`` layers whose gradients are returned as
    their factors instead (``{name: LayerFactors}``); ``out`` then holds only the other
    parameters' columns, in layout order (``factored.dense_index``).

    Raises:
        LayerEngineUnavailable: one example's output depends on the others of its batch
            (``check_examples_kept_apart``), or a hooked layer's output was modified in place
            later in the forward pass (its recorded output gradient would be wrong); nothing
            is written.
    """
    check_examples_kept_apart(model, inputs)
    index = dense_index(layout, factored) if factored else layout.index
    named = dict(model.named_parameters())
    columns = {id(p): index[name] for name, p in named.items() if name in index}
    wanted = columns.keys()
    kept_as_factors = {id(named[name]): name for name in factored}
    served = [
        s
        for s in _served_layers(model)
        if any(id(p) in wanted or id(p) in kept_as_factors for p in s.module.parameters())
    ]
    servable = {id(s.module.weight) for s in served if not s.fallback and factorable(s.module)}
    unservable = sorted(name for name in factored if id(named[name]) not in servable)
    if unservable:
        raise ValueError(f"no factors for {unservable}: not weights of Linear or Conv2d layers")
    written: set[int] = set()
    factors: dict[str, LayerFactors] = {}

    def write_factors(layer: ServedLayer, activation: torch.Tensor, backprop: torch.Tensor):
        module = layer.module
        made = LayerFactors.of(module, activation, backprop)
        bias = getattr(module, "bias", None)
        if bias is not None and id(bias) in wanted:
            store(bias, made.bias_gradients())
        name = kept_as_factors[id(module.weight)]
        if name in factors:  # a layer called more than once: its positions add up
            held = factors[name]
            made = LayerFactors(
                torch.cat([held.inputs, made.inputs], 1),
                torch.cat([held.backprops, made.backprops], 1),
            )
        factors[name] = made

    def store(param: torch.Tensor, grad: torch.Tensor) -> None:
        start, stop = columns[id(param)]
        block = out[:, start:stop]
        if id(param) in written:  # a layer called more than once: its gradients add up
            block += grad.reshape(block.shape)
        else:
            block.copy_(grad.reshape(block.shape))
            written.add(id(param))

    def write(layer: ServedLayer, activations: list[torch.Tensor], backprop: torch.Tensor):
        weight = getattr(layer.module, "weight", None)
        if weight is not None and id(weight) in kept_as_factors:
            write_factors(layer, activations[0], backprop)
            return
        rule = _rule_for(layer, activations[0])
        # Opacus's convolution rule reads its input through ``as_strided`` with the strides of
        # the default memory format: a channels-last input (an image batch permuted from
        # height x width x channels) would give it wrong gradients.
        activations = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in activations]
        for param, grad in rule(layer.module, activations, backprop).items():
            if id(param) in wanted:
                store(param, grad)

    # Each layer's per-example gradients are made as soon as its output gradient exists in
    # the backward pass, and its inputs and output gradient are freed then: no pass holds
    # every layer's output gradient at once.
    outputs_at: list[tuple[str, torch.Tensor, int]] = []  # for the in-place check
    roots: list[torch.Tensor] = []  # outputs not downstream of the input: asked for by name

    def capture(layer: ServedLayer):
        def hook(_module, args, output):
            if not isinstance(output, torch.Tensor):
                raise LayerEngineUnavailable(
                    f"layer {layer.name} returns a {type(output).__name__}"
                )
            if not output.requires_grad:
                return
            kept = [[a.detach() for a in args]]
            if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                roots.append(output)
            outputs_at.append((layer.name, output, output._version))

            def on_gradient(backprop: torch.Tensor) -> None:
                write(layer, kept.pop(), backprop)

            output.register_hook(on_gradient)

        return hook

    # The input as a leaf that requires a gradient: asking for its gradient reaches every
    # hooked output downstream of it (a copy, so that the model may change it in place).
    leaf = inputs.detach().requires_grad_() if inputs.is_floating_point() else None

    def find_root(_module, args, output):
        # a layer outside the layout whose output starts the graph (an embedding of indices):
        # asked for by name too, or no gradient would flow to the layers after it
        starts = not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if isinstance(output, torch.Tensor) and output.requires_grad and starts:
            roots.append(output)

    handles = [s.module.register_forward_hook(capture(s)) for s in served]
    handles += [
        s.module.register_forward_hook(find_root)
        for s in _served_layers(model)
        if all(s.module is not t.module for t in served)
    ]
    try:
        with torch.enable_grad():
            outputs = model(inputs if leaf is None else leaf.clone())
    finally:
        for h in handles:
            h.remove()
    changed = [name for name, output, version in outputs_at if output._version != version]
    if changed:
        raise LayerEngineUnavailable(
            f"the outputs of {', '.join(changed)} are modified in place later in the forward "
            "pass (e.g. ReLU(inplace=True) or `out += x`); make those operations out of place"
        )
    outputs_at.clear()
    losses = vmap(lambda o, t: loss_fn(o.unsqueeze(0), t.unsqueeze(0)), randomness="different")(
        outputs, targets
    )
    asked = ([leaf] if leaf is not None else []) + roots
    if asked and losses.requires_grad:
        torch.autograd.grad(losses.sum(), asked, allow_unused=True)
    for name, p in named.items():
        if id(p) in wanted and id(p) not in written:  # unused in this forward: gradient 0
            start, stop = index[name]
            out[:, start:stop] = 0
    n = inputs.shape[0]
    for name in factored:
        if name not in factors:  # unused: no positions, gradient 0
            weight = named[name]
            d_in = weight[0].numel()
            factors[name] = LayerFactors(
                out.new_zeros(n, 0, d_in), out.new_zeros(n, 0, weight.shape[0])
            )
    return factors


def _rule_for(layer: ServedLayer, activation: torch.Tensor) -> Rule:
    """Opacus's convolution rule unfolds the input (``c_in k^2`` copies of it) and multiplies;
    ``torch.func`` on the layer alone runs a grouped convolution instead. On CPU the second
    was faster for stride-1 convolutions with 16 to 32 input channels per group, and slower
    elsewhere (``benchmarks/step_time.py``'s models, 2 threads); on CUDA the rule is used."""
    module = layer.module
    if (
        not layer.fallback
        and isinstance(module, nn.Conv2d)
        and activation.device.type == "cpu"
        and module.stride == (1, 1)
        and 16 <= module.in_channels // module.groups <= 32
    ):
        return _opacus()[1]
    return layer.rule


def layer_engines(model: nn.Module, example: torch.Tensor) -> dict[str, str]:
    """How the layer engine serves each layer with trainable parameters for inputs shaped like
    ``example`` (a batch): ``"<Type>: rule"`` (Opacus's layer rule) or ``"<Type>: torch.func"``
    (the layer alone, vmapped). For reports; runs one forward pass without gradients."""
    found: dict[str, str] = {}

    def capture(layer: ServedLayer):
        def hook(_module, args, output):
            rule = _rule_for(layer, args[0])
            how = "torch.func" if rule is _opacus()[1] else "rule"
            found[layer.name] = f"{type(layer.module).__name__}: {how}"

        return hook

    _forward_with_hooks(model, example, _served_layers(model), capture)
    return found


def factor_shapes(
    model: nn.Module, example: torch.Tensor, layout: ParameterLayout
) -> dict[str, tuple[int, int, int]]:
    """``{weight name: (T, d_in, d_out)}`` for the weights in ``layout`` whose gradients
    ``layer_gradients`` can keep as factors (``factorable`` layers served by their rule), for
    inputs shaped like ``example``: what the cost models of the Gram and ghost routes read.
    Runs one forward pass without gradients."""
    names = {id(p): n for n, p in model.named_parameters() if n in layout.index}
    shapes: dict[str, tuple[int, int, int]] = {}

    def capture(layer: ServedLayer):
        def hook(_module, args, output):
            name = names.get(id(layer.module.weight))
            if name is not None and isinstance(output, torch.Tensor):
                f = LayerFactors.of(layer.module, args[0].detach(), output.detach())
                shapes[name] = (f.positions, f.inputs.shape[2], f.backprops.shape[2])

        return hook

    served = [s for s in _served_layers(model) if not s.fallback and factorable(s.module)]
    _forward_with_hooks(model, example, served, capture)
    return shapes


def _forward_with_hooks(model, example, layers, make_hook) -> None:
    """One forward pass without gradients with ``make_hook(layer)`` on each of ``layers``, on
    the model's device."""
    device = next(model.parameters()).device
    handles = [layer.module.register_forward_hook(make_hook(layer)) for layer in layers]
    try:
        with torch.no_grad():
            model(example.to(device))
    finally:
        for h in handles:
            h.remove()
