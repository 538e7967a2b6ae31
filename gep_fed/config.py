"""Typed, validated configuration: the privacy contract, a private step, a federated run.

Errors name the field, the value and the allowed range, so a bad value is fixed where it was
written (CLI option, ``pyproject.toml`` run config, node config or a received round config).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

from gep_fed.accounting.events import PrivacyEvent
from gep_fed.mechanisms.clip_bounds import CLIP_BOUND_RANGE
from gep_fed.mechanisms.mechanism import GP, Mechanism, mechanism_class

MECHANISMS = ("gep", "bgep", "gp")
ANCHOR_LABELS = ("random", "true")
MODES = ("central", "client")
FEDERATED_MECHANISMS = (*MECHANISMS, "langevin")


# GEP's best known step: the setting every standard benchmark (MNIST, Fashion-MNIST, CIFAR-10
# on ScatterNet features; benchmarks/standard.py) chose on validation, for GEP (S1, S2/S1 = 0.5,
# k, anchors, refresh) and for GP (S). Pinned to the benchmark's log by tests/test_defaults.py.
DEFAULT_CLIP_EMBEDDING = 0.1
DEFAULT_CLIP_RESIDUAL = 0.05
DEFAULT_CLIP_NORM = 0.1
DEFAULT_NUM_BASIS = 100
DEFAULT_NUM_ANCHORS = 1000
DEFAULT_BASIS_REFRESH = 20


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


@dataclass(frozen=True)
class PrivacyContract:
    """What one private step releases and how it is accounted, defined once.

    The server builds its mechanism (central noise) from the same contract object it sends to
    every site in the round config; each site builds its mechanism and its ledger events from
    the contract it received; ``GEPConfig`` and ``FederationConfig`` derive theirs. No copy of
    these fields is made by hand, so a site cannot clip with one S1 while the server noises
    with another.

    Attributes:
        mechanism: "gep" (embedding and residual, two releases per step), "bgep" (embedding
            only), "gp" (DP-SGD) or "langevin" (noisy SGD with a Gaussian prior; its noise
            comes from ``langevin_beta0`` and its events from the Langevin schedule).
        noise_multiplier: sigma, noise standard deviation divided by the clip norm of each
            released vector; 0 means no noise and no privacy (infinite epsilon).
        sample_rate: q, each private example's independent chance to be in a step's Poisson
            sample; smaller amplifies privacy.
        clip_embedding, clip_residual: S1 and S2, per-example bounds of the embedding and the
            residual (GEP, B-GEP); their noise is ``sigma * S1`` and ``sigma * S2``.
        clip_norm: S, per-example gradient bound (GP; Langevin's G). Clip norms must lie in
            ``CLIP_BOUND_RANGE`` (1e-30 to 1e30): there every bound holds in float32 with the
            proven rounding margins of ``gep_fed.mechanisms.clip_bounds``; a round config
            outside it is refused as malformed.
        langevin_beta0: Langevin's prior variance. It scales the noise and the step sizes of
            the multi-pass schedule together, so it shapes training, not privacy: multi-pass
            epsilon depends only on the steps, the batch, n and delta.
    """

    mechanism: str
    noise_multiplier: float
    sample_rate: float
    clip_embedding: float = DEFAULT_CLIP_EMBEDDING
    clip_residual: float = DEFAULT_CLIP_RESIDUAL
    clip_norm: float = DEFAULT_CLIP_NORM
    langevin_beta0: float = 0.0

    def __post_init__(self) -> None:
        _choice("mechanism", self.mechanism, FEDERATED_MECHANISMS)
        _number("noise_multiplier", self.noise_multiplier, low=0, low_open=False)
        _number("sample_rate", self.sample_rate, low=0, high=1)
        low, high = CLIP_BOUND_RANGE
        for name in ("clip_embedding", "clip_residual", "clip_norm"):
            _number(name, getattr(self, name), low=low, high=high, low_open=False)
        _number("langevin_beta0", self.langevin_beta0, low=0, low_open=self.is_langevin)

    @property
    def is_langevin(self) -> bool:
        return self.mechanism == "langevin"

    @property
    def mechanism_type(self) -> type[Mechanism]:
        """The class of the released mechanism (Langevin clips like GP)."""
        return GP if self.is_langevin else mechanism_class(self.mechanism)

    def build_mechanism(
        self, clip_embedding: float | None = None, clip_residual: float | None = None
    ) -> Mechanism:
        """The mechanism object with this contract's clip norms (or the given S1, S2, e.g.
        derived from public anchors)."""
        s1 = self.clip_embedding if clip_embedding is None else clip_embedding
        s2 = self.clip_residual if clip_residual is None else clip_residual
        cls = self.mechanism_type
        if cls.name == "gep":
            return cls(s1, s2)
        if cls.name == "bgep":
            return cls(s1)
        return cls(self.clip_norm)

    def events(
        self,
        steps: int,
        *,
        party: str = "",
        round: int | None = None,
        placement: str = "local",
    ) -> list[PrivacyEvent]:
        """``steps`` releases under this contract, one event each (each carries its round).
        Langevin's events depend on the step index and the data size: ``LangevinTrainer``
        builds those."""
        if self.is_langevin:
            raise ValueError("Langevin events come from LangevinTrainer.multi_pass_events")
        return [
            self.mechanism_type.event(
                self.noise_multiplier,
                self.sample_rate,
                party=party,
                round=round,
                placement=placement,
            )
            for _ in range(steps)
        ]

    def to_record(self, prefix: str = "privacy.") -> dict:
        """Flat ``{prefix + field: value}`` (a Flower ConfigRecord holds scalars only)."""
        return {prefix + k: v for k, v in asdict(self).items()}

    @classmethod
    def from_record(cls, record: Mapping, prefix: str = "privacy.") -> PrivacyContract:
        """Decode and validate; a missing, mistyped or out-of-range value is a
        ``ConfigError`` naming the field."""
        values = {}
        for f in fields(cls):
            key = prefix + f.name
            if key not in record:
                raise ConfigError(f"{key} is missing")
            value = record[key]
            if f.name != "mechanism" and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            values[f.name] = value
        return cls(**values)


@dataclass(frozen=True)
class GEPConfig:
    """One private gradient step.

    Attributes:
        mechanism: "gep" (embedding and residual, unbiased), "bgep" (embedding only, biased,
            k numbers per release) or "gp" (plain DP-SGD).
        noise_multiplier: sigma. Each released vector gets Gaussian noise of standard
            deviation ``sigma`` times its clip norm; larger means more private. GEP is
            accounted as ``sigma / sqrt(2)`` because it releases two vectors.
        sample_rate: q, each private example's independent chance to be in a step's batch
            (Poisson sampling); smaller amplifies privacy.
        num_basis: k, the anchor-subspace dimension, shared across parameter groups in
            proportion to sqrt(group size). No privacy meaning (public data only).
        num_anchors: m, public examples whose gradients span the subspace (None: all given;
            at most all given).
        power_iterations: t, passes of the power method per subspace computation.
        anchor_labels: "random" (fresh random labels at every computation, the paper's
            choice) or "true" (the public data's own labels).
        clip_embedding: S1, bound on each example's embedding norm (GEP, B-GEP).
        clip_residual: S2, bound on each example's residual norm (GEP).
        clip_norm: S, bound on each example's gradient norm (GP).

    The defaults of S1, S2, S, k, m and the refresh are GEP's best known step: what the
    standard benchmarks (``benchmarks/standard.py``: MNIST, Fashion-MNIST and CIFAR-10 on
    ScatterNet features, linear head, lr 4-8 with momentum 0.9 on the mean clipped gradient)
    chose on validation. Clip norms are relative to a model's gradient scale: for another model,
    tune them (smaller clips need a larger learning rate).
        clip_quantile: if set, S1 and S2 are re-derived at each subspace computation as this
            quantile of the *public* anchors' embedding and residual norms (privacy-free:
            public data at already-private parameters); ``clip_embedding`` and
            ``clip_residual`` are then ignored.
        residual_quantile: if set, S2 adapts at every step towards this quantile of the
            *private* residual norms (Andrew et al., "Differentially Private Learning with
            Adaptive Clipping", NeurIPS 2021): each step also releases the number of sampled
            examples whose residual was within S2, with Gaussian noise of std
            ``quantile_count_noise`` (sensitivity 1), and sets
            ``S2 <- S2 * exp(-quantile_lr * (noisy count / (q n) - residual_quantile))``. The
            count is accounted with the step (``Mechanism.accounting_noise_multiplier``), so
            for the same budget sigma must grow (``calibrate_noise_multiplier(...,
            count_noise=...)``). S2 starts at ``clip_residual``. GEP, single-machine only.
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
        groups: ``{group: [parameter-name patterns]}``; None for the layer-aware default.
        anchor_cache_mb: keep anchor gradients in memory between power iterations when they
            fit in this many MiB, else recompute them per pass.
    """

    mechanism: str = "gep"
    noise_multiplier: float = 1.0
    sample_rate: float = 0.01
    num_basis: int = DEFAULT_NUM_BASIS
    num_anchors: int | None = DEFAULT_NUM_ANCHORS
    power_iterations: int = 1
    anchor_labels: str = "random"
    clip_embedding: float = DEFAULT_CLIP_EMBEDDING
    clip_residual: float = DEFAULT_CLIP_RESIDUAL
    clip_norm: float = DEFAULT_CLIP_NORM
    clip_quantile: float | None = None
    residual_quantile: float | None = None
    quantile_count_noise: float | None = None
    quantile_lr: float = 0.2
    basis_refresh: int = DEFAULT_BASIS_REFRESH
    past_releases: int = 0
    max_chunk: int = 128
    groups: Mapping[str, Sequence[str]] | None = field(default=None, hash=False)
    anchor_cache_mb: int = 1024

    def __post_init__(self) -> None:
        _choice("mechanism", self.mechanism, MECHANISMS)
        _choice("anchor_labels", self.anchor_labels, ANCHOR_LABELS)
        _ = self.contract  # validates the privacy fields
        if self.clip_quantile is not None:
            _number("clip_quantile", self.clip_quantile, low=0, high=1)
        if self.residual_quantile is not None:
            _number("residual_quantile", self.residual_quantile, low=0, high=1)
            if self.mechanism != "gep":
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
            _number("quantile_count_noise", self.quantile_count_noise, low=0)
        _number("quantile_lr", self.quantile_lr, low=0)
        for name in ("num_basis", "power_iterations", "basis_refresh", "max_chunk"):
            _integer(name, getattr(self, name), low=1)
        if self.num_anchors is not None:
            _integer("num_anchors", self.num_anchors, low=1)
        _integer("anchor_cache_mb", self.anchor_cache_mb, low=0)
        _integer("past_releases", self.past_releases, low=0)
        if self.groups is not None and (
            not isinstance(self.groups, Mapping)
            or not all(
                isinstance(v, Sequence) and not isinstance(v, str) for v in self.groups.values()
            )
        ):
            raise ConfigError("groups must map group names to lists of parameter-name patterns")

    @property
    def contract(self) -> PrivacyContract:
        """The privacy fields of this step as one contract."""
        return PrivacyContract(**{f.name: getattr(self, f.name) for f in _STEP_CONTRACT_FIELDS})

    @classmethod
    def from_contract(cls, contract: PrivacyContract, **settings) -> GEPConfig:
        """A step configuration that releases exactly what ``contract`` says; ``settings``
        are the privacy-free knobs (``num_basis``, ``max_chunk``, ...)."""
        if contract.is_langevin:
            raise ConfigError("a Langevin contract is run by LangevinTrainer, not GEPStep")
        return cls(**{f.name: getattr(contract, f.name) for f in _STEP_CONTRACT_FIELDS}, **settings)

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> GEPConfig:
        """Build from a flat mapping (e.g. a Flower run config), naming unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown GEPConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


def _choice(name: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _number(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = True,
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ConfigError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ConfigError(f"{name} must be <= {high}, got {value!r}")


def _integer(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")


# The contract fields a GEPConfig carries (all but Langevin's prior).
_STEP_CONTRACT_FIELDS = tuple(f for f in fields(PrivacyContract) if f.name != "langevin_beta0")


def _opt(default, help_text: str):
    """A dataclass field with its ``--help`` text (what the CLI shows)."""
    return field(default=default, metadata={"help": help_text})


PARTITIONS = ("iid", "dirichlet")
# A run config's value that means "not given" (see FederationConfig.from_record).
RUN_CONFIG_DEFAULT = "default"
DEVICES = ("auto", "cpu", "cuda")
BASIS_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class FederationConfig:
    """A federated run: data and sites, privacy, subspace, optimisation, operation.

    In a Flower run config the keys are written in kebab-case (``target-epsilon``);
    ``noise-multiplier = "auto"`` and ``num-anchors = 0`` mean None.

    Privacy fields:
        mode: "client" (default; each site adds its own noise and keeps its own ledger, the
            server is not trusted) or "central" (sites send unnoised clipped sums to a
            trusted server, which adds the noise once per round).
        mechanism: "gep", "bgep" or "gp".
        target_epsilon, delta: the budget. The server stops before a round that would exceed
            it; sigma is calibrated to spend exactly it over all rounds when
            ``noise_multiplier`` is None. Each site enforces its own budget too.
        sample_rate: q, every site's Poisson rate; central mode accounts the union of the
            sites' data at this rate and normalises by ``q * total_examples``.
        total_examples: N, the declared size of the union of the sites' data (central mode);
            None lets a simulation use its partitions' sizes. Never a count sent by a site.
        clip_embedding, clip_residual, clip_norm: S1, S2 (GEP, B-GEP) and S (GP).
        noise_seed: fixes the server's noise, and in ``simulate`` the simulated sites' (tests
            and benchmarks only: a known seed voids privacy). A deployed site's noise is
            always seeded by its OS; no run config can set it.
        run_dir, run_name: outputs go to ``run_dir/run_name`` (``run_dir/run-<flower run id>``
            when ``run_name`` is empty); an existing one with a checkpoint is resumed.
        release_site_metrics: let *simulated* sites report their raw training loss
            (labelled in every output as outside the guarantee). Off by default. A deployed
            site decides this itself (node config ``release-metrics``).

    Every field's help text is in its metadata (what ``gep-fed simulate --help`` shows).
    """

    task: str = _opt(
        "digits",
        "the task: digits (bundled, offline), mnist, fashion-mnist, pneumonia, medmnist, "
        "cifar10, or your own as 'package.module:ClassName' (see docs/tasks.md); a task may "
        "recommend its own defaults, which options given here override",
    )
    model: str = _opt(
        "auto",
        "architecture, as the task understands it (built-in tasks: auto = mlp for digits, "
        "scatter-linear for fashion-mnist and cifar10, cnn otherwise; cnn, mlp, linear, "
        "scatter-linear, scatter-cnn; cifar10: scatter-linear, resnet20, cnn)",
    )
    data_dir: str = _opt("../shared/data", "folder with mnist/, kmnist/, medmnist/")
    medmnist_path: str = _opt("", "a MedMNIST <flag>.npz for task medmnist")
    num_sites: int = _opt(3, "number of sites (simulated SuperNodes)")
    partition: str = _opt("iid", "how the pooled data is split across sites: iid or dirichlet")
    dirichlet_alpha: float = _opt(0.5, "label skew for --partition dirichlet (smaller: more skew)")
    num_public: int = _opt(2000, "public anchor examples the server holds (labels never used)")
    mode: str = _opt(
        "client",
        "client: each site noises its own updates and keeps its own ledger (untrusted "
        "server); central: sites send unnoised clipped sums, the trusted server adds the noise",
    )
    mechanism: str = _opt(
        "gep",
        "gep (unbiased, two releases per step), bgep, gp (DP-SGD), or langevin (noisy SGD "
        "with a Gaussian prior; client mode, --model linear)",
    )
    target_epsilon: float = _opt(
        8.0,
        "privacy budget epsilon: the run stops before exceeding it and, unless "
        "--noise-multiplier is given, sigma is calibrated to spend it over all rounds",
    )
    delta: float = _opt(1e-5, "delta of the (epsilon, delta) guarantee")
    noise_multiplier: float | None = _opt(
        None,
        "sigma: noise std / clip norm ('auto': calibrated from the budget; 0: no noise, "
        "no privacy)",
    )
    sample_rate: float = _opt(
        0.1,
        "q: each private example's chance to be in a step's "
        "Poisson sample (smaller amplifies privacy)",
    )
    total_examples: int | None = _opt(
        None,
        "N, the declared size of the union of the sites' data (central-mode "
        "normalisation q*N); default: the simulation's pooled size",
    )
    clip_embedding: float = _opt(1.0, "S1: bound on each example's embedding norm (noise sigma*S1)")
    clip_residual: float = _opt(1.0, "S2: bound on each example's residual norm (noise sigma*S2)")
    clip_norm: float = _opt(1.0, "S: bound on each example's gradient norm (gp; G for langevin)")
    langevin_beta0: float = _opt(
        1.0,
        "langevin prior variance beta0: scales noise and step sizes together (training, not "
        "privacy: multi-pass epsilon depends on steps, batch, n and delta only)",
    )
    num_basis: int = _opt(64, "k: anchor-subspace dimension (public; no privacy cost)")
    num_anchors: int | None = _opt(None, "m: anchors used per subspace (default: all public data)")
    power_iterations: int = _opt(1, "t: power-method passes per subspace")
    anchor_labels: str = _opt(
        "random",
        "labels of the public anchors: random (fresh at every subspace, the default) or true "
        "(the public data's own labels)",
    )
    basis_refresh: int = _opt(1, "recompute and resend the basis every R rounds")
    basis_dtype: str = _opt("float32", "basis on the wire: float32 or float16 (half the bytes)")
    rounds: int = _opt(10, "federated rounds")
    local_steps: int = _opt(10, "private steps per site per round (client mode), each accounted")
    local_lr: float = _opt(1.0, "site learning rate (client mode)")
    local_momentum: float = _opt(0.0, "site SGD momentum (client mode)")
    server_lr: float = _opt(
        1.0, "server step size on the private gradient (central) or on the mean delta (client)"
    )
    server_momentum: float = _opt(0.0, "server SGD momentum")
    min_sites: int = _opt(1, "fewest valid replies for a round to update the model")
    round_timeout: float = _opt(600.0, "seconds to wait for the sites' replies in a round")
    seed: int = _opt(0, "public randomness: partitions, anchors, initial model (never noise)")
    noise_seed: int | None = _opt(
        None, "fix the noise (tests and benchmarks only: a known seed voids the guarantee)"
    )
    run_dir: str = _opt("runs", "where run directories are created")
    run_name: str = _opt("", "run directory name (an existing one is resumed)")
    device: str = _opt("auto", "auto (cuda when available), cpu or cuda")
    release_site_metrics: bool = _opt(
        False,
        "let simulated sites report raw training loss, labelled as OUTSIDE the privacy "
        "guarantee (a deployed site decides this in its own node config)",
    )
    max_chunk: int = _opt(128, "examples differentiated at once (memory bound)")

    def __post_init__(self) -> None:
        from gep_fed.data.task import resolve_task

        try:
            resolve_task(self.task)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model must be a name, got {self.model!r}")
        _choice("mode", self.mode, MODES)
        _choice("mechanism", self.mechanism, FEDERATED_MECHANISMS)
        _choice("partition", self.partition, PARTITIONS)
        _choice("basis_dtype", self.basis_dtype, BASIS_DTYPES)
        _choice("anchor_labels", self.anchor_labels, ANCHOR_LABELS)
        _choice("device", self.device, DEVICES)
        for name in (
            "num_sites",
            "num_public",
            "num_basis",
            "power_iterations",
            "basis_refresh",
            "rounds",
            "local_steps",
            "min_sites",
            "max_chunk",
        ):
            _integer(name, getattr(self, name), low=1)
        _integer("seed", self.seed, low=0)
        for name in ("num_anchors", "total_examples", "noise_seed"):
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name), low=0 if name == "noise_seed" else 1)
        _number("target_epsilon", self.target_epsilon, low=0)
        _number("delta", self.delta, low=0, high=0.1)
        _number("sample_rate", self.sample_rate, low=0, high=1)
        if self.noise_multiplier is not None:  # 0 switches the noise off (no privacy)
            _number("noise_multiplier", self.noise_multiplier, low=0, low_open=False)
        for name in (
            "clip_embedding",
            "clip_residual",
            "clip_norm",
            "dirichlet_alpha",
            "local_lr",
            "server_lr",
            "round_timeout",
        ):
            _number(name, getattr(self, name), low=0)
        for name in ("local_momentum", "server_momentum"):
            _number(name, getattr(self, name), low=0, high=0.999, low_open=False)
        from gep_fed.data.tasks import BUILT_IN_TASKS

        # ScatterNet + linear is linear in its parameters (a fixed transform, then GroupNorm
        # without parameters); a user task checks its own model
        linear = self.model in ("linear", "scatter-linear") or self.task not in BUILT_IN_TASKS
        if self.mechanism == "langevin" and (self.mode != "client" or not linear):
            raise ConfigError(
                "mechanism langevin runs in client mode on a linear model only (its guarantee "
                "needs a convex loss): use --mode client --model linear (or scatter-linear)"
            )
        if self.min_sites > self.num_sites:
            raise ConfigError(
                f"min_sites ({self.min_sites}) cannot exceed num_sites ({self.num_sites})"
            )
        if not isinstance(self.release_site_metrics, bool):
            raise ConfigError(
                f"release_site_metrics must be true or false, got {self.release_site_metrics!r}"
            )

    @classmethod
    def for_task(cls, task: str | None = None, **settings) -> FederationConfig:
        """The one resolution of a run's settings, on every path (``gep-fed simulate`` and
        ``compare``, the ServerApp under ``flwr run``, the library): the field defaults, under
        ``task``'s ``recommended_settings`` (e.g. what won its validation sweep), under
        ``settings`` (snake_case fields). ``task`` None is the default task."""
        task = cls.__dataclass_fields__["task"].default if task is None else task
        from gep_fed.data.task import resolve_task

        try:
            recommended = dict(resolve_task(task).recommended_settings)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(recommended) - known)
        if unknown:
            raise ConfigError(
                f"task {task!r} recommends unknown setting(s) {unknown}; known: {sorted(known)}"
            )
        return cls(task=task, **{**recommended, **settings})

    def make_task(self):
        """The run's task, built from its public settings (``gep_fed.data.task.Task``)."""
        from gep_fed.data.task import TaskSettings, resolve_task

        settings = TaskSettings(
            data_dir=self.data_dir,
            model=self.model,
            num_public=self.num_public,
            seed=self.seed,
            options={"medmnist-path": self.medmnist_path} if self.medmnist_path else {},
        )
        try:
            return resolve_task(self.task)(settings)
        except ValueError as err:
            raise ConfigError(f"task {self.task!r}: {err}") from None

    @property
    def steps_per_party(self) -> int:
        """Accounted releases over the whole run: per round one (central) or
        ``local_steps`` per site (client)."""
        return self.rounds * (1 if self.mode == "central" else self.local_steps)

    def run_directory(self, run_id: int | str) -> str:
        from pathlib import Path

        return str(Path(self.run_dir) / (self.run_name or f"run-{run_id}"))

    def contract(self, noise_multiplier: float) -> PrivacyContract:
        """The run's privacy contract at the resolved sigma (0 for Langevin, whose noise comes
        from its prior variance)."""
        return PrivacyContract(
            mechanism=self.mechanism,
            noise_multiplier=noise_multiplier,
            sample_rate=self.sample_rate,
            clip_embedding=self.clip_embedding,
            clip_residual=self.clip_residual,
            clip_norm=self.clip_norm,
            langevin_beta0=self.langevin_beta0 if self.mechanism == "langevin" else 0.0,
        )

    def anchor_config(self, contract: PrivacyContract) -> GEPConfig:
        """The server's step configuration for the anchor subspace (public data only)."""
        return GEPConfig.from_contract(
            contract,
            num_basis=self.num_basis,
            num_anchors=self.num_anchors,
            power_iterations=self.power_iterations,
            anchor_labels=self.anchor_labels,
            max_chunk=self.max_chunk,
        )

    def to_record(self) -> dict:
        """Flat kebab-case mapping (run-config style); None written as "auto" / 0."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                value = "auto" if f.name == "noise_multiplier" else 0
            if f.name == "noise_seed" and getattr(self, f.name) is None:
                value = -1
            out[f.name.replace("_", "-")] = value
        return out

    @classmethod
    def from_record(cls, values: Mapping[str, object]) -> FederationConfig:
        """From a kebab- or snake-case mapping (a Flower run config, JSON), naming bad keys,
        resolved as ``for_task`` resolves (defaults, the task's recommendations, the values).

        A Flower run config must list every key (``flwr run --run-config`` overrides only
        keys the app's ``pyproject.toml`` has), so there a value ``"default"`` means "not
        given": the task's recommendation, else the field's default, applies."""
        known = {f.name: f for f in fields(cls)}
        kwargs = {}
        for key, value in values.items():
            name = str(key).replace("-", "_")
            if name not in known:
                raise ConfigError(
                    f"unknown setting {key!r}; known: {sorted(k.replace('_', '-') for k in known)}"
                )
            if value == RUN_CONFIG_DEFAULT:
                continue
            means_none = (
                (name == "noise_multiplier" and value == "auto")
                or (name in ("num_anchors", "total_examples") and value == 0)
                or (name == "noise_seed" and isinstance(value, int) and value < 0)
            )
            if means_none:
                value = None
            elif (
                isinstance(value, int)
                and not isinstance(value, bool)
                and (known[name].type in ("float", "float | None"))
            ):
                value = float(value)
            kwargs[name] = value
        return cls.for_task(**kwargs)

    @classmethod
    def run_config_template(cls) -> dict:
        """The ``[tool.flwr.app.config]`` table of an app's ``pyproject.toml``: every key, with
        the default task and ``"default"`` for the rest (pinned by a test)."""
        template = {f.name.replace("_", "-"): RUN_CONFIG_DEFAULT for f in fields(cls)}
        template["task"] = cls.__dataclass_fields__["task"].default
        return template
