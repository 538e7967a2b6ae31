"""A site's peak memory does not grow with its data set: N = 10,000 vs 100,000 PNG images.

Each N gets a synthetic ImageFolder on disk (32x32 grey PNGs, two classes). A fresh process per
N builds the site exactly as a deployed site does (the task's ``site_dataset`` on the folder,
``Site`` with its ledger) and runs client-side GEP steps whose Poisson samples hold about 64
images whatever N is (q = 64 / N); it reports its peak resident memory (VmHWM). Only the index
arrays (the file list and labels) may grow with N.

    python benchmarks/site_memory.py                  # about 3 minutes on 2 cores
    python benchmarks/site_memory.py --sizes 10000 100000 --steps 5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"
CACHE = Path("/tmp/gep-fed-site-memory")


def make_folder(n: int, root: Path) -> Path:
    """``n`` random 32x32 grey PNGs in ``root/{a,b}/``, written once and reused."""
    from PIL import Image

    folder = root / f"n{n}"
    if (folder / "done").exists():
        return folder
    rng = np.random.default_rng(n)
    for name in ("a", "b"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        pixels = rng.integers(0, 256, (32, 32), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / ("a" if i % 2 else "b") / f"{i:07d}.png")
    (folder / "done").write_text("ok")
    return folder


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(folder: str, steps: int) -> dict:
    """Runs in its own process: build the site on ``folder`` and take ``steps`` steps."""
    import tempfile

    import torch

    from gep_fed.accounting.ledger import PrivacyLedger
    from gep_fed.data.formats import ImageFolderDataset, ImageTransform
    from gep_fed.data.models import MnistCNN
    from gep_fed.data.task import ArrayImageDataset, Task
    from gep_fed.federation.config import FederationConfig
    from gep_fed.federation.policy import SitePolicy
    from gep_fed.federation.rundir import RunDirectory
    from gep_fed.federation.server import FederationServer
    from gep_fed.federation.site import Site

    torch.set_num_threads(1)

    class FolderTask(Task):
        def build_model(self):
            return MnistCNN(1, 2, image_size=32)

        def site_dataset(self, data_path):
            return ImageFolderDataset(data_path, ImageTransform(mean=0.5, std=0.25))

        def eval_dataset(self):
            rng = np.random.default_rng(0)
            images = rng.integers(0, 256, (64, 32, 32), dtype=np.uint8)
            return ArrayImageDataset(images, np.arange(64) % 2, 0.5, 0.25)

        public_dataset = eval_dataset

    baseline = peak_rss_mib()
    task = FolderTask()
    data = task.site_dataset(folder)
    n = len(data)
    fed = FederationConfig(
        mode="client",
        num_basis=32,
        num_public=64,
        sample_rate=64 / n,
        local_steps=steps,
        noise_multiplier=2.0,
        run_dir=tempfile.mkdtemp(),
        run_name="r",
    )
    run = RunDirectory(fed.run_directory(0))
    run.path.mkdir(parents=True)
    server = FederationServer(fed, task, run, total_examples=None)
    plan = server.plan_round(1)
    site = Site(
        "s",
        task.build_model(),
        data,
        SitePolicy(100.0, 1e-5),
        ledger=PrivacyLedger(1e-5, 100.0, "s"),
        max_chunk=32,
    )
    site.load_state(server.model.state_dict())
    began = time.perf_counter()
    site.run_round(plan.config, server.subspace)
    return {
        "n": n,
        "steps": steps,
        "peak_rss_mib": peak_rss_mib(),
        "after_imports_mib": baseline,
        "seconds_per_step": (time.perf_counter() - began) / steps,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.steps)))
        return 0
    rows = []
    for n in args.sizes:
        began = time.perf_counter()
        folder = make_folder(n, CACHE)
        made = time.perf_counter() - began
        out = subprocess.run(
            [sys.executable, __file__, "--measure", str(folder), "--steps", str(args.steps)],
            capture_output=True,
            text=True,
            check=True,
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["folder_seconds"] = made
        rows.append(row)
        print(row, flush=True)
    base = rows[0]["peak_rss_mib"]
    lines = [
        "# Site memory against data set size",
        "",
        f"`python benchmarks/site_memory.py --sizes {' '.join(map(str, args.sizes))} "
        f"--steps {args.steps}`: ImageFolder of 32x32 grey PNGs on disk, MNIST-style CNN, "
        "client-side GEP, q = 64 / N (about 64 images per step), max_chunk 32, one thread, "
        "one process per N.",
        "",
        "| N images | peak RSS (MiB) | vs smallest | after imports (MiB) | s / step |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['n']:,} | {r['peak_rss_mib']:.0f} | {r['peak_rss_mib'] - base:+.0f} | "
        f"{r['after_imports_mib']:.0f} | {r['seconds_per_step']:.2f} |"
        for r in rows
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "site_memory.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "site_memory.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
