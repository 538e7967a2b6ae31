"""The cost of GEP's subspace refresh, amortised over the private steps, against Opacus' step
(issue 54): seconds per refresh for the library's refresh (a random start, one power pass over
m anchors) and for the warm-started refresh (``compute_anchor_subspace(previous=...)``: one
pass from the last basis; with ``memory``, the previous refreshes' anchor covariance carried,
so that m / 4 or m / 8 anchors do), and seconds per private step with the refresh amortised
at refresh R = 20, 5 and 1, as a ratio to Opacus' step measured in the same process.

Each variant also reports how much of the anchors' gradient energy its subspace captures
on fresh anchors (new random labels and subset) after a few refreshes along a moving model
(a few non-private steps between refreshes), against the library's refresh: a cheaper
refresh must not capture less.

    python benchmarks/refresh_cost.py --model resnet20 --num-anchors 1000 --threads 2
    python benchmarks/refresh_cost.py --model scatter_linear --num-anchors 1000

Timings are medians of interleaved repeats (these machines are shared and noisy; ratios
measured together are what to compare). Inputs are random tensors of the model's shape, as
``step_time.py``'s are: the cost does not depend on the pixels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import step_time
from common import RESULTS

from gep_fed import GEPConfig, PrivacyContract
from gep_fed.data.scatternet import scatter_linear
from gep_fed.mechanisms.anchors import compute_anchor_subspace

# ScatterNet + linear on Fashion-MNIST's features (the standard benchmark's cheapest model):
# the expected batch of its real-batch runs is ~4,000; timed here at 512 (the ratio to
# Opacus is what is reported); k = 100 as in its grids
step_time.SETUPS.setdefault("scatter_linear", (scatter_linear, (81, 7, 7), 512, 100, None))
REFRESHES = (20, 5, 1)


def variants(m: int) -> list[tuple[str, int, float | None]]:
    """(name, anchors per refresh, memory; None: the library's cold refresh)."""
    return [
        (f"cold, m={m} (library)", m, None),
        (f"warm, m={m}", m, 0.0),
        (f"warm + memory 0.8, m={m // 4}", m // 4, 0.8),
        (f"warm + memory 0.9, m={m // 8}", m // 8, 0.9),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet20", choices=list(step_time.SETUPS))
    ap.add_argument("--num-anchors", type=int, default=1000, help="m of the library's refresh")
    ap.add_argument("--k", type=int, default=None, help="basis size (default: the setup's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-repeats", type=int, default=10)
    ap.add_argument("--chain", type=int, default=4, help="refreshes along the moving model")
    ap.add_argument(
        "--held", type=int, default=None, help="fresh anchors the energy is measured on (m)"
    )
    ap.add_argument("--max-chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(RESULTS / "refresh_cost.jsonl"))
    ap.add_argument(
        "--data",
        choices=("real", "random"),
        default="real",
        help="real: Fashion-MNIST / KMNIST ScatterNet features (scatter_linear), CIFAR-10 / "
        "Tiny-ImageNet images (resnet20), MNIST / KMNIST (cnn); random: random tensors",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    make, shape, batch, k, groups = step_time.SETUPS[args.model]
    k = args.k or k
    step_time.SETUPS[args.model] = (make, shape, batch, k, groups)
    began = time.perf_counter()

    # the private steps (a random orthonormal basis of the same sizes: the step's cost)
    steps, *_ = step_time.make_steps(
        args.model, device, args.num_anchors, args.max_chunk, anchors=False
    )
    steps = {m: steps[m] for m in ("opacus", "gp", "gep")}
    step_s = step_time.time_steps(steps, args.step_repeats, device)
    print("step seconds", step_s, flush=True)

    # the refreshes, along a model that moves between them (real data: the anchors are the
    # public images the benchmarks use, the model moves on private training images)
    model, layout, x, y, public, _ = step_time.build(args.model, device, 2 * args.num_anchors)
    if args.data == "real":
        x, y, public = real_data(args.model, len(x), 2 * args.num_anchors)
        x, y, public = x.to(device), y.to(device), public.to(device)
    cfg = GEPConfig(
        PrivacyContract("gep", 1.0, 0.01), num_basis=k, max_chunk=args.max_chunk, groups=groups
    )
    held = public[args.num_anchors :][: args.held]  # fresh anchors for the captured energy
    public = public[: args.num_anchors]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    chains = {name: None for name, _, _ in variants(args.num_anchors)}
    seconds = {name: [] for name in chains}
    captured = {name: [] for name in chains}
    gen = torch.Generator().manual_seed(0)
    for link in range(args.chain + args.repeats):
        for name, m, memory in variants(args.num_anchors):
            # every chain starts with the library's refresh on all m anchors (untimed)
            m = m if link else args.num_anchors
            _sync = step_time._sync
            _sync(device)
            t = time.perf_counter()
            result = compute_anchor_subspace(
                model,
                public,
                layout,
                replace(cfg, num_anchors=m),
                loss_fn=F.cross_entropy,
                generator=gen,
                previous=None if memory is None else chains[name],
                memory=memory or 0.0,
            )
            _sync(device)
            if link >= args.chain - 1:
                seconds[name].append(time.perf_counter() - t)
            chains[name] = result.warm
            if link >= args.chain - 1:  # after a few links: what it captures on fresh anchors
                captured[name].append(energy(model, held, layout, cfg, result.subspace, link))
        for _ in range(5):  # the model moves (non-private steps on the batch)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        print(
            f"link {link}: { ({n: round(v[-1], 2) for n, v in seconds.items() if v}) }", flush=True
        )
    rows = []
    for name, m, memory in variants(args.num_anchors):
        refresh = statistics.median(seconds[name])
        row = {
            "model": args.model,
            "variant": name,
            "anchors": m,
            "memory": memory,
            "k": k,
            "batch": batch,
            "refresh_seconds": refresh,
            "captured": statistics.mean(captured[name]),
            "step_seconds": step_s,
            "amortised": {
                r: {
                    "seconds": step_s["gep"] + refresh / r,
                    "x_opacus": (step_s["gep"] + refresh / r) / step_s["opacus"],
                }
                for r in REFRESHES
            },
        }
        rows.append(row)
    wall = time.perf_counter() - began
    meta = {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "chain": args.chain,
        "data": args.data,
        "wall_seconds": wall,
        "command": "python benchmarks/refresh_cost.py " + " ".join(sys.argv[1:]),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    with open(args.out, "a") as fh:
        for row in rows:
            fh.write(json.dumps({**row, **meta}) + "\n")
    print(table(rows, meta))
    write_report(Path(args.out))
    return 0


def write_report(log: Path) -> Path:
    """``<log>.md`` from every run in the log (one section a run, newest last)."""
    runs: dict[str, list[dict]] = {}
    for line in log.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            runs.setdefault(row["command"] + row["finished"], []).append(row)
    lines = [
        "# The cost of GEP's subspace refresh, amortised (issue 54)",
        "",
        "Written by `benchmarks/refresh_cost.py` from `" + log.name + "`. Per run: the "
        "private steps (Opacus, our GP, GEP without its refresh; medians of interleaved "
        "repeats in one process), seconds per refresh of each kind (the library's: a random "
        "start and one power pass over m anchors; warm: one pass from the last basis; warm + "
        "memory: the previous refreshes' anchor covariance carried, on m / 4 or m / 8 "
        "anchors), the share of fresh anchors' gradient energy each subspace captures after a "
        "few refreshes along a moving model (real public data unless the run says random), "
        "and seconds per private step with the refresh amortised at R = 20, 5 and 1, as a "
        "ratio to Opacus' step measured in the same process. The machine is shared: "
        "absolute times vary between runs; compare within a run.",
        "",
    ]
    for rows in runs.values():
        lines.append(table(rows, rows[0]))
    path = log.with_suffix(".md")
    path.write_text("\n".join(lines))
    return path


def real_data(model: str, batch: int, anchors: int):
    """(private batch, its labels, public anchors) of the data set the model is benchmarked on:
    Fashion-MNIST and KMNIST ScatterNet features (cached), CIFAR-10 batch 1 and Tiny-ImageNet
    at 32x32 (per-channel normalised), or MNIST and KMNIST images."""
    import numpy as np
    from common import SHARED_DATA

    from gep_fed.data.datasets import MNIST_MEAN, MNIST_STD, load_kmnist, load_mnist, to_tensor

    order = np.random.default_rng(0).permutation(10_000)[:anchors]
    if model == "resnet20":
        from gep_fed.data.builtin_tasks import CIFAR_MEAN, CIFAR_STD

        mean, std = (torch.tensor(c).view(1, 3, 1, 1) for c in (CIFAR_MEAN, CIFAR_STD))
        raw = np.fromfile(SHARED_DATA / "cifar10/cifar-10-batches-bin/data_batch_1.bin", np.uint8)
        raw = raw.reshape(-1, 3073)[:batch]
        images = torch.from_numpy(raw[:, 1:].reshape(-1, 3, 32, 32).copy()).float() / 255
        tiny = np.load(SHARED_DATA / "tinyimagenet/tinyimagenet_val_32x32.npz")["x"][order]
        public = torch.from_numpy(tiny).permute(0, 3, 1, 2).float() / 255
        labels = torch.from_numpy(raw[:, 0].astype(np.int64))
        return (images - mean) / std, labels, (public - mean) / std
    kmnist = load_kmnist(SHARED_DATA / "kmnist").images[order]
    if model == "scatter_linear":
        from gep_fed.data.scatternet import scatter_cache_dir, scatter_features

        fm = load_mnist(SHARED_DATA / "fashion-mnist", "train")
        km = load_kmnist(SHARED_DATA / "kmnist").images
        cache = scatter_cache_dir()
        feats = scatter_features(fm.images, cache_dir=cache)  # cached by the benchmarks
        public = scatter_features(km, cache_dir=cache)[torch.from_numpy(order)]
        return feats[:batch], torch.from_numpy(fm.labels[:batch]).long(), public
    mn = load_mnist(SHARED_DATA / "mnist", "train")
    x = to_tensor(mn.images[:batch], MNIST_MEAN, MNIST_STD)
    return x, torch.from_numpy(mn.labels[:batch]).long(), to_tensor(kmnist, MNIST_MEAN, MNIST_STD)


def energy(model, held, layout, cfg, subspace, seed: int) -> float:
    """Share of the held anchors' gradient energy (random labels) inside ``subspace``."""
    from gep_fed.mechanisms.anchors import infer_num_classes
    from gep_fed.mechanisms.per_example import per_example_gradients

    gen = torch.Generator().manual_seed(2000 + seed)
    labels = torch.randint(infer_num_classes(model, held), (len(held),), generator=gen)
    total = inside = 0.0
    for start in range(0, len(held), cfg.max_chunk):
        g = per_example_gradients(
            model,
            F.cross_entropy,
            held[start : start + cfg.max_chunk],
            labels[start : start + cfg.max_chunk].to(held.device),
            layout,
            cfg.max_chunk,
        )
        total += float((g.double() ** 2).sum())
        inside += float((subspace.embed(g).double() ** 2).sum())
    return inside / total


def table(rows: list[dict], meta: dict) -> str:
    first = rows[0]
    s = first["step_seconds"]
    lines = [
        f"## {first['model']}: batch {first['batch']}, k = {first['k']}, "
        f"{meta.get('data', 'real')} data, "
        f"{meta['device']}, "
        f"{meta['threads']} threads ({meta['finished']})",
        "",
        f"Steps (median of interleaved repeats): Opacus {1000 * s['opacus']:.1f} ms, our GP "
        f"{1000 * s['gp']:.1f} ms, GEP without its refresh {1000 * s['gep']:.1f} ms "
        f"({s['gep'] / s['opacus']:.2f} x Opacus). Command: `{meta['command']}`",
        "",
        "| refresh | anchors | s per refresh | energy captured on fresh anchors | "
        + " | ".join(f"s per step at R={r} (x Opacus)" for r in REFRESHES)
        + " |",
        "|---|---|---|---|" + "---|" * len(REFRESHES),
    ]
    for r in rows:
        r = {**r, "amortised": {int(k): v for k, v in r["amortised"].items()}}  # JSON: str keys
        cells = [
            f"{1000 * r['amortised'][R]['seconds']:.0f} ms ({r['amortised'][R]['x_opacus']:.2f})"
            for R in REFRESHES
        ]
        lines.append(
            f"| {r['variant']} | {r['anchors']} | {r['refresh_seconds']:.2f} | "
            f"{100 * r['captured']:.1f} % | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
