"""``FederationConfig``: a federated run's settings (task and data, the privacy contract, the
anchor subspace, the schedule, the transport, the run), and ``ResolvedRun``, what they resolve to.

``gep-fed simulate`` and ``compare``, the ServerApp under ``flwr run`` and the library all
build a run's configuration through ``FederationConfig.for_task`` (``from_record`` for a
Flower run config): the field defaults, under the task's recommended settings, under the
values given. Each then resolves it once, explicitly, before the run starts
(``FederationConfig.resolve``): the privacy contract, sigma as given or calibrated to spend the
budget over the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from gep_fed.data.fronts import build_task
from gep_fed.data.registry import BUILT_IN_TASKS, resolve_task
from gep_fed.data.task import Task, TaskSettings
from gep_fed.federation.modes import MODE_NAMES, Mode, mode_named
from gep_fed.mechanisms.contract import FEDERATED_MECHANISMS, PrivacyContract
from gep_fed.mechanisms.step_config import ANCHOR_LABELS, GEPConfig
from gep_fed.validation import (
    AT_LEAST_ONE,
    AUGMENTATION_COPIES,
    BASIS_DTYPES,
    BASIS_TRANSPORTS,
    DELTA,
    LEARNING_RATE,
    MODEL_AVERAGE_DECAY,
    MOMENTUM,
    NOISE_MULTIPLIER,
    POSITIVE,
    PROBABILITY,
    ROUNDS,
    TARGET_EPSILON,
    ConfigError,
    Range,
    check_choice,
    check_flag,
)


def task_class(name: str) -> type[Task]:
    """``resolve_task``, its errors as ``ConfigError`` (one line each at the CLI)."""
    try:
        return resolve_task(name)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _opt(default, help_text: str):
    """A dataclass field with its ``--help`` text (what the CLI shows)."""
    return field(default=default, metadata={"help": help_text})


PARTITIONS = ("iid", "dirichlet")
# A run config's value that means "not given" (see FederationConfig.from_record).
RUN_CONFIG_DEFAULT = "default"
DEVICES = ("auto", "cpu", "cuda")

# FederationConfig's fields by group (view name: title, fields), in the class's order (a
# test pins both). Run-config keys and CLI flags stay flat; ``gep-fed simulate --help`` shows
# the groups.
_GROUPED = {
    "data": ("task and data", "task model data_dir medmnist_path num_sites partition "
             "dirichlet_alpha num_public"),
    "privacy": ("the privacy contract", "mode noise_shares quantization_bits mechanism "
                "target_epsilon delta noise_multiplier sample_rate total_examples "
                "clip_embedding clip_residual clip_norm langevin_beta0"),
    "subspace": ("the anchor subspace", "num_basis num_anchors power_iterations anchor_labels "
                 "basis_refresh"),
    "schedule": ("the schedule", "rounds local_steps local_lr local_momentum "
                 "augmentation_copies server_lr server_momentum ema_decay"),
    "transport": ("the transport", "basis_dtype basis_transport min_sites round_timeout"),
    "run": ("the run", "seed noise_seed run_dir run_name device release_site_metrics max_chunk"),
}  # fmt: skip
FIELD_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    view: (title, tuple(names.split())) for view, (title, names) in _GROUPED.items()
}


class FieldGroup(Mapping):
    """A read-only view of one group of a ``FederationConfig``'s flat fields
    (``FIELD_GROUPS``): ``cfg.privacy.delta`` is ``cfg.delta``; as a mapping, ``{field:
    value}`` (``dict(cfg.schedule)``)."""

    __slots__ = ("_config", "_names", "title")

    def __init__(self, config: FederationConfig, title: str, names: tuple[str, ...]) -> None:
        self._config, self._names, self.title = config, names, title

    def __getattr__(self, name: str) -> object:
        if not name.startswith("_") and name in self._names:
            return getattr(self._config, name)
        raise AttributeError(f"{self.title} holds {', '.join(self._names)}, not {name!r}")

    def __getitem__(self, name: str) -> object:
        if name not in self._names:
            raise KeyError(name)
        return getattr(self._config, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        values = ", ".join(f"{name}={self[name]!r}" for name in self._names)
        return f"<{self.title}: {values}>"


def _group(view: str) -> property:
    title, names = FIELD_GROUPS[view]
    return property(
        lambda cfg: FieldGroup(cfg, title, names), doc=f"{title}: {', '.join(names)} (a view)"
    )


@dataclass(frozen=True)
class FederationConfig:
    """A federated run's settings: flat fields in six groups, each also a read-only view
    (``FieldGroup``; ``FIELD_GROUPS``):

    - ``data``, task and data: task, model, data_dir, medmnist_path, num_sites, partition,
      dirichlet_alpha, num_public;
    - ``privacy``, the privacy contract: mode, noise_shares, quantization_bits, mechanism,
      target_epsilon, delta, noise_multiplier, sample_rate, total_examples, clip_embedding,
      clip_residual, clip_norm, langevin_beta0;
    - ``subspace``, the anchor subspace: num_basis, num_anchors, power_iterations,
      anchor_labels, basis_refresh;
    - ``schedule``: rounds, local_steps, local_lr, local_momentum, augmentation_copies,
      server_lr, server_momentum, ema_decay;
    - ``transport``: basis_dtype, basis_transport, min_sites, round_timeout;
    - ``run``: seed, noise_seed, run_dir, run_name, device, release_site_metrics, max_chunk.

    ``cfg.privacy.delta`` is ``cfg.delta``. In a Flower run config the keys stay flat, in
    kebab-case (``target-epsilon``); ``noise-multiplier = "auto"`` and ``num-anchors = 0``
    mean None. What the settings resolve to (the contract, sigma calibrated) is
    ``resolve()``'s ``ResolvedRun``.

    Privacy fields:
        mode: "client" (default; each site adds its own noise and keeps its own ledger, the
            server is not trusted), "central" (sites send unnoised clipped sums to a
            trusted server, which adds the noise once per round) or "distributed" (each site
            adds a share of discrete noise to its quantised clipped sums and a secure sum shows
            the server only their sum: central mode's noise without a trusted server).
        noise_shares, quantization_bits: distributed mode: the sum must hold the noise of at
            least ``noise_shares`` sites (0: all ``num_sites``; each adds 1/t of the
            variance), quantised modulo ``2**quantization_bits`` (8-24; more bits mean a
            finer step, so rounding grows the sensitivity less; the secure sum holds
            ``2**31 / 2**bits`` sites, 127 at the default 24).
        mechanism: "gep", "bgep" or "gp".
        target_epsilon, delta: the budget. The server stops before a round that would exceed
            it; sigma is calibrated to spend exactly it over all rounds when
            ``noise_multiplier`` is None. Each site enforces its own budget too.
        sample_rate: q, every site's Poisson rate; central mode accounts the union of the
            sites' data at this rate and normalises by ``q * total_examples``.
        total_examples: N, the declared size of the union of the sites' data: central and
            distributed mode normalise the noisy sum by ``q N``, and in client mode every
            site normalises its own by ``q N / num_sites`` (a public number: a site's own
            count would show in its update's noise). None lets a simulation use its pooled
            size; a deployment declares it. Never a count sent by a site.
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

    # -- task and data (data) --------------------------------------------------
    # -- task and data (data) --------------------------------------------------
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
        "scatter-linear, scatter-cnn, scatter-cnn-w2, scatter-cnn-w4; cifar10: the scatter "
        "models, resnet20, cnn)",
    )
    data_dir: str = _opt("../shared/data", "folder with mnist/, kmnist/, medmnist/")
    medmnist_path: str = _opt("", "a MedMNIST <flag>.npz for task medmnist")
    num_sites: int = _opt(3, "number of sites (simulated SuperNodes)")
    partition: str = _opt("iid", "how the pooled data is split across sites: iid or dirichlet")
    dirichlet_alpha: float = _opt(0.5, "label skew for --partition dirichlet (smaller: more skew)")
    num_public: int = _opt(2000, "public anchor examples the server holds (labels never used)")

    # -- the privacy contract (privacy) ----------------------------------------

    # -- the privacy contract (privacy) ----------------------------------------
    mode: str = _opt(
        "client",
        "client: each site noises its own updates and keeps its own ledger (untrusted "
        "server); central: sites send unnoised clipped sums, the trusted server adds the "
        "noise; distributed: each site adds a share of discrete noise and a secure sum (pairwise "
        "masks, keys signed by the sites' pinned peers) shows the server only the sum",
    )
    noise_shares: int = _opt(
        0,
        "distributed: the fewest sites whose noise shares the sum must hold (0: all "
        "num-sites); fewer survivors abandon the round",
    )
    quantization_bits: int = _opt(24, "distributed: bits per coordinate of the secure sum")
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
        "N, the declared size of the union of the sites' data (normalisation: q*N, in "
        "client mode q*N/num-sites at each site); default: the simulation's pooled size",
    )
    clip_embedding: float = _opt(1.0, "S1: bound on each example's embedding norm (noise sigma*S1)")
    clip_residual: float = _opt(1.0, "S2: bound on each example's residual norm (noise sigma*S2)")
    clip_norm: float = _opt(1.0, "S: bound on each example's gradient norm (gp; G for langevin)")
    langevin_beta0: float = _opt(
        1.0,
        "langevin prior variance beta0: scales noise and step sizes together (training, not "
        "privacy: multi-pass epsilon depends on steps, batch, n and delta only)",
    )

    # -- the anchor subspace (subspace) ----------------------------------------

    # -- the anchor subspace (subspace) ----------------------------------------
    num_basis: int = _opt(64, "k: anchor-subspace dimension (public; no privacy cost)")
    num_anchors: int | None = _opt(None, "m: anchors used per subspace (default: all public data)")
    power_iterations: int = _opt(1, "t: power-method passes per subspace")
    anchor_labels: str = _opt(
        "random",
        "labels of the public anchors: random (fresh at every subspace, the default) or true "
        "(the public data's own labels)",
    )
    basis_refresh: int = _opt(1, "recompute and resend the basis every R rounds")

    # -- the schedule (schedule) -----------------------------------------------

    # -- the schedule (schedule) -----------------------------------------------
    rounds: int = _opt(10, "federated rounds")
    local_steps: int = _opt(10, "private steps per site per round (client mode), each accounted")
    local_lr: float = _opt(1.0, "site learning rate (client mode)")
    local_momentum: float = _opt(0.0, "site SGD momentum (client mode)")
    augmentation_copies: int = _opt(
        0,
        "K: each private example's gradient is the mean over K randomly augmented copies of "
        "it (the task's augmentation), clipped once: no privacy cost, K times the compute; "
        "0: no augmentation",
    )
    server_lr: float = _opt(
        1.0, "server step size on the private gradient (central) or on the mean delta (client)"
    )
    server_momentum: float = _opt(0.0, "server SGD momentum")
    ema_decay: float = _opt(
        0.0,
        "the model the server evaluates, keeps and saves is an exponential moving average of "
        "its iterates with this decay (De et al. 2022; post-processing: no privacy cost; it "
        "damps the last rounds' noise); 0: the last iterate",
    )

    # -- the transport (transport) ---------------------------------------------

    # -- the transport (transport) ---------------------------------------------
    basis_dtype: str = _opt("float32", "basis on the wire: float32 or float16 (half the bytes)")
    basis_transport: str = _opt(
        "basis",
        "how a site gets each basis: basis (the server sends the bases, p_g x k_g numbers per "
        "group) or rebuild (the server sends the anchors and m x k_g coefficients per group, "
        "and each site rebuilds the bases from the anchors' gradients: public data only)",
    )
    min_sites: int = _opt(1, "fewest valid replies for a round to update the model")
    round_timeout: float = _opt(600.0, "seconds to wait for the sites' replies in a round")

    # -- the run (run) ---------------------------------------------------------

    # -- the run (run) ---------------------------------------------------------
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
        task_class(self.task)
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model must be a name, got {self.model!r}")
        check_choice("mode", self.mode, MODE_NAMES)
        check_choice("mechanism", self.mechanism, FEDERATED_MECHANISMS)
        check_choice("partition", self.partition, PARTITIONS)
        check_choice("basis_dtype", self.basis_dtype, BASIS_DTYPES)
        check_choice("basis_transport", self.basis_transport, BASIS_TRANSPORTS)
        check_choice("anchor_labels", self.anchor_labels, ANCHOR_LABELS)
        check_choice("device", self.device, DEVICES)
        for name in (
            "num_sites",
            "num_public",
            "num_basis",
            "power_iterations",
            "basis_refresh",
            "local_steps",
            "min_sites",
            "max_chunk",
        ):
            AT_LEAST_ONE.check(name, getattr(self, name))
        ROUNDS.check("rounds", self.rounds)
        Range(0, integer=True).check("seed", self.seed)
        for name in ("num_anchors", "total_examples"):
            if getattr(self, name) is not None:
                AT_LEAST_ONE.check(name, getattr(self, name))
        if self.noise_seed is not None:
            Range(0, integer=True).check("noise_seed", self.noise_seed)
        TARGET_EPSILON.check("target_epsilon", self.target_epsilon)
        DELTA.check("delta", self.delta)
        PROBABILITY.check("sample_rate", self.sample_rate)
        if self.noise_multiplier is not None:  # 0 switches the noise off (no privacy)
            NOISE_MULTIPLIER.check("noise_multiplier", self.noise_multiplier)
        if self.run_name in (".", "..") or Path(self.run_name).name != self.run_name:
            raise ConfigError(
                f"run_name must be a folder name inside run_dir (no / and not . or ..), got "
                f"{self.run_name!r}"
            )
        for name in ("dirichlet_alpha", "round_timeout"):
            POSITIVE.check(name, getattr(self, name))
        for name in ("local_lr", "server_lr"):
            LEARNING_RATE.check(name, getattr(self, name))
        for name in ("local_momentum", "server_momentum"):
            MOMENTUM.check(name, getattr(self, name))
        MODEL_AVERAGE_DECAY.check("ema_decay", self.ema_decay)
        AUGMENTATION_COPIES.check("augmentation_copies", self.augmentation_copies)
        if self.augmentation_copies and self.mechanism == "langevin":
            raise ConfigError("augmentation_copies needs gep, bgep or gp (langevin has none)")
        # The clip norms' own range is the contract's, checked where it is built; a
        # contract of the run's clips at sigma 0 checks them now.
        PrivacyContract(
            self.mechanism,
            0.0,
            self.sample_rate,
            self.clip_embedding,
            self.clip_residual,
            self.clip_norm,
            self.langevin_beta0 if self.mechanism == "langevin" else 0.0,
        )
        # ScatterNet + linear is linear in its parameters (a fixed transform, then GroupNorm
        # without parameters); a user task checks its own model
        linear = self.model in ("linear", "scatter-linear") or self.task not in BUILT_IN_TASKS
        if self.mechanism == "langevin" and not (self.noise_mode.runs_langevin and linear):
            raise ConfigError(
                "mechanism langevin runs in client mode on a linear model only (its guarantee "
                "needs a convex loss): use --mode client --model linear (or scatter-linear)"
            )
        self.noise_mode.check_config(self)
        if self.min_sites > self.num_sites:
            raise ConfigError(
                f"min_sites ({self.min_sites}) cannot exceed num_sites ({self.num_sites})"
            )
        check_flag("release_site_metrics", self.release_site_metrics)

    @classmethod
    def for_task(cls, task: str | None = None, **settings) -> FederationConfig:
        """The one resolution of a run's settings, on every path (``gep-fed simulate`` and
        ``compare``, the ServerApp under ``flwr run``, the library): the field defaults, under
        ``task``'s ``recommended_settings`` (e.g. what won its validation sweep), under
        ``settings`` (snake_case fields). ``task`` None is the default task."""
        task = cls.__dataclass_fields__["task"].default if task is None else task
        recommended = dict(task_class(task).recommended_settings)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(recommended) - known)
        if unknown:
            raise ConfigError(
                f"task {task!r} recommends unknown setting(s) {unknown}; known: {sorted(known)}"
            )
        fed = cls(task=task, **{**recommended, **settings})
        if fed.noise_mode.server_steps:
            # the sites' own steps, given for a mode whose server takes the round's one step,
            # would be ignored: refused by name (a value that changes nothing passes, as a
            # run config's or another config's record gives every key)
            plain = cls(task=task, **{**recommended, **{k: v for k, v in settings.items()
                                                      if k not in LOCAL_SETTINGS}})  # fmt: skip
            given = [n for n in LOCAL_SETTINGS if getattr(fed, n) != getattr(plain, n)]
            if given:
                raise ConfigError(
                    f"{', '.join(n.replace('_', '-') for n in given)} set(s) the sites' own "
                    f"steps, which {fed.mode} mode does not take (the server takes one private "
                    "step per round from the sites' sums): leave it out, or use mode client"
                )
        return fed

    def make_task(self) -> Task:
        """The run's task, built from its public settings."""
        settings = TaskSettings(
            data_dir=self.data_dir,
            model=self.model,
            num_public=self.num_public,
            seed=self.seed,
            options={"medmnist-path": self.medmnist_path} if self.medmnist_path else {},
        )
        cls = task_class(self.task)
        try:
            return build_task(cls, settings)
        except TypeError as err:  # e.g. an abstract method the task does not implement
            raise ConfigError(
                f"task {self.task!r} cannot be built: {err} (see docs/tasks.md)"
            ) from None
        except ValueError as err:
            raise ConfigError(f"task {self.task!r}: {err}") from None

    @property
    def noise_mode(self) -> Mode:
        """The run's noise placement (``gep_fed.federation.modes``)."""
        return mode_named(self.mode)

    @property
    def steps_per_party(self) -> int:
        """Accounted releases over the whole run: the mode's steps per round, each round."""
        return self.rounds * self.noise_mode.steps_per_round(self.local_steps)

    @property
    def shares_needed(self) -> int:
        """Distributed mode's t: the noise shares the secure sum must hold."""
        return self.noise_shares or self.num_sites

    def run_directory(self, run_id: int | str) -> str:
        return str(Path(self.run_dir) / (self.run_name or f"run-{run_id}"))

    data = _group("data")
    privacy = _group("privacy")
    subspace = _group("subspace")
    schedule = _group("schedule")
    transport = _group("transport")
    run = _group("run")

    def resolve(self) -> ResolvedRun:
        """Resolve the run, once: its privacy contract (``ResolvedRun.contract``), which may
        calibrate sigma (``ImpossibleTargetError`` when the budget is out of reach) and in
        distributed mode builds the task's model and training set.

        Every path calls it before its first round (``simulate``, the ServerApp, ``gep-fed
        compare``, the audit); the resolution is kept with this frozen config, so calling it
        again, or reading ``contract`` or ``anchor_config``, returns the same one."""
        resolved = self.__dict__.get("_resolved")
        if resolved is None:
            resolved = ResolvedRun(self, self._resolve_contract())
            object.__setattr__(self, "_resolved", resolved)
        return resolved

    @property
    def contract(self) -> PrivacyContract:
        """``resolve().contract``: the run's privacy contract (the server reads it here)."""
        return self.resolve().contract

    @property
    def anchor_config(self) -> GEPConfig:
        """``resolve().anchor_config``: the server's anchor-subspace step configuration."""
        return self.resolve().anchor_config

    def _resolve_contract(self) -> PrivacyContract:
        """The run's privacy contract: sigma as given, or the smallest that spends
        ``target_epsilon`` over ``steps_per_party`` releases; 0 for Langevin, whose noise
        comes from its prior variance and whose events from its schedule."""
        clips = {
            "clip_embedding": self.clip_embedding,
            "clip_residual": self.clip_residual,
            "clip_norm": self.clip_norm,
        }
        if self.mechanism == "langevin":
            return PrivacyContract(
                "langevin", 0.0, self.sample_rate, **clips, langevin_beta0=self.langevin_beta0
            )
        if self.noise_mode.secure_sum:
            return self.distributed_contract(**clips)
        if self.noise_multiplier is not None:
            return PrivacyContract(self.mechanism, self.noise_multiplier, self.sample_rate, **clips)
        return PrivacyContract.for_budget(
            self.mechanism,
            self.target_epsilon,
            self.delta,
            self.sample_rate,
            self.steps_per_party,
            **clips,
        )

    def distributed_contract(self, **clips: float) -> PrivacyContract:
        """Distributed mode's contract: sigma (given, or calibrated for the distributed
        discrete Gaussian's accounting) and the quantisation step that fits the sum of
        ``num_sites`` shares in ``2**quantization_bits``. It needs the quantised length (the
        task's model size and k) and the largest plausible batch of the union (of
        ``total_examples``, else the pooled data): public quantities."""
        task = self.make_task()
        num_params = sum(p.numel() for p in task.build_model().parameters() if p.requires_grad)
        try:
            total = self.total_examples or len(task.train_dataset())
        except NotImplementedError:
            raise ConfigError(
                "total-examples is not declared and the task has no pooled data to count: "
                "declare total-examples, N, the size of the sites' data (distributed mode fits "
                "the secure sum's range to it)"
            ) from None
        batch = self.sample_rate * total
        base = PrivacyContract(
            self.mechanism, self.noise_multiplier or 1.0, self.sample_rate, **clips
        )
        budget = None if self.noise_multiplier is not None else (self.target_epsilon, self.delta)
        return base.with_distributed_noise(
            self.shares_needed,
            self.quantization_bits,
            self.steps_per_party,
            base.quantized_dimension(self.num_basis, num_params),
            math.sqrt(base.mechanism_type.releases) * (batch + 8 * math.sqrt(batch) + 8),
            self.num_sites,
            budget,
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
    def resolved_model(cls, task: str, model: object = None) -> str:
        """The architecture a run of ``task`` trains when given ``model``: as given, or when
        not given (None, empty or ``"default"``) what ``for_task`` resolves (the task's
        recommended model, else ``"auto"``). A deployed site resolves its own task's model
        this way, so the server and the site build the same model."""
        if model in (None, "", RUN_CONFIG_DEFAULT):
            return cls.for_task(task).model
        return cls.for_task(task, model=model).model

    @classmethod
    def run_config_template(cls) -> dict:
        """The ``[tool.flwr.app.config]`` table of an app's ``pyproject.toml``: every key, with
        the default task and ``"default"`` for the rest (pinned by a test)."""
        template = {f.name.replace("_", "-"): RUN_CONFIG_DEFAULT for f in fields(cls)}
        template["task"] = cls.__dataclass_fields__["task"].default
        return template


# The settings of the steps a site takes itself (client mode).
LOCAL_SETTINGS = ("local_steps", "local_lr", "local_momentum")


@dataclass(frozen=True)
class ResolvedRun:
    """A ``FederationConfig`` resolved (``FederationConfig.resolve``): its settings and what
    they determine, computed once before the run starts.

    Attributes:
        config: the settings.
        contract: the privacy contract every site receives and the server's mechanism
            follows: sigma as given or calibrated to spend the budget over the run; in
            distributed mode also the quantisation, sized from the task's model and
            training set; sigma 0 for Langevin.
    """

    config: FederationConfig
    contract: PrivacyContract

    @property
    def anchor_config(self) -> GEPConfig:
        """The server's step configuration for the anchor subspace (public data only)."""
        cfg = self.config
        return GEPConfig(
            self.contract,
            num_basis=cfg.num_basis,
            num_anchors=cfg.num_anchors,
            power_iterations=cfg.power_iterations,
            anchor_labels=cfg.anchor_labels,
            max_chunk=cfg.max_chunk,
        )
