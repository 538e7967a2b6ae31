"""Diagnostic, not private: a standard-benchmark tuning setting trained with sigma = 0 (clipping
alone, the same Poisson batches and steps), to tell how much of a private run's accuracy the
noise costs. If clipping alone is no better than the noised run, the noise is not what limits
the model at that length, and a mechanism with less noise (GEP) has nothing to gain there.

    python benchmarks/noise_free.py --dataset cifar10 --features raw --grid resnet --tan 8 \\
        --runs gp:1 gep:2

Each ``method:index`` is a setting of the grid (``standard_grids.toml``); results are appended
to ``<out>/<dataset>_noise_free.jsonl``, labelled not private, and never enter the standard
table's selection.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import standard
import torch


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--runs" not in argv:
        raise SystemExit("give --runs METHOD:INDEX ... (settings of the grid to run noise-free)")
    at = argv.index("--runs")
    runs, rest = argv[at + 1 :], argv[:at]
    args = standard.parse_args(rest)
    torch.set_num_threads(args.threads)
    grids = standard.GRIDS[(args.features, args.grid)]
    # sigma = 0 everywhere the benchmark calibrates it; its epsilon is then infinite
    standard.calibrate_noise_multiplier = lambda *a, **k: 0.0
    standard.epsilons = lambda *a, **k: (float("inf"), float("inf"))
    data = standard.Data(args)
    out = Path(args.out) / f"{args.dataset}_noise_free.jsonl"
    chosen = []
    sizes = ", ".join(f"{m}: 0-{len(s) - 1}" for m, s in grids.items())
    for run in runs:
        method, _, index = run.partition(":")
        if method not in grids or not index.isdigit() or int(index) >= len(grids[method]):
            raise SystemExit(f"--runs {run!r}: give METHOD:INDEX of grid {args.grid!r} ({sizes})")
        chosen.append((method, grids[method][int(index)]))
    for method, setting in chosen:
        began = time.perf_counter()
        rec = standard.run_one(args, data, method, setting, "tune")
        row = {
            "method": method,
            "features": args.features,
            "head": standard.model_label(args),
            "setting": setting,
            "tan": args.tan,
            "seed": args.seed,
            "sigma": 0.0,
            "accuracy": rec["accuracy"],
            "seconds": time.perf_counter() - began,
            "diagnostic": "noise-free (clipping alone): not private",
        }
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
