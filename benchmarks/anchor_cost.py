"""Accuracy against anchor-subspace cost: reuse the basis for R steps, use m anchors.

Centralised MNIST (the fixed split; tuned on the validation split, never the test split),
GEP at epsilon 2 with the MNIST benchmark's chosen clip norms, 5 epochs, seeds fixed.

    python benchmarks/anchor_cost.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, mnist_data, save

from gep_fed import GEPConfig, PrivacyContract, calibrate_noise_multiplier
from gep_fed.data.metrics import evaluate
from gep_fed.data.models import MnistCNN
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.training import OptimizerConfig, train_private

SETTINGS = [(1, 2000), (5, 2000), (20, 2000), (1, 500), (5, 500), (20, 500)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--epsilon", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = mnist_data()
    x, y = data["fit"]
    q = 256 / len(x)
    steps = round(args.epochs / q)
    sigma = calibrate_noise_multiplier(args.epsilon, 1e-5, q, steps, "gep")
    rows = []
    for refresh, anchors in SETTINGS:
        torch.manual_seed(0)
        cfg = GEPConfig(
            PrivacyContract("gep", sigma, q, clip_embedding=0.25, clip_residual=0.05),
            num_basis=200,
            num_anchors=anchors,
            basis_refresh=refresh,
        )
        began = time.perf_counter()
        res = train_private(
            MnistCNN(),
            x,
            y,
            data["public"],
            cfg,
            steps,
            OptimizerConfig(lr=0.5),
            generator=torch.Generator().manual_seed(0),
            noise=NoiseSource(1),
            evaluate_fn=lambda m: evaluate(m, data["val"], "multiclass"),
        )
        secs = time.perf_counter() - began
        rows.append(
            {
                "refresh": refresh,
                "anchors": anchors,
                "val_accuracy": res.accuracy,
                "seconds": secs,
                "refreshes": -(-steps // refresh),
            }
        )
        print(rows[-1], flush=True)
    lines = [
        f"# Anchor cost vs accuracy (MNIST fit/val, GEP, epsilon={args.epsilon}, "
        f"{args.epochs} epochs = {steps} steps, k=200)",
        "",
        "| refresh every R steps | anchors m | refreshes | train seconds | val accuracy |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['refresh']} | {r['anchors']} | {r['refreshes']} | {r['seconds']:.0f} | "
        f"{r['val_accuracy']:.4f} |"
        for r in rows
    ]
    report = "\n".join(lines) + "\n"
    (RESULTS / "anchor_cost.md").write_text(report)
    save("anchor_cost", {"rows": rows})
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
