"""Diagnostic, not private: how much of the private gradient GEP's anchor subspace holds
along a run of the standard benchmark, and how hard each part is clipped. GEP removes noise
only from the embedding; the residual is released with a noise multiplier sqrt(2) times
DP-SGD's, so GEP can win only where the subspace holds most of the private gradient.

A GEP tuning setting of the grid (default: its validation winner in the log) is trained as
``benchmarks/standard.py --stage tune`` trains it (same split, TAN, seed: the run's validation
accuracy matches the logged one). Every ``--every`` steps, right after the step, on a fixed
probe of private fit images: the share of the per-example gradients' energy outside the
current subspace, and the shares of examples whose embedding exceeds S1 and whose residual
exceeds S2 (clipped). These are computed from private data without noise: they are printed
and logged for this benchmark only, never released by a site.

    python benchmarks/subspace_capture.py --dataset cifar10 --features raw --grid resnet \\
        --tan 8 --every 40
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import standard
import torch

from gep_fed import GEPConfig, PrivacyContract
from gep_fed.data.metrics import evaluate
from gep_fed.mechanisms import calibrate_noise_multiplier
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.per_example import per_example_gradients
from gep_fed.training import train_private


def probe_stats(step, x, y, s1: float, s2: float) -> dict:
    """Projection error and clip activity of the probe's per-example gradients."""
    grads = per_example_gradients(
        step.model, step.loss_fn, x, y, step.layout, step.config.max_chunk, step.config.engine
    ).double()
    emb = step.subspace.embed(grads)
    g2 = torch.linalg.vector_norm(grads, dim=1) ** 2
    w = torch.linalg.vector_norm(emb, dim=1)
    r = (g2 - w**2).clamp_min(0).sqrt()
    return {
        "projection_error": float((r**2).sum() / g2.sum()),
        "embedding_clipped": float((w > s1).double().mean()),
        "residual_clipped": float((r > s2).double().mean()),
        "median_embedding_norm": float(w.median()),
        "median_residual_norm": float(r.median()),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    options = {"--every": "40", "--probe": "500", "--index": None}
    for name in options:
        if name in argv:
            at = argv.index(name)
            options[name] = argv[at + 1]
            del argv[at : at + 2]
    args = standard.parse_args(argv)
    torch.set_num_threads(args.threads)
    grid = standard.GRIDS[(args.features, args.grid)]["gep"]
    if options["--index"] is None:
        logged = {r["key"]: r for r in standard.read_log(args.dataset, Path(args.out))}
        tuned = [(logged.get(standard.run_key(args, "gep", s, "tune")), s) for s in grid]
        if any(r is None for r, _ in tuned):
            raise SystemExit("the GEP grid is not fully tuned in the log: give --index")
        _, setting = max(tuned, key=lambda rs: rs[0]["accuracy"])
        print(f"the validation winner: {standard.fmt_setting('gep', setting)}", flush=True)
    else:
        setting = grid[int(options["--index"])]
    every, probe = int(options["--every"]), int(options["--probe"])

    data = standard.Data(args)
    x, y = data.split("fit")
    x_probe, y_probe = x[:probe], y[:probe]
    val = data.split("val")
    q, steps = standard.schedule(len(x), setting["batch"], setting["epochs"])
    sigma = calibrate_noise_multiplier(args.epsilon, standard.DELTA, q, steps, "gep")
    s1 = setting["clip"]
    s2 = s1 * setting["s2_ratio"]
    config = GEPConfig(
        PrivacyContract(
            "gep", sigma / args.tan, q / args.tan, clip_embedding=s1, clip_residual=s2, clip_norm=s1
        ),
        num_basis=setting["k"],
        num_anchors=setting["anchors"],
        basis_refresh=setting["refresh"],
        max_chunk=args.max_chunk,
    )
    torch.manual_seed(args.seed)
    model = standard.build_model(args, data)
    rows = []
    began = time.perf_counter()

    def measure(i, step):
        if i == 1 or i % every == 0:
            row = {"step": i, **probe_stats(step, x_probe, y_probe, s1, s2)}
            rows.append(row)
            print(json.dumps(row), flush=True)

    result = train_private(
        model,
        x,
        y,
        data.public,
        config,
        steps,
        standard.optimizer_config(setting),
        delta=standard.DELTA,
        generator=torch.Generator().manual_seed(args.seed),
        noise=NoiseSource(args.seed + 1),
        evaluate_fn=lambda m: evaluate(m, val, "multiclass"),
        on_step=measure,
    )
    record = {
        "dataset": args.dataset,
        "model": standard.model_label(args),
        "setting": setting,
        "tan": args.tan,
        "seed": args.seed,
        "epsilon": args.epsilon,
        "probe": probe,
        "val_accuracy": result.accuracy,
        "seconds": time.perf_counter() - began,
        "diagnostic": "not private: computed from private gradients without noise",
        "rows": rows,
    }
    out = Path(args.out) / f"{args.dataset}_capture.jsonl"
    with open(out, "a") as fh:
        fh.write(json.dumps(record) + "\n")
    print(f"validation accuracy {100 * result.accuracy:.2f} %; appended to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
