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
from gep_fed.data.tasks import TASKS, load_task


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--task", default="digits", choices=TASKS)
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--num-sites", type=int, default=3)
    ap.add_argument("--partition", default="iid", choices=["iid", "dirichlet"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    task = load_task(args.task, args.data_dir, seed=args.seed)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = partition_indices(task.train.labels, args.num_sites, args.partition, seed=args.seed)
    for i, idx in enumerate(parts):
        site = task.train.subset(idx)
        np.savez(out / f"site-{i}.npz", images=site.images, labels=site.labels)
        print(f"{out / f'site-{i}.npz'}: {len(site)} examples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
