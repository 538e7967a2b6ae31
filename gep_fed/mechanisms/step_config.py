"""``GEPConfig``: one private gradient step, its privacy contract and its privacy-free knobs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gep_fed.mechanisms.contract import (
    DEFAULT_BASIS_REFRESH,
    DEFAULT_NUM_ANCHORS,
    DEFAULT_NUM_BASIS,
    MECHANISMS,
    PrivacyContract,
)
from gep_fed.mechanisms.per_example import ENGINES
from gep_fed.validation import (
    AT_LEAST_ONE,
    POSITIVE,
    PROBABILITY,
    ConfigError,
    Range,
    check_choice,
)

ANCHOR_LABELS = ("random", "true")


@dataclass(frozen=True)
class GEPConfig:
    """One private gradient step.

    Attributes:
        contract: what each step releases and how it is accounted (``PrivacyContract``:
            mechanism, sigma, q, S1, S2, S); the only privacy settings of the step.
        num_basis: k, the anchor-subspace dimension, shared across parameter groups in
            proportion to sqrt(group size). No privacy meaning (public data only).
        num_anchors: m, public examples whose gradients span the subspace (None: all given;
            at most all given).
        power_iterations: t, passes of the power method per subspace computation.
        anchor_labels: "random" (fresh random labels at every computation, the paper's
            choice) or "true" (the public data's own labels).
        clip_quantile: if set, S1 and S2 are re-derived at each subspace computation as this
            quantile of the *public* anchors' embedding and residual norms (privacy-free:
            public data at already-private parameters); the contract's S1 and S2 are then
            only the starting point. Accounting is unchanged (it depends on sigma and q).
        residual_quantile: if set, S2 adapts at every step towards this quantile of the
            *private* residual norms (Andrew et al., "Differentially Private Learning with
            Adaptive Clipping", NeurIPS 2021): each step also releases the number of sampled
            examples whose residual was within S2, with Gaussian noise of std
            ``quantile_count_noise`` (sensitivity 1), and sets
            ``S2 <- S2 * exp(-quantile_lr * (noisy count / (q n) - residual_quantile))``. The
            count is accounted with the step (``Mechanism.accounting_noise_multiplier``), so
            for the same budget sigma must grow (``PrivacyContract.for_budget(...,
            count_noise=...)``). S2 starts at the contract's. GEP, single-machine only.
        quantile_count_noise: std of the noise on that count, in examples (Andrew et al.
            suggest the expected batch size / 20); larger costs less privacy, adapts slower.
        quantile_lr: the geometric step of the S2 update (Andrew et al.: 0.2).
        basis_refresh: recompute the subspace every this many steps (1: every step).
        past_releases: also span the subspace with this step's latest ``past_releases``
            released gradient estimates (each group's part, orthogonalised against the
            public basis): the releases are already noised and accounted, so reusing them is
            post-processing and costs no privacy. They add up to ``past_releases``
            dimensions per group to the ``num_basis`` public ones (0: public anchors only).
            Single-machine ``GEPStep`` only; a federation's subspace is public-only.
        max_chunk: at most this many examples are differentiated at once (memory bound).
        engine: how per-example gradients are computed: "layers" (each layer's rule from one
            batched backward pass, ``torch.func`` for layers without a rule) or "vmap"
            (``torch.func`` for the whole model). No privacy meaning: the clip bounds are
            computed on the gradients either engine gives.
        factored_layers: keep the per-example gradients of linear and convolution layers
            as their factors (layer inputs, output gradients) where that costs less than
            materialising them: GEP and B-GEP embed such layers by Gram products with the
            anchors' factors (``gep_fed.mechanisms.gram``; few output positions, many
            channels: a ResNet's last stage), GP takes their norms as ghost norms. The
            subspace's computation costs more (those layers' bases are built in float64).
            No privacy meaning: the clip bounds hold on either route.
        groups: ``{group: [parameter-name patterns]}``; None for the layer-aware default.
        anchor_cache_mb: keep anchor gradients in memory between power iterations when they
            fit in this many MiB, else recompute them per pass.

    The defaults of k, m and the refresh (and ``PrivacyContract``'s S1, S2, S) are GEP's best
    known step: what the standard benchmarks (``benchmarks/standard.py``: MNIST,
    Fashion-MNIST and CIFAR-10 on ScatterNet features, linear head, lr 4-8 with momentum 0.9
    on the mean clipped gradient) chose on validation. Clip norms are relative to a model's
    gradient scale: for another model, tune them (smaller clips need a larger learning rate).
    """

    contract: PrivacyContract
    num_basis: int = DEFAULT_NUM_BASIS
    num_anchors: int | None = DEFAULT_NUM_ANCHORS
    power_iterations: int = 1
    anchor_labels: str = "random"
    clip_quantile: float | None = None
    residual_quantile: float | None = None
    quantile_count_noise: float | None = None
    quantile_lr: float = 0.2
    basis_refresh: int = DEFAULT_BASIS_REFRESH
    past_releases: int = 0
    max_chunk: int = 128
    engine: str = "layers"
    factored_layers: bool = True
    groups: Mapping[str, Sequence[str]] | None = field(default=None, hash=False)
    anchor_cache_mb: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.contract, PrivacyContract):
            raise ConfigError(
                f"contract must be a PrivacyContract, got {type(self.contract).__name__}"
            )
        check_choice("contract.mechanism", self.contract.mechanism, MECHANISMS)
        check_choice("anchor_labels", self.anchor_labels, ANCHOR_LABELS)
        check_choice("engine", self.engine, ENGINES)
        if not isinstance(self.factored_layers, bool):
            raise ConfigError(
                f"factored_layers must be true or false, got {self.factored_layers!r}"
            )
        if self.clip_quantile is not None:
            PROBABILITY.check("clip_quantile", self.clip_quantile)
        if self.residual_quantile is not None:
            PROBABILITY.check("residual_quantile", self.residual_quantile)
            if self.contract.mechanism != "gep":
                raise ConfigError("residual_quantile adapts GEP's S2: use mechanism gep")
            if self.clip_quantile is not None:
                raise ConfigError(
                    "give either clip_quantile (public anchors' norms) or residual_quantile "
                    "(private, accounted), not both"
                )
            if self.quantile_count_noise is None:
                raise ConfigError(
                    "residual_quantile needs quantile_count_noise, the std of the noise on the "
                    "count of examples within S2 (e.g. the expected batch size / 20)"
                )
        if self.quantile_count_noise is not None:
            POSITIVE.check("quantile_count_noise", self.quantile_count_noise)
        POSITIVE.check("quantile_lr", self.quantile_lr)
        for name in ("num_basis", "power_iterations", "basis_refresh", "max_chunk"):
            AT_LEAST_ONE.check(name, getattr(self, name))
        if self.num_anchors is not None:
            AT_LEAST_ONE.check("num_anchors", self.num_anchors)
        Range(0, integer=True).check("anchor_cache_mb", self.anchor_cache_mb)
        Range(0, integer=True).check("past_releases", self.past_releases)
        if self.groups is not None and (
            not isinstance(self.groups, Mapping)
            or not all(
                isinstance(v, Sequence) and not isinstance(v, str) for v in self.groups.values()
            )
        ):
            raise ConfigError("groups must map group names to lists of parameter-name patterns")

    @property
    def count_noise(self) -> float | None:
        """Std of the noise on the count of examples within S2 (adaptive S2), else None."""
        return self.quantile_count_noise if self.residual_quantile is not None else None
