"""Write each site's private data by partitioning a built-in task's training set: trial data
for a hospital federation on one machine.

    python deploy/make_site_data.py OUT_DIR [--task digits] [--num-sites 3] [--format npz]
    python deploy/make_site_data.py OUT_DIR --task pneumonia --format png

``--format npz`` writes ``site-<i>.npz`` (``images``, ``labels``); ``--format png`` writes one
ImageFolder per site, ``site-<i>/<class>/<index>.png``, as hospitals store images. Each site's
output is written to a temporary name and renamed into place when complete, so an interrupted
run leaves no half-written site.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from gep_fed.data.partition import partition_indices
from gep_fed.data.registry import BUILT_IN_TASKS
from gep_fed.data.task import TaskSettings

CLASS_NAMES = {"pneumonia": ("normal", "pneumonia"), "medmnist": None}


def class_names(task: str, num_classes: int) -> list[str]:
    """Folder names per class: the task's own where it has them, else the class index."""
    return list(CLASS_NAMES.get(task) or [str(c) for c in range(num_classes)])


def write_png_folder(target: Path, images: np.ndarray, labels: np.ndarray, names) -> None:
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    for name in names:
        (partial / name).mkdir(parents=True)
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        Image.fromarray(image).save(partial / names[int(label)] / f"{i:06d}.png")
    if target.exists():  # a folder cannot be replaced in one rename: move the old one aside
        old = target.with_name(target.name + ".old")
        os.replace(target, old)
        os.replace(partial, target)
        shutil.rmtree(old)
    else:
        os.replace(partial, target)


def write_npz(target: Path, images: np.ndarray, labels: np.ndarray) -> None:
    partial = target.with_name(target.name + ".partial.npz")
    np.savez(partial, images=images, labels=labels)  # uncompressed: a site memory-maps it
    os.replace(partial, target)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--task", default="digits", choices=sorted(BUILT_IN_TASKS))
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--num-sites", type=int, default=3)
    ap.add_argument("--partition", default="iid", choices=["iid", "dirichlet"])
    ap.add_argument("--format", default="npz", choices=["npz", "png"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    task = BUILT_IN_TASKS[args.task](TaskSettings(data_dir=args.data_dir, seed=args.seed))
    images, labels = task.train
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = partition_indices(labels, args.num_sites, args.partition, seed=args.seed)
    names = class_names(args.task, task.num_classes)
    for i, idx in enumerate(parts):
        if args.format == "png":
            target = out / f"site-{i}"
            write_png_folder(target, images[idx], labels[idx], names)
        else:
            target = out / f"site-{i}.npz"
            write_npz(target, images[idx], labels[idx])
        print(f"{target}: {len(idx)} examples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
