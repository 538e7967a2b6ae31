"""The README's library example runs as written (on small real data, fewer steps)."""

import re
from pathlib import Path

import numpy as np
import torch

from gep_fed.data.datasets import load_digits

README = Path(__file__).parents[1] / "README.md"


def test_the_readme_library_example_runs_and_spends_its_budget_over_its_steps():
    code = re.search(r"```python\n(.*?)```", README.read_text(), flags=re.S).group(1)
    assert "private_step(" in code and "steps=900" in code
    digits = load_digits()  # 8x8 digits padded to 28x28: MnistCNN's input
    images = np.zeros((len(digits.images), 28, 28), np.float32)
    images[:, 10:18, 10:18] = digits.images / 255.0
    x = torch.from_numpy(images)[:, None]
    y = torch.from_numpy(digits.labels.astype(np.int64))
    namespace = {"train_x": x[:1000], "train_y": y[:1000], "public_x": x[1000:1100]}
    # the same program with 3 steps planned (calibrated for 3, so the budget is spent by them)
    exec(code.replace("steps=900", "steps=3").replace("num_basis=200", "num_basis=20"), namespace)
    step = namespace["step"]
    assert step.ledger.steps == 3
    assert abs(step.ledger.epsilon() - 2.0) < 0.01
    assert all(p.grad is not None for p in step.model.parameters())


def test_the_readmes_fast_tier_installs_pytest_before_running_it():
    text = " ".join(README.read_text().split())
    (fast,) = re.findall(r"`([^`]*-m \"not slow and not audit\"[^`]*)`", text)
    install, _, run = fast.partition("&&")
    assert "pip install" in install and "'.[test]'" in install and "pytest" in run


def test_the_task_guide_names_every_built_in_task():
    from gep_fed.data.registry import BUILT_IN_TASKS

    guide = (README.parent / "docs" / "tasks.md").read_text()
    intro = " ".join(guide.split("## What a task provides")[0].split())
    listed = re.search(r"The built-in tasks \(([^)]*)\)", intro).group(1)
    assert re.findall(r"`([^`]+)`", listed) == list(BUILT_IN_TASKS)
