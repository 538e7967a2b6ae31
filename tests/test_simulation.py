"""Real Flower simulations (Simulation Engine, Ray backend) of the GEP federation.

Small real data (scikit-learn's digits, bundled) and few rounds; each run takes ~30 s.
"""

import json
import math
import sys

import cloudpickle
import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp

from gep_fed.accounting.events import epsilon_rdp
from gep_fed.accounting.ledger import PrivacyLedger, create_ledger_key, default_key_path
from gep_fed.federation import wire
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import RunDirectory
from gep_fed.flower.simulation import simulate
from gep_fed.mechanisms.mechanism import GEP
from gep_fed.validation import ConfigError

# Ray workers must unpickle the tampering client app defined here.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.slow  # every test here runs a Flower simulation

FAST = dict(num_basis=30, num_public=300, sample_rate=0.2, noise_seed=7, local_steps=2)


def fresh_epsilon(sigma_accounted: float, q: float, steps: int, delta: float) -> float:
    """Epsilon straight from dp-accounting, bypassing gep_fed's composition code."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma_accounted)),
        steps,
    )
    return rdp.RdpAccountant().compose(event).get_epsilon(delta)


def initial_weights(fed: FederationConfig) -> torch.Tensor:
    torch.manual_seed(fed.seed)
    model = fed.make_task().build_model()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def final_weights(run_dir) -> torch.Tensor:
    state = torch.load(run_dir / "model.pt", weights_only=True)["model"]
    return torch.cat([v.reshape(-1) for v in state.values()])


@pytest.mark.parametrize("mode", ["client", "central", "distributed"])
def test_three_site_simulation_trains_and_accounts_every_release(tmp_path, mode):
    fed = FederationConfig(
        mode=mode, rounds=3, run_dir=str(tmp_path), run_name="r", basis_refresh=2, **FAST
    )
    result = simulate(fed, progress=False)
    assert result.stop_reason is None
    assert [m["round"] for m in result.metrics] == [1, 2, 3]
    assert all(m["sites_ok"] == 3 and not m["rejected"] for m in result.metrics)
    assert not torch.allclose(final_weights(result.run_dir), initial_weights(fed))
    sigma = json.loads((result.run_dir / "config.json").read_text())["resolved-noise-multiplier"]
    accounted = sigma / math.sqrt(2)  # GEP: two releases per step
    if mode == "central":
        ledger = PrivacyLedger.load(result.run_dir / "ledger.json")
        assert ledger.steps == 3 and [e.round for e in ledger.events] == [1, 2, 3]
        assert ledger.epsilon() == pytest.approx(fresh_epsilon(accounted, 0.2, 3, 1e-5), rel=1e-9)
    elif mode == "distributed":  # one release per round, accounted alike by all parties
        ledger = PrivacyLedger.load(result.run_dir / "ledger.json")
        assert ledger.steps == 3 and {e.placement for e in ledger.events} == {"distributed"}
        for site in range(3):
            path = result.run_dir / "sites" / f"site-{site}" / "ledger.json"
            own = PrivacyLedger.load_keyed(path)
            assert [e.round for e in own.events] == [1, 2, 3]
            assert own.epsilon() == pytest.approx(ledger.epsilon(), rel=1e-9)
        # the discrete noise costs more than the continuous Gaussian it approaches
        assert ledger.epsilon() > fresh_epsilon(accounted, 0.2, 3, 1e-5)
    else:
        for site in range(3):
            path = result.run_dir / "sites" / f"site-{site}" / "ledger.json"
            ledger = PrivacyLedger.load_keyed(path)
            assert ledger.steps == 3 * 2
            assert {e.party for e in ledger.events} == {f"site-{site}"}
            assert ledger.epsilon() == pytest.approx(
                fresh_epsilon(accounted, 0.2, 6, 1e-5), rel=1e-9
            )
    # the basis is recomputed every 2 rounds and sent only then
    assert [sum(m["basis_bytes_per_site"]) > 0 for m in result.metrics] == [True, False, True]
    # the calibrated sigma spends the target over the whole run
    assert result.metrics[-1]["epsilon"] == pytest.approx(8.0, abs=0.01)


def partition_zero_tampers(tamper):
    """A client-app factory (``make_client_app``'s signature) whose site partition 0 answers
    every train message as an honest site would, then ``tamper(reply, round)`` alters the
    reply; the other sites are honest."""
    from flwr.clientapp import ClientApp

    from gep_fed.flower.clientapp import handle_train

    def make(fed, simulation):
        app = ClientApp()

        @app.train()
        def train(msg, context):
            reply = handle_train(msg, context, fed, simulation)
            if context.node_config["partition-id"] == 0:
                tamper(reply, msg.content.config_records[wire.ROUND_CONFIG]["round"])
            return reply

        return app

    return make


def _corrupt_sums(reply, rnd: int) -> None:
    """A different corruption of a central reply each round."""
    from flwr.app import Array, ArrayRecord, ConfigRecord

    content = reply.content
    sums = content.array_records[wire.CLIPPED_SUMS]
    if rnd == 1:  # wrong shape
        sums["residual"] = Array(np.zeros(7, np.float32))
    elif rnd == 2:  # NaN
        bad = sums["embedding"].numpy().copy()
        bad[0] = np.nan
        sums["embedding"] = Array(bad)
    elif rnd == 3:  # missing key
        content.array_records[wire.CLIPPED_SUMS] = ArrayRecord({"embedding": sums["embedding"]})
    else:  # wrong protocol version
        content[wire.REPLY_META] = ConfigRecord({**wire.reply_meta(rnd, "central"), "protocol": 99})


tampering_client_app = partition_zero_tampers(_corrupt_sums)


def test_bad_replies_are_rejected_by_name_and_the_round_goes_on(tmp_path, monkeypatch, caplog):
    import gep_fed.flower.simulation as runner

    fed = FederationConfig(
        mode="central", rounds=4, num_sites=4, run_dir=str(tmp_path), run_name="r", **FAST
    )
    monkeypatch.setattr("gep_fed.flower.clientapp.make_client_app", tampering_client_app)
    caplog.set_level("WARNING", logger="gep_fed.server")
    result = runner.simulate(fed, progress=False, engine="in-process")
    expected = [
        "'clipped-sums.residual': shape",
        "'clipped-sums.embedding': contains NaN",
        "'clipped-sums.residual': missing",
        "'reply-meta.protocol': protocol version 99",
    ]
    for metrics, problem in zip(result.metrics, expected, strict=True):
        assert metrics["sites_ok"] == 3 and metrics["applied"]
        assert len(metrics["rejected"]) == 1 and problem in metrics["rejected"][0]
        assert "site at node" in metrics["rejected"][0]
        assert any(problem in r.getMessage() for r in caplog.records)
    assert PrivacyLedger.load(result.run_dir / "ledger.json").steps == 4


BAD_METRICS = [
    ("site-epsilon", [1.0], "'metrics.site-epsilon': not a number"),
    ("basis-id", float("inf"), "'metrics.basis-id': not finite"),
    ("site-epsilon", float("nan"), "'metrics.site-epsilon': not finite"),
    ("site-epsilon", -1.0, "'metrics.site-epsilon': negative"),
    ("basis-id", 99, "'metrics.basis-id': a basis the server never sent"),
    ("anything", 1.0, "'metrics': unknown key(s) ['anything']"),
]


def _bad_metric(reply, rnd: int) -> None:
    """Round ``rnd``'s bad metric (``BAD_METRICS``) in a reply that carries metrics."""
    from flwr.app import MetricRecord

    if not reply.has_error() and wire.REPLY_METRICS in reply.content.metric_records:
        key, value, _ = BAD_METRICS[rnd - 1]
        metrics = dict(reply.content.metric_records[wire.REPLY_METRICS])
        reply.content[wire.REPLY_METRICS] = MetricRecord({**metrics, key: value})


tampering_metrics_app = partition_zero_tampers(_bad_metric)


@pytest.mark.parametrize("mode", ["client", "central"])
def test_a_reply_with_bad_metrics_is_rejected_by_name_before_it_is_used(
    tmp_path, monkeypatch, mode
):
    """A site's metrics (its epsilon, the basis it holds) are read by the server: a list, a
    NaN or a basis never sent crashed the round after it was applied, or became the run's
    recorded epsilon. Each is now a rejected reply, named, and the round goes on with the
    others."""
    import gep_fed.flower.simulation as runner

    fed = FederationConfig(
        mode=mode, rounds=len(BAD_METRICS), num_sites=3, min_sites=2, run_dir=str(tmp_path),
        run_name="r", **{**FAST, "local_steps": 1},
    )  # fmt: skip
    monkeypatch.setattr("gep_fed.flower.clientapp.make_client_app", tampering_metrics_app)
    result = runner.simulate(fed, progress=False, engine="in-process")
    assert [m["round"] for m in result.metrics] == list(range(1, len(BAD_METRICS) + 1))
    for metrics, (*_, problem) in zip(result.metrics, BAD_METRICS, strict=True):
        assert any(problem in r for r in metrics["rejected"]), metrics["rejected"]
        assert math.isfinite(metrics["epsilon"])  # (a site without noise may report inf)
        assert metrics["sites_ok"] == 2 and metrics["applied"], metrics


def _huge_delta(reply, rnd: int) -> None:
    """A finite but huge model delta: 3e38 everywhere."""
    from flwr.app import Array, ArrayRecord

    arrays = reply.content.array_records[wire.MODEL_DELTA]
    huge = {k: Array(np.full_like(a.numpy(), 3e38)) for k, a in arrays.items()}
    reply.content[wire.MODEL_DELTA] = ArrayRecord(huge)


huge_delta_app = partition_zero_tampers(_huge_delta)


def test_a_finite_but_huge_client_delta_is_rejected_and_the_run_trains_and_resumes(
    tmp_path, monkeypatch
):
    """A delta of 3e38 was applied: the checkpoint held weights of 1e38, the evaluation
    failed on NaN without naming the site, and every resume failed. It is rejected by name."""
    import gep_fed.flower.simulation as runner

    fed = FederationConfig(
        mode="client", rounds=2, num_sites=3, min_sites=2, run_dir=str(tmp_path), run_name="r",
        **{**FAST, "local_steps": 1},
    )  # fmt: skip
    monkeypatch.setattr("gep_fed.flower.clientapp.make_client_app", huge_delta_app)
    result = runner.simulate(fed, progress=False, engine="in-process")
    for metrics in result.metrics:
        assert metrics["sites_ok"] == 2 and metrics["applied"]
        (rejected,) = metrics["rejected"]
        assert "'model-delta': a value above 1e+06 x the model's scale" in rejected
        assert math.isfinite(metrics["test_loss"])
    assert torch.isfinite(final_weights(result.run_dir)).all()


def _extra_sums(reply, rnd: int) -> None:
    """Clipped sums (central mode's payload) added to a client reply."""
    from flwr.app import Array, ArrayRecord

    reply.content[wire.CLIPPED_SUMS] = ArrayRecord({"residual": Array(np.zeros(3, np.float32))})


extra_record_app = partition_zero_tampers(_extra_sums)


def test_a_reply_with_records_its_mode_does_not_send_is_rejected_by_name(tmp_path, monkeypatch):
    import gep_fed.flower.simulation as runner

    fed = FederationConfig(
        mode="client", rounds=1, num_sites=3, min_sites=2, run_dir=str(tmp_path), run_name="r",
        **{**FAST, "local_steps": 1},
    )  # fmt: skip
    monkeypatch.setattr("gep_fed.flower.clientapp.make_client_app", extra_record_app)
    (metrics,) = runner.simulate(fed, progress=False, engine="in-process").metrics
    (rejected,) = metrics["rejected"]
    assert "records this mode does not send: ['clipped-sums']" in rejected
    assert metrics["sites_ok"] == 2 and metrics["applied"]


def test_client_rounds_the_sites_replied_to_but_not_applied_are_not_left_out_of_the_summary(
    tmp_path, monkeypatch
):
    """Client mode: with one reply rejected and min_sites 3, no round updates the model, so
    the server accounts nothing, yet the two honest sites released and recorded each round.
    The summary showed the server's 0 as the sites' spend."""
    import gep_fed.flower.simulation as runner
    from gep_fed.federation.report import summary_lines

    fed = FederationConfig(
        mode="client", rounds=2, num_sites=3, min_sites=3, run_dir=str(tmp_path), run_name="r",
        **{**FAST, "local_steps": 1},
    )  # fmt: skip
    monkeypatch.setattr("gep_fed.flower.clientapp.make_client_app", huge_delta_app)
    result = runner.simulate(fed, progress=False, engine="in-process")
    assert [m["applied"] for m in result.metrics] == [False, False]
    site_spend = max(m["site_epsilon_max"] for m in result.metrics)
    for site in ("site-1", "site-2"):
        ledger = PrivacyLedger.load_keyed(result.run_dir / "sites" / site / "ledger.json")
        assert ledger.steps == 2 and ledger.epsilon() == pytest.approx(site_spend)
    lines = summary_lines(fed, result.metrics, None, result.site_rounds, result.run_dir, 1.0)
    (spent,) = [x for x in lines if "epsilon spent (each site)" in x]
    assert "the sites' own ledgers also hold 2 round(s) they replied to" in spent
    assert f"largest epsilon a site reported: {site_spend:.3f}" in spent


def resumed_after_a_metrics_fault(fed, monkeypatch, fault):
    """``fed`` simulated in process with ``fault(run_dir, record, append)`` in place of
    writing each metrics row until it raises (the machine went down), then run again as it
    is (the resume): the second run's result."""
    from gep_fed.federation.rundir import RunDirectory

    append = RunDirectory.append_metrics
    monkeypatch.setattr(RunDirectory, "append_metrics", lambda run, r: fault(run, r, append))
    with pytest.raises(RuntimeError, match="went down"):
        simulate(fed, progress=False, engine="in-process")
    monkeypatch.setattr(RunDirectory, "append_metrics", append)
    return simulate(fed, progress=False, engine="in-process")


def test_a_round_committed_before_a_crash_keeps_a_metrics_row_that_says_its_metrics_were_lost(
    tmp_path, monkeypatch
):
    """A crash between a round's commit (checkpoint and ledger) and its metrics row lost the
    row for good: a resume gave rounds [1, 3] with 3 ledger steps, and said nothing."""
    from gep_fed.federation.report import render_report, summary_lines
    from gep_fed.federation.rundir import RunDirectory

    fed = FederationConfig(mode="central", rounds=3, run_dir=str(tmp_path), run_name="r", **FAST)

    def crash_at_round_two(self, record, append):
        if record["round"] == 2:
            raise RuntimeError("the machine went down")
        append(self, record)

    result = resumed_after_a_metrics_fault(fed, monkeypatch, crash_at_round_two)
    rows = RunDirectory(result.run_dir).read_metrics()
    assert [(r["round"], "metrics_lost" in r) for r in rows] == [(1, False), (2, True), (3, False)]
    assert PrivacyLedger.load(result.run_dir / "ledger.json").steps == 3
    lines = summary_lines(fed, result.metrics, None, result.site_rounds, result.run_dir, 1.0)
    assert any(
        x.startswith("round(s) 2: applied and accounted, but the run stopped") for x in lines
    )
    assert "**round(s) 2: applied and accounted" in render_report(result.run_dir).read_text()


def test_a_torn_last_metrics_line_is_set_aside_when_the_run_resumes(tmp_path, monkeypatch):
    """A run that stopped while writing a row left half a line: a resume appended its next
    row onto it, losing that one too, and the file failed to read only at the end."""
    from gep_fed.federation.rundir import RunDirectory

    fed = FederationConfig(mode="central", rounds=2, run_dir=str(tmp_path), run_name="r", **FAST)

    def torn_at_round_two(self, record, append):
        if record["round"] != 2:
            return append(self, record)
        with open(self.file("metrics.jsonl"), "a") as fh:
            fh.write('{"round": 2, "test_acc')
        raise RuntimeError("the machine went down mid-write")

    result = resumed_after_a_metrics_fault(fed, monkeypatch, torn_at_round_two)
    rows = RunDirectory(result.run_dir).read_metrics()
    assert [(r["round"], "metrics_lost" in r) for r in rows] == [(1, False), (2, True)]
    assert (tmp_path / "r" / "metrics.jsonl.torn").read_text() == '{"round": 2, "test_acc\n'


def test_run_stops_before_the_round_that_would_exceed_the_budget(tmp_path):
    sigma, q = 1.5, 0.2
    two = epsilon_rdp([GEP.event(sigma, q, 2)], 1e-5)
    three = epsilon_rdp([GEP.event(sigma, q, 3)], 1e-5)
    fed = FederationConfig(
        mode="central",
        rounds=5,
        noise_multiplier=sigma,
        target_epsilon=(two + three) / 2,
        run_dir=str(tmp_path),
        run_name="r",
        **FAST,
    )
    result = simulate(fed, progress=False, engine="in-process")
    assert [m["round"] for m in result.metrics] == [1, 2]
    assert "stopped before round 3" in result.stop_reason
    assert "spent so far" in result.stop_reason and "left" in result.stop_reason
    assert PrivacyLedger.load(result.run_dir / "ledger.json").steps == 2


def test_a_site_with_an_exhausted_budget_refuses_and_the_others_go_on(tmp_path):
    fed = FederationConfig(
        mode="client", rounds=2, noise_multiplier=1.0, run_dir=str(tmp_path), run_name="r", **FAST
    )
    spent = tmp_path / "r" / "sites" / "site-1" / "ledger.json"
    key = create_ledger_key(default_key_path(spent))
    PrivacyLedger(1e-5, None, "site-1", spent, key=key).record(GEP.event(1.0, 0.2, 95))
    result = simulate(fed, progress=False, engine="in-process")
    for metrics in result.metrics:
        assert metrics["sites_ok"] == 2 and metrics["applied"]
        (why,) = metrics["rejected"]  # a fixed code, nothing else from the site
        assert why.startswith("site at node ") and why.endswith("'error': refused: over budget")
    assert PrivacyLedger.load(spent, key).steps == 95  # nothing more recorded, nothing lost
    site0 = tmp_path / "r" / "sites" / "site-0" / "ledger.json"
    assert PrivacyLedger.load_keyed(site0).steps == 4


def test_rounds_without_enough_valid_replies_fail_the_run_on_every_path(tmp_path):
    """min_sites=2 of 2 sites and one site over budget: no round updates the model. The
    ServerApp as deployed (``flwr run``) raises, so Flower records the run as failed, and
    ``simulate``'s result (what ``gep-fed simulate`` exits 1 on) names the same rounds;
    metrics and ledgers stay."""
    from gep_fed.flower.clientapp import make_client_app
    from gep_fed.flower.in_process import run_in_process
    from gep_fed.flower.serverapp import RunFailedError, make_server_app
    from gep_fed.flower.simulation import SimulationResult, simulated_site_settings

    fed = FederationConfig(
        mode="client",
        rounds=2,
        noise_multiplier=1.0,
        num_sites=2,
        min_sites=2,
        run_dir=str(tmp_path),
        run_name="r",
        **FAST,
    )
    spent = tmp_path / "r" / "sites" / "site-1" / "ledger.json"
    key = create_ledger_key(default_key_path(spent))
    PrivacyLedger(1e-5, None, "site-1", spent, key=key).record(GEP.event(1.0, 0.2, 95))
    with pytest.raises(RunFailedError, match=r"not updated in round\(s\) 1-2") as raised:
        run_in_process(
            make_server_app(fed, progress=False),
            make_client_app(fed, simulated_site_settings(fed)),
            num_sites=2,
        )
    assert "at most 1 in those rounds" in str(raised.value)
    rows = RunDirectory(tmp_path / "r").read_metrics()
    assert [(r["sites_ok"], r["applied"]) for r in rows] == [(1, False), (1, False)]
    assert PrivacyLedger.load(spent, key).steps == 95
    result = SimulationResult(tmp_path / "r", rows, None, 0.0)
    assert result.failures() == [str(raised.value)]


def test_simulated_sites_accept_the_work_their_own_simulation_asks():
    """The local user runs every simulated site, so its sites allow the steps and copies the
    simulation asks for, above the deployed defaults too; a deployed site keeps its own."""
    from gep_fed.federation.policy import SiteConfig
    from gep_fed.flower.simulation import simulated_site_settings

    def policy(fed):
        settings = simulated_site_settings(fed)
        node = {"partition-id": 0, "num-partitions": 2}
        return SiteConfig.from_node_config(node, settings, "/tmp/run").policy

    large = policy(FederationConfig(local_steps=150, augmentation_copies=32))
    assert (large.max_local_steps, large.max_augmentation_copies) == (150, 32)
    small = policy(FederationConfig(local_steps=3))
    assert (small.max_local_steps, small.max_augmentation_copies) == (100, 16)


def test_an_unknown_engine_is_named_before_anything_runs(tmp_path):
    fed = FederationConfig(rounds=1, run_dir=str(tmp_path), run_name="r", **FAST)
    with pytest.raises(ConfigError, match=r"engine must be one of \['ray', 'in-process'\]"):
        simulate(fed, engine="threads")
    assert not (tmp_path / "r").exists()


def test_the_in_process_engine_turns_a_sites_exception_into_a_reply_without_its_text():
    from flwr.app import Message, MessageType, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity

    from gep_fed.flower.in_process import InProcessGrid, site_contexts

    app = ClientApp()

    @app.train()
    def train(msg, context):
        raise ValueError("patient 1234's label")

    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 5, 0, 0
    try:
        grid = InProcessGrid(app, site_contexts(1, 5), Run.create_empty(5))
        msg = Message(content=RecordDict(), dst_node_id=100, message_type=MessageType.TRAIN)
        (reply,) = grid.send_and_receive([msg])
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    assert reply.has_error() and reply.error.code == 2
    assert "1234" not in reply.error.reason
