"""A site can rebuild each basis from the public anchors and the basis' coefficients in their
gradients instead of receiving the bases (``basis_transport = "rebuild"``): it reaches the
server's basis, receives a fraction of the bytes, and a malformed record is refused by name."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.models import MnistCNN
from gep_fed.data.task import TaskSettings
from gep_fed.federation import wire
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.policy import SitePolicy
from gep_fed.federation.rundir import RunDirectory
from gep_fed.federation.server import FederationServer
from gep_fed.federation.site import Site
from gep_fed.mechanisms.anchors import compute_anchor_subspace, rebuild_anchor_subspace
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.validation import ConfigError


def test_the_coefficients_rebuild_the_power_method_basis():
    torch.manual_seed(0)
    model = MnistCNN()
    layout = ParameterLayout.from_model(model)
    public = torch.randn(300, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    config = GEPConfig(PrivacyContract("gep", 1.0, 0.1), num_basis=60, num_anchors=200)
    result = compute_anchor_subspace(
        model,
        public,
        layout,
        config,
        loss_fn=F.cross_entropy,
        generator=torch.Generator().manual_seed(1),
        with_coefficients=True,
    )
    assert [c.shape[0] for c in result.anchors.coefficients] == [200] * len(layout.groups)
    rebuilt = rebuild_anchor_subspace(model, result.anchors, layout, loss_fn=F.cross_entropy)
    for q, b in zip(result.subspace.bases, rebuilt.bases, strict=True):
        assert q.shape == b.shape
        assert float((q - b).abs().max()) < 1e-4
    assert rebuilt.orthonormality_error < 1e-3


@pytest.fixture(scope="module")
def digits():
    return DigitsTask(TaskSettings(num_public=300))


def server_for(tmp_path, task, transport):
    fed = FederationConfig(
        num_basis=30,
        sample_rate=0.2,
        rounds=2,
        run_dir=str(tmp_path),
        run_name=transport,
        basis_transport=transport,
    )
    run = RunDirectory(fed.run_directory(0))
    run.path.mkdir(parents=True, exist_ok=True)
    return FederationServer(fed, task, run, total_examples=len(task.train_dataset()))


def as_received(arrays):
    return {name: wire.as_wire_array(value) for name, value in arrays.items()}


def test_a_site_rebuilds_the_servers_basis_from_a_third_of_the_bytes(tmp_path, digits):
    rebuild = server_for(tmp_path, digits, "rebuild")
    plan = rebuild.plan_round(1)
    site = Site(
        "s0",
        digits.build_model(),
        digits.train_dataset(),
        SitePolicy(8.0, 1e-5),
        loss_fn=digits.loss,
    )
    site.load_state(rebuild.model.state_dict())
    anchors = wire.decode_anchors(as_received(plan.basis), site.layout)
    at_site = wire.checked_basis(site.rebuild_subspace(anchors))
    for server_basis, site_basis in zip(rebuild.subspace.bases, at_site.bases, strict=True):
        torch.testing.assert_close(site_basis, server_basis, rtol=0, atol=1e-6)
    # the same subspace as the one sent whole (same seed), from far fewer bytes
    sent_whole = server_for(tmp_path, digits, "basis")
    whole = sent_whole.plan_round(1)
    for q, b in zip(sent_whole.subspace.bases, rebuild.subspace.bases, strict=True):
        assert float((q - b).abs().max()) < 1e-4
    assert wire.basis_bytes(plan.basis) * 3 < wire.basis_bytes(whole.basis)


def anchor_record(digits, tmp_path):
    return server_for(tmp_path, digits, "rebuild").plan_round(1).basis


@pytest.mark.parametrize(
    "corrupt, where",
    [
        (
            lambda a: a.update({"coefficients.0": np.zeros((300, 301), np.float32)}),
            "coefficients.0",
        ),
        (lambda a: a.update({"coefficients.1": a["coefficients.1"][:5]}), "coefficients.1"),
        (lambda a: a.update({"anchors.labels": a["anchors.labels"][:7]}), "anchors.labels"),
        (lambda a: a.pop("coefficients.0"), "coefficients.0"),
        (lambda a: a.update({"extra": np.zeros(3, np.float32)}), "unexpected arrays"),
        (lambda a: a["coefficients.0"].__setitem__((0, 0), np.nan), "NaN"),
        (lambda a: a.update({"anchors.inputs": a["anchors.inputs"].astype(np.float64)}), "dtype"),
    ],
    ids=["k above m", "rows", "labels", "missing", "extra", "nan", "dtype"],
)
def test_a_malformed_anchor_record_is_refused_by_name(tmp_path, digits, corrupt, where):
    arrays = {k: v.copy() for k, v in anchor_record(digits, tmp_path).items()}
    corrupt(arrays)
    layout = ParameterLayout.from_model(digits.build_model())
    with pytest.raises(wire.WireError, match=where):
        wire.decode_anchors(as_received(arrays), layout)


def test_an_unknown_basis_transport_is_refused_by_name():
    with pytest.raises(ConfigError, match="basis_transport"):
        FederationConfig(basis_transport="carrier-pigeon")


@pytest.mark.slow
def test_a_simulated_federation_trains_on_rebuilt_bases(tmp_path):
    """Real Flower simulation (client mode: the sites step on the rebuilt basis; central
    mode's server-side lift uses the basis the unit test above compares): every site rebuilds
    each basis (rounds 1 and 3) and trains; what each site receives for a basis is the anchors
    and coefficients, under a third of the bases' own bytes."""
    from gep_fed.flower.simulation import simulate

    fed = FederationConfig(
        mode="client",
        rounds=3,
        basis_refresh=2,
        num_basis=30,
        num_public=300,
        sample_rate=0.2,
        noise_seed=7,
        local_steps=2,
        run_dir=str(tmp_path),
        run_name="r",
        basis_transport="rebuild",
    )
    result = simulate(fed, progress=False, engine="in-process")
    assert result.stop_reason is None
    assert all(m["sites_ok"] == 3 and not m["rejected"] for m in result.metrics)
    sent = [m["basis_bytes_per_site"] for m in result.metrics]
    assert [sum(s) > 0 for s in sent] == [True, False, True]
    layout = ParameterLayout.from_model(fed.make_task().build_model())
    whole = 4 * sum(
        g.size * k for g, k in zip(layout.groups, layout.allocate_basis(30, 300), strict=True)
    )
    assert all(0 < b * 3 < whole for b in sent[0] + sent[2])
    assert result.metrics[-1]["test_accuracy"] > 0.3  # 10 classes
