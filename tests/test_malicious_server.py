"""A malicious server against a deployed site in client-side mode.

The server controls every message and the run config. Each test crafts what it sends to the
real ClientApp handler (``gep_fed.flower.handle_train``) of a site whose node config, data
file and keyed ledger are its own, then checks that the attempt was refused with a fixed code or
made harmless, what the site's ledger holds afterwards, and that no reply carries
data-dependent text or numbers.
"""

import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

import gep_fed.flower.clientapp as client_app
from gep_fed.accounting.ledger import PrivacyLedger, create_ledger_key, default_key_path
from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.datasets import load_digits
from gep_fed.data.task import ArrayImageDataset, TaskSettings, stack_examples
from gep_fed.federation import site as site_module
from gep_fed.federation import wire
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.policy import SitePolicy
from gep_fed.federation.server import FederationServer
from gep_fed.mechanisms.anchors import AnchorSet
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.per_example import per_example_gradients
from helpers import tiny_federation

# What a reply's metrics may hold: each is public or set by the site's own accounting.
DATA_FREE_METRICS = {"basis-bytes-received", "basis-id", "local-steps", "site-epsilon"}
BUDGET = 2.0


@pytest.fixture(autouse=True)
def _flower_task_identity():
    """Messages are built inside a Flower runtime; set the identity it would set."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    client_app._SITES.clear()
    yield
    client_app._SITES.clear()


@pytest.fixture(scope="module")
def digits():
    return DigitsTask(TaskSettings(num_public=200))


@pytest.fixture
def hospital(tmp_path):
    """A deployed site: its own data file, a ledger created once with its key, its budget."""
    data = load_digits().subset(np.arange(400))
    path = tmp_path / "site" / "data.npz"
    path.parent.mkdir()
    np.savez(path, images=data.images, labels=data.labels)
    ledger = tmp_path / "site" / "ledger.json"
    PrivacyLedger.open(
        ledger, 1e-5, None, "h1", key=create_ledger_key(default_key_path(ledger)), create=True
    )
    return {
        "site-id": "h1",
        "task": "digits",
        "data-path": str(path),
        "ledger-path": str(ledger),
        "epsilon-budget": BUDGET,
        "delta": 1e-5,
        "device": "cpu",
    }


def site_ledger(node_config) -> PrivacyLedger:
    return PrivacyLedger.load_keyed(node_config["ledger-path"])


def make_server(tmp_path, built_task, **settings) -> FederationServer:
    base = dict(num_basis=16, sample_rate=0.1, rounds=5, local_steps=2, noise_multiplier=3.0)
    return tiny_federation(tmp_path / "server", built_task, **{**base, **settings})


def round_message(server, rnd, rc_changes=None, record_changes=None, state=None, basis=None):
    """What the server sends in round ``rnd``, with the attacker's changes."""
    plan = server.plan_round(rnd)
    rc = plan.config if not rc_changes else replace(plan.config, **rc_changes)
    record = {**rc.to_record(), **(record_changes or {})}
    arrays = state if state is not None else plan.state
    content = {
        wire.GLOBAL_MODEL: ArrayRecord({k: Array(v) for k, v in arrays.items()}),
        wire.ROUND_CONFIG: ConfigRecord(record),
    }
    basis = basis if basis is not None else plan.basis
    if basis is not None:
        content[wire.BASIS] = ArrayRecord({k: Array(v) for k, v in basis.items()})
    return Message(content=RecordDict(content), message_type=MessageType.TRAIN, dst_node_id=1)


def answer(msg, node_config, run_config: FederationConfig, context=None):
    context = context or Context(1, 1, node_config, RecordDict(), {})
    return client_app.handle_train(msg, context, run_config), context


def assert_data_free(reply: Message) -> None:
    """No reply carries data-dependent text or numbers beyond the noised release."""
    if reply.has_error():
        assert reply.error.reason in wire.REFUSALS
        assert reply.error.code == wire.REFUSALS[reply.error.reason]
        assert not reply.has_content()
        return
    content = reply.content
    assert set(content.metric_records[wire.REPLY_METRICS]) <= DATA_FREE_METRICS
    assert wire.CLIPPED_SUMS not in content.array_records  # client-only: never unnoised sums


def refused(reply: Message, reason: str) -> bool:
    assert_data_free(reply)
    return reply.has_error() and reply.error.reason == reason


def delta_of(reply: Message) -> torch.Tensor:
    record = reply.content.array_records[wire.MODEL_DELTA]
    return torch.cat([torch.from_numpy(a.numpy()).reshape(-1) for a in record.values()])


# -- the attacks of the review, points 1-7 --------------------------------------------------


def test_a_noise_seed_in_the_run_config_does_not_seed_the_sites_noise(tmp_path, digits, hospital):
    """Point 1. With q = 1 the batch is the whole data set, so noise is the only randomness:
    two fresh sites told noise-seed=1234 must still release different deltas."""
    server = make_server(tmp_path, digits, sample_rate=1.0, noise_multiplier=20.0)
    run_config = replace(server.cfg, noise_seed=1234)
    msg = round_message(server, 1)
    first, _ = answer(msg, hospital, run_config)
    client_app._SITES.clear()
    second, _ = answer(msg, hospital, run_config)
    assert_data_free(first)
    assert_data_free(second)
    assert not torch.allclose(delta_of(first), delta_of(second))
    site, _ = next(iter(client_app._SITES.values()))
    assert repr(site.noise) == "NoiseSource(cryptographic)"
    assert repr(NoiseSource(1234)) != repr(site.noise)


def test_a_central_round_sent_to_a_client_only_site_is_refused(tmp_path, digits, hospital):
    """Point 2: the mode comes from the round config, the permission from the site."""
    server = make_server(tmp_path, digits, mode="central")
    reply, _ = answer(round_message(server, 1), hospital, server.cfg)
    assert refused(reply, "mode not allowed")
    assert site_ledger(hospital).steps == 0


@pytest.mark.parametrize(
    "attack",
    [
        {"noise_multiplier": 0.0},  # the run config switches the noise off
        {"noise_multiplier": 0.05, "target_epsilon": 500.0},  # and raises the target
    ],
    ids=["sigma-0", "sigma-tiny-target-500"],
)
def test_the_server_cannot_raise_or_remove_the_sites_budget(tmp_path, digits, hospital, attack):
    """Point 3: the budget is the node config's; no run-config value replaces it."""
    server = make_server(tmp_path, digits, **attack)
    reply, _ = answer(round_message(server, 1), hospital, server.cfg)
    assert refused(reply, "over budget")
    assert site_ledger(hospital).steps == 0


def test_a_last_round_beyond_the_budget_is_refused_at_once_and_an_early_one_buys_one_round(
    tmp_path, digits, hospital
):
    """The round config's last round: announced beyond what the site's budget holds, the
    site refuses its first round with nothing recorded, and the rest of that run, even
    announced shorter; in another run, announced early (a lie to get in), the site still
    admits one round at a time within its budget, as it would anyway."""
    server = make_server(tmp_path, digits)
    reply, _ = answer(round_message(server, 1, {"last_round": 100_001}), hospital, server.cfg)
    assert refused(reply, "malformed round")  # a plan longer than any site would build
    reply, context = answer(round_message(server, 1, {"last_round": 10_000}), hospital, server.cfg)
    assert refused(reply, "over budget")
    reply, _ = answer(round_message(server, 2, {"last_round": 2}), hospital, server.cfg, context)
    assert refused(reply, "over budget")
    assert site_ledger(hospital).steps == 0
    reply, _ = answer(round_message(server, 1, {"last_round": 1}), hospital, server.cfg)
    assert not reply.has_error()
    assert site_ledger(hospital).steps == 2


def test_the_server_cannot_switch_on_the_release_of_site_metrics(tmp_path, digits, hospital):
    """Point 4: only the site's own policy (node config release-metrics) allows it."""
    server = make_server(tmp_path, digits, release_site_metrics=True)
    reply, _ = answer(round_message(server, 1), hospital, server.cfg)
    assert not reply.has_error()
    assert client_app.UNPROTECTED_LOSS_KEY not in reply.content.metric_records[wire.REPLY_METRICS]
    assert_data_free(reply)
    assert site_ledger(hospital).steps == 2


def test_a_model_crafted_to_overflow_on_chosen_examples_learns_nothing_from_errors(
    tmp_path, digits, hospital
):
    """Point 5: hidden units 0 and 1 copy input pixels 10 and 20 (through tanh) and output
    weights of 3e38 on them overflow the logits exactly for the examples where both pixels are
    bright: a predicate the server chose. Those examples get clip factor 0 (no error, no
    count); the reply is an ordinary noised release, and an exception anywhere would be a
    fixed code, not its text."""
    server = make_server(tmp_path, digits)
    plan = server.plan_round(1)
    state = {k: v.copy() for k, v in plan.state.items()}
    hidden_w, hidden_b, out_w = "hidden.0.weight", "hidden.0.bias", "out.weight"
    state[hidden_w][:2] = 0.0
    state[hidden_w][0, 10] = state[hidden_w][1, 20] = 50.0
    state[hidden_b][:2] = 0.0
    state[out_w][:, :2] = 3e38
    # the attack is real: some of the site's examples (not all) now have non-finite gradients
    site_x = load_digits().subset(np.arange(400))
    model = digits.build_model()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    grads = per_example_gradients(
        model,
        torch.nn.functional.cross_entropy,
        *stack_examples(ArrayImageDataset(site_x.images, site_x.labels, 0.5, 0.5)),
        server.layout,
    )
    overflowing = (~torch.isfinite(grads).all(dim=1)).sum()
    assert 0 < overflowing < len(grads)
    reply, _ = answer(round_message(server, 1, state=state), hospital, server.cfg)
    assert not reply.has_error()
    assert_data_free(reply)
    assert torch.isfinite(delta_of(reply)).all()
    assert site_ledger(hospital).steps == 2
    # a round the site cannot compute (a model of another architecture) is a fixed code
    wrong = {k: v for k, v in plan.state.items() if k != out_w}
    reply, _ = answer(round_message(server, 2, state=wrong), hospital, server.cfg)
    assert refused(reply, "malformed round")


def test_a_deleted_or_forged_ledger_stops_the_site_and_is_not_recreated(tmp_path, digits, hospital):
    """Point 6: no silent restart at zero; an edit without the key is detected."""
    server = make_server(tmp_path, digits)
    reply, _ = answer(round_message(server, 1), hospital, server.cfg)
    assert not reply.has_error()
    ledger_path = tmp_path / "site" / "ledger.json"
    honest = ledger_path.read_text()
    # forged: the history rewritten with a recomputed plain checksum
    import hashlib
    import json

    body = json.loads(honest)
    body.pop("hmac-sha256")
    body["events"] = body["events"][:1]
    body["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    ledger_path.write_text(json.dumps(body))
    client_app._SITES.clear()
    reply, _ = answer(round_message(server, 2), hospital, server.cfg)
    assert refused(reply, "site error")
    assert json.loads(ledger_path.read_text()) == body  # left untouched
    # deleted: the site refuses rather than starting a fresh ledger
    ledger_path.unlink()
    reply, _ = answer(round_message(server, 3), hospital, server.cfg)
    assert refused(reply, "site error")
    assert not ledger_path.exists()


def test_a_rejected_central_reply_leaves_no_trace_of_its_values_on_the_server(tmp_path, digits):
    """Point 7: the rejection of implausible clipped sums is the same text whatever the
    sums were, so nothing computed from unnoised site data reaches metrics or reports."""
    from gep_fed.mechanisms.mechanism import ClippedSums

    server = make_server(tmp_path, digits, mode="central")
    server.plan_round(1)
    k, p = server.subspace.num_basis, server.layout.size
    texts = set()
    for scale in (1e4, 3.7e5):
        sums = ClippedSums(torch.full((k,), scale), torch.zeros(p))
        with pytest.raises(wire.WireError) as err:
            server.check_plausible(sums, "site at node 7")
        texts.add(str(err.value))
    assert len(texts) == 1 and "not honestly clipped" in texts.pop()


# -- further attempts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "record_changes",
    [
        {"privacy.sample_rate": 1.5},
        {"privacy.noise_multiplier": -1.0},
        {"privacy.mechanism": "none"},
        {"privacy.clip_embedding": float("inf")},
        {"round": -3},
        {"local_steps": 0},
        {"augmentation_copies": 1000},
        {"augmentation_copies": 4},  # the site's task (digits) has no augmentation
    ],
    ids=[
        "q>1",
        "sigma<0",
        "unknown-mechanism",
        "S1-inf",
        "round<1",
        "no-steps",
        "copies>64",
        "copies-without-augmentation",
    ],
)
def test_malformed_round_configs_are_refused_before_computing(
    tmp_path, digits, hospital, record_changes
):
    server = make_server(tmp_path, digits)
    msg = round_message(server, 1, record_changes=record_changes)
    reply, _ = answer(msg, hospital, server.cfg)
    assert refused(reply, "malformed round")
    assert site_ledger(hospital).steps == 0


@pytest.mark.parametrize(
    "record_changes, site_limits",
    [
        ({"local_steps": 101}, {}),
        ({"local_steps": 3}, {"max-local-steps": 2}),
        ({"augmentation_copies": 17}, {}),
        ({"augmentation_copies": 2}, {"max-augmentation-copies": 1}),
    ],
    ids=["steps>default", "steps>site's", "copies>default", "copies>site's"],
)
def test_a_round_asking_more_work_than_the_site_allows_is_refused(
    tmp_path, digits, hospital, record_changes, site_limits
):
    """A server cannot tie a site up: its node config (or the defaults) bounds the steps and
    augmented copies of one round; the refusal comes before any work or ledger entry."""
    server = make_server(tmp_path, digits)
    msg = round_message(server, 1, record_changes=record_changes)
    reply, _ = answer(msg, {**hospital, **site_limits}, server.cfg)
    assert refused(reply, "over compute limit")
    assert site_ledger(hospital).steps == 0


def test_a_round_within_the_sites_work_limits_is_answered(tmp_path, digits, hospital):
    server = make_server(tmp_path, digits, local_steps=2)
    reply, _ = answer(round_message(server, 1), {**hospital, "max-local-steps": 2}, server.cfg)
    assert not reply.has_error()
    assert site_ledger(hospital).steps == 2


def rebuild_cost(arrays) -> wire.RebuildCost:
    """The cost a site computes for an anchor record, from its declared shapes."""
    layout = ParameterLayout.from_model(DigitsTask(TaskSettings()).build_model())
    costs = []
    received = {k: wire.as_wire_array(v) for k, v in arrays.items()}
    wire.decode_anchors(received, layout, admit=costs.append)
    return costs[0]


def more_anchors(arrays, copies: int) -> dict:
    """The record with its anchors (and their coefficients' rows) repeated ``copies`` times."""
    return {k: np.concatenate([v] * copies) for k, v in arrays.items()}


@pytest.mark.parametrize("cap", ["max-rebuild-work", "max-rebuild-mib"])
def test_a_rebuild_over_the_sites_cap_is_refused_before_it_is_computed(
    tmp_path, digits, hospital, monkeypatch, cap
):
    """N6: anchors and coefficients whose product is huge (a 40 GB basis and 1e14
    multiply-adds from 0.43 GB on the wire) would tie a site up before the orthonormality
    check. The site refuses a record costing more than its node config allows, from the
    shapes alone, before the basis is allocated or any anchor differentiated."""
    server = make_server(tmp_path, digits, basis_transport="rebuild")
    record = server.plan_round(1).basis
    if cap == "max-rebuild-work":  # one multiply-add over this site's cap
        limit = rebuild_cost(record).work - 1
    else:  # 1 MiB, and the record's anchors repeated until they hold more
        record, limit = more_anchors(record, 20), 1
        assert rebuild_cost(record).bytes > 2**20

    def never(*args, **kwargs):
        raise AssertionError("the basis was rebuilt")

    monkeypatch.setattr(site_module, "rebuild_anchor_subspace", never)
    began = time.perf_counter()
    reply, _ = answer(round_message(server, 1, basis=record), {**hospital, cap: limit}, server.cfg)
    assert time.perf_counter() - began < 1.0
    assert refused(reply, "over compute limit")
    assert site_ledger(hospital).steps == 0


def test_a_rebuild_within_the_sites_cap_is_answered(tmp_path, digits, hospital):
    server = make_server(tmp_path, digits, basis_transport="rebuild")
    work = rebuild_cost(server.plan_round(1).basis).work
    reply, _ = answer(round_message(server, 1), {**hospital, "max-rebuild-work": work}, server.cfg)
    assert not reply.has_error()
    assert site_ledger(hospital).steps == 2


def test_n6s_record_is_refused_by_default_from_its_declared_shapes_alone():
    """N6's record at ResNet-18-GN's size (11.2 million parameters): 10,000 anchors at 64x64
    and 900 columns, 0.53 GB on the wire, would make a 40 GB basis in 1e14 multiply-adds. The
    default caps refuse it from the declared shapes: no payload is read (there is none)."""
    p, m, k = 11_181_642, 10_000, 900
    layout = ParameterLayout.from_dict(
        {"names": ["w"], "shapes": [[p]], "groups": [["all", ["w"]]]}
    )
    declared = {
        "anchors.inputs": ("float32", (m, 3, 64, 64)),
        "anchors.labels": ("int64", (m,)),
        "coefficients.0": ("float32", (m, k)),
    }
    record = ArrayRecord(
        {
            name: Array(dtype, shape, "numpy.ndarray", b"")
            for name, (dtype, shape) in declared.items()
        }
    )
    costs = []
    policy = SitePolicy(BUDGET, 1e-5)

    def admit(cost):
        costs.append(cost)
        policy.admit_rebuild(cost)

    began = time.perf_counter()
    with pytest.raises(wire.RoundRefused, match="over compute limit"):
        wire.decode_anchors(record, layout, admit=admit)
    assert time.perf_counter() - began < 1.0
    assert costs[0].work == m * p * k > 1e14 and costs[0].bytes > 40e9


def test_a_site_refuses_n6s_rebuild_before_allocating_it(digits, monkeypatch):
    """The site's own check (``Site.rebuild_subspace``), on anchors as decoded: a million
    anchors whose coefficients give every group a full basis (2e13 multiply-adds, 19 GB of
    coefficients). Zero-stride tensors stand in for them: nothing is allocated unless the
    rebuild starts."""
    site = site_module.Site(
        "h1", digits.build_model(), digits.train_dataset(), SitePolicy(BUDGET, 1e-5)
    )
    m = 1_000_000
    anchors = AnchorSet(
        torch.zeros(1, 1, 8, 8).expand(m, 1, 8, 8),
        torch.zeros(1, dtype=torch.int64).expand(m),
        tuple(torch.zeros(1, 1).expand(m, g.size) for g in site.layout.groups),
    )

    def never(*args, **kwargs):
        raise AssertionError("the basis was rebuilt")

    monkeypatch.setattr(site_module, "rebuild_anchor_subspace", never)
    began = time.perf_counter()
    with pytest.raises(wire.RoundRefused, match="over compute limit"):
        site.rebuild_subspace(anchors)
    assert time.perf_counter() - began < 1.0


def test_huge_clip_norms_only_buy_proportionally_more_noise(tmp_path, digits, hospital):
    """S1 = S2 = 1e9 disables clipping in effect, but the site's noise is sigma * S: the
    release stays private, and it is accounted at the contract's sigma like any other."""
    server = make_server(tmp_path, digits, clip_embedding=1e9, clip_residual=1e9)
    reply, _ = answer(round_message(server, 1), hospital, server.cfg)
    assert_data_free(reply)
    delta = delta_of(reply)
    # each step's noise has std sigma * S / (q n) per coordinate, times the local lr
    expected = server.contract.noise_multiplier * 1e9 / (0.1 * 400) * server.cfg.local_lr
    assert float(delta.std()) > 0.1 * expected
    events = site_ledger(hospital).events
    assert len(events) == 2
    sigma = server.contract.noise_multiplier
    assert all(e.accounting_noise_multiplier == sigma / math.sqrt(2) for e in events)


def test_a_basis_that_is_not_orthonormal_is_refused(tmp_path, digits, hospital):
    server = make_server(tmp_path, digits)
    plan = server.plan_round(1)
    skewed = {k: (v * 3.0).astype(v.dtype) for k, v in plan.basis.items()}
    reply, _ = answer(round_message(server, 1, basis=skewed), hospital, server.cfg)
    assert refused(reply, "malformed round")
    assert site_ledger(hospital).steps == 0


def test_a_langevin_schedule_whose_steps_leave_the_float_range_is_refused_unrecorded(
    tmp_path, hospital
):
    """The server sets beta0, G and the declared n: a prior variance of 1e76 made a float32
    step overflow before its noise, where the unnoised gradient pointed. Such a schedule is
    refused as malformed from its public values, with nothing recorded."""
    from dataclasses import replace

    task = DigitsTask(TaskSettings(num_public=200, model="linear"))
    server = make_server(
        tmp_path, task, mode="client", mechanism="langevin", model="linear",
        sample_rate=1.0, local_steps=1, rounds=2,
    )  # fmt: skip
    plan = server.plan_round(2)
    attack = replace(plan.config.privacy, langevin_beta0=1e76, clip_norm=0.01)
    reply, _ = answer(
        round_message(server, 2, {"privacy": attack, "site_examples": 100}),
        {**hospital, "model": "linear"},
        server.cfg,
    )
    assert refused(reply, "malformed round") and site_ledger(hospital).steps == 0


@pytest.mark.parametrize("second_round", [3, 2], ids=["replayed", "backwards"])
def test_a_replayed_or_backwards_round_is_refused(tmp_path, digits, hospital, second_round):
    server = make_server(tmp_path, digits)
    reply, context = answer(round_message(server, 3), hospital, server.cfg)
    assert not reply.has_error()
    again, _ = answer(round_message(server, second_round), hospital, server.cfg, context)
    assert refused(again, "replayed round")
    assert site_ledger(hospital).steps == 2  # the first round only


@pytest.mark.parametrize("mechanism", ["gp", "gep"])
def test_a_model_with_non_finite_outputs_gets_the_same_reply_whether_or_not_its_sample_was_empty(
    tmp_path, digits, hospital, mechanism
):
    """Finite weights of 3e38 make every output inf or NaN. Whether the site's Poisson sample
    was empty must not decide the reply's kind (an error was one bit about the data, before):
    every example gets clip factor 0, and the reply is the noised release either way."""
    kinds = []
    for q in (1e-6, 0.5):
        node = {**hospital, "ledger-path": str(tmp_path / f"{q}.json"), "new-ledger": True}
        server = make_server(
            tmp_path / str(q),
            digits,
            mechanism=mechanism,
            sample_rate=q,
            rounds=1,
            local_steps=1,
            noise_multiplier=10.0,
        )
        state = {k: v.copy() for k, v in server.plan_round(1).state.items()}
        state["out.weight"][:] = 3e38
        state["out.bias"][:] = -3e38
        reply, _ = answer(round_message(server, 1, state=state), node, server.cfg)
        assert_data_free(reply)
        kinds.append(reply.error.reason if reply.has_error() else "release")
        if not reply.has_error():
            assert torch.isfinite(delta_of(reply)).all()
    assert kinds == ["release", "release"]


def test_a_model_with_nan_weights_is_refused(tmp_path, digits, hospital):
    server = make_server(tmp_path, digits)
    plan = server.plan_round(1)
    state = {k: v.copy() for k, v in plan.state.items()}
    next(iter(state.values())).flat[0] = np.nan
    reply, _ = answer(round_message(server, 1, state=state), hospital, server.cfg)
    assert refused(reply, "malformed round")
    assert site_ledger(hospital).steps == 0


def test_a_site_that_opted_into_central_mode_records_it_as_trusted_server_noise(
    tmp_path, digits, hospital
):
    """Central mode releases unnoised sums; a site that accepts it still accounts it, in its
    own ledger, against its own budget."""
    server = make_server(tmp_path, digits, mode="central")
    trusting = {**hospital, "accept-modes": "client,central"}
    reply, _ = answer(round_message(server, 1), trusting, server.cfg)
    assert not reply.has_error() and wire.CLIPPED_SUMS in reply.content.array_records
    (event,) = site_ledger(hospital).events
    assert event.placement == "trusted-server" and event.party == "h1"


def test_a_deployed_site_refuses_a_central_round_whose_server_noise_is_seeded(
    tmp_path, digits, hospital
):
    """A run config's noise-seed fixes the trusted server's noise: whoever knows the seed
    (every site is sent the run config) removes it. A deployed site, which has no seed, now
    refuses such a round before anything is released; the same round unseeded is answered."""
    trusting = {**hospital, "accept-modes": "client,central"}
    seeded = make_server(tmp_path / "seeded", digits, mode="central", noise_seed=7)
    assert seeded.plan_round(1).config.server_noise_seeded
    reply, _ = answer(round_message(seeded, 1), trusting, seeded.cfg)
    assert refused(reply, "over budget") and site_ledger(hospital).steps == 0
    honest = make_server(tmp_path / "os", digits, mode="central")
    reply, _ = answer(round_message(honest, 1), trusting, honest.cfg)
    assert not reply.has_error() and site_ledger(hospital).steps == 1


def selection_round(server, search: str, steps: int, state=None) -> Message:
    """A central round of a private selection whose trials are bounded by ``steps`` rounds."""
    from gep_fed.accounting.events import PrivacyEvent, Selection

    event = PrivacyEvent.gaussian(
        "gep", 3.0, 0.1, steps, 3.0 / math.sqrt(2), placement="trusted-server"
    )
    event = replace(event, selection=Selection(2.0, 1.0))
    terms = wire.SelectionTerms(search, 1, event).to_json()
    return round_message(server, 1, rc_changes={"selection": terms}, state=state)


@pytest.mark.parametrize("fault", ["nan weights", "plan above the trial's bound"])
def test_a_selection_round_refused_after_its_terms_are_read_spends_nothing(
    tmp_path, digits, hospital, fault
):
    """A selection's round refused after its terms are read (a malformed model; more rounds
    planned than one trial may hold) leaves the site's ledger as it was: once it charged the
    whole selection with nothing released."""
    server = make_server(tmp_path, digits, mode="central", rounds=5, local_steps=1)
    opted = {**hospital, "accept-modes": "client,central", "max-selection-mean": 2.0}
    state = {k: v.copy() for k, v in server.plan_round(1).state.items()}
    if fault == "nan weights":
        next(iter(state.values())).flat[0] = np.nan
    steps = 5 if fault == "nan weights" else 1  # the run plans 5 rounds of 1 step each
    reply, _ = answer(selection_round(server, "a" * 32, steps, state), opted, server.cfg)
    reason = "malformed round" if fault == "nan weights" else "over budget"
    assert refused(reply, reason) and site_ledger(hospital).events == ()
    reply, _ = answer(selection_round(server, "b" * 32, 5), opted, server.cfg)
    assert not reply.has_error()  # a well-formed one: its round recorded, as in any run
    (event,) = site_ledger(hospital).events
    assert event.selection is None and event.placement == "trusted-server"


# -- issue 19: what the site runs and checks ---------------------------------------------------


class DigitsFolders(DigitsTask):
    """The digits task with a site's data as PNG class folders (a user's task: named by its
    import path, read one sampled image at a time)."""

    def site_dataset(self, data_path):
        from gep_fed.data.formats import ImageFolderDataset, ImageTransform

        transform = ImageTransform(channels=1, mean=0.5, std=0.5)
        return ImageFolderDataset(data_path, transform, classes=[str(c) for c in range(10)])


def deployed(node_config, run_config) -> Context:
    """A deployed site's context under ``flwr run``: only the run config's strings arrive."""
    return Context(1, 1, node_config, RecordDict(), run_config)


def test_a_run_config_naming_another_task_is_refused_before_anything_is_imported(
    tmp_path, digits, hospital, monkeypatch
):
    """Point 2: the task comes from the site's node config; a server's import path is only
    compared with it, never imported (its module's side effects would run at the site)."""
    import sys

    marker = tmp_path / "imported"
    (tmp_path / "evil_task.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    server = make_server(tmp_path, digits)
    for task in ("evil_task:Evil", "pneumonia"):
        run_config = {**server.cfg.to_record(), "task": task}
        reply = client_app.handle_train(round_message(server, 1), deployed(hospital, run_config))
        assert refused(reply, "malformed round")
    assert not marker.exists() and "evil_task" not in sys.modules
    assert not client_app._SITES  # nothing was built: the site's data was never read
    assert site_ledger(hospital).steps == 0
    # another model than the node config's is refused the same way
    run_config = {**server.cfg.to_record(), "model": "cnn"}
    reply = client_app.handle_train(round_message(server, 1), deployed(hospital, run_config))
    assert refused(reply, "malformed round")
    # the site's own task, named by the run config as the node config does, trains
    reply = client_app.handle_train(
        round_message(server, 1), deployed(hospital, server.cfg.to_record())
    )
    assert not reply.has_error() and site_ledger(hospital).steps == 2


def test_a_node_config_without_a_task_is_a_clear_error_at_the_site(tmp_path, digits, hospital):
    from gep_fed.federation.policy import SiteConfig
    from gep_fed.validation import ConfigError

    unpinned = {k: v for k, v in hospital.items() if k != "task"}
    with pytest.raises(ConfigError, match="node config needs 'task'"):
        SiteConfig.from_node_config(unpinned)
    server = make_server(tmp_path, digits)
    reply, _ = answer(round_message(server, 1), unpinned, server.cfg)
    assert refused(reply, "malformed round")


def test_an_example_with_a_label_the_task_lacks_is_dropped_not_an_error(tmp_path, digits, hospital):
    """Point 2: two site data sets that differ in one label (a valid 1 against 10, which the
    10-class task lacks) both give an ordinary release; the bad example gets clip factor 0,
    exactly as if it were absent."""
    from gep_fed.federation.policy import SitePolicy
    from gep_fed.federation.site import Site
    from gep_fed.mechanisms.step import clipped_sums_of_batches

    data = load_digits().subset(np.arange(400))
    labels = data.labels.copy()
    labels[7] = 10
    bad = tmp_path / "bad.npz"
    np.savez(bad, images=data.images, labels=labels)
    server = make_server(tmp_path, digits, sample_rate=1.0)
    for path in (hospital["data-path"], str(bad)):
        client_app._SITES.clear()
        site = {**hospital, "data-path": path, "epsilon-budget": 100.0}
        reply, _ = answer(round_message(server, 1), site, server.cfg)
        assert not reply.has_error()
        assert_data_free(reply)
    # both rounds accounted alike: 2 steps each, in one ledger
    assert site_ledger(hospital).steps == 4
    # the dropped example contributes nothing: sums equal those without it
    site = Site(
        "s",
        digits.build_model(),
        digits.site_dataset(str(bad)),
        SitePolicy(epsilon_budget=1.0, delta=1e-5),
    )
    assert site.dataset.problem(7).startswith("target 10")
    plan = server.plan_round(1)
    site.load_state(
        wire.decode_state(
            {k: wire.as_wire_array(v) for k, v in plan.state.items()}, site.model.state_dict()
        )
    )
    mech = plan.config.privacy.build_mechanism()
    with_bad = clipped_sums_of_batches(
        site.model,
        site.loss_fn,
        site.batches(torch.arange(400)),
        site.layout,
        mech,
        server.subspace,
    )
    without = clipped_sums_of_batches(
        site.model,
        site.loss_fn,
        site.batches(torch.tensor([i for i in range(400) if i != 7])),
        site.layout,
        mech,
        server.subspace,
    )
    assert torch.allclose(with_bad.residual, without.residual, atol=1e-6)
    assert torch.allclose(with_bad.embedding, without.embedding, atol=1e-6)


def test_a_truncated_image_drawn_in_every_sample_is_dropped_not_an_error(
    tmp_path, digits, hospital
):
    """Point 2: a PNG cut short fails only when read, i.e. when a Poisson sample draws it; a
    failed reply would tell the server so. At q = 1 it is drawn every round."""
    from PIL import Image

    data = load_digits().subset(np.arange(120))
    root = tmp_path / "folders"
    for i, (image, label) in enumerate(zip(data.images, data.labels, strict=True)):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(root / str(label) / f"{i}.png")
    victim = next((root / "3").iterdir())
    victim.write_bytes(victim.read_bytes()[: len(victim.read_bytes()) // 2])
    task = f"{__name__}:DigitsFolders"
    folders = DigitsFolders(TaskSettings(num_public=200))
    server = make_server(tmp_path, folders, task=task, sample_rate=1.0)
    site = {**hospital, "task": task, "data-path": str(root), "epsilon-budget": 100.0}
    for rnd in (1, 2):
        reply, _ = answer(round_message(server, rnd), site, server.cfg)
        assert not reply.has_error()
        assert_data_free(reply)
    checked = next(iter(client_app._SITES.values()))[0].dataset
    problems = [i for i in range(len(checked)) if checked.problem(i)]
    assert len(problems) == 1 and "cannot be read" in checked.problem(problems[0])


@pytest.mark.parametrize("mode", ["client", "central"])
def test_a_layout_naming_a_parameter_twice_or_regrouped_is_refused(
    tmp_path, digits, hospital, mode
):
    """Point 6: the sums used to carry uninitialised memory for the columns a duplicated
    name left unwritten. Now the round's layout must equal the site's own model's."""
    import json

    server = make_server(tmp_path, digits, mode=mode)
    site = {**hospital, "accept-modes": "client,central"}
    layout = server.layout.to_dict()
    twice = {
        **layout,
        "names": layout["names"] + layout["names"][:1],
        "shapes": layout["shapes"] + layout["shapes"][:1],
        "groups": layout["groups"] + [["again", layout["names"][:1]]],
    }
    regrouped = {**layout, "groups": [["all", layout["names"]]]}
    for changed in (twice, regrouped):
        msg = round_message(server, 1, record_changes={"layout": json.dumps(changed)})
        reply, _ = answer(msg, site, server.cfg)
        assert refused(reply, "malformed round")
    assert site_ledger(hospital).steps == 0
    from gep_fed.mechanisms.groups import ParameterLayout

    with pytest.raises(ValueError, match="more than once"):
        ParameterLayout.from_dict(twice)


@pytest.mark.parametrize("clip", [5.1e-38, 1e-31, 1e31])
def test_clip_norms_outside_the_proven_range_are_refused_as_malformed(
    tmp_path, digits, hospital, clip
):
    """Point 3: the digits MLP attack used S = 5.1e-38 with output weights scaled by 1e7."""
    server = make_server(tmp_path, digits, mechanism="gp")
    msg = round_message(server, 1, record_changes={"privacy.clip_norm": clip})
    reply, _ = answer(msg, hospital, server.cfg)
    assert refused(reply, "malformed round")
    assert site_ledger(hospital).steps == 0


def test_a_restored_ledger_or_a_reopened_one_stops_the_site(tmp_path, digits, hospital):
    """Point 5: yesterday's ledger copied back (HMAC intact) is refused and left as it is;
    with new-ledger left in the node config, deleting the ledger alone (key kept) does not
    reopen it at 0 steps."""
    server = make_server(tmp_path, digits)
    ledger = tmp_path / "site" / "ledger.json"
    answer(round_message(server, 1), hospital, server.cfg)
    backup = ledger.read_text()
    answer(round_message(server, 2), hospital, server.cfg)
    assert site_ledger(hospital).steps == 4
    ledger.write_text(backup)
    client_app._SITES.clear()
    reply, _ = answer(round_message(server, 3), hospital, server.cfg)
    assert refused(reply, "site error")
    assert ledger.read_text() == backup
    with pytest.raises(Exception, match="already recorded 4 step"):
        site_ledger(hospital)
    ledger.unlink()
    reopened = {**hospital, "new-ledger": True}
    client_app._SITES.clear()  # the SuperNode restarted with new-ledger in its node config
    reply, _ = answer(round_message(server, 4), reopened, server.cfg)
    assert refused(reply, "site error")
    assert not ledger.exists()
    # the mark deleted too, the key kept: new-ledger still creates nothing (one-shot)
    (tmp_path / "site" / "ledger.json.key.mark").unlink()
    reply, _ = answer(round_message(server, 5), reopened, server.cfg)
    assert refused(reply, "site error")
    assert not ledger.exists()


def test_new_ledger_creates_a_ledger_only_where_no_key_exists(tmp_path, digits, hospital):
    fresh = {**hospital, "ledger-path": str(tmp_path / "new" / "l.json"), "new-ledger": True}
    server = make_server(tmp_path, digits)
    for rnd in (1, 2):  # the second round opens what the first created
        reply, _ = answer(round_message(server, rnd), fresh, server.cfg)
        assert not reply.has_error()
    assert site_ledger(fresh).steps == 4


def test_a_flwr_run_config_leaving_the_model_to_the_task_reaches_the_pinned_site(hospital):
    """The app's pyproject lists every run-config key as "default": the site resolves the
    model of its own (already matched) task exactly as the server does."""
    from flwr.common.config import get_fused_config_from_dir

    root = Path(__file__).parents[1]
    run_config = get_fused_config_from_dir(root, {"task": "fashion-mnist"})
    assert run_config["model"] == "default"
    pinned = {**hospital, "task": "fashion-mnist"}
    client_app.admit_task(deployed(pinned, run_config), None)  # the task's own: scatter-linear
    client_app.admit_task(deployed({**pinned, "model": "scatter-linear"}, run_config), None)
    with pytest.raises(wire.RoundRefused):
        client_app.admit_task(deployed({**pinned, "model": "cnn"}, run_config), None)
    with pytest.raises(wire.RoundRefused):
        client_app.admit_task(deployed(hospital, run_config), None)  # another task


# -- a score of the served model on the site's held-out examples ------------------------------


def score_query(server, classes: int = 10) -> Message:
    state = wire.encode_state(server.served_model.state_dict())
    content = {
        wire.GLOBAL_MODEL: ArrayRecord({k: Array(v) for k, v in state.items()}),
        wire.SCORE_REQUEST: ConfigRecord(wire.score_request(classes)),
    }
    return Message(content=RecordDict(content), message_type=MessageType.QUERY, dst_node_id=1)


def test_a_deployed_site_scores_only_by_its_own_node_config_and_records_every_answer(
    tmp_path, digits, hospital
):
    """A score query holds the model and the classes only: the site answers where its own
    node config holds examples out and sets the noise, records each answer in its ledger
    first, and replies with its noised counts alone; asking again spends again."""
    server = make_server(tmp_path, digits)
    run_config = server.cfg.to_record()
    reply = client_app.handle_query(score_query(server), deployed(hospital, run_config))
    assert refused(reply, "release not allowed") and site_ledger(hospital).steps == 0
    client_app._SITES.clear()
    scoring = {**hospital, "validation-fraction": 0.25, "score-noise": 6.0}  # two fit BUDGET
    answers = []
    for _ in range(2):
        reply = client_app.handle_query(score_query(server), deployed(scoring, run_config))
        assert not reply.has_error() and set(reply.content) == {wire.SITE_SCORE}
        answers.append(wire.decode_counts(reply.content.array_records[wire.SITE_SCORE], "h1", 10))
    assert not np.allclose(answers[0], answers[1])  # fresh noise each time
    events = site_ledger(hospital).events
    assert [e.mechanism for e in events] == ["site-score"] * 2
    ((site, _),) = client_app._SITES.values()
    assert len(site.dataset) + len(site.validation) == 400  # the held-out part is not trained on
    assert 50 <= len(site.validation) <= 150
    # the counts of its held-out examples, noised: 10 counts of std 6 (5 std of their sum)
    assert abs(answers[0][0].sum() - len(site.validation)) < 5 * 6 * 10**0.5
    for bad in (score_query(server, classes=1), round_message(server, 1)):
        reply = client_app.handle_query(bad, deployed(scoring, run_config))
        assert refused(reply, "malformed round")
    assert site_ledger(hospital).steps == 2
