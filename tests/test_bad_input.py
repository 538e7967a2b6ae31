"""Bad input at the federation's boundaries: every problem named, nothing recorded lost."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from gep_fed.accounting.ledger import LedgerError, PrivacyLedger
from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.datasets import load_site_file
from gep_fed.data.formats import DataError
from gep_fed.data.task import TaskSettings
from gep_fed.federation import wire
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.policy import SiteConfig
from gep_fed.flower.strategy import GEPStrategy
from gep_fed.mechanisms.mechanism import ClippedSums
from gep_fed.validation import ConfigError
from helpers import tiny_federation


@pytest.fixture(scope="module")
def digits():
    return DigitsTask(TaskSettings(num_public=200))


def make_server(tmp_path, task, **overrides):
    base = dict(num_basis=20, sample_rate=0.2, rounds=3, mode="central", noise_multiplier=1.0)
    return tiny_federation(tmp_path, task, **{**base, **overrides})


@pytest.fixture(autouse=True)
def _flower_task_identity():
    """Messages are built inside a Flower runtime; set the identity it would set."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1


def reply(to_node: int, content: dict) -> Message:
    request = Message(content=RecordDict({}), message_type=MessageType.TRAIN, dst_node_id=to_node)
    return Message(content=RecordDict(content), reply_to=request)


def sums_reply(server, node, rnd, embedding=None, residual=None, meta=None):
    k, p = server.subspace.num_basis, server.layout.size
    emb = np.zeros(k, np.float32) if embedding is None else embedding
    res = np.zeros(p, np.float32) if residual is None else residual
    return reply(
        node,
        {
            wire.CLIPPED_SUMS: ArrayRecord({"embedding": Array(emb), "residual": Array(res)}),
            wire.REPLY_META: ConfigRecord(meta or wire.reply_meta(rnd, "central")),
        },
    )


def test_duplicate_and_implausible_replies_are_rejected_and_the_round_goes_on(tmp_path, digits):
    server = make_server(tmp_path, digits)
    strategy = GEPStrategy(server, progress=False)
    strategy._round_info = {}
    server.plan_round(1)
    huge = np.full(server.subspace.num_basis, 1e4, np.float32)
    replies = [
        sums_reply(server, 7, 1),
        sums_reply(server, 7, 1),  # the same site twice
        sums_reply(server, 8, 1, embedding=huge),  # more than clipping allows for any batch
        sums_reply(server, 9, 1),
    ]
    strategy.aggregate_train(1, replies)
    info = strategy._round_info
    assert info["sites_ok"] == 2 and info["applied"]
    assert any("node 7" in r and "duplicate" in r for r in info["rejected"])
    assert any(
        "node 8" in r and "clipped-sums.embedding" in r and "not honestly clipped" in r
        for r in info["rejected"]
    )
    assert PrivacyLedger.load(server.ledger.path).steps == 1


def test_plausibility_bound_allows_honest_sums(tmp_path, digits):
    server = make_server(tmp_path, digits)
    server.plan_round(1)
    expected = 0.2 * len(digits.train_dataset())
    honest = ClippedSums(
        torch.full((server.subspace.num_basis,), 0.0),
        torch.ones(server.layout.size) * 0.2 * expected / server.layout.size**0.5,
    )
    server.check_plausible(honest, "site")  # norm = S2 * expected batch: fine


SITE = {
    "site-id": "h1",
    "task": "digits",
    "data-path": "/x.npz",
    "ledger-path": "/l.json",
    "delta": 1e-5,
}


@pytest.mark.parametrize(
    "node_config, problem",
    [
        (
            {"task": "digits", "data-path": "/x.npz", "ledger-path": "/l.json", "delta": 1e-5},
            "site-id",
        ),
        ({**SITE, "ledger-path": None}, "ledger-path"),
        ({"site-id": "h1", "task": "digits", "ledger-path": "/l.json", "delta": 1e-5}, "data-path"),
        ({"site-id": "h1", "data-path": "/x.npz", "ledger-path": "/l.json", "delta": 1e-5}, "task"),
        ({**SITE, "delta": None}, "delta"),
        (SITE, "epsilon-budget"),
        ({**SITE, "epsilon-budget": -1.0}, "epsilon-budget"),
        ({**SITE, "epsilon-budget": 1.0, "device": "tpu"}, "device"),
        ({**SITE, "epsilon-budget": 1.0, "colour": "red"}, "colour"),
        ({**SITE, "epsilon-budget": 1.0, "noise-seed": 3}, "noise-seed"),
        ({**SITE, "epsilon-budget": 1.0, "accept-modes": "client,trusting"}, "accept-modes"),
        ({**SITE, "epsilon-budget": 1.0, "release-metrics": "yes"}, "release-metrics"),
        ({**SITE, "epsilon-budget": 1.0, "max-local-steps": 0}, "max-local-steps"),
        ({**SITE, "epsilon-budget": 1.0, "max-augmentation-copies": 65}, "max-augmentation-copies"),
    ],
)
def test_bad_node_config_is_named(node_config, problem):
    node_config = {k: v for k, v in node_config.items() if v is not None}
    with pytest.raises(ConfigError, match=problem):
        SiteConfig.from_node_config(node_config, None, "/tmp/run")


def test_unreadable_site_data_file_is_named(tmp_path):
    path = tmp_path / "site-3.npz"
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(DataError, match=r"site-3\.npz"):
        load_site_file(path)
    with pytest.raises(DataError, match="does not exist"):
        load_site_file(tmp_path / "missing.npz")


def test_server_refuses_a_corrupted_ledger_and_leaves_it_untouched(tmp_path, digits):
    server = make_server(tmp_path, digits)
    server.ledger.record(*server.round_events(1))
    damaged = server.ledger.path.read_text().replace('"round": 1', '"round": 2')
    server.ledger.path.write_text(damaged)
    with pytest.raises(LedgerError, match="checksum"):
        make_server(tmp_path, digits)
    assert server.ledger.path.read_text() == damaged


def test_noise_seeding_is_recorded_in_the_run_directory(tmp_path):
    from gep_fed.flower.strategy import GEPStrategy

    for seed, expected in ((None, "NoiseSource(cryptographic)"), (5, "NoiseSource(seed=5)")):
        fed = FederationConfig(
            num_public=100,
            num_basis=10,
            run_dir=str(tmp_path),
            run_name=f"s{seed}",
            noise_seed=seed,
        )
        GEPStrategy.from_config(fed, 0, progress=False)
        config = json.loads((tmp_path / f"s{seed}" / "config.json").read_text())
        assert config["noise"] == expected
        assert config["noise-seed"] == (-1 if seed is None else seed)


def test_a_simulation_whose_site_count_differs_from_num_sites_fails_naming_both(tmp_path):
    """Flower's simulation with 2 SuperNodes under a run config of num-sites 3 (flwr run's
    federation config and run config disagreeing): each simulated site refuses to train a
    share of 3 partitions (one would never train, silently), naming both numbers and the
    fix, so the run fails instead of training on two thirds of the data."""
    from gep_fed.flower.clientapp import make_client_app
    from gep_fed.flower.in_process import run_in_process
    from gep_fed.flower.serverapp import make_server_app
    from gep_fed.flower.simulation import simulated_site_settings

    fed = FederationConfig(
        task="digits", num_sites=3, rounds=1, num_basis=4, run_dir=str(tmp_path), run_name="r"
    )
    outcome = {}
    server_app = make_server_app(fed, progress=False, on_done=lambda o: outcome.update(o=o))
    run_in_process(server_app, make_client_app(fed, simulated_site_settings(fed)), 2)
    metrics = outcome["o"].strategy.server.run.read_metrics()
    assert [m["applied"] for m in metrics] == [False]
    rows = [
        json.loads(line)
        for site in ("site-0", "site-1")
        for line in (tmp_path / "r" / "sites" / site / "rounds.jsonl").read_text().splitlines()
    ]
    assert [r["outcome"] for r in rows] == ["malformed round"] * 2
    assert all(
        "2 simulated sites (Flower's num-supernodes) and the run config num-sites 3" in r["cause"]
        and "set num-sites=2" in r["cause"]
        for r in rows
    )


@pytest.fixture(scope="module")
def noiseless_run(tmp_path_factory):
    """One round of two simulated sites at noise multiplier 0 (no privacy), in process."""
    from gep_fed.flower.simulation import simulate

    fed = FederationConfig(
        num_public=100, num_basis=8, rounds=1, local_steps=1, sample_rate=1.0, num_sites=2,
        noise_seed=3, noise_multiplier=0.0, run_dir=str(tmp_path_factory.mktemp("runs")),
        run_name="run",
    )  # fmt: skip
    return fed, simulate(fed, False, engine="in-process")


def test_a_run_without_noise_says_it_has_no_privacy_in_its_summary_and_report(noiseless_run):
    from gep_fed.federation.report import render_report, summary_lines

    fed, result = noiseless_run
    lines = summary_lines(fed, result.metrics, None, result.site_rounds, result.run_dir, 1.0)
    assert lines[0].startswith("NO PRIVACY: the noise multiplier is 0")
    assert "**NO PRIVACY: the noise multiplier is 0" in render_report(result.run_dir).read_text()


def test_a_run_with_seeded_noise_says_so_first_in_its_summary_and_report(tmp_path):
    """noise-seed is for tests and benchmarks; a run config that sets it (flwr run reads it
    too) must not read as private: the seed removes the noise for whoever knows it."""
    from gep_fed.federation.report import render_report, summary_lines
    from gep_fed.flower.simulation import simulate

    fed = FederationConfig(
        num_public=100, num_basis=8, rounds=1, local_steps=1, sample_rate=1.0, num_sites=2,
        noise_seed=3, run_dir=str(tmp_path), run_name="run",
    )  # fmt: skip
    result = simulate(fed, False, engine="in-process")
    lines = summary_lines(fed, result.metrics, None, result.site_rounds, result.run_dir, 1.0)
    assert lines[0].startswith("NOISE SEEDED (noise-seed 3; tests and benchmarks only)")
    assert "**NOISE SEEDED (noise-seed 3" in render_report(result.run_dir).read_text()
    unseeded = replace(fed, noise_seed=None)
    assert not summary_lines(unseeded, result.metrics, None, {}, result.run_dir, 1.0)[0].startswith(
        "NOISE SEEDED"
    )


def test_a_damaged_site_ledger_is_named_in_the_summary_and_report_which_still_stand(
    noiseless_run, tmp_path
):
    """A simulated site's ledger damaged after a run (or between a run and its resume): the
    summary and the report name it with its problem and keep every other line; the file is
    left untouched."""
    import shutil

    from gep_fed.federation.report import render_report, summary_lines

    fed, result = noiseless_run
    run_dir = shutil.copytree(result.run_dir, tmp_path / "run")
    damaged = run_dir / "sites" / "site-0" / "ledger.json"
    text = damaged.read_text()[:100]
    damaged.write_text(text)
    lines = summary_lines(fed, result.metrics, None, result.site_rounds, run_dir, 1.0)
    (line,) = [x for x in lines if "site-0 (its own ledger)" in x]
    assert "its ledger cannot be read" in line and "not valid JSON" in line
    assert any("site-1 (its own ledger)  epsilon" in x for x in lines)
    report = render_report(run_dir).read_text()
    assert "site `site-0` (its own ledger): its ledger cannot be read" in report
    assert "site `site-1` (its own ledger): epsilon" in report
    assert damaged.read_text() == text


@pytest.mark.parametrize("transport", ["basis", "rebuild"])
def test_a_basis_the_sites_would_refuse_is_an_error_naming_num_basis(
    tmp_path, digits, monkeypatch, transport
):
    """More basis directions than the anchors' gradients span (num_basis 100,000 on
    digits' 2,000 anchors) rebuilt a basis 0.07 from orthonormal, and the run ended naming
    only the wire field. Here every basis is held to a bound none meets."""
    monkeypatch.setattr(wire, "MAX_BASIS_ORTHONORMALITY_ERROR", -1.0)
    server = make_server(tmp_path, digits, mode="client", basis_transport=transport)
    with pytest.raises(
        ConfigError, match=r"not orthonormal .*num_basis 20 asks for \[.* 200 anchors"
    ):
        server.plan_round(1)
