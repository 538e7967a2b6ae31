"""Write one private data file per site (``site-<i>.npz`` with ``images`` and ``labels``) by
partitioning a task's training set: trial data for a hospital federation on one machine.

    python deploy/make_site_data.py OUT_DIR [--task digits] [--num-sites 3] [--partition iid]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from gep_fed.data.partition import partition_indices
from gep_fed.data.task import TaskSettings
from gep_fed.data.tasks import BUILT_IN_TASKS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--task", default="digits", choices=sorted(BUILT_IN_TASKS))
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--num-sites", type=int, default=3)
    ap.add_argument("--partition", default="iid", choices=["iid", "dirichlet"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    task = BUILT_IN_TASKS[args.task](TaskSettings(data_dir=args.data_dir, seed=args.seed))
    images, labels = task.train
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = partition_indices(labels, args.num_sites, args.partition, seed=args.seed)
    for i, idx in enumerate(parts):
        np.savez(out / f"site-{i}.npz", images=images[idx], labels=labels[idx])
        print(f"{out / f'site-{i}.npz'}: {len(idx)} examples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
