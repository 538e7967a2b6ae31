"""Splitting a pooled data set across sites: IID or Dirichlet(alpha) label skew.

Uses flwr-datasets' partitioners (the maintained implementations) on the label column.
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import numpy as np

PARTITIONS = ("iid", "dirichlet")


def partition_indices(
    labels: np.ndarray,
    num_sites: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    min_size: int = 10,
) -> list[np.ndarray]:
    """Indices of each site's examples; disjoint, covering every example.

    Args:
        labels: the pooled data set's labels.
        scheme: "iid" (random equal shares) or "dirichlet" (each class split across sites in
            Dirichlet(alpha) proportions; smaller alpha, more skew).
        min_size: Dirichlet draws are repeated until every site has at least this many.
    """
    if scheme not in PARTITIONS:
        raise ValueError(f"partition must be one of {list(PARTITIONS)}, got {scheme!r}")
    if num_sites < 1:
        raise ValueError(f"num_sites must be >= 1, got {num_sites}")
    if len(labels) < fewest_examples(num_sites, scheme, min_size):
        raise ValueError(f"{len(labels)} examples cannot be split across {num_sites} sites")
    if scheme == "dirichlet" and not alpha > 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
    labels = np.ascontiguousarray(labels)
    args = (num_sites, scheme, alpha, seed, min_size)
    if labels.dtype.hasobject:  # no byte image to key on
        return _split(labels, *args)
    parts = _partition(labels.tobytes(), labels.dtype.str, labels.shape, *args)
    return [part.copy() for part in parts]


def fewest_examples(num_sites: int, scheme: str, min_size: int = 10) -> int:
    """The fewest examples ``partition`` splits across ``num_sites`` sites by ``scheme``."""
    return num_sites * max(1, min_size if scheme == "dirichlet" else 1)


# Every simulated site of a run asks for the same split of the same labels (Dirichlet over
# 60,000 labels takes seconds), so a process computes each split once.
@lru_cache(maxsize=8)
def _partition(label_bytes: bytes, dtype: str, shape: tuple[int, ...], *args) -> list[np.ndarray]:
    return _split(np.frombuffer(label_bytes, dtype=dtype).reshape(shape), *args)


def _split(
    labels: np.ndarray, num_sites: int, scheme: str, alpha: float, seed: int, min_size: int
) -> list[np.ndarray]:
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    perm = np.random.default_rng(seed).permutation(len(labels))
    table = Dataset.from_dict({"label": np.asarray(labels)[perm], "index": perm})
    if scheme == "iid":
        partitioner = IidPartitioner(num_partitions=num_sites)
    else:
        partitioner = DirichletPartitioner(
            num_partitions=num_sites,
            partition_by="label",
            alpha=alpha,
            min_partition_size=min_size,
            self_balancing=False,
            seed=seed,
        )
    partitioner.dataset = table
    # the index column read at once (iterating a column reads it row by row)
    with warnings.catch_warnings():  # Flower warns at each failed draw; the error below says it
        warnings.simplefilter("ignore", UserWarning)
        try:
            return [
                np.sort(
                    partitioner.load_partition(i).with_format("numpy")[:]["index"].astype(np.int64)
                )
                for i in range(num_sites)
            ]
        except ValueError as err:  # Flower's Dirichlet partitioner gave up
            if scheme != "dirichlet":
                raise
            raise ValueError(
                f"a Dirichlet split with alpha {alpha:g} gave no {num_sites} shares of at least "
                f"{min_size} examples each from {len(labels)} examples in 10 draws ({err}): "
                "raise dirichlet_alpha, or use fewer sites"
            ) from None
