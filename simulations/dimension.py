"""Does the excess risk of private logistic regression grow with the dimension d?

Logistic regression on random Fourier features of scikit-learn's digits (n = 1,437 train,
360 test), d in {64, 1024, 16384}, at epsilon <= 2: Langevin DP-SGD (Ma-Marinov-Zhang) in both
schedules, GP (DP-SGD) and GEP (anchors: the same features of bundled photograph patches,
random labels), against non-private training. Every method has the same model, a linear layer
*without bias*, on features of norm <= 1: softmax cross-entropy's per-example gradient is then
at most G = sqrt(2) and its smoothness L <= 1/2. With a bias the gradient reaches 2 (and L 1),
so G = sqrt(2) would bind, which can make a step expansive and voids single-pass Langevin's
proof; dropping the bias keeps the clip norm of the earlier runs, and the ten balanced digit
classes need no intercept. So no clip at G binds (GEP's residual clip at G/2 may), and
single-pass Langevin's conditions hold (eta <= 2 / L = 4; the trainer checks them).

The epsilons are not all of one kind. GP, GEP and multi-pass Langevin are private against
adding or removing one example (every iterate of multi-pass is released); single-pass
Langevin's last iterate only, against replacing one example. Multi-pass Langevin's privacy
does not depend on beta0 or G (Theorem 2's steps scale with sqrt(beta0) / G), only on n, the
batch size and the number of steps: 10,000 steps spend epsilon ~0.02 and reaching 2 would take
~1.5 x 10^8, so it runs 10,000 steps and the table reports the epsilon it spent. Each method's
knobs (step size; for multi-pass Langevin beta0 and the batch size) are chosen on a validation
split of the training set; the test split is used once per method. The table reports test
cross-entropy minus the non-private model's, and the seconds each method took (tuning and
final run).

    python -m simulations.dimension            # about 7 minutes on 2 CPU cores
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
from torch import nn

from gep_fed import GEPConfig, PrivacyContract
from gep_fed.data.datasets import load_digits, sample_photo_patches, validation_split
from gep_fed.mechanisms.langevin import LangevinConfig, LangevinTrainer, beta0_for_epsilon
from gep_fed.mechanisms.mechanism import calibrate_noise_multiplier
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.training import OptimizerConfig, train_nonprivate, train_private

FEATURE_NORM = 1.0
G = math.sqrt(2.0) * FEATURE_NORM  # the largest gradient norm without bias: no clip binds
DELTA = 1e-5
MULTI_PASS_STEPS = 10_000


def features(images: np.ndarray, d: int, seed: int = 0) -> torch.Tensor:
    """Random Fourier features of flattened 8x8 images, of norm just under FEATURE_NORM (the
    margin keeps float32 rounding from lifting a norm above the declared bound)."""
    rng = np.random.default_rng(seed)
    x = images.reshape(len(images), -1).astype(np.float32) / 255.0
    w = rng.normal(0, 1.0 / 2.0, size=(x.shape[1], d)).astype(np.float32)
    b = rng.uniform(0, 2 * np.pi, size=d).astype(np.float32)
    phi = np.cos(x @ w + b).astype(np.float64)
    phi *= FEATURE_NORM * (1 - 1e-6) / np.linalg.norm(phi, axis=1, keepdims=True)
    return torch.from_numpy(phi.astype(np.float32))


def test_loss(model, x, y) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def run(method: str, d: int, eps: float, knob, data: dict, seed: int = 0) -> tuple[float, float]:
    """Train ``method`` with ``knob`` (a step size; for multi-pass Langevin ``(beta0, batch)``)
    on ``data["train"]``; returns the cross-entropy on ``data["eval"]`` and the epsilon spent."""
    xtr, ytr, xev, yev = data["train"] + data["eval"]
    torch.manual_seed(seed)
    model = nn.Linear(d, 10, bias=False)
    gen = torch.Generator().manual_seed(seed)
    n = len(xtr)
    spent = math.inf
    if method == "nonprivate":
        train_nonprivate(
            model, xtr, ytr, 600, 64, OptimizerConfig(lr=knob, momentum=0.9), generator=gen
        )
    elif method.startswith("langevin"):
        if method == "langevin single-pass":
            config = LangevinConfig(
                eta=knob,
                grad_bound=G,
                beta0=beta0_for_epsilon(eps, DELTA, knob, G, n),
                feature_norm_bound=FEATURE_NORM,
            )
        else:
            beta0, batch = knob
            config = LangevinConfig(
                schedule="multi-pass",
                grad_bound=G,
                beta0=beta0,
                steps=MULTI_PASS_STEPS,
                batch=batch,
                delta=DELTA,
            )
        trainer = LangevinTrainer(model, config, noise=NoiseSource(seed + 1), generator=gen)
        trainer.fit(xtr, ytr)
        spent = trainer.ledger.epsilon()
        if config.schedule == "multi-pass" and spent > eps:  # not calibrated: check the target
            raise RuntimeError(f"{method} spent epsilon={spent:.4g} > {eps}")
    else:
        q, steps = 64 / n, 300
        sigma = calibrate_noise_multiplier(eps, DELTA, q, steps, method)
        cfg = GEPConfig(
            PrivacyContract(method, sigma, q, clip_embedding=G, clip_residual=G / 2, clip_norm=G),
            num_basis=64,
            basis_refresh=10,
        )
        spent = train_private(
            model,
            xtr,
            ytr,
            data["public"],
            cfg,
            steps,
            OptimizerConfig(lr=knob, momentum=0.9),
            delta=DELTA,
            generator=gen,
            noise=NoiseSource(seed + 1),
        ).epsilon
    return test_loss(model, xev, yev), spent


GRID = {
    "nonprivate": (0.5, 2.0, 8.0),
    "langevin single-pass": (0.02, 0.05, 0.1, 0.25, 1.0),
    "langevin multi-pass": tuple((beta0, b) for beta0 in (0.01, 0.1, 1.0) for b in (1, 16)),
    "gp": (0.5, 2.0, 8.0),
    "gep": (0.5, 2.0, 8.0),
}
KNOB_NAMES = {"langevin single-pass": "eta", "langevin multi-pass": "beta0, batch"}
ADJACENCY = {"nonprivate": "-", "langevin single-pass": "replace-one"}


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
        for method, knobs in GRID.items():
            began = time.perf_counter()
            best = min(knobs, key=lambda k, m=method: run(m, d, args.epsilon, k, tuning)[0])
            loss, spent = run(method, d, args.epsilon, best, final)
            results[method] = (best, loss, spent, time.perf_counter() - began)
            print(f"d={d} {method}: {best} test loss {loss:.4f} eps {spent:.4g}", flush=True)
        base = results["nonprivate"][1]
        for method, (knob, loss, spent, secs) in results.items():
            rows.append(
                {
                    "d": d,
                    "method": method,
                    "adjacency": ADJACENCY.get(method, "add-remove"),
                    "knob": f"{KNOB_NAMES.get(method, 'lr')}={knob}",
                    "epsilon": spent if math.isfinite(spent) else None,
                    "test_loss": loss,
                    "excess": loss - base,
                    "seconds": secs,
                }
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Excess test loss vs dimension (digits random features, epsilon <= {args.epsilon}, "
        f"delta={DELTA})",
        "",
        "Linear model without bias, features of norm <= 1, G = sqrt(2). Adjacency: the "
        "neighbouring data sets each epsilon is against (replace-one: single-pass Langevin's "
        f"last iterate only). Multi-pass Langevin runs {MULTI_PASS_STEPS} steps of Theorem 2's "
        "schedule and spends the epsilon shown. Seconds: tuning and final run.",
        "",
        "| d | method | adjacency | chosen knobs | epsilon | test loss | excess | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['d']} | {r['method']} | {r['adjacency']} | {r['knob']} | "
        f"{'-' if r['epsilon'] is None else format(r['epsilon'], '.3g')} | "
        f"{r['test_loss']:.4f} | {r['excess']:+.4f} | {r['seconds']:.0f} |"
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

    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=100)
    for method in GRID:
        if method == "nonprivate":
            continue
        pts = [(r["d"], r["excess"]) for r in rows if r["method"] == method]
        ax.plot(*zip(*pts, strict=True), marker="o", label=method)
    ax.set_xscale("log")
    ax.set_xlabel("dimension d")
    ax.set_ylabel("excess test loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
