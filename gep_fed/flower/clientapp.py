"""Flower ClientApp helper: one site. Thin: Flower records in, ``federation.site`` calls, out.

What leaves the site: the clipped sums (central mode, only if the site's policy accepts it),
the noisy model delta (client-side mode), or, in distributed mode and only at the secure
sum's collect stage (``gep_fed.federation.secure_sum``), the site's masked noised share, after
it has checked every listed key against its pinned peers, plus data-free metrics (bytes
received, basis id, steps, the site's epsilon, which depends on public parameters only). To a
score query, only where the site's node config allows a score: its noised per-class counts on
its held-out examples (``Site.score_counts``), in its ledger first. A raw training loss
leaves only when the *site's* policy allows it, under a key that says it is outside the
guarantee. Every failure becomes a reply with a fixed reason code (``wire.REFUSALS``); the
detail goes to the site's own log, never to the server.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from gep_fed.accounting.ledger import (
    LedgerError,
    PrivacyLedger,
    create_ledger_key,
    default_mark_path,
    read_ledger_key,
)
from gep_fed.federation import wire
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.policy import SiteConfig, simulated_site_name
from gep_fed.federation.rundir import SITE_ROUNDS
from gep_fed.federation.secure_sum import (
    ADVERTISE,
    COLLECT,
    MASKED_SHARE,
    SECURE_SUM,
    RoundBinding,
    SecureSumRefused,
    SignedKey,
    advertise,
    check_keys,
    masked_vector,
    read_keys,
    read_settings,
)
from gep_fed.federation.site import Site, resolve_device, site_data_parts
from gep_fed.federation.site_score import new_coins_key
from gep_fed.federation.site_selection import trial_ledger
from gep_fed.federation.tuning import run_settings
from gep_fed.mechanisms.subspace import AnchorSubspace
from gep_fed.validation import ConfigError

log = logging.getLogger("gep_fed.federation.site")

# One Site per (run, node, trial) in this process: data is loaded once, not every round (a
# search's trial: the latest one per node is kept).
_SITES: dict[tuple[int, int, int], tuple[Site, SiteConfig]] = {}
BASIS_ID_KEY = wire.BASIS_ID
BASIS_DTYPE_KEY = "basis-dtype"  # how the held basis is stored
LAST_ROUND_KEY = "last-round"
# The last planned round of the run, once the site refused it for its budget.
DECLINED_KEY = "declined-through"
# The last round's selection terms ("" outside one): its trial's score goes in the trial's ledger.
SELECTION_KEY = "selection"
# A distributed round's agreement key, from the advertise stage to the collect stage.
AGREEMENT_KEY = "secure-sum-agreement"
# The secret key of the run's held-out coins: every message of the run (a deployed site
# serves each in a fresh process) holds out the same examples.
COINS_KEY = "held-out-coins"
UNPROTECTED_LOSS_KEY = wire.UNPROTECTED_LOSS


def _arrays(values: dict) -> ArrayRecord:
    return ArrayRecord({name: Array(value) for name, value in values.items()})


@dataclass(frozen=True)
class SimulatedTrial:
    """A search's trial as its simulated sites serve it (``gep_fed.flower.search``): the
    rounds it numbers (``first`` to ``last``, run-wide), its settings and the simulated
    sites' own (node-config keys: its budget and ledger folder)."""

    number: int
    first: int
    last: int
    fed: FederationConfig
    settings: Mapping


@dataclass(frozen=True)
class Served:
    """What a simulated site serves a message for: the run's settings and its own, the
    trial (0: a run of its own) that keys its ``Site``, and the rounds before the trial's."""

    fed: FederationConfig | None
    simulation: Mapping | None
    trial: int = 0
    offset: int = 0


def _served(
    msg: Message,
    context: Context,
    fed: FederationConfig | None,
    simulation: Mapping | None,
    trials: Sequence[SimulatedTrial] | None,
) -> Served:
    """A simulated search's trial of the message: by the round it names (a train or secure
    sum stage) or, for a score query, by the last round this node served. Outside a search
    (or at a deployed site, which takes nothing from it), the settings as given."""
    if not trials or not SiteConfig.is_simulated(context.node_config):
        return Served(fed, simulation)
    records = msg.content.config_records
    round_ = records.get(wire.ROUND_CONFIG, records.get(SECURE_SUM, {})).get("round")
    if round_ is None:
        round_ = context.state.config_records.get(LAST_ROUND_KEY, {}).get(LAST_ROUND_KEY)
    for trial in trials:
        if isinstance(round_, int) and trial.first <= round_ <= trial.last:
            return Served(trial.fed, trial.settings, trial.number, trial.first - 1)
    raise wire.RoundRefused("malformed round")  # a round of no planned trial


def _site(context: Context, served: Served) -> Site:
    """This node's site, built on its first round of the run (of a search's trial).

    A deployed site is built from its node config alone: its own task (pinned there, never
    the run config's string), model, data path and memory bound. A simulated site is the
    local user's stand-in and trains the simulation's task and partition."""
    fed, simulation = served.fed, served.simulation
    key = (context.run_id, context.node_id, served.trial)
    if key not in _SITES:
        for old in [k for k in _SITES if k[:2] == key[:2]]:  # an earlier trial's site
            del _SITES[old]
        simulated = SiteConfig.is_simulated(context.node_config)
        if simulated:
            fed = fed if fed is not None else run_settings(context.run_config)
            run_directory = fed.run_directory(context.run_id)
        else:
            run_directory = ""
        cfg = SiteConfig.from_node_config(context.node_config, simulation, run_directory)
        coins = _coins_key(context)
        if simulated:
            check_site_count(cfg, fed)
            task, max_chunk = fed.make_task(), fed.max_chunk
            torch.manual_seed(fed.seed)  # the replica's initial weights are overwritten anyway
            data, held = site_data_parts(
                task, cfg, fed.num_sites, fed.partition, fed.dirichlet_alpha, fed.seed, coins
            )
        else:
            task, max_chunk = cfg.make_task(), cfg.max_chunk
            data, held = site_data_parts(task, cfg, coins_key=coins)
        site = Site(
            cfg.site_id,
            task.build_model(),
            data,
            cfg.policy,
            loss_fn=task.loss,
            kind=task.kind,
            device=resolve_device(cfg.device),
            max_chunk=max_chunk,
            num_workers=cfg.num_workers,
            augmentation=task.augmentation(),
            validation=held if cfg.validation_fraction else None,
        )
        _SITES[key] = (site, cfg)
    site, cfg = _SITES[key]
    # Re-read the ledger every round: the file is the authority (a simulated site may be
    # served by several worker processes), and a stale copy must never overwrite it.
    site.ledger = _open_ledger(cfg)
    return site


def _coins_key(context: Context) -> bytes:
    """The run's held-out coins key, drawn on the node's first message of the run and kept
    in its run state (which stays on the node)."""
    held = context.state.config_records.get(COINS_KEY, {}).get(COINS_KEY)
    if held is None:
        held = new_coins_key()
        context.state[COINS_KEY] = ConfigRecord({COINS_KEY: held})
    return held


def check_site_count(cfg: SiteConfig, fed: FederationConfig) -> None:
    """A simulated site's share is one of ``fed.num_sites`` partitions of the pooled data:
    a simulation with another number of simulated sites (Flower's ``num-partitions``, its
    ``num-supernodes``) would leave partitions untrained, and in central mode divide by the
    pooled size, so the site refuses to train rather than drop data silently."""
    given = cfg.num_partitions
    if given is not None and not cfg.data_path and given != fed.num_sites:
        raise ConfigError(
            f"this simulation has {given} simulated sites (Flower's num-supernodes) and the "
            f"run config num-sites {fed.num_sites}: the pooled data is split into "
            f"{fed.num_sites} shares, so {abs(fed.num_sites - given)} would never train (or "
            f"sites would share one); set num-sites={given} in the run config, or "
            f"num-supernodes={fed.num_sites} in the federation config"
        )


@contextmanager
def served_sites(
    contexts: Mapping[int, Context],
    sites: Mapping[int, Site],
    fed: FederationConfig,
    simulation: Mapping,
) -> Iterator[None]:
    """For the time of the ``with`` block, this process's ClientApp serves ``sites`` (built
    by the caller, by node id: the audit harness's, with canary observers) as the simulated
    nodes of ``contexts`` instead of building them; each still opens its ledger from its
    node config every round, as a built site does."""
    keys = []
    try:
        for node, site in sites.items():
            context = contexts[node]
            key = (context.run_id, context.node_id, 0)
            run_directory = fed.run_directory(context.run_id)
            cfg = SiteConfig.from_node_config(context.node_config, simulation, run_directory)
            _SITES[key] = (site, cfg)
            keys.append(key)
        yield
    finally:
        for key in keys:
            _SITES.pop(key, None)


def admit_task(context: Context, fed: FederationConfig | None) -> None:
    """A deployed site trains only the task (and model) of its own node config: a run config
    naming another task is refused as malformed by comparing the strings, before anything is
    imported or read. Only then does the site resolve the model of its own task (the run
    config's and the node config's, each as ``FederationConfig`` resolves a model)."""
    if SiteConfig.is_simulated(context.node_config):
        return
    if fed is not None:
        task, model = fed.task, fed.model
    else:
        task, model = context.run_config.get("task"), context.run_config.get("model")
    pinned_task = context.node_config.get("task")
    if task == pinned_task:
        requested = task, FederationConfig.resolved_model(task, model)
        pinned = task, FederationConfig.resolved_model(task, context.node_config.get("model"))
    else:
        requested, pinned = (task, model), (pinned_task, context.node_config.get("model"))
    if requested != pinned:
        log.warning(
            "the run config asks for task %r, model %r; this site's node config pins task %r, "
            "model %r",
            *requested,
            *pinned,
        )
        raise wire.RoundRefused("malformed round")


def _open_ledger(cfg: SiteConfig) -> PrivacyLedger:
    """The site's ledger under its key, checked against its high-water mark.

    ``new-ledger`` is one-shot: it creates the key, the ledger and the mark only where no key
    exists yet. Once a key exists, a missing ledger is an error, never a fresh start."""
    key_file = Path(cfg.ledger_key_path)
    create = cfg.new_ledger and not key_file.exists()
    if create:
        key = create_ledger_key(key_file)
    else:
        key = read_ledger_key(key_file)
        if cfg.new_ledger and not Path(cfg.ledger_path).exists():
            raise LedgerError(
                f"ledger {cfg.ledger_path} is missing and its key {key_file} exists: new-ledger "
                "creates a ledger only for a site without a key. Restore the newest copy of "
                "the ledger, and remove new-ledger from the node config"
            )
    return PrivacyLedger.open(
        cfg.ledger_path,
        cfg.policy.delta,
        cfg.policy.epsilon_budget,
        cfg.site_id,
        key=key,
        mark_path=default_mark_path(key_file),
        create=create,
    )


def _basis(
    msg: Message, context: Context, rc: wire.RoundConfig, site: Site
) -> tuple[AnchorSubspace | None, int]:
    """The basis the round needs: from the message (the bases, or the anchors and
    coefficients to rebuild them from at the round's weights, loaded before this call), kept
    for later rounds, or from the site's state. Returns it with the bytes received for it
    this round."""
    if rc.basis_id < 0:
        return None, 0
    if wire.BASIS in msg.content.array_records:
        record = msg.content.array_records[wire.BASIS]
        if wire.is_anchor_record(record):
            anchors = wire.decode_anchors(record, site.layout, admit=site.policy.admit_rebuild)
            subspace = wire.checked_basis(site.rebuild_subspace(anchors))
            kept = _arrays(wire.encode_basis(subspace))
        else:
            subspace, kept = wire.decode_basis(record, site.layout, rc.basis_dtype), record
        context.state[wire.BASIS] = kept
        context.state[BASIS_ID_KEY] = ConfigRecord(
            {BASIS_ID_KEY: rc.basis_id, BASIS_DTYPE_KEY: _held_dtype(record, rc)}
        )
        return subspace, sum(len(a.data) for a in record.values())
    held = context.state.config_records.get(BASIS_ID_KEY, {})
    if held.get(BASIS_ID_KEY) != rc.basis_id:
        raise wire.WireError("server", wire.BASIS, f"round needs basis {rc.basis_id}, not sent")
    record = context.state.array_records[wire.BASIS]
    return wire.decode_basis(record, site.layout, held.get(BASIS_DTYPE_KEY, rc.basis_dtype)), 0


def _held_dtype(record, rc: wire.RoundConfig) -> str:
    """A rebuilt basis is kept in float32; a received one as it came."""
    return "float32" if wire.is_anchor_record(record) else rc.basis_dtype


def _train(msg: Message, context: Context, served: Served) -> Message:
    admit_task(context, served.fed)
    rc = wire.RoundConfig.from_record(msg.content.config_records[wire.ROUND_CONFIG])
    site = _site(context, served)
    last_round = context.state.config_records.get(LAST_ROUND_KEY, {}).get(LAST_ROUND_KEY)
    # Policy and layout first: a refused round changes nothing the site holds.
    site.admit(rc, last_round)
    ledger = site.ledger
    context.state[SELECTION_KEY] = ConfigRecord({SELECTION_KEY: rc.selection})  # its score's
    if rc.selection_terms is not None:  # the selection in its ledger, the trial in its own
        site.ledger = trial_ledger(ledger, rc.selection_terms)
    if rc.noise_mode.secure_sum:  # a share leaves only masked, after the keys are checked
        agreement = _checked_keys(msg, context, rc, site, served)
    state = wire.decode_state(msg.content.array_records[wire.GLOBAL_MODEL], site.model.state_dict())
    site.load_state(state)
    subspace, received = _basis(msg, context, rc, site)
    context.state[LAST_ROUND_KEY] = ConfigRecord({LAST_ROUND_KEY: rc.round})
    declined = context.state.config_records.get(DECLINED_KEY, {}).get(DECLINED_KEY)
    try:
        release = site.run_round(rc, subspace, last_round, declined)
    except wire.RoundRefused as refused:
        if refused.reason == "over budget":  # the rest of this plan is refused too
            through = max(rc.last_round, declined or 0)
            context.state[DECLINED_KEY] = ConfigRecord({DECLINED_KEY: through})
        raise
    metrics = {wire.BASIS_BYTES_RECEIVED: received, BASIS_ID_KEY: rc.basis_id}
    if release.sums is not None:
        payload = {wire.CLIPPED_SUMS: _arrays(wire.encode_sums(release.sums))}
    elif release.share is not None:
        private, own, keys, binding = agreement
        bits = rc.privacy.quantization_bits
        masked = masked_vector(release.share, private, own, keys, binding, bits)
        payload = {MASKED_SHARE: _arrays({MASKED_SHARE: masked.astype(np.uint32)})}
    else:
        delta = wire.encode_delta(site.layout, release.delta)
        payload = {wire.MODEL_DELTA: _arrays(delta)}
        metrics[wire.LOCAL_STEPS] = rc.local_steps
    metrics[wire.SITE_EPSILON] = ledger.epsilon()
    if site.policy.release_metrics:
        metrics[UNPROTECTED_LOSS_KEY] = site.training_loss()
    content = RecordDict(
        {
            **payload,
            wire.REPLY_META: ConfigRecord(wire.reply_meta(rc.round, rc.mode)),
            wire.REPLY_METRICS: MetricRecord(metrics),
        }
    )
    return Message(content=content, reply_to=msg)


def _advertise(msg: Message, context: Context, served: Served) -> Message:
    """The secure sum's first stage: a fresh agreement key for the round, signed with the
    site's key and kept (private part) until the collect stage."""
    admit_task(context, served.fed)
    record = msg.content.config_records[SECURE_SUM]
    round_ = record.get("round")
    if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 1:
        raise wire.RoundRefused("malformed round")
    site = _site(context, served)
    if not site.policy.accepts_secure_sum:
        raise wire.RoundRefused("mode not allowed")
    last_round = context.state.config_records.get(LAST_ROUND_KEY, {}).get(LAST_ROUND_KEY)
    held = context.state.config_records.get(AGREEMENT_KEY, {}).get("round")
    if any(seen is not None and round_ <= seen for seen in (last_round, held)):
        raise wire.RoundRefused("replayed round")  # one agreement key per round, at most
    declined = context.state.config_records.get(DECLINED_KEY, {}).get(DECLINED_KEY)
    if declined is not None and round_ <= declined:
        raise wire.RoundRefused("over budget")  # the run it refused: no key for its rounds
    try:
        settings = read_settings(record)
    except ValueError:
        raise wire.RoundRefused("malformed round") from None
    cfg = _SITES[(context.run_id, context.node_id, served.trial)][1]
    binding = RoundBinding(msg.metadata.run_id, round_, settings)
    private, signed = advertise(cfg.site_key(), binding)
    context.state[AGREEMENT_KEY] = ConfigRecord(
        {
            "round": round_,
            "settings": settings,
            "private": private,
            "signed": b"".join(signed.as_list()),
        }
    )
    content = RecordDict({SECURE_SUM: ConfigRecord({"signed-key": b"".join(signed.as_list())})})
    return Message(content=content, reply_to=msg)


def _checked_keys(
    msg: Message, context: Context, rc: wire.RoundConfig, site: Site, served: Served
) -> tuple[bytes, SignedKey, list[SignedKey], RoundBinding]:
    """The collect stage's keys, checked against this site's pinned peers and noise split,
    and the round config against the settings every listed site signed, before anything is
    computed; the round's agreement key is erased from the site's state here, so it masks
    one share at most."""
    held = context.state.config_records.get(AGREEMENT_KEY)
    if AGREEMENT_KEY in context.state.config_records:
        del context.state.config_records[AGREEMENT_KEY]
    record = msg.content.config_records.get(SECURE_SUM)
    if record is None or record.get("stage") != COLLECT or record.get("round") != rc.round:
        raise wire.RoundRefused("malformed round")
    if held is None or held.get("round") != rc.round:
        raise wire.RoundRefused("malformed round")  # no key advertised for this round
    try:
        keys = read_keys(record)
    except ValueError:
        raise wire.RoundRefused("malformed round") from None
    settings = rc.digest()
    if held.get("settings") != settings:  # other settings than those it signed
        raise wire.RoundRefused("malformed round")
    signed = held["signed"]
    own = SignedKey(signed[:32], signed[32:64], signed[64:])
    cfg = _SITES[(context.run_id, context.node_id, served.trial)][1]
    binding = RoundBinding(msg.metadata.run_id, rc.round, settings)
    check_keys(keys, own, cfg.pinned_peers(), binding, site.policy.sites_needed())
    return held["private"], own, keys, binding


def _score(msg: Message, context: Context, served: Served) -> Message:
    """The served model's noised per-class counts on the site's held-out examples, if the
    site's node config releases a score (``Site.score_counts``)."""
    admit_task(context, served.fed)
    record = msg.content.config_records.get(wire.SCORE_REQUEST)
    if record is None:
        raise wire.RoundRefused("malformed round")
    classes = wire.check_score_request(record)
    site = _site(context, served)
    terms = context.state.config_records.get(SELECTION_KEY, {}).get(SELECTION_KEY)
    if terms:  # a selection's trial scores in the trial's own ledger, under its bound
        site.ledger = trial_ledger(site.ledger, wire.SelectionTerms.from_json(terms))
    state = wire.decode_state(msg.content.array_records[wire.GLOBAL_MODEL], site.model.state_dict())
    site.load_state(state)
    counts = site.score_counts(classes)
    content = RecordDict({wire.SITE_SCORE: _arrays(wire.encode_counts(counts))})
    return Message(content=content, reply_to=msg)


def handle_query(
    msg: Message,
    context: Context,
    fed: FederationConfig | None = None,
    simulation: Mapping | None = None,
    trials: Sequence[SimulatedTrial] | None = None,
) -> Message:
    """A score query at this site. Never raises: a refusal or failure is a reply with a
    fixed reason code, its detail logged here only."""
    served = None  # a query of no trial of a simulated search: no site's folder to note it in
    try:
        served = _served(msg, context, fed, simulation, trials)
        reply = _score(msg, context, served)
        _note_simulated_outcome(msg, context, served, "accepted", None, "score")
        return reply
    except Exception as err:
        reason, cause = _refusal_reason(err, context)
    if served is not None:
        _note_simulated_outcome(msg, context, served, reason, cause, "score")
    return refusal(msg, reason)


def _refusal_reason(err: Exception, context: Context) -> tuple[str, str | None]:
    """The fixed reason a failure is refused with, and its cause for a simulated site's
    record; logged here, at the site."""
    if isinstance(err, SecureSumRefused):
        log.warning("secure sum refused: %s", err)
        return err.reason, f"secure sum: {err.detail}"
    if isinstance(err, wire.RoundRefused):
        log.warning("round refused: %s", err.reason)
        return err.reason, None
    if isinstance(err, wire.WireError | ConfigError | KeyError):
        log.warning("round refused as malformed: %s", err)
        return "malformed round", f"{type(err).__name__}: {err}"
    cause = f"{type(err).__name__}: {err}"
    if SiteConfig.is_simulated(context.node_config):  # its cause goes to the summary
        log.warning("round failed at this simulated site: %s", cause)
    else:
        log.error("round failed at this site (nothing of this is sent to the server)", exc_info=err)
    return "site error", cause


def handle_train(
    msg: Message,
    context: Context,
    fed: FederationConfig | None = None,
    simulation: Mapping | None = None,
    trials: Sequence[SimulatedTrial] | None = None,
) -> Message:
    """One round at this site. Never raises: any refusal or failure is a reply with a
    fixed reason code, and its detail is logged here, at the site, only.

    ``fed``: the run's settings as the caller knows them (a simulation); None reads a
    simulated site's from the run config. A deployed site takes nothing from either but
    the task's name, which must equal its node config's. ``trials``: a simulated search's
    trials, each with its own settings (``SimulatedTrial``), instead of ``fed``."""
    served = None  # a round of no trial of a simulated search: no site's folder to note it in
    try:
        served = _served(msg, context, fed, simulation, trials)
        stage = msg.content.config_records.get(SECURE_SUM, {}).get("stage")
        if stage == ADVERTISE:
            return _advertise(msg, context, served)
        reply = _train(msg, context, served)
        _note_simulated_outcome(msg, context, served, "accepted", None)
        return reply
    except Exception as err:
        reason, cause = _refusal_reason(err, context)
    if served is not None:
        _note_simulated_outcome(msg, context, served, reason, cause)
    return refusal(msg, reason)


def _note_simulated_outcome(
    msg: Message,
    context: Context,
    served: Served,
    outcome: str,
    cause: str | None,
    stage: str = "round",
) -> None:
    """A simulated site's round, with the cause of a refusal, in its folder of the run
    directory (``sites/<site>/rounds.jsonl``), for the local user who runs every site of a
    simulation. A deployed site writes nothing of the kind: its detail stays in its log."""
    node = context.node_config
    if not SiteConfig.is_simulated(node):
        return
    fed, simulation = served.fed, served.simulation
    try:
        fed = fed if fed is not None else run_settings(context.run_config)
        run_sites = Path(fed.run_directory(context.run_id)) / "sites"
        folder = Path((simulation or {}).get("ledger-dir") or run_sites)
        site = str(node.get("site-id") or simulated_site_name({**(simulation or {}), **node}))
        record = msg.content.config_records.get(wire.ROUND_CONFIG, {})
        round_ = record.get("round")
        if served.trial and isinstance(round_, int):  # a search's trial: its own round
            round_ -= served.offset
        row = {"round": round_, "node": context.node_id, "outcome": outcome}
        if served.trial:
            row["trial"] = served.trial
        if stage != "round":  # a score query: no round of its own
            row["stage"] = stage
        if cause is not None:
            row["cause"] = cause
        (folder / site).mkdir(parents=True, exist_ok=True)
        with open(folder / site / SITE_ROUNDS, "ab+") as fh:  # appends whatever it reads
            end, torn = fh.seek(0, os.SEEK_END), False
            if end:
                fh.seek(end - 1)
                torn = fh.read(1) != b"\n"
            # a line torn by a crash keeps a line of its own: the new row never joins it
            fh.write((("\n" if torn else "") + json.dumps(row) + "\n").encode())
    except Exception:  # a diagnostic: never let it change the site's reply
        log.exception("could not record this simulated site's round")


def refusal(msg: Message, reason: str) -> Message:
    """The reply that declines ``msg``: a fixed code and its fixed text, nothing else."""
    return Message(error=Error(wire.REFUSALS[reason], reason), reply_to=msg)


def make_client_app(
    fed: FederationConfig | None = None,
    simulation: Mapping | None = None,
    trials: Sequence[SimulatedTrial] | None = None,
) -> ClientApp:
    """A ClientApp for ``fed`` (None: a simulated site reads the run config). ``simulation``
    is the simulated sites' own settings (node-config keys such as ``epsilon-budget``);
    ``trials``, a simulated search's trials, each with its own of both. A deployed site's
    settings, its task included, come only from its node config: it never builds a
    configuration from the run config, so no string the server sends is imported there."""

    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        return handle_train(msg, context, fed, simulation, trials)

    @client.query()
    def query(msg: Message, context: Context) -> Message:
        return handle_query(msg, context, fed, simulation, trials)

    return client
