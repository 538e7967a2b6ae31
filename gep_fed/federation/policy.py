"""A site's own privacy policy and settings: from its node config, never from the server.

In client-side mode a site's guarantee must hold against a malicious server, so everything
that decides it is the site's: the modes it accepts, its budget and delta, whether anything
beyond the noised release may leave, and its noise (always keyed by the operating system in
a deployment). ``SitePolicy.admit`` checks each round against this before anything is
computed; a refusal is a fixed reason code (``gep_fed.wire.REFUSALS``), never an exception
text.

A deployed site's settings come from its SuperNode's ``--node-config``. A simulated site (one
that Flower gives a ``partition-id``) has no node config of its own beyond that: its settings
come from the simulation's own site settings (``simulate()`` passes them; ``flwr run`` on a
simulation SuperLink reads the TOML file named by ``GEP_FED_SIMULATED_SITE``), else from
``SIMULATED_SITE_DEFAULTS``. Neither is the run config the server sends.
"""

from __future__ import annotations

import base64
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gep_fed.accounting.ledger import default_key_path
from gep_fed.data.fronts import build_task
from gep_fed.data.registry import resolve_task
from gep_fed.data.task import Task, TaskSettings
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.modes import MODE_NAMES, mode_named
from gep_fed.federation.secure_sum import (
    PinnedPeers,
    create_site_key,
    key_text,
    load_site_key,
)
from gep_fed.federation.wire import RebuildCost, RoundConfig, RoundRefused
from gep_fed.validation import AT_LEAST_ONE, AUGMENTATION_COPIES, DELTA, ConfigError

DEVICES = ("auto", "cpu", "cuda")
SIMULATED_SITE_ENV = "GEP_FED_SIMULATED_SITE"
# A simulated site that was given no settings: client-side only, the documented default budget.
SIMULATED_SITE_DEFAULTS = {"epsilon-budget": 8.0, "delta": 1e-5}
# The most work a site does for one round unless its node config says otherwise: a server
# that asks for more is refused ("over compute limit"), so it cannot tie a site up for hours.
DEFAULT_MAX_LOCAL_STEPS = 100
DEFAULT_MAX_AUGMENTATION_COPIES = 16
# A basis rebuilt from anchors (``basis-transport = rebuild``, ``wire.RebuildCost``): at most
# 1e13 multiply-adds (m * sum_g p_g k_g) and 8 GiB (record plus float32 bases). The largest
# built-in refresh, cifar10's ResNet20-GN at k = 1,000 from 2,000 anchors, needs 2.5e11 and
# 0.5 GiB; ResNet-18-GN at 64x64, k = 100 from 1,000 anchors, 4.9e11 and 1.9 GiB.
DEFAULT_MAX_REBUILD_WORK = 10**13
DEFAULT_MAX_REBUILD_MIB = 8 * 1024
# A simulated site's secure-sum signing key, in its folder (``.pub``: its public key).
SIMULATED_SITE_KEY = "site-key.pem"

# Keys a deployed site's node config may hold, with what they mean (``gep-fed site check
# --help`` prints them).
NODE_CONFIG_KEYS = {
    "site-id": "how the site names itself in its ledger",
    "task": "the task this site trains: a built-in name or 'package.module:Class' (required); "
    "a round whose run config names another task is refused",
    "model": "the task's architecture at this site (default: the task's own choice, as a "
    "run config's default resolves it); rounds must match it",
    "task-data-dir": "where a built-in task reads its fixed data (default ../shared/data)",
    "medmnist-path": "a MedMNIST file for task medmnist",
    "max-chunk": "examples differentiated at once: this site's memory bound (default 128)",
    "data-path": "the site's private data (required)",
    "ledger-path": "the site's privacy ledger, kept across runs (required)",
    "ledger-key-path": "the ledger's HMAC key file (default: <ledger-path>.key)",
    "new-ledger": "create the ledger, its key and mark where no key exists yet (first start)",
    "epsilon-budget": "the most epsilon this site will ever spend from this data (required)",
    "delta": "the delta of the site's guarantee (required)",
    "accept-modes": "'client' (default), or a list such as 'client,distributed' or "
    "'client,central' (central trusts the server; distributed trusts secure aggregation)",
    "max-colluding-sites": "distributed mode: how many other sites may collude with the "
    "server (their noise shares are not counted); the site masks its share only when at least "
    "its noise-shares plus this many pinned sites are listed in the round (default 0)",
    "noise-shares": "distributed mode (required there): t, the number of shares the noise is "
    "split into; this site adds 1/t of the noise variance and refuses rounds with another t",
    "site-key": "distributed mode (required there): this site's Ed25519 key file, which signs "
    "its secure-sum keys (make one with gep-fed site keygen)",
    "peers": "distributed mode (required there): a file of the sites this site sums with, one "
    "'NAME PUBLIC-KEY' a line; a key no pinned peer signed is refused",
    "max-local-steps": "the most private steps this site takes in one client-mode round "
    f"(compute; default {DEFAULT_MAX_LOCAL_STEPS}); rounds asking more are refused",
    "max-augmentation-copies": "the most augmented copies of each example this site "
    f"differentiates in a round (compute; default {DEFAULT_MAX_AUGMENTATION_COPIES}); rounds "
    "asking more are refused",
    "max-rebuild-work": "the most multiply-adds of a basis this site rebuilds from anchors "
    "(basis-transport rebuild: anchors x sum over groups of parameters x basis columns; "
    f"default {DEFAULT_MAX_REBUILD_WORK:.0e}); a record asking more is refused from its "
    "declared shapes",
    "max-rebuild-mib": "the most memory, in MiB, of a basis this site rebuilds from anchors "
    f"(the record's arrays plus the float32 bases; default {DEFAULT_MAX_REBUILD_MIB}); a "
    "record asking more is refused from its declared shapes",
    "release-metrics": "let a training loss leave the site, outside the guarantee (false)",
    "allow-no-noise": "accept rounds without noise: no privacy, no budget (tests only; false)",
    "device": "auto (cuda when available), cpu or cuda",
    "num-workers": "DataLoader worker processes that decode the sampled examples (0)",
    "validation-fraction": "share of the site's examples it holds out (each by a secret coin "
    "drawn once each run, never trained on in that run) to score a model when asked "
    "(gep-fed tune --site-validation); 0: none",
    "score-noise": "the std of the Gaussian noise this site adds to each count of a score "
    "(one release per query, in its ledger); without it the site releases no score",
    "max-selection-mean": "the largest mean number of trials of a private selection (gep-fed "
    "tune --random-trials, central mode) this site takes part in; its ledger records every "
    "trial, and the published choice's figure trusts the server to draw the number secretly "
    "from the declared law and to publish only the best trial (default 0: none)",
}
# Keys only a simulated site's settings may hold (a deployed site's noise is never seeded).
SIMULATION_KEYS = {
    "partition-id": "the simulated site's share of the pooled data (set by Flower)",
    "num-partitions": "number of simulated sites (set by Flower)",
    "noise-seed": "fixes the site's noise (reproducible tests and benchmarks only)",
    "ledger-dir": "folder of the simulated sites' ledgers (default: the run directory)",
    "site-data": "the simulated sites' own data: {site name: data path}, site i takes the "
    "i-th (default: shares of the task's pooled data)",
}


@dataclass(frozen=True)
class SitePolicy:
    """What a site accepts. Set by the site alone; no value is ever taken from the server.

    Attributes:
        epsilon_budget: the most epsilon the site will spend from its data over all runs (its
            ledger persists); a round that would exceed it is refused before computing.
            None only together with ``allow_no_noise``.
        delta: the delta at which the site's ledger accounts and enforces the budget.
        accepted_modes: "client" only by default; "central" means trusting the server with
            unnoised clipped sums, so it needs this explicit opt-in; "distributed" trusts
            secure aggregation with the pinned peers (the server sees only the sum of the
            sites' noised shares, whatever it does).
        max_colluding_sites: distributed mode: other sites that may collude with the server
            (their noise shares are not counted). The site masks its share only when at least
            ``noise_shares + max_colluding_sites`` pinned sites are listed in the round.
        noise_shares: distributed mode: t, the shares the noise is split into; the site adds
            ``sigma**2 / t`` of noise variance, so its share alone would carry noise
            multiplier ``sigma / sqrt(t)``. Rounds with another t are refused.
        release_metrics: let a raw training loss leave the site (outside the guarantee,
            labelled so everywhere). Off by default.
        allow_no_noise: accept sigma = 0, i.e. no privacy at all (tests only). Off by default.
        noise_seed: fixes the site's noise (simulations for tests and benchmarks only; a
            deployed site has none and its noise is keyed by the OS CSPRNG).
        max_local_steps, max_augmentation_copies: the most work one round may ask of the
            site (client-mode steps; augmented copies per example). They bound compute, not
            privacy: every step is accounted whatever its number, and copies leave the
            sensitivity unchanged.
        max_rebuild_work, max_rebuild_mib: the most a basis rebuilt from anchors may cost
            (``wire.RebuildCost``: multiply-adds, and MiB held), checked from the record's
            declared shapes before anything is computed (``admit_rebuild``).
        score_noise: the std of the Gaussian noise the site adds to each count of a score
            of a model on its held-out examples (``gep_fed.federation.site_score``); None:
            the site releases no score.
        max_selection_mean: the largest mean number of trials of a private selection the
            site takes part in (central mode only). Its ledger records every trial's
            releases; the published choice's figure holds only if the server draws the number
            of trials from the declared law and publishes only the best trial: an opt-in,
            like central mode. 0: none.
    """

    epsilon_budget: float | None
    delta: float
    accepted_modes: tuple[str, ...] = ("client",)
    release_metrics: bool = False
    allow_no_noise: bool = False
    noise_seed: int | None = None
    max_colluding_sites: int = 0
    noise_shares: int | None = None
    max_local_steps: int = DEFAULT_MAX_LOCAL_STEPS
    max_augmentation_copies: int = DEFAULT_MAX_AUGMENTATION_COPIES
    max_rebuild_work: int = DEFAULT_MAX_REBUILD_WORK
    max_rebuild_mib: int = DEFAULT_MAX_REBUILD_MIB
    score_noise: float | None = None
    max_selection_mean: float = 0.0

    def __post_init__(self) -> None:
        if self.epsilon_budget is None and not self.allow_no_noise:
            raise ConfigError("epsilon-budget is required: the site's own privacy budget")
        if self.epsilon_budget is not None and not (
            math.isfinite(self.epsilon_budget) and self.epsilon_budget > 0
        ):
            raise ConfigError(f"epsilon-budget must be a number > 0, got {self.epsilon_budget}")
        if self.allow_no_noise and self.epsilon_budget is not None:
            raise ConfigError(
                "allow-no-noise accepts rounds with infinite epsilon, so a budget cannot be "
                "enforced: drop epsilon-budget (tests only) or allow-no-noise"
            )
        DELTA.check("delta", self.delta)
        bad = [m for m in self.accepted_modes if m not in MODE_NAMES]
        if bad or not self.accepted_modes:
            raise ConfigError(f"accept-modes must name modes from {list(MODE_NAMES)}, got {bad}")
        if not (isinstance(self.max_colluding_sites, int) and self.max_colluding_sites >= 0):
            raise ConfigError(
                f"max-colluding-sites must be an integer >= 0, got {self.max_colluding_sites!r}"
            )
        if self.accepts_secure_sum and not (
            isinstance(self.noise_shares, int) and self.noise_shares >= 1
        ):
            raise ConfigError(
                "accept-modes lists distributed: noise-shares (an integer >= 1) must say how "
                f"many shares this site's noise is split into, got {self.noise_shares!r}"
            )
        AT_LEAST_ONE.check("max-local-steps", self.max_local_steps)
        AUGMENTATION_COPIES.check("max-augmentation-copies", self.max_augmentation_copies)
        AT_LEAST_ONE.check("max-rebuild-work", self.max_rebuild_work)
        AT_LEAST_ONE.check("max-rebuild-mib", self.max_rebuild_mib)
        if self.score_noise is not None and not (
            math.isfinite(self.score_noise) and self.score_noise > 0
        ):
            raise ConfigError(f"score-noise must be a std > 0, got {self.score_noise}")
        if not (math.isfinite(self.max_selection_mean) and self.max_selection_mean >= 0):
            raise ConfigError(
                f"max-selection-mean must be a number >= 0, got {self.max_selection_mean}"
            )

    def admit_rebuild(self, cost: RebuildCost) -> None:
        """Refuse ("over compute limit") a basis rebuild that costs more work or memory than
        this site allows, from shapes alone: before anything is read, allocated or computed."""
        if cost.work > self.max_rebuild_work or cost.bytes > self.max_rebuild_mib * 2**20:
            raise RoundRefused("over compute limit")

    @property
    def accepts_secure_sum(self) -> bool:
        """Whether the site accepts a mode whose replies go through the secure sum."""
        return any(mode_named(m).secure_sum for m in self.accepted_modes)

    def sites_needed(self) -> int:
        """The fewest pinned sites (this one included) a distributed round must list before
        this site masks its share: its noise shares, from sites other than the colluders."""
        return (self.noise_shares or 0) + self.max_colluding_sites

    def admit(self, rc: RoundConfig, last_round: int | None) -> None:
        """Refuse (``RoundRefused``) a round this policy does not allow. The ledger's budget
        is checked next, by the site, with the round's own events."""
        if rc.mode not in self.accepted_modes:
            raise RoundRefused("mode not allowed")
        if last_round is not None and rc.round <= last_round:
            raise RoundRefused("replayed round")
        if rc.selection and (
            rc.noise_mode.site_placement != "trusted-server"
            # (a law fitted to a requested mean may exceed it by a rounding error)
            or rc.selection_terms.event.selection.mean > self.max_selection_mean * (1 + 1e-6)
        ):
            # a selection's bound covers only what a trusted server publishes (elsewhere the
            # server sees every trial's releases), and only for a site that opted in to it
            raise RoundRefused("mode not allowed")
        noise_free = rc.privacy.noise_multiplier == 0 and not rc.privacy.is_langevin
        if noise_free and not self.allow_no_noise:
            raise RoundRefused("over budget")  # epsilon would be infinite
        refusal = rc.noise_mode.refusal(rc, self)
        if refusal is not None:
            raise RoundRefused(refusal)
        if rc.augmentation_copies > self.max_augmentation_copies:
            raise RoundRefused("over compute limit")


@dataclass(frozen=True)
class SiteConfig:
    """A site's own settings: identity, data, ledger, device and policy.

    Attributes:
        site_id: how the site names itself in its ledger.
        policy: what the site accepts (``SitePolicy``).
        task: the task a deployed site trains (a built-in name or an import path), pinned by
            its node config: the site imports nothing the server names. Empty for a
            simulated site, which trains the simulation's task.
        model, task_data_dir, task_options: the task's settings at this site.
        max_chunk: at most this many examples are differentiated at once (memory).
        site_key_path, peers_path: distributed mode: the site's Ed25519 key file and its
            pinned peers (``gep_fed.federation.secure_sum``). A simulated site's key is made
            in its folder on first use, and it pins the simulation's other sites' keys.
        data_path: the site's private data (deployed sites).
        partition_id, num_partitions: the simulated site's share of the pooled data.
        ledger_path, ledger_key_path: the site's ledger and its HMAC key, on its own disk.
        new_ledger: create the ledger (and key) if missing; otherwise a missing ledger stops
            the site, so a deleted file can never reset its accounting.
        device: "auto" (cuda when available), "cpu" or "cuda".
        num_workers: ``DataLoader`` worker processes decoding each sample (0: in process).
        validation_fraction: the site's share of examples held out to score models on,
            never trained on (``gep_fed.federation.site_score``); 0: none.
    """

    site_id: str
    policy: SitePolicy
    task: str = ""
    model: str = ""
    task_data_dir: str = ""
    task_options: Mapping[str, str] = field(default_factory=dict)
    max_chunk: int = 128
    data_path: str = ""
    partition_id: int | None = None
    num_partitions: int | None = None
    ledger_path: str = ""
    ledger_key_path: str = ""
    new_ledger: bool = False
    device: str = "auto"
    num_workers: int = 0
    site_key_path: str = ""
    peers_path: str = ""
    validation_fraction: float = 0.0

    @property
    def simulated(self) -> bool:
        return self.partition_id is not None

    @staticmethod
    def is_simulated(node_config: Mapping[str, object]) -> bool:
        """A node config Flower's simulation made (it holds a ``partition-id``)."""
        return "partition-id" in node_config

    def make_task(self) -> Task:
        """The site's own task (a deployed site's node config names it)."""
        try:
            return build_task(resolve_task(self.task), self.task_settings())
        except ValueError as err:
            raise ConfigError(f"node config task {self.task!r}: {err}") from None

    def task_settings(self) -> TaskSettings:
        """The settings the site's own task is built with (from its node config)."""
        model = FederationConfig.resolved_model(self.task, self.model)
        settings = TaskSettings(model=model, options=dict(self.task_options))
        if self.task_data_dir:
            settings = replace(settings, data_dir=self.task_data_dir)
        return settings

    @classmethod
    def from_node_config(
        cls,
        node_config: Mapping[str, object],
        simulation: Mapping[str, object] | None = None,
        run_directory: str = "",
    ) -> SiteConfig:
        """Parse a node config. A simulated site (``partition-id`` present) fills the gaps
        from ``simulation`` (the simulation's own site settings), then from the file named by
        ``GEP_FED_SIMULATED_SITE``, then ``SIMULATED_SITE_DEFAULTS``; its ledgers go to
        ``ledger-dir`` or the run directory's ``sites/`` folder."""
        simulated = cls.is_simulated(node_config)
        if simulated:
            settings = {
                **SIMULATED_SITE_DEFAULTS,
                **simulated_site_file(),
                **(simulation or {}),
                **node_config,
            }
            allowed = NODE_CONFIG_KEYS.keys() | SIMULATION_KEYS.keys()
        else:
            settings, allowed = dict(node_config), NODE_CONFIG_KEYS.keys()
        unknown = sorted(set(settings) - allowed)
        if unknown:
            raise ConfigError(f"unknown node config key(s) {unknown}; known: {sorted(allowed)}")
        get = _Reader(settings)
        pid = get.integer("partition-id")
        own_data = _simulated_site_data(settings.get("site-data"), pid) if simulated else None
        site_id = get.text("site-id") or (simulated_site_name(settings) if simulated else "")
        if not site_id:
            raise ConfigError("node config needs 'site-id' (how the site names its ledger)")
        if not simulated:
            for key in ("task", "data-path", "ledger-path", "delta"):
                if key not in settings:
                    raise ConfigError(f"node config needs {key!r}: {NODE_CONFIG_KEYS[key]}")
        ledger = get.text("ledger-path")
        if not ledger:
            folder = get.text("ledger-dir") or str(Path(run_directory) / "sites")
            ledger = str(Path(folder) / site_id / "ledger.json")
        modes = tuple(m.strip() for m in (get.text("accept-modes") or "client").split(","))
        seed = get.integer("noise-seed")
        no_noise = get.flag("allow-no-noise")
        policy = SitePolicy(
            epsilon_budget=None if no_noise else get.number("epsilon-budget"),
            delta=get.number("delta"),
            accepted_modes=modes,
            release_metrics=get.flag("release-metrics"),
            allow_no_noise=no_noise,
            noise_seed=None if seed is None else seed + (pid or 0),
            max_colluding_sites=get.integer("max-colluding-sites") or 0,
            noise_shares=get.integer("noise-shares"),
            max_local_steps=get.integer("max-local-steps", DEFAULT_MAX_LOCAL_STEPS),
            max_augmentation_copies=get.integer(
                "max-augmentation-copies", DEFAULT_MAX_AUGMENTATION_COPIES
            ),
            max_rebuild_work=get.integer("max-rebuild-work", DEFAULT_MAX_REBUILD_WORK),
            max_rebuild_mib=get.integer("max-rebuild-mib", DEFAULT_MAX_REBUILD_MIB),
            score_noise=get.number("score-noise"),
            max_selection_mean=get.number("max-selection-mean") or 0.0,
        )
        device = get.text("device") or "auto"
        if device not in DEVICES:
            raise ConfigError(f"node config device must be one of {list(DEVICES)}, got {device!r}")
        max_chunk = get.integer("max-chunk")
        if max_chunk is not None and max_chunk < 1:
            raise ConfigError(f"node config max-chunk must be >= 1, got {max_chunk}")
        medmnist = get.text("medmnist-path")
        site_key, peers = get.text("site-key"), get.text("peers")
        if simulated:
            site_key = site_key or str(Path(ledger).parent / SIMULATED_SITE_KEY)
        elif policy.accepts_secure_sum and not (site_key and peers):
            raise ConfigError(
                "accept-modes lists distributed: the node config needs 'site-key' (this "
                "site's signing key, from gep-fed site keygen) and 'peers' (the file of the "
                "other sites' public keys it accepts)"
            )
        return cls(
            site_id=site_id,
            policy=policy,
            task=get.text("task"),
            model=get.text("model"),
            task_data_dir=get.text("task-data-dir"),
            task_options={"medmnist-path": medmnist} if medmnist else {},
            max_chunk=max_chunk or 128,
            data_path=own_data[1] if own_data else get.text("data-path"),
            partition_id=pid,
            num_partitions=get.integer("num-partitions"),
            ledger_path=ledger,
            ledger_key_path=get.text("ledger-key-path") or str(default_key_path(ledger)),
            # A simulated site's ledger lives in its run: each simulation starts it afresh.
            new_ledger=get.flag("new-ledger") or simulated,
            device=device,
            num_workers=get.integer("num-workers") or 0,
            site_key_path=site_key,
            peers_path=peers,
            validation_fraction=_fraction(get.number("validation-fraction")),
        )

    def pinned_peers(self) -> PinnedPeers:
        """The peers this site sums with: its ``peers`` file; a simulated site without one
        pins the keys of every site of its simulation (their folders beside its own)."""
        if self.peers_path:
            return PinnedPeers.read(self.peers_path)
        if not self.simulated:
            raise ConfigError("node config needs 'peers' for distributed mode")
        folder = Path(self.site_key_path).parent.parent
        names = {}
        for pub in sorted(folder.glob(f"*/{SIMULATED_SITE_KEY}.pub")):
            names[base64.b64decode(pub.read_text().strip())] = pub.parent.name
        return PinnedPeers(names)

    def site_key(self) -> Ed25519PrivateKey:
        """The site's signing key (a simulated site's is made on first use)."""
        path = Path(self.site_key_path)
        if self.simulated and not path.exists():
            public = create_site_key(path)
            path.with_name(path.name + ".pub").write_text(key_text(public) + "\n")
        return load_site_key(path)


def _fraction(value: float | None) -> float:
    if value is None:
        return 0.0
    if not 0 <= value < 1:
        raise ConfigError(f"node config validation-fraction must be in [0, 1), got {value}")
    return float(value)


def simulated_site_name(settings: Mapping[str, object]) -> str:
    """A simulated site's name: its ``site-data`` entry's, else ``site-<partition-id>``."""
    own = _simulated_site_data(settings.get("site-data"), settings.get("partition-id"))
    return own[0] if own else f"site-{settings.get('partition-id')}"


def _simulated_site_data(site_data: object, partition_id: int | None) -> tuple[str, str] | None:
    """(name, path) of simulated site ``partition_id`` in ``site-data``, or None."""
    if site_data is None:
        return None
    if not isinstance(site_data, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in site_data.items()
    ):
        raise ConfigError(f"site-data must map site names to data paths, got {site_data!r}")
    items = list(site_data.items())
    if partition_id is None or not (0 <= partition_id < len(items)):
        raise ConfigError(f"partition-id {partition_id} has no entry in site-data ({len(items)})")
    return items[partition_id]


def simulated_site_file() -> dict:
    """The settings in the TOML file named by ``GEP_FED_SIMULATED_SITE`` (if set)."""
    path = os.environ.get(SIMULATED_SITE_ENV)
    if not path:
        return {}
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{SIMULATED_SITE_ENV}={path}: cannot read it as TOML: {err}") from err


class _Reader:
    """Typed access to node-config values, naming the key in every error."""

    def __init__(self, values: Mapping[str, object]) -> None:
        self.values = values

    def text(self, key: str) -> str:
        value = self.values.get(key, "")
        if not isinstance(value, str):
            raise ConfigError(f"node config {key} must be a string, got {value!r}")
        return value

    def number(self, key: str) -> float | None:
        value = self.values.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"node config {key} must be a number, got {value!r}")
        return float(value)

    def integer(self, key: str, default: int | None = None) -> int | None:
        """The key's value (0 included) where the node config sets it, else ``default``."""
        value = self.values.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"node config {key} must be an integer >= 0, got {value!r}")
        return value

    def flag(self, key: str) -> bool:
        value = self.values.get(key, False)
        if not isinstance(value, bool):
            raise ConfigError(f"node config {key} must be true or false, got {value!r}")
        return value
