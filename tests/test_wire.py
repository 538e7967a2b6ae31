"""Validation of everything a server or site receives."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from gep_fed import PrivacyContract
from gep_fed.data.models import MLP
from gep_fed.federation import wire
from gep_fed.federation.wire import WireError, as_wire_array
from gep_fed.mechanisms.groups import ParameterLayout


def arrays(**values):
    return {k: as_wire_array(v) for k, v in values.items()}


def good_sums():
    return arrays(embedding=np.zeros(5, np.float32), residual=np.ones(20, np.float32))


def test_valid_sums_decode():
    sums = wire.decode_sums(good_sums(), "site-a", 5, 20)
    assert sums.embedding.shape == (5,) and not sums.noised


@pytest.mark.parametrize(
    "mutate, field, problem",
    [
        (lambda a: a.pop("residual"), "clipped-sums.residual", "missing"),
        (lambda a: a.update(residual=as_wire_array(np.ones(21, np.float32))), "residual", "shape"),
        (lambda a: a.update(residual=as_wire_array(np.ones(20, np.float64))), "residual", "dtype"),
        (
            lambda a: a.update(embedding=as_wire_array(np.array([0, 0, np.nan, 0, 0], np.float32))),
            "embedding",
            "NaN",
        ),
        (
            lambda a: a.update(residual=as_wire_array(np.full(20, np.inf, np.float32))),
            "residual",
            "inf",
        ),
        (
            lambda a: a.update(extra=as_wire_array(np.ones(1, np.float32))),
            "clipped-sums",
            "unexpected",
        ),
    ],
    ids=["missing", "shape", "dtype", "nan", "inf", "extra"],
)
def test_bad_sums_are_rejected_naming_site_and_field(mutate, field, problem):
    values = good_sums()
    mutate(values)
    with pytest.raises(WireError, match=problem) as err:
        wire.decode_sums(values, "site-a", 5, 20)
    assert err.value.sender == "site-a" and field in err.value.field


def test_oversized_arrays_are_rejected_before_reading():
    class Huge:
        dtype, shape = "float32", (10**9,)

        def numpy(self):  # pragma: no cover - must never be called
            raise AssertionError("read an oversized array")

    with pytest.raises(WireError, match="oversized"):
        wire.decode_sums({"embedding": Huge(), "residual": Huge()}, "s", 5, 20)


LAYOUT = ParameterLayout.from_model(MLP(4, 2, hidden=(3,)))


def round_config() -> wire.RoundConfig:
    return wire.RoundConfig(
        round=2,
        last_round=5,
        mode="client",
        privacy=PrivacyContract("gep", 1.0, 0.1, clip_embedding=1.0, clip_residual=0.2),
        local_steps=2,
        local_lr=0.5,
        local_momentum=0.0,
        augmentation_copies=4,
        basis_id=0,
        basis_dtype="float16",
        layout=json.dumps(LAYOUT.to_dict()),
        site_examples=300,
    )


def test_round_config_round_trips_and_refuses_other_protocol_versions():
    rc = round_config()
    assert wire.RoundConfig.from_record(rc.to_record()) == rc
    assert rc.parameter_layout() == LAYOUT
    with pytest.raises(WireError, match="protocol version 99"):
        wire.RoundConfig.from_record({**rc.to_record(), "protocol": 99})
    with pytest.raises(WireError, match="missing keys"):
        wire.RoundConfig.from_record({k: v for k, v in rc.to_record().items() if k != "mode"})
    scored = replace(rc, scored=True)  # a site plans the score it will be asked for
    assert wire.RoundConfig.from_record(scored.to_record()) == scored
    with pytest.raises(WireError, match="'scored': must be bool, got 1"):
        wire.RoundConfig.from_record({**rc.to_record(), "scored": 1})


@pytest.mark.parametrize(
    "change, field",
    [
        ({"privacy.sample_rate": 1.5}, "sample_rate"),
        ({"privacy.noise_multiplier": -1.0}, "noise_multiplier"),
        ({"privacy.clip_residual": float("nan")}, "clip_residual"),
        ({"privacy.mechanism": "laplace"}, "mechanism"),
        ({"privacy.clip_norm": "1.0"}, "clip_norm"),
        ({"round": 0}, "round"),
        ({"round": 2.5}, "round"),
        ({"last_round": 1}, "last_round"),  # before the round itself
        ({"last_round": 100_002}, "last_round"),  # 100,001 rounds from round 2: too long
        ({"last_round": "5"}, "last_round"),
        ({"local_steps": 0}, "local_steps"),
        ({"local_momentum": 1.0}, "local_momentum"),
        ({"augmentation_copies": -1}, "augmentation_copies"),
        ({"augmentation_copies": 65}, "augmentation_copies"),
        ({"augmentation_copies": 2.0}, "augmentation_copies"),
        ({"basis_id": -1}, "basis_id"),
        ({"layout": "not json"}, "layout"),
        ({"extra": 1}, "unexpected"),
        ({"selection": "not json"}, "selection"),
        ({"selection": 3}, "selection"),
        ({"selection": '{"search": "ab", "trial": 1, "event": {}}'}, "selection"),
        # client mode: every site normalises by this public size; elsewhere the server does
        ({"site_examples": 0}, "site_examples"),
        ({"site_examples": 300.0}, "site_examples"),
        ({"mode": "central"}, "site_examples"),
    ],
)
def test_a_bad_round_config_value_is_a_wire_error_naming_it(change, field):
    rc = round_config()
    with pytest.raises(WireError, match=field):
        wire.RoundConfig.from_record({**rc.to_record(), **change})


def test_reply_meta_must_match_round_mode_and_version():
    wire.check_reply_meta(wire.reply_meta(3, "central"), "s", 3, "central")
    with pytest.raises(WireError, match="round"):
        wire.check_reply_meta(wire.reply_meta(2, "central"), "s", 3, "central")
    with pytest.raises(WireError, match="protocol"):
        wire.check_reply_meta({**wire.reply_meta(3, "central"), "protocol": 0}, "s", 3, "central")


def test_float16_basis_is_used_exactly_as_received():
    layout = ParameterLayout.from_model(MLP(30, 5, hidden=(20,)))
    dims = layout.allocate_basis(8)
    bases = tuple(
        torch.linalg.qr(torch.randn(g.size, k)).Q for g, k in zip(layout.groups, dims, strict=True)
    )
    from gep_fed.mechanisms.subspace import AnchorSubspace

    encoded = wire.encode_basis(AnchorSubspace(layout, bases), "float16")
    assert all(a.dtype == np.float16 for a in encoded.values())
    received = wire.decode_basis(
        {k: as_wire_array(v) for k, v in encoded.items()}, layout, "float16"
    )
    for sent, got in zip(encoded.values(), received.bases, strict=True):
        assert torch.equal(got, torch.from_numpy(sent.astype(np.float32)))
    # the decomposition against the received basis is exact: g = lift(embed(g)) + residual
    g = torch.randn(4, layout.size)
    residual = g - received.lift(received.embed(g))
    torch.testing.assert_close(received.lift(received.embed(g)) + residual, g)
    assert wire.basis_bytes(encoded) == sum(v.size * 2 for v in encoded.values())


def test_model_delta_must_match_the_layout():
    layout = ParameterLayout.from_model(MLP(4, 2, hidden=(3,)))
    delta = torch.randn(layout.size)
    encoded = {k: as_wire_array(v) for k, v in wire.encode_delta(layout, delta).items()}
    torch.testing.assert_close(wire.decode_delta(encoded, layout, "s"), delta)
    encoded.pop(layout.names[0])
    with pytest.raises(WireError, match="missing"):
        wire.decode_delta(encoded, layout, "s")
