"""The round loop (``gep_fed.federation.rounds``) over a grid without Flower.

``SiteGrid`` is a grid of real ``Site`` objects called in this process: no Flower message,
record or context anywhere, each request's arrays copied on the way in and each reply's on
the way out, as a transport would. Each mode's run over it must train and account exactly
as the same run through ``GEPStrategy`` (the Flower adapter) and the real ClientApp of each
site (``helpers.LocalGrid``): the same metrics, the same ledgers, the same model.
"""

from __future__ import annotations

import copy
import itertools
import math
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.federation import wire
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.policy import SiteConfig
from gep_fed.federation.rounds import (
    Arrays,
    Config,
    Envelope,
    Metrics,
    Reply,
    RoundLoop,
    open_server,
)
from gep_fed.federation.secure_sum import (
    ADVERTISE,
    COLLECT,
    MASKED_SHARE,
    SECURE_SUM,
    PinnedPeers,
    RoundBinding,
    SecureSumRefused,
    advertise,
    check_keys,
    masked_vector,
    read_keys,
    read_settings,
    site_public_key,
)
from gep_fed.federation.site import Site, site_dataset
from gep_fed.mechanisms import distributed_noise
from gep_fed.mechanisms.noise import NoiseSource

TINY = dict(
    num_basis=10,
    num_public=100,
    sample_rate=0.2,
    noise_seed=3,
    rounds=2,
    local_steps=2,
    basis_refresh=2,
)
FIRST_NODE = 100
RUN_IDS = itertools.count(5000)


def carried(content: Envelope) -> Envelope:
    """A copy of ``content`` as a transport delivers it: arrays as received wire arrays."""
    records = {}
    for name, record in content.records.items():
        if isinstance(record, Arrays):
            records[name] = Arrays(
                {k: wire.as_wire_array(np.array(_numpy(v), copy=True)) for k, v in record.items()}
            )
        else:
            records[name] = type(record)(copy.deepcopy(dict(record)))
    return Envelope(records)


def _numpy(value) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else value.numpy()


def payload_bytes(content: Envelope) -> int:
    total = 0
    for record in content.records.values():
        for value in record.values():
            if isinstance(record, Arrays):
                total += _numpy(value).nbytes
            elif isinstance(value, bytes | str):
                total += len(value)
    return total


class SiteGrid:
    """``RoundGrid`` over the simulated sites of ``fed``, each a real ``Site`` with its
    own policy (the simulation's site settings), in-memory ledger, noise and signing key."""

    def __init__(self, fed: FederationConfig, run_id: int) -> None:
        from gep_fed.flower.simulation import simulated_site_settings  # a dict: no Flower object

        self.run_id = run_id
        self.sent = self.received = 0
        task = fed.make_task()
        settings = simulated_site_settings(fed)
        self.sites: dict[int, Site] = {}
        self.state: dict[int, dict] = {}
        self.keys: dict[int, Ed25519PrivateKey] = {}
        for i in range(fed.num_sites):
            cfg = SiteConfig.from_node_config(
                {"partition-id": i, "num-partitions": fed.num_sites}, settings, "unused"
            )
            torch.manual_seed(fed.seed)
            data = site_dataset(
                task, cfg, fed.num_sites, fed.partition, fed.dirichlet_alpha, fed.seed
            )
            policy = cfg.policy
            self.sites[FIRST_NODE + i] = Site(
                cfg.site_id,
                task.build_model(),
                data,
                policy,
                loss_fn=task.loss,
                kind=task.kind,
                ledger=PrivacyLedger(policy.delta, policy.epsilon_budget, cfg.site_id),
                noise=NoiseSource(policy.noise_seed),
                max_chunk=fed.max_chunk,
                augmentation=task.augmentation(),
            )
            self.state[FIRST_NODE + i] = {}
            self.keys[FIRST_NODE + i] = Ed25519PrivateKey.generate()
        self.peers = PinnedPeers(
            {site_public_key(k): self.sites[n].site_id for n, k in self.keys.items()}
        )

    def node_ids(self) -> list[int]:
        return list(self.sites)

    def exchange(self, requests, *, group_id, timeout) -> list[Reply]:
        replies = []
        for request in requests:
            self.sent += payload_bytes(request.content)
            reply = self._answer(request.node, carried(request.content))
            if reply.content is not None:
                self.received += payload_bytes(reply.content)
                reply = Reply(reply.node, carried(reply.content), run_id=self.run_id)
            replies.append(reply)
        return replies

    def _answer(self, node: int, content: Envelope) -> Reply:
        stage = (content.config(SECURE_SUM) or {}).get("stage")
        try:
            if stage == ADVERTISE:
                return self._advertise(node, content)
            return self._train(node, content)
        except (wire.RoundRefused, SecureSumRefused) as refused:
            return Reply(node, error=wire.REFUSALS[refused.reason], run_id=self.run_id)

    def _advertise(self, node: int, content: Envelope) -> Reply:
        record = content.config(SECURE_SUM)
        binding = RoundBinding(self.run_id, record["round"], read_settings(record))
        private, signed = advertise(self.keys[node], binding)
        self.state[node]["agreement"] = (binding, private, signed)
        key = Config({"signed-key": b"".join(signed.as_list())})
        return Reply(node, Envelope({SECURE_SUM: key}))

    def _train(self, node: int, content: Envelope) -> Reply:
        site, state = self.sites[node], self.state[node]
        rc = wire.RoundConfig.from_record(content.config(wire.ROUND_CONFIG))
        last_round = state.get("last-round")
        site.admit(rc, last_round)
        if rc.noise_mode.secure_sum:
            binding, private, own = state.pop("agreement")
            keys = read_keys(content.config(SECURE_SUM))
            assert content.config(SECURE_SUM)["stage"] == COLLECT
            assert binding == RoundBinding(self.run_id, rc.round, rc.digest())
            check_keys(keys, own, self.peers, binding, site.policy.sites_needed())
        model = wire.decode_state(content.arrays(wire.GLOBAL_MODEL), site.model.state_dict())
        site.load_state(model)
        subspace = None
        if rc.basis_id >= 0:
            if content.arrays(wire.BASIS) is not None:
                state["basis"] = (rc.basis_id, content.arrays(wire.BASIS))
            held_id, held = state["basis"]
            assert held_id == rc.basis_id
            subspace = wire.decode_basis(held, site.layout, rc.basis_dtype)
        state["last-round"] = rc.round
        release = site.run_round(rc, subspace, last_round)
        metrics = {"basis-bytes-received": 0, "basis-id": rc.basis_id}
        if release.sums is not None:
            records = {wire.CLIPPED_SUMS: Arrays(wire.encode_sums(release.sums))}
        elif release.share is not None:
            bits = rc.privacy.quantization_bits
            masked = masked_vector(release.share, private, own, keys, binding, bits)
            records = {MASKED_SHARE: Arrays({MASKED_SHARE: masked.astype(np.uint32)})}
        else:
            records = {wire.MODEL_DELTA: Arrays(wire.encode_delta(site.layout, release.delta))}
            metrics["local-steps"] = rc.local_steps
        metrics["site-epsilon"] = site.ledger.epsilon()
        records[wire.REPLY_META] = Config(wire.reply_meta(rc.round, rc.mode))
        records[wire.REPLY_METRICS] = Metrics(metrics)
        return Reply(node, Envelope(records))


@pytest.fixture
def deterministic_sites(monkeypatch):
    """Each site's Poisson samples and distributed noise drawn from fixed seeds (by site and
    call), so that two runs of the same federation release the same values; returns the
    reset to call before each run."""
    from gep_fed.federation import site as site_module

    calls: dict[str, int] = {}
    draws = itertools.count()

    def sample(self, rate):
        calls[self.site_id] = calls.get(self.site_id, 0) + 1
        seed = 1000 * int(self.site_id.rsplit("-", 1)[1]) + calls[self.site_id]
        u = torch.rand(self.num_examples, generator=torch.Generator().manual_seed(seed))
        return torch.nonzero(u < rate).reshape(-1)

    def os_uniforms(n):
        return np.random.default_rng(next(draws)).random(n)

    def discrete_gaussian(values, scale):
        rng = np.random.default_rng(next(draws))
        return np.round(values + rng.normal(0, scale, np.shape(values))).astype(np.int64)

    monkeypatch.setattr(site_module.Site, "_sample", sample)
    monkeypatch.setattr(distributed_noise, "os_uniforms", os_uniforms)
    monkeypatch.setattr(distributed_noise, "discrete_gaussian", discrete_gaussian)

    def reset():
        nonlocal draws
        calls.clear()
        draws = itertools.count()

    return reset


def through_flower(tmp_path, fed: FederationConfig):
    """The run through ``GEPStrategy`` and each site's real ClientApp."""
    from flwr.supercore.task_identity import TaskIdentity

    from gep_fed.flower.strategy import GEPStrategy
    from helpers import LocalGrid

    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = next(RUN_IDS), 0, 0
    try:
        strategy = GEPStrategy.from_config(fed, TaskIdentity.run_id, progress=False)
        strategy.start(LocalGrid(fed))
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    sites = {}
    for path in sorted(tmp_path.glob("**/sites/*/ledger.json")):
        sites[path.parent.name] = PrivacyLedger.load_keyed(path).events
    return strategy.server, sites


def through_the_loop(fed: FederationConfig):
    """The same run: the round loop over ``SiteGrid``."""
    run_id = next(RUN_IDS)
    grid = SiteGrid(fed, run_id)
    loop = RoundLoop(open_server(fed, run_id), progress=False)
    first = loop.restore(None) + 1
    loop.run(grid, first, fed.rounds)
    return loop, grid


UNTIMED = ("round_seconds", "anchor_seconds", "bytes_sent", "bytes_received")


def rows(server) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in UNTIMED} for r in server.run.read_metrics()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, settings",
    [("central", {}), ("client", {}), ("distributed", {"noise_shares": 3})],
)
def test_each_mode_trains_and_accounts_over_any_grid_as_through_flower(
    tmp_path, deterministic_sites, mode, settings
):
    def fed(where):
        return FederationConfig(run_dir=str(where), run_name="r", mode=mode, **TINY, **settings)

    deterministic_sites()
    flower_server, flower_sites = through_flower(tmp_path / "flower", fed(tmp_path / "flower"))
    deterministic_sites()
    loop, grid = through_the_loop(fed(tmp_path / "loop"))
    server = loop.server

    assert loop.stop_reason is None
    expected = rows(flower_server)
    assert [r["applied"] for r in expected] == [True, True]
    assert [r["sites_ok"] for r in expected] == [3, 3]
    # round 1 sends each site the basis; round 2 none: every site holds it
    assert [r["basis_bytes_per_site"][0] > 0 for r in expected] == [True, False]
    assert rows(server) == expected  # accuracy, epsilon, rejections: each round the same
    assert PrivacyLedger.load(server.run.ledger_path).events == flower_server.ledger.events
    steps = TINY["local_steps"] if mode == "client" else 1  # private steps per round
    assert server.ledger.steps == 2 * steps
    site_events = {site.site_id: site.ledger.events for site in grid.sites.values()}
    assert site_events == flower_sites
    assert all(sum(e.steps for e in events) == 2 * steps for events in site_events.values())
    trained, reference = server.model.state_dict(), flower_server.model.state_dict()
    assert all(torch.equal(trained[k], reference[k]) for k in reference)
    torch.manual_seed(fed(tmp_path).seed)
    initial = fed(tmp_path).make_task().build_model().state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)  # it trained
    assert math.isfinite(server.run.read_metrics()[-1]["epsilon"])
    assert grid.sent > 0 and grid.received > 0
    assert (server.run.path / "model.pt").exists()


def test_a_refusing_site_is_named_and_the_round_goes_on(tmp_path):
    fed = FederationConfig(run_dir=str(tmp_path), run_name="r", mode="central", **TINY)
    grid = SiteGrid(fed, next(RUN_IDS))
    refusing = grid.sites[FIRST_NODE + 1]
    refusing.policy = replace(refusing.policy, accepted_modes=("client",))
    loop = RoundLoop(open_server(fed, grid.run_id), progress=False)
    loop.run(grid, 1, 1)
    (row,) = loop.server.run.read_metrics()
    assert row["applied"] and row["sites_ok"] == 2
    assert row["rejected"] == ["site at node 101: field 'error': refused: mode not allowed"]
    assert loop.server.ledger.steps == 1


@pytest.mark.slow  # a fresh interpreter imports torch
def test_the_loop_needs_no_flower():
    code = (
        "import sys, gep_fed.federation.rounds; "
        "assert not [m for m in sys.modules if m.startswith(('flwr', 'gep_fed.flower'))]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class TamperingGrid(SiteGrid):
    """Node 100's collect replies: a share one coordinate short in round 1, a NaN epsilon in
    round 2 (the others answer honestly)."""

    def _train(self, node: int, content: Envelope) -> Reply:
        reply = super()._train(node, content)
        if node != FIRST_NODE or reply.content is None:
            return reply
        rnd = wire.RoundConfig.from_record(content.config(wire.ROUND_CONFIG)).round
        records = dict(reply.content.records)
        if rnd == 1:
            share = records[MASKED_SHARE][MASKED_SHARE]
            records[MASKED_SHARE] = Arrays({MASKED_SHARE: share[:-1]})
        else:
            records[wire.REPLY_METRICS] = Metrics(
                {**records[wire.REPLY_METRICS], "site-epsilon": float("nan")}
            )
        return Reply(node, Envelope(records))


def test_a_distributed_reply_with_a_short_share_or_bad_metrics_is_named_by_site(tmp_path):
    """A short share was reported as "the sites' masked shares differ in length", naming no
    site; a NaN epsilon in a collect reply was read unchecked. Each names node 100 now, and
    the round (which needs every listed site's share) is abandoned with nothing accounted."""
    fed = FederationConfig(
        run_dir=str(tmp_path), run_name="r", mode="distributed", noise_shares=2, min_sites=2,
        **{**TINY, "rounds": 2},
    )  # fmt: skip
    grid = TamperingGrid(fed, next(RUN_IDS))
    loop = RoundLoop(open_server(fed, grid.run_id), progress=False)
    loop.run(grid, 1, 2)
    first, second = loop.server.run.read_metrics()
    assert any(
        r.startswith("site at node 100: field 'masked-share': shape") for r in first["rejected"]
    ), first["rejected"]
    assert any(
        "site at node 100: field 'metrics.site-epsilon': not finite" in r
        for r in second["rejected"]
    ), second["rejected"]
    assert loop.server.ledger.steps == 0
