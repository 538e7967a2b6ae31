"""Flower ClientApp helper: one site. Thin: Flower records in, ``federation.site`` calls, out.

What leaves the site: the clipped sums (central mode, only if the site's policy accepts it)
or the noisy model delta (client-side mode), plus data-free metrics (bytes received, basis
id, steps, the site's epsilon, which depends on public parameters only). A raw training loss
leaves only when the *site's* policy allows it, under a key that says it is outside the
guarantee. Every failure becomes a reply with a fixed reason code (``wire.REFUSALS``); the
detail goes to the site's own log, never to the server.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

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

from gep_fed.accounting.ledger import PrivacyLedger, create_ledger_key, read_ledger_key
from gep_fed.config import ConfigError, FederationConfig
from gep_fed.federation import wire
from gep_fed.federation.policy import SiteConfig
from gep_fed.federation.site import Site, resolve_device, site_dataset
from gep_fed.mechanisms.subspace import AnchorSubspace

log = logging.getLogger("gep_fed.federation.site")

# One Site per (run, node) in this process: data is loaded once, not every round.
_SITES: dict[tuple[int, int], tuple[Site, SiteConfig]] = {}
BASIS_ID_KEY = "basis-id"
LAST_ROUND_KEY = "last-round"
UNPROTECTED_LOSS_KEY = "train-loss-OUTSIDE-PRIVACY-GUARANTEE"


def _arrays(values: dict) -> ArrayRecord:
    return ArrayRecord({name: Array(value) for name, value in values.items()})


def _site(
    context: Context, fed: FederationConfig, rc: wire.RoundConfig, simulation: Mapping | None
) -> Site:
    key = (context.run_id, context.node_id)
    if key not in _SITES:
        cfg = SiteConfig.from_node_config(
            context.node_config, simulation, fed.run_directory(context.run_id)
        )
        task = fed.make_task()
        torch.manual_seed(fed.seed)  # the replica's initial weights are overwritten anyway
        data = site_dataset(
            task, cfg, fed.num_sites, fed.partition, fed.dirichlet_alpha, fed.seed
        )
        site = Site(
            cfg.site_id,
            task.build_model(),
            data,
            cfg.policy,
            loss_fn=task.loss,
            device=resolve_device(cfg.device),
            max_chunk=fed.max_chunk,
            num_workers=cfg.num_workers,
        )
        _SITES[key] = (site, cfg)
    site, cfg = _SITES[key]
    # Re-read the ledger every round: the file is the authority (a simulated site may be
    # served by several worker processes), and a stale copy must never overwrite it.
    site.ledger = _open_ledger(cfg)
    return site


def _open_ledger(cfg: SiteConfig) -> PrivacyLedger:
    """The site's ledger under its key; only ``new-ledger`` may create them."""
    if cfg.new_ledger and not Path(cfg.ledger_path).exists():
        key_file = Path(cfg.ledger_key_path)
        key = read_ledger_key(key_file) if key_file.exists() else create_ledger_key(key_file)
    else:
        key = read_ledger_key(cfg.ledger_key_path)
    return PrivacyLedger.open(
        cfg.ledger_path,
        cfg.policy.delta,
        cfg.policy.epsilon_budget,
        cfg.site_id,
        key=key,
        create=cfg.new_ledger,
    )


def _basis(
    msg: Message, context: Context, rc: wire.RoundConfig
) -> tuple[AnchorSubspace | None, int]:
    """The basis the round needs: from the message (kept for later rounds) or from the
    site's state. Returns it with the bytes received for it this round."""
    if rc.basis_id < 0:
        return None, 0
    layout = rc.parameter_layout()
    if wire.BASIS in msg.content.array_records:
        record = msg.content.array_records[wire.BASIS]
        subspace = wire.decode_basis(record, layout, rc.basis_dtype)
        context.state[wire.BASIS] = record
        context.state[BASIS_ID_KEY] = ConfigRecord({BASIS_ID_KEY: rc.basis_id})
        return subspace, sum(len(a.data) for a in record.values())
    held = context.state.config_records.get(BASIS_ID_KEY, {}).get(BASIS_ID_KEY)
    if held != rc.basis_id:
        raise wire.WireError("server", wire.BASIS, f"round needs basis {rc.basis_id}, not sent")
    return wire.decode_basis(context.state.array_records[wire.BASIS], layout, rc.basis_dtype), 0


def _train(
    msg: Message, context: Context, fed: FederationConfig, simulation: Mapping | None
) -> Message:
    rc = wire.RoundConfig.from_record(msg.content.config_records[wire.ROUND_CONFIG])
    site = _site(context, fed, rc, simulation)
    state = wire.decode_state(msg.content.array_records[wire.GLOBAL_MODEL], site.model.state_dict())
    last_round = context.state.config_records.get(LAST_ROUND_KEY, {}).get(LAST_ROUND_KEY)
    # Policy first: a refused round changes nothing the site holds.
    site.policy.admit(rc, last_round)
    site.load_state(state)
    subspace, received = _basis(msg, context, rc)
    context.state[LAST_ROUND_KEY] = ConfigRecord({LAST_ROUND_KEY: rc.round})
    release = site.run_round(rc, subspace, last_round)
    metrics = {"basis-bytes-received": received, BASIS_ID_KEY: rc.basis_id}
    if release.sums is not None:
        payload = {wire.CLIPPED_SUMS: _arrays(wire.encode_sums(release.sums))}
    else:
        delta = wire.encode_delta(rc.parameter_layout(), release.delta)
        payload = {wire.MODEL_DELTA: _arrays(delta)}
        metrics["local-steps"] = rc.local_steps
    metrics["site-epsilon"] = site.ledger.epsilon()
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


def handle_train(
    msg: Message,
    context: Context,
    fed: FederationConfig,
    simulation: Mapping | None = None,
) -> Message:
    """One round at this site. Never raises: any refusal or failure is a reply with a
    fixed reason code, and its detail is logged here, at the site, only."""
    try:
        return _train(msg, context, fed, simulation)
    except wire.RoundRefused as refused:
        reason = refused.reason
        log.warning("round refused: %s", reason)
    except (wire.WireError, ConfigError, KeyError) as err:
        reason = "malformed round"
        log.warning("round refused as malformed: %s", err)
    except Exception:
        reason = "site error"
        log.exception("round failed at this site (nothing of this is sent to the server)")
    return refusal(msg, reason)


def refusal(msg: Message, reason: str) -> Message:
    """The reply that declines ``msg``: a fixed code and its fixed text, nothing else."""
    return Message(error=Error(wire.REFUSALS[reason], reason), reply_to=msg)


def make_client_app(
    fed: FederationConfig | None = None, simulation: Mapping | None = None
) -> ClientApp:
    """A ClientApp for ``fed`` (None: each message's run config decides the training).
    ``simulation`` is the simulated sites' own settings (node-config keys such as
    ``epsilon-budget``); a deployed site's settings come only from its node config."""
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        try:
            config = fed if fed is not None else FederationConfig.from_record(context.run_config)
        except ConfigError as err:
            log.warning("run config refused: %s", err)
            return refusal(msg, "malformed round")
        return handle_train(msg, context, config, simulation)

    return client


