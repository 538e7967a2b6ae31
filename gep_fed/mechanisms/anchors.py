"""Computing the anchor subspace from public data at the current parameters.

Public examples get fresh random labels at each computation (the paper's choice: true labels
make the subspace overfit the auxiliary set). Nothing here touches private data.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from gep_fed.mechanisms.factored import LayerFactors
from gep_fed.mechanisms.gram import build_gram_group, gram_pays
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.layer_gradients import factor_shapes
from gep_fed.mechanisms.per_example import LossFn, factored_gradients, per_example_gradients
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.mechanisms.subspace import (
    AnchorSubspace,
    power_method_subspace,
    subspace_from_coefficients,
)


@dataclass(frozen=True)
class AnchorSet:
    """What a party needs to rebuild a subspace itself: the anchors used (inputs and the
    labels they were given) and each group's ``(m, k_g)`` coefficients of the basis in their
    gradients (``rebuild_anchor_subspace``). All public: public data, public random labels,
    and a function of their gradients at the current (public) weights."""

    inputs: torch.Tensor
    labels: torch.Tensor
    coefficients: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class WarmStart:
    """What a subspace computation leaves for the next one to start from (public values only):
    the bases and, per group, the power method's estimate of the anchors' mean squared
    gradient along each basis vector (``|diag R| / m`` of its last QR step).

    ``compute_anchor_subspace(..., previous=warm)`` starts the power method from these bases
    instead of a Gaussian matrix: subspace iteration continued across refreshes, so that one
    pass per refresh converges as the model moves slowly. With ``memory`` > 0 the anchors'
    gradient covariance of the previous refreshes is carried too (``memory`` times
    ``B diag(scales) B^T`` added to this refresh's ``G^T G / m``): a refresh can then use
    fewer anchors than basis vectors would need alone, as streaming PCA does."""

    subspace: AnchorSubspace
    # None after a cold start: the next start estimates them on its own anchors
    scales: tuple[torch.Tensor, ...] | None


@dataclass(frozen=True)
class AnchorResult:
    """A computed subspace and what was measured on the anchors along the way.

    Attributes:
        subspace: the per-group orthonormal bases.
        projection_error: ``sum ||r||^2 / sum ||g||^2`` on the anchors (None if not measured).
        clip_embedding, clip_residual: the ``clip_quantile`` quantiles of the anchors'
            embedding and residual norms (None unless requested).
        seconds: wall time of the computation.
        anchors: the anchors and the basis' coefficients, when asked for
            (``compute_anchor_subspace(..., with_coefficients=True)``), else None.
    """

    subspace: AnchorSubspace
    projection_error: float | None
    clip_embedding: float | None
    clip_residual: float | None
    seconds: float
    anchors: AnchorSet | None = None
    warm: WarmStart | None = None


class _AnchorGradients:
    """Anchor-gradient chunks, cached in memory when they fit, else recomputed per pass."""

    def __init__(self, model, loss_fn, inputs, labels, layout, max_chunk, engine, cache_bytes):
        self._args = (model, loss_fn, layout, engine)
        self._inputs, self._labels, self._max_chunk = inputs, labels, max_chunk
        self._cache: list[torch.Tensor] | None = (
            [] if inputs.shape[0] * layout.size * 4 <= cache_bytes else None
        )
        self._complete = False

    def __call__(self) -> Iterator[torch.Tensor]:
        if self._complete:
            yield from self._cache
            return
        model, loss_fn, layout, engine = self._args
        for start in range(0, self._inputs.shape[0], self._max_chunk):
            stop = start + self._max_chunk
            chunk = per_example_gradients(
                model,
                loss_fn,
                self._inputs[start:stop],
                self._labels[start:stop],
                layout,
                self._max_chunk,
                engine,
            )
            if self._cache is not None:
                self._cache.append(chunk)
            yield chunk
        self._complete = self._cache is not None


def infer_num_classes(model: nn.Module, example: torch.Tensor) -> int:
    """The width of the model's output for one example (for drawing random labels)."""
    with torch.no_grad():
        out = model(example[:1].to(next(model.parameters()).device))
    if out.ndim != 2:
        raise ValueError(
            f"the model's output for one example has shape {tuple(out.shape)}; random anchor "
            "labels need a (batch, classes) output, or pass num_classes"
        )
    return int(out.shape[1])


def compute_anchor_subspace(
    model: nn.Module,
    public_inputs: torch.Tensor,
    layout: ParameterLayout,
    config: GEPConfig,
    *,
    loss_fn: LossFn,
    num_classes: int | None = None,
    public_labels: torch.Tensor | None = None,
    multilabel: bool = False,
    generator: torch.Generator | None = None,
    measure: bool = False,
    with_coefficients: bool = False,
    previous: WarmStart | None = None,
    memory: float = 0.0,
) -> AnchorResult:
    """The anchor subspace of ``model`` at its current parameters.

    Args:
        public_inputs: the public (non-sensitive) examples, on the model's device.
        config: k, m, t, labels and chunking (see ``GEPConfig``).
        num_classes: for random labels (inferred from the model's output if None).
        public_labels: required when ``config.anchor_labels == "true"``.
        multilabel: random labels are independent fair 0/1 per output (multi-label or
            one-logit binary tasks) instead of one random class.
        generator: public randomness for the anchor subset, labels and power-method start.
        measure: also measure the projection error (and, if ``config.clip_quantile`` is set,
            the clip norms) on the anchors: one more pass over their gradients.
        with_coefficients: also return the anchors and the basis' coefficients in their
            gradients (``AnchorResult.anchors``), from which ``rebuild_anchor_subspace``
            rebuilds the basis.
        previous: the last computation's ``AnchorResult.warm``: the power method starts
            from its bases instead of a random matrix (ignored when the layout or the basis
            sizes differ). Public values only, so no privacy cost.
        memory: with ``previous``, the weight of the previous refreshes' anchor covariance
            (``WarmStart``); 0 (the default) uses this refresh's anchors alone. Not with
            ``with_coefficients``, and no Gram groups (``factored_layers``): a carried
            covariance has no coefficients in this refresh's anchors. The result's
            ``warm`` is what the next computation starts from (no extra cost: the bases
            and the last QR step's diagonal).
    """
    if memory < 0:
        raise ValueError(f"memory must be >= 0, got {memory}")
    if memory and with_coefficients:
        raise ValueError("memory > 0 has no coefficients in the anchors' gradients")
    began = time.perf_counter()
    device = next(model.parameters()).device
    m_total = public_inputs.shape[0]
    if m_total == 0:
        raise ValueError("the public (anchor) data set is empty")
    m = m_total if config.num_anchors is None else min(config.num_anchors, m_total)
    pick = torch.randperm(m_total, generator=generator)[:m] if m < m_total else torch.arange(m)
    inputs = public_inputs[pick.to(public_inputs.device)]
    if config.anchor_labels == "true":
        if public_labels is None:
            raise ValueError("anchor_labels='true' needs the public data's labels")
        labels = public_labels[pick.to(public_labels.device)]
    else:
        classes = num_classes or infer_num_classes(model, inputs)
        if multilabel:
            labels = torch.randint(2, (m, classes), generator=generator).float()
        else:
            labels = torch.randint(classes, (m,), generator=generator)
    labels = labels.to(device)
    grads = _AnchorGradients(
        model,
        loss_fn,
        inputs.to(device),
        labels,
        layout,
        config.max_chunk,
        config.engine,
        config.anchor_cache_mb * 2**20,
    )
    dims = layout.allocate_basis(config.num_basis, max_rank=m)
    if memory and previous is not None:  # the carried covariance spans the previous bases too
        dims = tuple(
            max(d, min(p, k))
            for d, p, k in zip(
                dims, layout.allocate_basis(config.num_basis), previous.subspace.dims, strict=True
            )
        )
    anchors = None
    gram_weights = (
        planned_gram_weights(model, inputs[:1].to(device), layout, dims, m)
        if config.engine == "layers" and config.factored_layers and not memory
        else frozenset()  # a carried covariance has no coefficients to build Gram groups from
    )
    if previous is not None and (
        previous.subspace.layout.names != layout.names or previous.subspace.dims != dims
    ):
        previous = None  # another model or basis size: a cold start
    if previous is None:
        subspace, coefficients = power_method_subspace(
            grads,
            layout,
            dims,
            config.power_iterations,
            generator=generator,
            device=device,
            with_coefficients=True,
        )
        scales = None
    else:
        subspace, coefficients, scales = warm_power_method(
            grads, layout, previous, config.power_iterations, memory, m
        )
    if gram_weights:
        subspace, coefficients = with_gram_groups(
            model,
            loss_fn,
            inputs.to(device),
            labels,
            subspace,
            coefficients,
            gram_weights,
            config.max_chunk,
        )
    if with_coefficients:
        anchors = AnchorSet(inputs, labels, coefficients)
    projection_error = clip_e = clip_r = None
    if measure or config.clip_quantile is not None:
        g2, w2 = [], []
        for chunk in grads():
            g2.append(torch.linalg.vector_norm(chunk, dim=1, dtype=torch.float64) ** 2)
            emb = subspace.embed(chunk)
            w2.append(torch.linalg.vector_norm(emb, dim=1, dtype=torch.float64) ** 2)
        g2, w2 = torch.cat(g2), torch.cat(w2)
        r2 = (g2 - w2).clamp_min(0)
        total = float(g2.sum())
        projection_error = float(r2.sum()) / total if total > 0 else 0.0
        if config.clip_quantile is not None:
            clip_e = float(torch.quantile(w2.sqrt(), config.clip_quantile))
            clip_r = float(torch.quantile(r2.sqrt(), config.clip_quantile))
            # A zero quantile (e.g. all-zero anchor gradients) cannot serve as a clip norm.
            tiny = 1e-6
            clip_e, clip_r = max(clip_e, tiny), max(clip_r, tiny)
    warm = WarmStart(AnchorSubspace(layout, subspace.bases), scales)
    seconds = time.perf_counter() - began
    return AnchorResult(subspace, projection_error, clip_e, clip_r, seconds, anchors, warm)


def warm_power_method(
    gradient_chunks, layout: ParameterLayout, previous: WarmStart, passes: int, memory: float, m
) -> tuple[AnchorSubspace, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``power_method_subspace`` started from ``previous``' bases: each pass computes
    ``L <- orth((G_g^T G_g / m + memory B diag(s) B^T) L)`` (``B``, ``s``: the previous bases
    and scales) with ``G_g`` streamed in chunks. Returns the subspace, the coefficients of its
    bases in the anchors' gradients (``C = Y R^-1 / m``, as ``power_method_subspace`` gives
    them; meaningful when ``memory`` is 0) and the scales of the new bases (``|diag R|``)."""
    bases = tuple(b.to(torch.float32) for b in previous.subspace.bases)
    current = list(bases)
    cols = [slice(g.start, g.stop) for g in layout.groups]
    for step in range(passes):
        acc = [torch.zeros_like(c) for c in current]
        last = step == passes - 1
        products: list[list[torch.Tensor]] = [[] for _ in cols]
        along = [torch.zeros(c.shape[1], dtype=c.dtype, device=c.device) for c in current]
        for chunk in gradient_chunks():
            for g, sl in enumerate(cols):
                block = chunk[:, sl]
                y = block @ current[g]
                acc[g].addmm_(block.T, y, alpha=1.0 / m)
                if last:
                    products[g].append(y)
                if step == 0:  # along the previous bases: their scales if none were kept
                    along[g] += (y * y).sum(0)
        if step == 0:
            carried = previous.scales or tuple(a / m for a in along)
        if memory:
            for g, (b, s) in enumerate(zip(bases, carried, strict=True)):
                acc[g].addmm_(b * (memory * s.to(b)), b.T @ current[g])
        factors = [torch.linalg.qr(a) for a in acc]
        current = [f.Q for f in factors]
    coefficients = tuple(
        torch.linalg.solve_triangular(f.R * m, torch.cat(y), upper=True, left=False)
        for f, y in zip(factors, products, strict=True)
    )
    scales = tuple(torch.diagonal(f.R).abs() for f in factors)
    return AnchorSubspace(layout, tuple(current)), coefficients, scales


def rebuild_anchor_subspace(
    model: nn.Module,
    anchors: AnchorSet,
    layout: ParameterLayout,
    *,
    loss_fn: LossFn,
    max_chunk: int = 128,
    engine: str = "layers",
) -> AnchorSubspace:
    """The subspace ``B_g = G_g^T C_g`` from ``anchors``' gradients at ``model``'s current
    parameters: what a site computes instead of receiving the bases (the server computes it
    the same way, so both use the same basis up to float rounding). The groups where the
    cost model (``planned_gram_weights``) prefers it are built for Gram embedding, as
    ``compute_anchor_subspace`` builds them. Public data only."""
    device = next(model.parameters()).device
    grads = _AnchorGradients(
        model,
        loss_fn,
        anchors.inputs.to(device),
        anchors.labels.to(device),
        layout,
        max_chunk,
        engine,
        0,  # one pass: nothing to cache
    )
    coefficients = tuple(c.to(device) for c in anchors.coefficients)
    subspace = subspace_from_coefficients(grads, layout, coefficients)
    inputs, labels = anchors.inputs.to(device), anchors.labels.to(device)
    weights = (
        planned_gram_weights(model, inputs[:1], layout, subspace.dims, inputs.shape[0])
        if engine == "layers"
        else frozenset()
    )
    if weights:  # the server built these groups the same way (``with_gram_groups``)
        subspace, _ = with_gram_groups(
            model, loss_fn, inputs, labels, subspace, coefficients, weights, max_chunk
        )
    return subspace


# A group's other parameters are still materialised and their anchor gradients held in
# float64 at each refresh: below this share of factored weights the overhead outweighs the saving.
GRAM_GROUP_SHARE = 0.5


def planned_gram_weights(
    model: nn.Module, example: torch.Tensor, layout: ParameterLayout, dims, num_anchors: int
) -> frozenset[str]:
    """The weights whose embedding costs less by Gram products with ``num_anchors`` anchors
    than by materialising their gradients (``gram.gram_pays``), for inputs like ``example``,
    in the groups where such weights hold at least ``GRAM_GROUP_SHARE`` of the parameters."""
    group_of = {n: i for i, g in enumerate(layout.groups) for n in g.param_names}
    chosen: dict[int, list[str]] = {}
    for name, shape in factor_shapes(model, example, layout).items():
        if gram_pays(shape, num_anchors, dims[group_of[name]]):
            chosen.setdefault(group_of[name], []).append(name)

    def size(name: str) -> int:
        start, stop = layout.index[name]
        return stop - start

    return frozenset(
        name
        for index, names in chosen.items()
        if sum(map(size, names)) >= GRAM_GROUP_SHARE * layout.groups[index].size
        for name in names
    )


def with_gram_groups(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    subspace: AnchorSubspace,
    coefficients: tuple[torch.Tensor, ...],
    weights: frozenset[str],
    max_chunk: int = 128,
) -> tuple[AnchorSubspace, tuple[torch.Tensor, ...]]:
    """``subspace`` with the groups holding ``weights`` rebuilt for Gram embedding
    (``gram.build_gram_group``) from the anchors ``inputs`` (with ``labels``) and the power
    method's ``coefficients``; returns it and the coefficients of its bases in the anchors'
    gradients. Public data only. A group whose anchors span too few directions keeps its
    basis and is embedded from materialised gradients."""
    layout = subspace.layout
    groups = [i for i, g in enumerate(layout.groups) if weights & set(g.param_names)]
    # only these groups' parameters are differentiated: the others' rules do not run
    served = ParameterLayout.from_dict(
        {
            "names": [n for i in groups for n in layout.groups[i].param_names],
            "shapes": [
                layout.shapes[layout.names.index(n)]
                for i in groups
                for n in layout.groups[i].param_names
            ],
            "groups": [[layout.groups[i].name, list(layout.groups[i].param_names)] for i in groups],
        }
    )
    factors: dict[str, list[LayerFactors]] = {n: [] for n in weights}
    dense: dict[int, list[torch.Tensor]] = {i: [] for i in groups}
    for start in range(0, inputs.shape[0], max_chunk):
        chunk = factored_gradients(
            model,
            loss_fn,
            inputs[start : start + max_chunk],
            labels[start : start + max_chunk],
            served,
            weights,
        )
        if chunk is None:  # the layer engine cannot serve this model
            return subspace, coefficients
        for name, f in chunk.factors.items():
            factors[name].append(f)
        for j, i in enumerate(groups):
            dense[i].append(chunk.dense[:, chunk.dense_columns(served.groups[j])])
    bases, coefficients, gram = list(subspace.bases), list(coefficients), {}
    for i in groups:
        mine = {
            n: LayerFactors(
                torch.cat([f.inputs for f in factors[n]]),
                torch.cat([f.backprops for f in factors[n]]),
            )
            for n in layout.groups[i].param_names
            if n in weights
        }
        built = build_gram_group(layout, i, mine, torch.cat(dense[i]), coefficients[i])
        if built is not None:
            bases[i], gram[i] = built
            coefficients[i] = gram[i].coefficients.float()
    return AnchorSubspace(layout, tuple(bases), gram), tuple(coefficients)
