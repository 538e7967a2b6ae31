"""Flower ClientApp: one site. Thin: Flower records in, ``gep_fed.site`` calls, records out.

What leaves the site: the clipped sums (central mode, for a trusted server) or the noisy model
delta (client-side mode, accounted in the site's own ledger), plus data-free metrics (bytes
received, steps, the site's epsilon, which depends on public parameters only). A raw training
loss is sent only when the run enables ``release-site-metrics``, under a key that says it is
outside the guarantee.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from gep_fed import wire
from gep_fed.config import FederationConfig
from gep_fed.ledger import PrivacyLedger
from gep_fed.noise import NoiseSource
from gep_fed.site import Site, SiteConfig, load_site_data, resolve_device
from gep_fed.subspace import AnchorSubspace
from gep_fed.tasks import ModelSpec

# One Site per (run, node) in this process: data is loaded once, not every round.
_SITES: dict[tuple[int, int], tuple[Site, SiteConfig]] = {}
BASIS_ID_KEY = "basis-id"
UNPROTECTED_LOSS_KEY = "train-loss-OUTSIDE-PRIVACY-GUARANTEE"


def _arrays(values: dict) -> ArrayRecord:
    return ArrayRecord({name: Array(value) for name, value in values.items()})


def _site(context: Context, fed: FederationConfig, rc: wire.RoundConfig) -> Site:
    key = (context.run_id, context.node_id)
    if key not in _SITES:
        cfg = SiteConfig.from_node_config(
            context.node_config, fed, fed.run_directory(context.run_id)
        )
        spec = ModelSpec.from_json(rc.model_spec)
        data = load_site_data(cfg, fed)
        spec.check_images(data.images, cfg.data_path or f"partition {cfg.partition_id}")
        site = Site(
            cfg.site_id,
            spec.build(),
            spec.tensor(data.images),
            torch.from_numpy(data.labels),
            device=resolve_device(cfg.device),
            noise=NoiseSource(fed.noise_seed),
            max_chunk=fed.max_chunk,
        )
        _SITES[key] = (site, cfg)
    site, cfg = _SITES[key]
    if fed.mode == "client":
        # Re-read the ledger every round: the file is the authority (a simulated site may be
        # served by several worker processes), and a stale copy must never overwrite it.
        site.ledger = PrivacyLedger.open(
            cfg.ledger_path, cfg.delta, cfg.epsilon_budget, cfg.site_id
        )
    return site


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
        raise ValueError(
            f"round {rc.round} needs basis {rc.basis_id} but this site holds {held}; "
            "the server must send it"
        )
    return wire.decode_basis(context.state.array_records[wire.BASIS], layout, rc.basis_dtype), 0


def handle_train(msg: Message, context: Context, fed: FederationConfig) -> Message:
    """One round at this site: decode, compute with ``gep_fed.site``, encode the reply."""
    rc = wire.RoundConfig.from_record(msg.content.config_records[wire.ROUND_CONFIG])
    site = _site(context, fed, rc)
    state = wire.decode_state(msg.content.array_records[wire.GLOBAL_MODEL], site.model.state_dict())
    site.load_state(state)
    subspace, received = _basis(msg, context, rc)
    metrics = {"basis-bytes-received": received, BASIS_ID_KEY: rc.basis_id}
    if rc.mode == "central":
        payload = {wire.CLIPPED_SUMS: _arrays(wire.encode_sums(site.central_sums(subspace, rc)))}
    else:
        delta = site.local_update(subspace, rc)
        payload = {wire.MODEL_DELTA: _arrays(wire.encode_delta(rc.parameter_layout(), delta))}
        metrics["local-steps"] = rc.local_steps
        metrics["site-epsilon"] = site.ledger.epsilon()
    if fed.release_site_metrics:
        with torch.no_grad():
            metrics[UNPROTECTED_LOSS_KEY] = float(
                F.cross_entropy(site.model(site.inputs), site.targets)
            )
    content = RecordDict(
        {
            **payload,
            wire.REPLY_META: ConfigRecord(wire.reply_meta(rc.round, rc.mode)),
            wire.REPLY_METRICS: MetricRecord(metrics),
        }
    )
    return Message(content=content, reply_to=msg)


def make_client_app(fed: FederationConfig | None = None) -> ClientApp:
    """A ClientApp for ``fed``, or (None) for the run config of each message's run."""
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        config = fed if fed is not None else FederationConfig.from_record(context.run_config)
        return handle_train(msg, context, config)

    return client


app = make_client_app()
