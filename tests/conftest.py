"""Shared fixtures: the real data sets of ../shared/data, skipped with a reason when absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # Each worker gets its share of the cores, and so do the processes it starts (Flower
    # simulations, SuperNodes, CLI runs): oversubscribed OpenMP threads spin against each other.
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("OMP_NUM_THREADS", _threads)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Under `--dist loadfile` a file is one unit of work, handed out in collection order
# (`--no-loadscope-reorder`: xdist would otherwise put files with the most tests first, and
# these few long end-to-end tests last, where one worker runs them while the other waits).
LONGEST_FIRST = (
    "test_deployment.py",
    "test_app_pinning.py",
    "test_cli.py",
    "test_flwr_run.py",
    "test_simulation.py",
    "test_tune.py",
    "test_tasks.py",
    "test_hospital_run.py",
    "test_audit.py",
    "test_flower_app.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep order


SHARED_DATA = Path(
    os.environ.get("GEP_FED_SHARED_DATA", Path(__file__).parents[1] / ".." / "shared" / "data")
).resolve()


def shared_file(relative: str) -> Path:
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(
            f"needs the real data file {path} (../shared/data beside the checkout); absent here"
        )
    return path


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
