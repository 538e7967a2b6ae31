"""Feature fronts carry to any image task by name, with no change to the task's file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from example_task import TwoFindingsTask
from torch import nn
from torch.utils.data import Dataset

from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.fronts import FrontedTask, build_task, front_size
from gep_fed.data.task import CheckedExamples, Task, TaskSettings
from gep_fed.federation.config import FederationConfig

pytest.importorskip("kymatio")


class Scans(Dataset):
    """RGB 40 x 40 images in [-1, 1] as a user's transform leaves them; example 3 is a
    truncated file, example 5 a grey image among colour ones."""

    def __init__(self, count: int, seed: int, clean: bool = False, side: int = 40) -> None:
        self.clean = clean
        rng = np.random.default_rng(seed)
        self.labels = rng.integers(0, 5, count)
        shape = (count, 3, side, side)
        self.images = torch.from_numpy(rng.uniform(-1, 1, shape).astype(np.float32))
        self.images += torch.from_numpy(self.labels.astype(np.float32)).view(-1, 1, 1, 1) / 5

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        if i == 3 and not self.clean:
            raise OSError("image file is truncated")
        x = self.images[i][:1] if i == 5 and not self.clean else self.images[i]
        return x, torch.tensor(int(self.labels[i]))


class GradedScans(Task):
    """A user's 5-grade RGB task whose own model is a small MLP."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 40 * 40, 5))

    def train_dataset(self) -> Dataset:
        return Scans(60, 0)

    def site_dataset(self, data_path: str) -> Dataset:
        return Scans(20, 1)

    def eval_dataset(self) -> Dataset:
        return Scans(30, 2, clean=True)

    def public_dataset(self) -> Dataset:
        return Scans(40, 3, clean=True)


class SmallScans(GradedScans):
    """The same task at 12 x 12 (a pretrained front's test that trains in a second)."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 12 * 12, 5))

    def eval_dataset(self) -> Dataset:
        return Scans(30, 2, clean=True, side=12)

    def public_dataset(self) -> Dataset:
        return Scans(40, 3, clean=True, side=12)


def test_front_names_wrap_a_users_task_and_leave_its_own_models_alone():
    settings = TaskSettings(model="scatter-linear")
    assert isinstance(build_task(GradedScans, settings), FrontedTask)
    assert isinstance(build_task(GradedScans, TaskSettings(model="public-pretrained")), FrontedTask)
    assert type(build_task(GradedScans, TaskSettings())) is GradedScans
    assert type(build_task(DigitsTask, settings)) is DigitsTask  # digits builds it itself


def test_any_size_and_channel_count_is_resized_then_scattered_once(monkeypatch, tmp_path):
    monkeypatch.setenv("GEP_FED_CACHE", str(tmp_path / "cache"))
    task = build_task(GradedScans, TaskSettings(model="scatter-linear"))
    assert (task.channels, task.size, task.num_outputs) == (3, (32, 32), 5)
    model = task.build_model()
    site = task.site_dataset("unused")
    x, y = site[0]
    assert x.shape == (243, 8, 8) and int(y) == int(Scans(20, 1).labels[0])
    assert model(x.unsqueeze(0)).shape == (1, 5)
    # the bad examples are kept as errors, and a site leaves them out of every sample
    checked = CheckedExamples.of(site, task.kind, model)
    assert [i for i in range(len(site)) if not checked[i][2]] == [3, 5]
    assert "truncated" in checked.problem(3) and "channels" in checked.problem(5)
    assert not (tmp_path / "cache").exists()  # never written to disk


def test_an_example_that_is_not_an_image_is_one_bad_example_of_a_front():
    """One (H, W) example made every read of the data set fail (a site could answer no
    round); it keeps its error alone, as an unreadable one does."""
    from gep_fed.data.formats import DataError
    from gep_fed.data.fronts import FrontDataset

    class OneFlat(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            x = torch.full((1, 4, 4), float(i))
            return (x[0] if i == 4 else torch.zeros(1, 0, 4) if i == 2 else x), i % 2

    front = FrontDataset(OneFlat(), lambda rows: torch.stack([r.flatten() for r in rows]), "t")
    assert front[5][0].tolist() == [5.0] * 16 and int(front[5][1]) == 1
    with pytest.raises(DataError, match=r"example 4 is not a \(C, H, W\) image"):
        front[4]
    with pytest.raises(DataError, match=r"example 2 is not .* shape \(1, 0, 4\)"):
        front[2]


def test_front_size_caps_each_side_and_rounds_to_a_multiple_of_four():
    assert front_size(224, 224) == (32, 32)
    assert front_size(28, 28) == (28, 28)
    assert front_size(30, 18) == (28, 16)
    assert front_size(8, 8) == (8, 8)


@pytest.mark.slow
def test_a_user_task_trains_on_scatter_features_by_name_in_a_simulation(tmp_path):
    from gep_fed.flower.simulation import simulate

    fed = FederationConfig(
        task="example_task:TwoFindingsTask",
        model="scatter-linear",
        num_public=100,
        num_anchors=100,
        num_basis=8,
        rounds=3,
        local_steps=1,
        sample_rate=0.2,
        server_lr=2.0,
        noise_seed=0,
        run_dir=str(tmp_path),
    )
    result = simulate(fed, progress=False, engine="in-process")
    assert result.stop_reason is None and len(result.metrics) == 3
    assert all(np.isfinite(row["test_loss"]) for row in result.metrics)
    task = fed.make_task()
    assert isinstance(task, FrontedTask) and task.kind == TwoFindingsTask.kind


def test_the_pretrained_front_learns_from_public_data_only_and_is_the_same_everywhere():
    from gep_fed.data import fronts

    first = build_task(SmallScans, TaskSettings(model="public-pretrained", seed=4))
    first.eval_dataset()[0]
    fronts._extractor_memo.clear()  # a site's own process trains its front itself
    fronts._features_memo.clear()
    again = build_task(SmallScans, TaskSettings(model="public-pretrained", seed=4))
    other = build_task(SmallScans, TaskSettings(model="public-pretrained", seed=5))
    a, b, c = (t.eval_dataset()[0][0] for t in (first, again, other))
    assert a.shape == (64,) and torch.equal(a, b) and not torch.equal(a, c)
    assert all(not p.requires_grad for p in first.extractor().parameters())
    head = first.build_model()
    assert [n for n, p in head.named_parameters() if p.requires_grad] == ["1.weight", "1.bias"]
