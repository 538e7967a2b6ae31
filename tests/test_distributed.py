"""Distributed mode: the sites' quantised noise shares, summed by Flower's SecAgg+.

The federation runs here in one process: ``LocalGrid`` hands every message of the real
``GEPStrategy`` to the real ClientApp of each site (its mods, Flower's ``secaggplus_mod``
and the site's code), without the transport, so that a test sees every reply the server
receives and can make a site fall silent at any stage. ``tests/test_simulation.py`` runs the
same mode in a Flower simulation.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.supercore.task_identity import TaskIdentity

from gep_fed.accounting.events import epsilon_pld, epsilon_rdp
from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.server import FederationServer
from gep_fed.flower.clientapp import make_client_app
from gep_fed.flower.secure_sum import (
    MOD_RANGE,
    ROUND_NOISE_KEY,
    SecureSum,
    SecureSumDeclined,
    SiteGuard,
    secagg_settings,
)
from gep_fed.flower.simulation import simulated_site_settings
from gep_fed.flower.strategy import GEPStrategy
from gep_fed.mechanisms.distributed_noise import DistributedNoise, padded_dimension
from gep_fed.validation import ConfigError

FAST = dict(num_basis=10, num_public=100, sample_rate=0.2, noise_seed=3, mode="distributed")


RUN_IDS = itertools.count(1000)


@pytest.fixture(autouse=True)
def server_identity():
    """Messages the strategy builds take the run and node of the process (the ServerApp's);
    each test is a run of its own (a site's state is kept per run and node)."""
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = next(RUN_IDS), 0, 0
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class LocalGrid:
    """Every site's real ClientApp, called in this process; ``silent(round, node, stage)``
    True drops that message (the site never answers it)."""

    def __init__(self, fed: FederationConfig, silent=lambda rnd, node, stage: False) -> None:
        self.app = make_client_app(fed, simulated_site_settings(fed))
        self.contexts = {
            100 + i: Context(
                TaskIdentity.run_id,
                100 + i,
                {"partition-id": i, "num-partitions": fed.num_sites},
                RecordDict(),
                {},
            )
            for i in range(fed.num_sites)
        }
        self.silent = silent
        self.received = []  # every reply, as the server got it
        self.stages = []  # (round, stage) of every message sent

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            configs = msg.content.config_records.get(RECORD_KEY_CONFIGS, {})
            stage, rnd = configs.get(Key.STAGE), int(msg.metadata.group_id or 0)
            self.stages.append((rnd, stage))
            if self.silent(rnd, node, stage):
                continue
            reply = self.app(msg, self.contexts[node])
            self.received.append(reply)
            replies.append(reply)
        return replies


def spy_shares(monkeypatch):
    """Record every share a site computes and every secure sum the server decodes."""
    shares, sums = [], []
    encode, apply = DistributedNoise.encode, FederationServer.apply_distributed

    def spy_encode(self, *args, **kwargs):
        shares.append(encode(self, *args, **kwargs))
        return shares[-1]

    def spy_apply(self, round_, modular_sum):
        sums.append((round_, modular_sum.copy()))
        return apply(self, round_, modular_sum)

    monkeypatch.setattr(DistributedNoise, "encode", spy_encode)
    monkeypatch.setattr(FederationServer, "apply_distributed", spy_apply)
    return shares, sums


def run(tmp_path, grid_silent=None, **settings):
    fed = FederationConfig(run_dir=str(tmp_path), run_name="r", **{**FAST, **settings})
    grid = LocalGrid(fed, grid_silent or (lambda rnd, node, stage: False))
    strategy = GEPStrategy.from_config(fed, TaskIdentity.run_id, progress=False)
    strategy.start(grid)
    return fed, grid, strategy


def test_the_unmasked_sum_is_exactly_the_sum_of_the_sites_shares_and_none_is_seen(
    tmp_path, monkeypatch
):
    shares, sums = spy_shares(monkeypatch)
    _, grid, strategy = run(tmp_path, rounds=1)
    assert [r for r, _ in sums] == [1] and len(shares) == 3
    bits = strategy.server.contract.quantization_bits
    for i, (_, total) in enumerate(sums):
        own = shares[3 * i : 3 * i + 3]
        np.testing.assert_array_equal(total, sum(own) % (1 << bits))
    # The server's view: every array and byte string of every reply it received.
    seen = []
    for reply in grid.received:
        if reply.has_error():
            continue
        for record in reply.content.array_records.values():
            seen += [np.asarray(a.numpy()) for a in record.values()]
        for record in reply.content.config_records.values():
            for value in record.values():
                values = value if isinstance(value, list) else [value]
                for b in values:
                    if isinstance(b, bytes) and b[:6] == b"\x93NUMPY":
                        seen.append(bytes_to_ndarray(b))
    vectors = [a.reshape(-1) for a in seen if a.size == shares[0].size]
    assert len(vectors) == 3  # the masked vectors, and nothing else of that length
    offset = 1 << (bits + 1)  # what Flower's mod adds before masking
    for v in vectors:
        for share in shares:
            # a masked vector agrees with a clear share (or its offset form) by chance only
            assert np.mean(v == share) < 0.01 and np.mean(v == share + offset) < 0.01
    ledger = PrivacyLedger.load(strategy.server.run.ledger_path)
    assert ledger.steps == 1 and {e.placement for e in ledger.events} == {"distributed"}


def test_a_site_that_drops_after_masking_is_recovered_and_one_before_is_left_out(
    tmp_path, monkeypatch
):
    shares, sums = spy_shares(monkeypatch)
    after, before = 100, 101  # silent at unmasking; silent at collection (computes nothing)
    silent = {(after, Stage.UNMASK), (before, Stage.COLLECT_MASKED_VECTORS)}
    *_, strategy = run(
        tmp_path,
        grid_silent=lambda rnd, node, stage: (node, stage) in silent,
        rounds=1,
        num_sites=5,
        noise_shares=3,
    )
    assert len(sums) == 1 and len(shares) == 4  # the round completed without site 101
    bits = strategy.server.contract.quantization_bits
    # site 100's share is in the sum: its own mask is rebuilt from the others' shares
    np.testing.assert_array_equal(sums[0][1], sum(shares) % (1 << bits))
    rows = strategy.server.run.read_metrics()
    assert [(r["applied"], r["sites_ok"]) for r in rows] == [(True, 4)]


def test_too_few_survivors_abandon_the_round_before_anything_is_unmasked(tmp_path, monkeypatch):
    shares, sums = spy_shares(monkeypatch)
    _, grid, strategy = run(
        tmp_path,
        grid_silent=lambda rnd, node, stage: node == 100 and stage == Stage.COLLECT_MASKED_VECTORS,
        rounds=1,
    )
    assert sums == []  # nothing decoded, nothing stepped
    assert (1, Stage.UNMASK) not in grid.stages  # no site was asked for unmasking shares
    (row,) = strategy.server.run.read_metrics()
    assert not row["applied"] and row["sites_ok"] == 0
    assert row["rejected"] == ["site at node 100: no collect_masked_vectors reply"]
    assert PrivacyLedger.load(strategy.server.run.ledger_path).steps == 0
    assert len(shares) == 2  # the two survivors computed (and recorded) their shares


def guard_state(noise_shares: int) -> RecordDict:
    state = RecordDict()
    state.config_records[ROUND_NOISE_KEY] = ConfigRecord({"noise-shares": noise_shares})
    return state


def test_a_site_that_accepts_no_distributed_round_is_named_with_its_refusal(tmp_path):
    fed = FederationConfig(run_dir=str(tmp_path), run_name="r", rounds=1, **FAST)
    grid = LocalGrid(fed)
    grid.app = make_client_app(fed, {**simulated_site_settings(fed), "accept-modes": "client"})
    strategy = GEPStrategy.from_config(fed, TaskIdentity.run_id, progress=False)
    strategy.start(grid)
    (row,) = strategy.server.run.read_metrics()
    assert not row["applied"]
    assert row["rejected"] == [
        f"site at node {n}: setup: refused: mode not allowed" for n in (100, 101, 102)
    ]
    logs = sorted(tmp_path.glob("**/sites/*/rounds.jsonl"))  # each site's own record
    assert len(logs) == 3
    for site_log in logs:
        (entry,) = map(json.loads, site_log.read_text().splitlines())
        assert entry["outcome"] == "mode not allowed"
        assert entry["cause"] == "secure sum stage setup: declined"


def test_a_site_declines_to_unmask_when_fewer_sites_than_its_noise_needs_survive():
    guard = SiteGuard(max_colluding_sites=1)
    unmask = {Key.ACTIVE_NODE_ID_LIST: [1, 2, 3], Key.DEAD_NODE_ID_LIST: [4]}
    guard.check(Stage.UNMASK, ConfigRecord(unmask), guard_state(2))  # 3 >= 2 + 1
    with pytest.raises(SecureSumDeclined, match="too few sites"):
        guard.check(Stage.UNMASK, ConfigRecord(unmask), guard_state(3))
    with pytest.raises(SecureSumDeclined, match="malformed"):  # a node both alive and dead
        guard.check(
            Stage.UNMASK,
            ConfigRecord({Key.ACTIVE_NODE_ID_LIST: [1, 2, 3], Key.DEAD_NODE_ID_LIST: [3]}),
            guard_state(1),
        )
    with pytest.raises(SecureSumDeclined, match="malformed"):  # no collect stage this round
        guard.check(Stage.UNMASK, ConfigRecord(unmask), RecordDict())


@pytest.mark.parametrize(
    "change",
    [
        {Key.SHARE_NUMBER: 3},  # not every site shares with every other
        {Key.THRESHOLD: 1},  # a single share reconstructs a site's secrets
        {Key.CLIPPING_RANGE: 1000.0},  # the mod would clip and rescale the shares
        {Key.TARGET_RANGE: 1 << 22},
        {Key.MAX_WEIGHT: 2.0},
        {Key.MOD_RANGE: 1 << 20},  # the sum would wrap
        {Key.SAMPLE_NUMBER: 2, Key.SHARE_NUMBER: 2, Key.THRESHOLD: 2},  # one pairwise mask
    ],
)
def test_a_site_refuses_secure_sum_settings_that_would_weaken_it(change):
    settings = secagg_settings(bits=20, sample_num=5, threshold=3)
    SiteGuard(0).check(Stage.SETUP, ConfigRecord(settings), RecordDict())
    with pytest.raises(SecureSumDeclined, match="malformed round"):
        SiteGuard(0).check(Stage.SETUP, ConfigRecord({**settings, **change}), RecordDict())


def test_a_reconstruction_threshold_a_colluding_group_could_meet_is_refused():
    settings = secagg_settings(bits=20, sample_num=5, threshold=3)
    with pytest.raises(SecureSumDeclined):
        SiteGuard(max_colluding_sites=3).check(Stage.SETUP, ConfigRecord(settings), RecordDict())


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ([b"x"], "must be two arrays"),
        ([b"x", b"y"], "cannot be read"),
        (
            [np.array([1]).tobytes(), np.array([1]).tobytes()],
            "cannot be read",
        ),
    ],
)
def test_a_malformed_masked_vector_is_refused_by_name(value, why):
    problem = SecureSum(None, 20, 2)._masked_problem(value)
    assert problem is not None and Key.MASKED_PARAMETERS in problem and why in problem


def test_masked_vectors_out_of_range_or_of_floats_are_refused():
    from flwr.common import ndarray_to_bytes

    ok = [ndarray_to_bytes(np.array([5])), ndarray_to_bytes(np.arange(8))]
    assert SecureSum(None, 20, 2)._masked_problem(ok) is None
    for bad in (np.arange(8) * 1.0, np.array([MOD_RANGE] * 8), -np.arange(1, 9)):
        value = [ok[0], ndarray_to_bytes(bad)]
        assert "integers in [0, 2**32)" in SecureSum(None, 20, 2)._masked_problem(value)


def test_distributed_settings_are_checked_when_the_run_is_configured():
    with pytest.raises(ConfigError, match="noise_shares"):
        FederationConfig(mode="distributed", num_sites=3, noise_shares=4)
    with pytest.raises(ConfigError, match="distributed mode needs"):
        FederationConfig(mode="distributed", noise_multiplier=0.0)
    with pytest.raises(ConfigError, match="at least 3 sites"):
        FederationConfig(mode="distributed", num_sites=2, min_sites=1)


def test_distributed_calibration_spends_the_budget_with_about_central_noise():
    central = FederationConfig(
        mode="central", rounds=20, **{k: v for k, v in FAST.items() if k != "mode"}
    )
    distributed = FederationConfig(rounds=20, **FAST)
    c, d = central.contract, distributed.contract
    assert d.noise_shares == 3 and d.quantization_bits == 24 and 0 < d.quantization_step < 1e-4
    assert 1.0 <= d.noise_multiplier / c.noise_multiplier < 1.02
    torch.manual_seed(0)
    params = sum(p.numel() for p in distributed.make_task().build_model().parameters())
    events = d.events(20, dimension=d.quantized_dimension(20, params))
    assert epsilon_rdp(events, 1e-5) == pytest.approx(8.0, abs=0.01)
    assert math.isnan(epsilon_pld(events, 1e-5))  # no PLD for the sum of discrete shares


@pytest.mark.parametrize("mechanism", ["bgep", "gp"])
def test_bgep_and_gp_rounds_are_summed_decoded_and_stepped(tmp_path, monkeypatch, mechanism):
    shares, sums = spy_shares(monkeypatch)
    *_, strategy = run(tmp_path, rounds=1, mechanism=mechanism)
    server = strategy.server
    assert len(sums) == 1 and shares[0].shape == (server.quantized_dimension,)
    released = server.num_basis if mechanism == "bgep" else server.layout.size
    assert server.quantized_dimension == padded_dimension(released) >= released
    (row,) = server.run.read_metrics()
    assert row["applied"] and row["sites_ok"] == 3


def test_quantization_bits_out_of_range_are_named_when_the_run_is_configured():
    with pytest.raises(ConfigError, match="quantization_bits"):
        FederationConfig(mode="distributed", quantization_bits=40)
