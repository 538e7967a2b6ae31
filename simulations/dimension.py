"""Does the excess risk of private logistic regression grow with the dimension d?

Logistic regression on random Fourier features of scikit-learn's digits (n = 1,437 train,
360 test), d in {64, 1024, 16384}, at a fixed epsilon: Langevin DP-SGD (single pass,
Ma-Marinov-Zhang), GP (DP-SGD) and GEP (anchors: the same features of bundled photograph
patches, random labels), against non-private training. Features are scaled to unit norm so
softmax cross-entropy is sqrt(2)-Lipschitz and 1-smooth: clipping at G = sqrt(2) changes nothing
and Langevin's convexity/smoothness assumptions hold (eta <= 2). Step sizes are chosen on a
validation split of the training set; the table reports test cross-entropy minus the
non-private model's.

    python -m simulations.dimension            # about 10 minutes on 2 CPU cores
    python -m simulations.dimension --dims 64 1024 --epsilon 2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gep_fed import MLP, GEPConfig, NoiseSource, calibrate_noise_multiplier
from gep_fed.data import load_digits, sample_photo_patches, validation_split
from gep_fed.langevin import LangevinConfig, LangevinTrainer, beta0_for_epsilon
from gep_fed.training import OptimizerConfig, train_nonprivate, train_private

G = math.sqrt(2.0)
DELTA = 1e-5


def features(images: np.ndarray, d: int, seed: int = 0) -> torch.Tensor:
    """Unit-norm random Fourier features of flattened 8x8 images."""
    rng = np.random.default_rng(seed)
    x = images.reshape(len(images), -1).astype(np.float32) / 255.0
    w = rng.normal(0, 1.0 / 2.0, size=(x.shape[1], d)).astype(np.float32)
    b = rng.uniform(0, 2 * np.pi, size=d).astype(np.float32)
    phi = np.cos(x @ w + b)
    phi /= np.linalg.norm(phi, axis=1, keepdims=True)
    return torch.from_numpy(phi)


def test_loss(model, x, y) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def run(method: str, d: int, eps: float, lr: float, data: dict, seed: int = 0) -> float:
    xtr, ytr, xev, yev = data["train"] + data["eval"]
    torch.manual_seed(seed)
    model = MLP(d, 10, hidden=())
    gen = torch.Generator().manual_seed(seed)
    n = len(xtr)
    if method == "nonprivate":
        train_nonprivate(
            model, xtr, ytr, 600, 64, OptimizerConfig(lr=lr, momentum=0.9), generator=gen
        )
    elif method == "langevin":
        beta0 = beta0_for_epsilon(eps, DELTA, lr, G, n)
        trainer = LangevinTrainer(
            model,
            LangevinConfig(eta=lr, grad_bound=G, beta0=beta0),
            noise=NoiseSource(seed + 1),
            generator=gen,
        )
        trainer.fit(xtr, ytr)
    else:
        q, steps = 64 / n, 300
        sigma = calibrate_noise_multiplier(eps, DELTA, q, steps, method)
        cfg = GEPConfig(
            mechanism=method,
            noise_multiplier=sigma,
            sample_rate=q,
            num_basis=64,
            clip_norm=G,
            clip_embedding=G,
            clip_residual=G / 2,
            basis_refresh=10,
        )
        train_private(
            model,
            xtr,
            ytr,
            data["public"],
            cfg,
            steps,
            OptimizerConfig(lr=lr, momentum=0.9),
            delta=DELTA,
            generator=gen,
            noise=NoiseSource(seed + 1),
        )
    return test_loss(model, xev, yev)


GRID = {
    "nonprivate": (0.5, 2.0, 8.0),
    "langevin": (0.02, 0.05, 0.1, 0.25, 1.0),
    "gp": (0.5, 2.0, 8.0),
    "gep": (0.5, 2.0, 8.0),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 1024, 16384])
    ap.add_argument("--epsilon", type=float, default=2.0)
    ap.add_argument("--out", default="simulations/results")
    args = ap.parse_args(argv)
    digits = load_digits()
    perm = np.random.default_rng(0).permutation(len(digits))
    train, test = digits.subset(perm[:1437]), digits.subset(perm[1437:])
    fit, val = validation_split(train, 0.25, seed=2)
    patches = sample_photo_patches(500, 8, seed=0)
    rows = []
    for d in args.dims:

        def data_for(tr, ev, d=d):
            return {
                "train": (features(tr.images, d), torch.from_numpy(tr.labels)),
                "eval": (features(ev.images, d), torch.from_numpy(ev.labels)),
                "public": features(patches, d),
            }

        tuning, final = data_for(fit, val), data_for(train, test)
        results = {}
        for method, lrs in GRID.items():
            began = time.perf_counter()
            best = min(lrs, key=lambda lr, m=method: run(m, d, args.epsilon, lr, tuning))
            results[method] = (
                best,
                run(method, d, args.epsilon, best, final),
                time.perf_counter() - began,
            )
            print(f"d={d} {method}: lr={best} test loss {results[method][1]:.4f}", flush=True)
        base = results["nonprivate"][1]
        for method, (lr, loss, secs) in results.items():
            rows.append(
                {
                    "d": d,
                    "method": method,
                    "lr": lr,
                    "test_loss": loss,
                    "excess": loss - base,
                    "seconds": secs,
                }
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Excess test loss vs dimension (digits random features, epsilon={args.epsilon}, "
        f"delta={DELTA})",
        "",
        "| d | method | chosen step size | test loss | excess |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['d']} | {r['method']} | {r['lr']} | {r['test_loss']:.4f} | {r['excess']:+.4f} |"
        for r in rows
    ]
    (out / "dimension.md").write_text("\n".join(lines) + "\n")
    (out / "dimension.json").write_text(json.dumps(rows, indent=1))
    _plot(rows, out / "dimension.png")
    print("\n".join(lines))
    return 0


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=100)
    for method in ("langevin", "gp", "gep"):
        pts = [(r["d"], r["excess"]) for r in rows if r["method"] == method]
        ax.plot(*zip(*pts, strict=True), marker="o", label=method)
    ax.set_xscale("log")
    ax.set_xlabel("dimension d")
    ax.set_ylabel("excess test loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
