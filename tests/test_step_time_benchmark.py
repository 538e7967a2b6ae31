"""The step-time benchmark builds and runs every method it reports (it broke silently once
when the mechanisms' interface changed)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import step_time


def test_every_method_of_the_step_time_benchmark_runs_a_step():
    steps, _, params, failures, embedding_product, _ = step_time.make_steps(
        "cnn", torch.device("cpu"), num_anchors=16, max_chunk=256, anchors=False
    )
    assert params == 28_938
    assert set(steps) | set(failures) == set(step_time.METHODS)
    for name, step in steps.items():
        step()
        assert not failures, f"{name}: {failures}"
    embedding_product()
