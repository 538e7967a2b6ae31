"""Release observers: the two hooks of a private step, and who may attach them."""

import ast
from pathlib import Path

import pytest
import torch

from gep_fed import GEPConfig, GEPStep, PrivacyContract
from gep_fed.data.models import MLP
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.observer import Observers, ReleaseObserver

PACKAGE = Path(__file__).resolve().parents[1] / "gep_fed"


class Recorder(ReleaseObserver):
    """Watches the noisy releases only (post-processing)."""

    def __init__(self) -> None:
        self.releases = []

    def on_release(self, release) -> None:
        self.releases.append(release)


class Rows(ReleaseObserver):
    """Adds the same rows to every sample."""

    adds_rows = True

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        self.rates = []

    def extra_rows(self, subspace, sample_rate):
        self.rates.append(sample_rate)
        return self.rows


def _step(observers=()):
    torch.manual_seed(0)
    model = MLP(4, 3, hidden=())
    config = GEPConfig(PrivacyContract("gp", 1.0, 0.5, clip_norm=1.0))
    step = GEPStep(model, None, config, dataset_size=8, noise=NoiseSource(0), observers=observers)
    return model, step


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 4, generator=g), torch.randint(3, (4,), generator=g)


def test_an_observer_sees_every_noisy_release_and_changes_nothing():
    recorder = Recorder()
    model, step = _step([recorder])
    bare_model, bare = _step()
    for _ in range(2):
        step(*_batch())
        bare(*_batch())
    assert len(recorder.releases) == 2 and not step.observers.adds_rows
    release = recorder.releases[-1]
    assert release.sums.noised and release.mechanism is step.mechanism
    assert (release.noise_multiplier, release.sample_rate) == (1.0, 0.5)
    for p, q in zip(model.parameters(), bare_model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_rows_an_observer_adds_are_clipped_and_summed_with_the_sample():
    direction = torch.zeros(15)
    direction[2] = 1.0
    first, second = Rows(5.0 * direction[None]), Rows(3.0 * direction[None])
    _, step = _step([first, second])
    _, bare = _step()
    assert step.observers.adds_rows and len(step.observers) == 2
    added = step.clipped_sums([_batch()]).residual - bare.clipped_sums([_batch()]).residual
    # two rows, each clipped to (just under: the clip is conservative) S = 1
    torch.testing.assert_close(added, 2.0 * direction, atol=1e-3, rtol=0)
    assert float(added[2]) <= 2.0
    assert first.rates == second.rates == [0.5]


def test_an_observer_that_adds_rows_must_say_so():
    with pytest.raises(TypeError, match="adds_rows"):

        class Undeclared(ReleaseObserver):
            def extra_rows(self, subspace, sample_rate):
                return None

    with pytest.raises(TypeError, match="ReleaseObserver"):
        Observers([object()])


def test_no_production_module_imports_the_audit():
    """The audit builds on the trainers and the federation, never the reverse: only the
    audit itself and the command line (its ``gep-fed audit``) import ``gep_fed.audit``."""
    importers = []
    for path in PACKAGE.rglob("*.py"):
        part = path.relative_to(PACKAGE).parts[0]
        if part in ("audit", "cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if any(n == "gep_fed.audit" or n.startswith("gep_fed.audit.") for n in names):
                importers.append(str(path.relative_to(PACKAGE)))
    assert importers == []
