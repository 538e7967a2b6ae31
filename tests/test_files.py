"""Files several processes may write at once: whole or not at all, and no writer fails
(issue 24: two workers computing the same ScatterNet features wrote one temporary file)."""

import multiprocessing

import numpy as np
import pytest
import torch

from gep_fed.data.scatternet import scatter_features
from gep_fed.files import write_atomically


def _features(cache_dir: str, barrier, results) -> None:
    images = np.random.default_rng(0).integers(0, 256, (2000, 16, 16), dtype=np.uint8)
    barrier.wait()  # all compute and write at the same moment
    try:
        results.put(float(scatter_features(images, cache_dir=cache_dir).sum()))
    except Exception as err:  # reported to the test, not lost in a child's stderr
        results.put(repr(err))


@pytest.mark.slow
def test_processes_computing_the_same_cached_features_at_once_all_succeed(tmp_path):
    """Several real processes, released together by a barrier (a race: the old fixed
    temporary name failed here in some runs, not all)."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    workers = [
        context.Process(target=_features, args=(str(tmp_path), barrier, results)) for _ in range(2)
    ]
    for w in workers:
        w.start()
    sums = [results.get(timeout=300) for _ in workers]
    for w in workers:
        w.join()
    assert all(isinstance(s, float) for s in sums), sums
    assert len(set(sums)) == 1
    cached = list(tmp_path.iterdir())
    assert len(cached) == 1 and cached[0].suffix == ".pt"  # no temporary file left behind
    assert float(torch.load(cached[0], weights_only=True).sum()) == sums[0]


def test_a_writer_that_starts_while_another_is_writing_the_same_file_does_not_fail_it(tmp_path):
    """Deterministic interleaving: B writes the whole file while A is halfway through. With
    one shared temporary name B's rename takes A's file away and A fails; here both succeed
    and the file is one writer's whole content."""
    target = tmp_path / "features.pt"

    def a(fh):
        fh.write(b"A" * 1000)
        write_atomically(target, lambda other: other.write(b"B" * 1000))
        fh.write(b"A" * 1000)

    write_atomically(target, a)
    assert target.read_bytes() == b"A" * 2000
    assert list(tmp_path.iterdir()) == [target]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "f.json"
    target.write_text("old")

    def fail(fh):
        fh.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, fail)
    assert target.read_text() == "old" and list(tmp_path.iterdir()) == [target]


def test_a_writers_own_error_is_an_os_error_naming_the_file(tmp_path):
    """torch.save turns a full disk into a RuntimeError of its own ("unexpected pos"), which
    reached the user as a 40-line traceback naming no file."""
    target = tmp_path / "checkpoint.pt"

    def fail(fh):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2496")

    with pytest.raises(OSError, match=r"cannot write .*checkpoint\.pt: \[enforce fail"):
        write_atomically(target, fail)
    assert list(tmp_path.iterdir()) == []
