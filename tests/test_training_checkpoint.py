"""``train_private``'s checkpoints: an interrupted run resumes and ends as the unbroken run."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import gep_fed.training as training
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.multiplicity import AugmentationMultiplicity
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.training import Checkpoint, OptimizerConfig, train_private

STEPS = 10


class Interrupted(Exception):
    pass


def _data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 12, generator=gen)
    y = torch.randint(0, 3, (200,), generator=gen)
    return x, y, torch.randn(40, 12, generator=gen)


def _config(mechanism: str, **knobs) -> GEPConfig:
    contract = PrivacyContract(mechanism, 1.0, 0.1, clip_embedding=1.0, clip_residual=0.5)
    return GEPConfig(contract, num_basis=3, num_anchors=20, **knobs)


def _train(config, checkpoint=None, stop_after=None, lr=0.1, seeded=True, aug=False):
    """A seeded run, raising ``Interrupted`` after step ``stop_after`` if given."""
    x, y, public = _data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))
    draws = torch.Generator().manual_seed(5)
    multiplicity = None
    if aug:
        multiplicity = AugmentationMultiplicity(
            2, lambda t: t + 0.1 * torch.randn(t.shape, generator=draws)
        )
        checkpoint = checkpoint and Checkpoint(checkpoint.path, checkpoint.interval, (draws,))

    result = train_private(
        model,
        x,
        y,
        public,
        config,
        STEPS,
        OptimizerConfig(lr=lr, weight_decay=1e-3, decay_at=0.5),
        generator=torch.Generator().manual_seed(1) if seeded else None,
        noise=NoiseSource(2) if seeded else NoiseSource(),
        average_iterates=0.9,
        multiplicity=multiplicity,
        evaluate_fn=lambda m: {"accuracy": float(m(x).argmax(1).eq(y).float().mean())},
        eval_every=4,
        on_step=_stop_after(stop_after),
        checkpoint=checkpoint,
    )
    return result, [p.detach().clone() for p in model.parameters()]


def _stop_after(step: int):
    def stop(i, _step):
        if i == step:
            raise Interrupted

    return stop


CASES = {
    "gep, a subspace every 3 steps spanning 2 past releases, augmented": (
        _config("gep", basis_refresh=3, past_releases=2),
        True,
    ),
    "gep, a subspace every step": (_config("gep", basis_refresh=1), False),
    "gp": (_config("gp"), False),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stop_after", [4, 7])
def test_a_run_interrupted_and_resumed_ends_exactly_as_the_unbroken_run(tmp_path, case, stop_after):
    config, aug = CASES[case]
    whole, whole_params = _train(config, aug=aug)
    checkpoint = Checkpoint(tmp_path / "run.ckpt", interval=0.0)
    with pytest.raises(Interrupted):
        _train(config, checkpoint, stop_after=stop_after, aug=aug)
    assert checkpoint.path.exists()
    resumed, resumed_params = _train(config, checkpoint, aug=aug)
    # saved after every step (interval 0) but the one interrupted in its callback
    assert resumed.resumed_at == stop_after - 1 and whole.resumed_at == 0
    assert all(torch.equal(a, b) for a, b in zip(whole_params, resumed_params, strict=True))
    assert resumed.accuracy == whole.accuracy
    assert resumed.history == whole.history
    # the ledger holds every step once: those before the checkpoint and those after it
    assert resumed.ledger.steps == whole.ledger.steps == STEPS
    assert resumed.ledger.epsilon() == pytest.approx(whole.ledger.epsilon(), rel=1e-12)
    assert not checkpoint.path.exists()  # removed when the run finished


def test_a_checkpoint_written_for_other_settings_is_refused_and_kept(tmp_path):
    config = _config("gep")
    checkpoint = Checkpoint(tmp_path / "run.ckpt", interval=0.0)
    with pytest.raises(Interrupted):
        _train(config, checkpoint, stop_after=5)
    before = checkpoint.path.read_bytes()
    with pytest.raises(ValueError, match="other data, settings or length"):
        _train(config, checkpoint, lr=0.2)
    assert checkpoint.path.read_bytes() == before


def test_an_unreadable_checkpoint_is_named_and_kept(tmp_path):
    checkpoint = Checkpoint(tmp_path / "run.ckpt", interval=0.0)
    checkpoint.path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read"):
        _train(_config("gep"), checkpoint)
    assert checkpoint.path.read_bytes() == b"not a checkpoint"


def test_a_real_runs_secret_randomness_is_never_written(tmp_path):
    # unseeded sampling and noise: the checkpoint holds neither, and a resumed run still
    # accounts every step
    checkpoint = Checkpoint(tmp_path / "run.ckpt", interval=0.0)
    with pytest.raises(Interrupted):
        _train(_config("gep"), checkpoint, stop_after=6, seeded=False)
    state = torch.load(checkpoint.path, weights_only=False)
    assert state["generators"] == [] and state["step"]["noise"] == {}
    resumed, _ = _train(_config("gep"), checkpoint, seeded=False)
    assert resumed.ledger.steps == STEPS


def test_a_save_waits_for_the_step_before_a_refresh_so_the_subspace_is_not_written(
    tmp_path, monkeypatch
):
    # a clock that advances one second per reading: with a 1.5 s interval a save is due
    # from step 2 on, and waits for step 3, after which the subspace is recomputed
    clock = itertools.count()
    monkeypatch.setattr(training, "_clock", lambda: float(next(clock)))
    checkpoint = Checkpoint(tmp_path / "run.ckpt", interval=1.5)
    with pytest.raises(Interrupted):
        _train(_config("gep", basis_refresh=3), checkpoint, stop_after=4)
    state = torch.load(checkpoint.path, weights_only=False)
    assert state["done"] == 3
    assert state["step"]["anchor_subspace"] is None


@pytest.mark.parametrize(
    "kwargs, named",
    [({"interval": -1.0}, "checkpoint interval"), ({"interval": float("nan")}, "interval"),
     ({"generators": (3,)}, "torch.Generators, got int")],
)  # fmt: skip
def test_bad_checkpoint_settings_are_named(tmp_path, kwargs, named):
    from gep_fed.validation import ConfigError

    with pytest.raises(ConfigError, match=named):
        Checkpoint(tmp_path / "run.ckpt", **kwargs)


def test_a_checkpoint_carries_no_digest_of_the_private_data(tmp_path):
    # two private data sets of one shape give one fingerprint: the file depends on the private
    # data only through the released (noised) state
    fingerprints = []
    for shift in (0.0, 1.0):
        path = tmp_path / f"{shift}.ckpt"
        x, y, public = _data()
        with pytest.raises(Interrupted):
            train_private(
                nn.Linear(12, 3),
                x + shift,
                y,
                public,
                _config("gp"),
                STEPS,
                OptimizerConfig(),
                generator=torch.Generator().manual_seed(1),
                noise=NoiseSource(2),
                on_step=_stop_after(3),
                checkpoint=Checkpoint(path, interval=0.0),
            )
        fingerprints.append(torch.load(path, weights_only=False)["fingerprint"])
    assert fingerprints[0] == fingerprints[1]
