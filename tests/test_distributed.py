"""Distributed mode: the sites' quantised noise shares, summed by the secure sum
(``gep_fed.federation.secure_sum``: pairwise masks, signed keys, no dropout recovery).

The federation runs here in one process: ``helpers.LocalGrid`` hands every message of the real
``GEPStrategy`` to the real ClientApp of each site, without the transport, so that a test sees
every reply the server receives, can make a site fall silent at any stage, and can play a
server that deviates (``tamper`` rewrites a message before a site gets it).
``tests/test_simulation.py`` runs the same mode in a Flower simulation.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from gep_fed.accounting.events import epsilon_pld, epsilon_rdp
from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.federation import wire
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.secure_sum import (
    ADVERTISE,
    COLLECT,
    MASKED_SHARE,
    MODULUS,
    SECURE_SUM,
    PinnedPeers,
    RoundBinding,
    SignedKey,
    advertise,
    create_site_key,
    key_text,
    mask_stream,
    pairwise_key,
    read_keys,
    read_masked_share,
    stage_config,
)
from gep_fed.federation.server import FederationServer
from gep_fed.flower.simulation import simulated_site_settings
from gep_fed.flower.strategy import GEPStrategy
from gep_fed.mechanisms.distributed_noise import DistributedNoise, padded_dimension
from gep_fed.validation import ConfigError
from helpers import LocalGrid

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


def run(tmp_path, grid_silent=None, tamper=None, site_settings=None, **settings):
    fed = FederationConfig(run_dir=str(tmp_path), run_name="r", **{**FAST, **settings})
    silent = grid_silent or (lambda rnd, node, stage: False)
    extra = site_settings or {}
    grid = LocalGrid(fed, silent, tamper, {**simulated_site_settings(fed), **extra})
    strategy = GEPStrategy.from_config(fed, TaskIdentity.run_id, progress=False)
    strategy.start(grid)
    return fed, grid, strategy


def site_rounds(tmp_path) -> dict[str, list[dict]]:
    """Each simulated site's own record of its rounds (outcome and cause)."""
    return {
        log.parent.name: [json.loads(line) for line in log.read_text().splitlines()]
        for log in sorted(tmp_path.glob("**/sites/*/rounds.jsonl"))
    }


def site_ledger_steps(tmp_path, site: str) -> int:
    (path,) = tmp_path.glob(f"**/sites/{site}/ledger.json")
    return PrivacyLedger.load_keyed(path).steps


def test_the_unmasked_sum_is_exactly_the_sum_of_the_sites_shares_and_none_is_seen(
    tmp_path, monkeypatch
):
    shares, sums = spy_shares(monkeypatch)
    _, grid, strategy = run(tmp_path, rounds=1)
    assert [r for r, _ in sums] == [1] and len(shares) == 3
    bits = strategy.server.contract.quantization_bits
    np.testing.assert_array_equal(sums[0][1], sum(shares) % (1 << bits))
    # The server's view: every array of every reply it received.
    seen = []
    for reply in grid.received:
        if not reply.has_error():
            for record in reply.content.array_records.values():
                seen += [np.asarray(a.numpy()).reshape(-1) for a in record.values()]
    masked = [v for v in seen if v.size == shares[0].size + 1]
    assert len(masked) == 3 and len(seen) == 3  # the masked shares, and nothing else
    for v in masked:
        assert v.dtype == np.uint32
        for share in shares:  # a masked share agrees with a clear one by chance only
            assert np.mean(v[1:] == share) < 0.01
    ledger = PrivacyLedger.load(strategy.server.run.ledger_path)
    assert ledger.steps == 1 and {e.placement for e in ledger.events} == {"distributed"}
    (path,) = tmp_path.glob("**/sites/site-0/ledger.json")
    site = PrivacyLedger.load_keyed(path)
    assert [e.noise_shares for e in site.events] == [3]
    assert site.epsilon_if_shares_exposed() > site.epsilon()  # the share alone: sigma / sqrt(3)


def test_sites_that_refused_a_run_for_their_budget_refuse_its_later_rounds_at_advertise(
    tmp_path,
):
    """Budgets below one round: every site refuses round 1 when the round config comes
    (collect), and round 2 already when asked for a key: no collect is sent in round 2,
    and no ledger records anything."""
    _, grid, _ = run(tmp_path, rounds=2, site_settings={"epsilon-budget": 0.01})
    assert [s for r, s in grid.stages if r == 1].count(COLLECT) == 3
    assert {s for r, s in grid.stages if r == 2} == {ADVERTISE}
    assert all(reply.has_error() for reply in grid.received[-3:])
    for site in ("site-0", "site-1", "site-2"):
        assert [row["outcome"] for row in site_rounds(tmp_path)[site]] == ["over budget"] * 2
        ledgers = list(tmp_path.glob(f"**/sites/{site}/ledger.json"))
        assert all(PrivacyLedger.load_keyed(path).steps == 0 for path in ledgers)


def test_a_site_silent_at_collect_abandons_the_round_with_nothing_revealed(tmp_path, monkeypatch):
    shares, sums = spy_shares(monkeypatch)
    _, grid, strategy = run(
        tmp_path,
        grid_silent=lambda rnd, node, stage: node == 100 and stage == COLLECT,
        rounds=1,
        num_sites=4,
        noise_shares=3,
    )
    assert sums == []  # nothing decoded, nothing stepped
    (row,) = strategy.server.run.read_metrics()
    assert not row["applied"] and row["sites_ok"] == 0
    assert row["rejected"][0] == "site at node 100: no collect reply"
    assert "round abandoned with nothing revealed" in row["rejected"][1]
    assert PrivacyLedger.load(strategy.server.run.ledger_path).steps == 0
    # The three others computed, masked and recorded their shares: their ledgers over-count
    # the abandoned round, and its masked shares reveal nothing (site 100's masks are in).
    assert len(shares) == 3
    assert [site_ledger_steps(tmp_path, f"site-{i}") for i in (1, 2, 3)] == [1, 1, 1]
    stages = {stage for _, stage in grid.stages}
    assert stages == {ADVERTISE, COLLECT}  # no stage ever asks a site for a secret


def test_too_few_keys_abandon_the_round_before_any_site_computes(tmp_path, monkeypatch):
    shares, sums = spy_shares(monkeypatch)
    _, grid, strategy = run(
        tmp_path,
        grid_silent=lambda rnd, node, stage: node == 100 and stage == ADVERTISE,
        rounds=1,
    )
    assert sums == [] and shares == []
    assert (1, COLLECT) not in grid.stages  # no site was asked for its share
    (row,) = strategy.server.run.read_metrics()
    assert not row["applied"]
    assert row["rejected"] == [
        "site at node 100: no advertise reply",
        "2 sites advertised a key, 3 needed: round abandoned",
    ]
    assert PrivacyLedger.load(strategy.server.run.ledger_path).steps == 0


def test_a_site_that_accepts_no_distributed_round_is_named_with_its_refusal(tmp_path):
    fed = FederationConfig(run_dir=str(tmp_path), run_name="r", rounds=1, **FAST)
    grid = LocalGrid(fed, settings={**simulated_site_settings(fed), "accept-modes": "client"})
    strategy = GEPStrategy.from_config(fed, TaskIdentity.run_id, progress=False)
    strategy.start(grid)
    (row,) = strategy.server.run.read_metrics()
    assert not row["applied"]
    assert row["rejected"][:3] == [
        f"site at node {n}: advertise: refused: mode not allowed" for n in (100, 101, 102)
    ]
    for entries in site_rounds(tmp_path).values():
        assert [e["outcome"] for e in entries] == ["mode not allowed"]


# -- a server that deviates: each attack of issue 50 against the real site code ----------


def tamper_keys(victim: int, change):
    """A server that rewrites the list of keys the ``victim`` gets at the collect stage
    (``change(keys, binding)``, the binding of the round as the victim checks it)."""

    def tamper(node, stage, content):
        if node == victim and stage == COLLECT:
            record = content.config_records[SECURE_SUM]
            rc = wire.RoundConfig.from_record(content.config_records[wire.ROUND_CONFIG])
            binding = RoundBinding(TaskIdentity.run_id, rc.round, rc.digest())
            keys = change(read_keys(record), binding)
            content.config_records[SECURE_SUM] = ConfigRecord(
                stage_config(COLLECT, record["round"], keys)
            )

    return tamper


def assert_victim_refused_before_computing(tmp_path, shares, reason, cause):
    """Site 0 (node 100) refused with ``reason`` (its own record says ``cause``), computed no
    share and recorded nothing."""
    entries = site_rounds(tmp_path)["site-0"]
    assert entries[-1]["outcome"] == reason and cause in entries[-1]["cause"]
    assert site_ledger_steps(tmp_path, "site-0") == 0
    assert len(shares) == 2  # the two other sites' shares only


def test_n1_a_victim_given_fewer_keys_than_its_noise_split_needs_refuses(tmp_path, monkeypatch):
    """N1: the victim is told of one neighbour only, so that its share would carry one mask."""
    shares, sums = spy_shares(monkeypatch)
    own_and_one = tamper_keys(100, lambda keys, _: keys[:2])
    run(tmp_path, tamper=own_and_one, rounds=1)
    assert sums == []
    assert_victim_refused_before_computing(tmp_path, shares, "too few sites", "2 sites listed")


def forged(keys, binding, sign_with=None):
    """Site 1's entry replaced by a key the server made: signed by ``sign_with`` (a key no
    site pinned), or carrying site 1's site key over a signature that is not its own."""
    agreement = advertise(sign_with or Ed25519PrivateKey.generate(), binding)[1]
    if sign_with is None:
        agreement = SignedKey(keys[1].site_key, agreement.agreement_key, agreement.signature)
    return [keys[0], agreement, *keys[2:]]


@pytest.mark.parametrize("signer", ["unpinned key", "pinned site's key, forged signature"])
def test_n2_a_key_no_pinned_peer_signed_is_refused_by_name(tmp_path, monkeypatch, signer):
    """N2: the server hands the victim agreement keys it made itself."""
    shares, sums = spy_shares(monkeypatch)
    outsider = Ed25519PrivateKey.generate() if signer == "unpinned key" else None
    run(tmp_path, tamper=tamper_keys(100, lambda k, b: forged(k, b, outsider)), rounds=1)
    assert sums == []
    if outsider is not None:
        outsider_text = key_text(outsider.public_key().public_bytes_raw())
        cause = f"a key signed by {outsider_text}, not a pinned peer"
    else:
        cause = "the key listed for site-1 is not signed by it for this round and settings"
    assert_victim_refused_before_computing(tmp_path, shares, "unpinned peer", cause)


def test_n2_a_key_signed_for_another_round_is_refused(tmp_path, monkeypatch):
    shares, _ = spy_shares(monkeypatch)

    def old_key(keys, binding):
        # site 1's key file signs a key for round 7: a valid signature for another round
        (path,) = tmp_path.glob("**/sites/site-1/site-key.pem")
        from gep_fed.federation.secure_sum import load_site_key

        site_1 = advertise(load_site_key(path), replace(binding, round=7))[1]
        return [keys[0], site_1, *keys[2:]]

    run(tmp_path, tamper=tamper_keys(100, old_key), rounds=1)
    assert_victim_refused_before_computing(
        tmp_path, shares, "unpinned peer", "not signed by it for this round"
    )


def test_n3_no_message_makes_a_site_reveal_a_secret_or_mask_twice(tmp_path, monkeypatch):
    """N3's split survivor lists need an unmask stage; there is none. A site answers an
    unmask request (Flower's SecAgg+ stage) as a malformed round, and the round's own
    advertise and collect messages, sent again (a second sum holding the same share), as
    replayed; its agreement key was erased when it masked."""
    shares, _ = spy_shares(monkeypatch)
    _, grid, _ = run(tmp_path, rounds=1)
    assert len(shares) == 3
    context = grid.contexts[100]
    assert "secure-sum-agreement" not in context.state.config_records
    unmask = Message(
        content=RecordDict({SECURE_SUM: ConfigRecord(stage_config("unmask", 1))}),
        dst_node_id=100,
        message_type=MessageType.TRAIN,
    )
    again = [msg for node, _, msg in grid.sent if node == 100]
    assert len(again) == 2  # advertise and collect
    expected = ["malformed round", "replayed round", "replayed round"]
    assert [grid.app(m, context).error.reason for m in [unmask, *again]] == expected
    assert len(shares) == 3 and site_ledger_steps(tmp_path, "site-0") == 1


def test_a_second_advertise_of_a_round_not_yet_collected_is_refused_as_replayed(tmp_path):
    """The site signs one agreement key per round: a second advertise of the round it holds
    a key for (or of an earlier one) is refused, as the threat model says."""
    _, grid, _ = run(tmp_path, rounds=1)
    context = grid.contexts[100]

    def advertise_round(round_: int) -> Message:
        stage = stage_config(ADVERTISE, round_, settings=b"s" * 32)
        content = RecordDict({SECURE_SUM: ConfigRecord(stage)})
        return Message(content=content, dst_node_id=100, message_type=MessageType.TRAIN)

    assert not grid.app(advertise_round(2), context).has_error()
    replies = [grid.app(advertise_round(r), context) for r in (2, 1)]
    assert [r.error.reason for r in replies] == ["replayed round", "replayed round"]
    assert not grid.app(advertise_round(3), context).has_error()


@pytest.mark.parametrize("site_split", [2, 4])
def test_n4_a_round_splitting_the_noise_otherwise_than_the_site_is_refused(
    tmp_path, monkeypatch, site_split
):
    """N4: the round asks noise_shares 3; the sites' own node configs say otherwise."""
    shares, sums = spy_shares(monkeypatch)
    run(tmp_path, rounds=1, num_sites=4, noise_shares=3, site_settings={"noise-shares": site_split})
    assert sums == [] and shares == []
    for entries in site_rounds(tmp_path).values():
        assert entries[-1]["outcome"] == "other noise split"


def finer_step(record, factor=4.0):
    """A round config whose quantisation step is ``factor`` times finer: the site's share,
    in integers, comes out ``factor`` times larger, so the other sites' noise shrinks to
    1/``factor`` relative to it in the sum (review of 2026-12-07: sigma 0.61 of the target
    at 4, an effective epsilon near 17 where the ledger said 8)."""
    record["privacy.quantization_step"] = record["privacy.quantization_step"] / factor


@pytest.mark.parametrize("where", ["collect stage only", "both stages"])
def test_n6_a_victim_sent_other_settings_than_its_peers_is_never_summed(
    tmp_path, monkeypatch, where
):
    """N6: the server gives the victim (node 100) a finer quantisation step than its peers.
    Each site signs its agreement key over the digest of the round's settings and checks
    every peer's key over its own round config's digest: sent at the collect stage only, the
    victim refuses the settings it did not sign; sent consistently at both stages, its
    peers' keys do not verify over its settings, nor its key over theirs. No sum is
    decoded, and the victim computes no share and records nothing."""
    from gep_fed.federation.rounds import RoundLoop

    shares, sums = spy_shares(monkeypatch)
    tamper = None
    if where == "collect stage only":

        def tamper(node, stage, content):
            if node == 100 and stage == COLLECT:
                finer_step(content.config_records[wire.ROUND_CONFIG])

    else:
        configure = RoundLoop.configure_round

        def configure_finer_for_the_victim(self, rnd, nodes):
            requests = configure(self, rnd, nodes)
            for request in requests:
                if request.node == 100:
                    request.content.records[wire.ROUND_CONFIG] = type(
                        request.content.records[wire.ROUND_CONFIG]
                    )(request.content.records[wire.ROUND_CONFIG])
                    finer_step(request.content.records[wire.ROUND_CONFIG])
            return requests

        monkeypatch.setattr(RoundLoop, "configure_round", configure_finer_for_the_victim)
    run(tmp_path, tamper=tamper, rounds=1)
    assert sums == []
    assert site_ledger_steps(tmp_path, "site-0") == 0
    victim = site_rounds(tmp_path)["site-0"][-1]
    if where == "collect stage only":
        assert victim["outcome"] == "malformed round" and len(shares) == 2
    else:
        assert victim["outcome"] == "unpinned peer" and shares == []
        assert "not signed by it for this round and settings" in victim["cause"]
        for peer in ("site-1", "site-2"):
            assert site_rounds(tmp_path)[peer][-1]["outcome"] == "unpinned peer"


def test_n5_masks_have_no_32_bit_bottleneck():
    """Flower folded each seed to 32 bits (XOR of its words) before MT19937. Two keys that
    agree in that fold give unrelated masks here."""
    a = bytes(range(32))
    b = bytearray(a)
    for i in (0, 4):  # flip the same bits in two words: the 32-bit XOR fold is unchanged
        b[i] ^= 0xFF
    b = bytes(b)

    def fold(seed: bytes) -> int:
        out = 0
        for i in range(0, 32, 4):
            out ^= int.from_bytes(seed[i : i + 4], "little")
        return out

    assert fold(a) == fold(b) and a != b
    ma, mb = mask_stream(a, 100_000), mask_stream(b, 100_000)
    assert ma.min() >= 0 and ma.max() < MODULUS
    assert np.mean(ma == mb) < 1e-3  # equal words by chance only (2**-32 each)
    assert abs(float(np.corrcoef(ma, mb)[0, 1])) < 0.02
    # the pairwise key depends on the whole shared secret through HKDF, bound to the round
    binding = RoundBinding(1, 1, bytes(32))
    p1, k1 = advertise(Ed25519PrivateKey.generate(), binding)
    p2, k2 = advertise(Ed25519PrivateKey.generate(), binding)
    assert pairwise_key(p1, k1.agreement_key, k2.agreement_key, binding) == pairwise_key(
        p2, k2.agreement_key, k1.agreement_key, binding
    )
    for other in (replace(binding, round=2), replace(binding, settings=bytes(31) + b"\1")):
        assert pairwise_key(p1, k1.agreement_key, k2.agreement_key, other) != pairwise_key(
            p1, k1.agreement_key, k2.agreement_key, binding
        )


def test_the_server_learns_the_sum_of_the_shares_modulo_their_bits_and_no_carries():
    """The shares live modulo 2**bits; masked modulo 2**32, the masked vectors' sum showed
    the server the sum of the shares below 2**32 too, whose carries count, coordinate by
    coordinate, the sites whose share is negative (review of 2026-12-07). Masked modulo
    2**bits, every value the server sees is below 2**bits, and what its plain sum carries
    above 2**bits changes with the masks, not with the shares."""
    from gep_fed.federation.secure_sum import masked_vector, unmasked_sum

    bits, n = 8, 2000
    rng = np.random.default_rng(0)
    shares = [rng.integers(0, 1 << bits, n) for _ in range(3)]
    carries = []
    for _ in range(2):  # the same shares under two rounds' keys
        binding = RoundBinding(1, 1, bytes(32))
        drawn = [advertise(Ed25519PrivateKey.generate(), binding) for _ in shares]
        keys = [signed for _, signed in drawn]
        masked = [
            masked_vector(share, private, own, keys, binding, bits)
            for share, (private, own) in zip(shares, drawn, strict=True)
        ]
        assert all(v.min() >= 0 and v.max() < 1 << bits for v in masked)
        np.testing.assert_array_equal(unmasked_sum(masked, bits), sum(shares) % (1 << bits))
        carries.append(sum(masked)[1:] >> bits)
    assert np.mean(carries[0] == carries[1]) < 0.6  # 3 uniform values: 3 carry counts


def test_a_peers_file_is_read_with_every_problem_named(tmp_path):
    key = create_site_key(tmp_path / "a.pem")
    with pytest.raises(ConfigError, match="never overwritten"):
        create_site_key(tmp_path / "a.pem")
    good = tmp_path / "peers.txt"
    good.write_text(f"# the trial's hospitals\nsite-a {key_text(key)}\n")
    assert PinnedPeers.read(good).name(key) == "site-a"
    for text, problem in [
        ("site-a\n", "expected 'NAME PUBLIC-KEY'"),
        ("site-a bm90IGEga2V5\n", "not a base64 Ed25519 public key"),
        (f"site-a {key_text(key)}\nsite-b {key_text(key)}\n", "listed twice"),
        ("# nobody\n", "names no peer"),
    ]:
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=problem):
            PinnedPeers.read(bad)


def test_a_deployed_site_accepting_distributed_mode_needs_its_keys_and_noise_split(tmp_path):
    from gep_fed.federation.policy import SiteConfig

    base = {
        "site-id": "h",
        "task": "digits",
        "data-path": "d",
        "ledger-path": str(tmp_path / "l.json"),
        "epsilon-budget": 8.0,
        "delta": 1e-5,
        "accept-modes": "client,distributed",
    }
    with pytest.raises(ConfigError, match="noise-shares"):
        SiteConfig.from_node_config(base)
    with pytest.raises(ConfigError, match="'site-key'"):
        SiteConfig.from_node_config({**base, "noise-shares": 3})
    cfg = SiteConfig.from_node_config({**base, "noise-shares": 3, "site-key": "k", "peers": "p"})
    assert cfg.policy.sites_needed() == 3


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (np.arange(8, dtype=np.int64), "must be a vector of uint32"),
        (np.zeros((2, 4), dtype=np.uint32), "must be a vector of uint32"),
    ],
)
def test_a_malformed_masked_share_is_refused_by_name(value, why):
    from flwr.app import Array, ArrayRecord

    content = RecordDict({MASKED_SHARE: ArrayRecord({MASKED_SHARE: Array(value)})})
    reply = Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)
    with pytest.raises(ValueError, match=why):
        read_masked_share(reply.content.array_records.get(MASKED_SHARE))


def test_distributed_settings_are_checked_when_the_run_is_configured():
    with pytest.raises(ConfigError, match="noise_shares"):
        FederationConfig(mode="distributed", num_sites=3, noise_shares=4)
    with pytest.raises(ConfigError, match="distributed mode needs"):
        FederationConfig(mode="distributed", noise_multiplier=0.0)
    with pytest.raises(ConfigError, match="at least 2 sites"):
        FederationConfig(mode="distributed", num_sites=1, min_sites=1)


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


def test_a_share_alone_is_accounted_as_one_discrete_gaussian_at_sigma_over_root_t():
    """The ledger's second figure (N4): what a site's own share guarantees if more sites
    collude than it assumed, against the same release built directly at sigma / sqrt(t)."""
    from dataclasses import replace

    from gep_fed.mechanisms.distributed_noise import distributed_event

    contract = FederationConfig(rounds=20, **{**FAST, "num_sites": 4}).contract
    t, dimension = contract.noise_shares, 4096
    assert t == 4
    events = contract.events(20, dimension=dimension)
    alone = [e.share_alone() for e in events]
    root = math.sqrt(t)
    direct = distributed_event(
        contract.mechanism_type.event(contract.noise_multiplier / root, contract.sample_rate),
        replace(contract.distributed_noise, noise_shares=1),
        dimension,
        contract.mechanism_type.releases,
    )
    assert epsilon_rdp(alone, 1e-5) == pytest.approx(epsilon_rdp([direct] * 20, 1e-5), rel=1e-9)
    assert epsilon_rdp(alone, 1e-5) > 2 * epsilon_rdp(events, 1e-5)
