"""A recipe that learns on small data (issue 24): a hospital federation with about 1,000
training images over 3 sites, epsilon 8, chosen on validation, tested once.

Data: PneumoniaMNIST (28 x 28 grey, normal / pneumonia; ``--dataset fashion-mnist``: the
same protocol on Fashion-MNIST) cut down to ``--train`` training images (a seeded subset of
its train split); the tuning runs are scored on its validation split, the finals on its test
split (never used to choose). Tuning: GEP and GP through the
library's training loop on the pooled data (``gep_fed.training.train_private``: the same
steps and accounting as central mode), equal grids, one seed; the winner of each method then
runs in real federated simulations (3 sites, central and client-side), beside the
non-private reference (the same clipping, no noise) and the majority-class rate.

    python benchmarks/small_data.py                 # tune, then the finals
    python benchmarks/small_data.py --stage final   # the finals of the logged winners

Every run is appended to ``results/small_data/<dataset>.jsonl`` (resumable: a run whose key
is logged is not run again); the table is ``results/small_data/<dataset>.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, SHARED_DATA

from gep_fed.data.builtin_tasks import MedMnistTask
from gep_fed.data.metrics import evaluate
from gep_fed.data.task import TaskSettings, stack_examples
from gep_fed.federation.config import FederationConfig
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.training import OptimizerConfig, train_private

OUT = RESULTS / "small_data"
DELTA = 1e-5
# The grid (the same for both methods): model, q (batch share of n), steps, clip (S1 for GEP
# with S2 = S1 / 2; S for GP), server lr on the mean clipped gradient (momentum 0.9).
GRID = {
    "model": ["scatter-linear", "cnn"],
    "sample_rate": [0.1, 0.25],
    "steps": [40, 100],
    "clip": [0.1, 1.0],
    "lr_times_clip": [0.4, 1.6],  # lr = lr_times_clip / clip: the step scale of a clipped mean
}


def splits(dataset: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(images, labels) of the data set's train, val and test splits: PneumoniaMNIST's own;
    Fashion-MNIST's official test set, its validation 2,000 seeded training images."""
    if dataset == "pneumonia":
        data = np.load(SHARED_DATA / "medmnist" / "pneumoniamnist.npz")
        return {s: (data[f"{s}_images"], data[f"{s}_labels"]) for s in ("train", "val", "test")}
    from gep_fed.data.datasets import load_mnist

    train = load_mnist(SHARED_DATA / "fashion-mnist", "train")
    test = load_mnist(SHARED_DATA / "fashion-mnist", "test")
    order = np.random.default_rng(12345).permutation(len(train))
    val, rest = order[:2000], order[2000:]
    return {
        "train": (train.images[rest], train.labels[rest]),
        "val": (train.images[val], train.labels[val]),
        "test": (test.images, test.labels),
    }


def cut_file(dataset: str, train: int, score_on: str, seed: int, folder: Path) -> Path:
    """A MedMNIST-layout file whose train split is ``train`` seeded images of the data set's
    train split and whose test split is its ``score_on`` split (val for tuning)."""
    data = splits(dataset)
    images, labels = data["train"]
    pick = np.random.default_rng(seed).permutation(len(labels))[:train]
    arrays = {
        "train_images": images[pick],
        "train_labels": labels[pick].reshape(-1, 1),
        "val_images": data["val"][0],
        "val_labels": data["val"][1].reshape(-1, 1),
        "test_images": data[score_on][0],
        "test_labels": data[score_on][1].reshape(-1, 1),
    }
    path = folder / f"{dataset}-cut-{train}-{score_on}-{seed}.npz"
    np.savez(path, **arrays)
    return path


def settings_of(point: dict) -> dict:
    clip = point["clip"]
    return {
        "model": point["model"],
        "sample_rate": point["sample_rate"],
        "rounds": point["steps"],
        "clip_embedding": clip,
        "clip_residual": clip / 2,
        "clip_norm": clip,
        "server_lr": point["lr_times_clip"] / clip,
        "server_momentum": 0.9,
        "local_steps": 1,
        "local_lr": 1.0,
        "num_basis": 32,
        "num_anchors": 500,
        "num_public": 1000,
        "basis_refresh": 10,
    }


def tune_one(args, method: str, point: dict, path: Path) -> dict:
    """One tuning run: the library's loop on the pooled training images, scored on val."""
    s = settings_of(point)
    task = MedMnistTask(
        TaskSettings(
            data_dir=str(SHARED_DATA),
            model=s["model"],
            num_public=s["num_public"],
            seed=args.seed,
            options={"medmnist-path": str(path)},
        )
    )
    x, y = stack_examples(task.train_dataset())
    val = stack_examples(task.eval_dataset())
    public = stack_examples(task.public_dataset())[0]
    contract = PrivacyContract.for_budget(
        method,
        args.epsilon,
        DELTA,
        s["sample_rate"],
        s["rounds"],
        clip_embedding=s["clip_embedding"],
        clip_residual=s["clip_residual"],
        clip_norm=s["clip_norm"],
    )
    config = GEPConfig(
        contract,
        num_basis=s["num_basis"],
        num_anchors=s["num_anchors"],
        basis_refresh=s["basis_refresh"],
    )
    torch.manual_seed(args.seed)
    model = task.build_model()
    began = time.perf_counter()
    result = train_private(
        model,
        x,
        y,
        public,
        config,
        s["rounds"],
        OptimizerConfig(lr=s["server_lr"], momentum=s["server_momentum"]),
        delta=DELTA,
        generator=torch.Generator().manual_seed(args.seed),
        noise=NoiseSource(args.seed + 1),
        evaluate_fn=lambda m: evaluate(m, val, task.kind),
    )
    scores = evaluate(model, val, task.kind)
    return {
        "val_accuracy": scores["accuracy"],
        "val_balanced_accuracy": scores["balanced_accuracy"],
        "val_auroc": scores["auroc"],
        "epsilon": result.epsilon,
        "sigma": contract.noise_multiplier,
        "seconds": time.perf_counter() - began,
    }


def final_one(args, method: str, point: dict, mode: str, path: Path, run_dir: Path) -> dict:
    """A real federated simulation of the chosen setting, scored on the test split."""
    from gep_fed.flower.simulation import simulate

    s = settings_of(point)
    noise_free = method == "nonprivate"
    fed = FederationConfig.for_task(
        "medmnist",
        medmnist_path=str(path),
        data_dir=str(SHARED_DATA),
        mode=mode,
        mechanism="gp" if noise_free else method,
        target_epsilon=args.epsilon,
        delta=DELTA,
        num_sites=3,
        seed=args.seed,
        noise_seed=args.seed + 1,
        noise_multiplier=0.0 if noise_free else None,
        run_dir=str(run_dir),
        run_name=f"{method}-{mode}-{int(time.time())}",
        **s,
    )
    result = simulate(fed, progress=False)
    last = result.metrics[-1]
    return {
        "test_accuracy": last["test_accuracy"],
        "test_balanced_accuracy": last["test_balanced_accuracy"],
        "test_auroc": last["test_auroc"],
        "majority_rate": last["test_majority_rate"],
        "epsilon": last.get("epsilon"),
        "sites_ok": [r["sites_ok"] for r in result.metrics],
        "failures": result.failures(),
        "seconds": result.seconds,
    }


def log_path(args) -> Path:
    return OUT / f"{args.dataset}.jsonl"


def read_log(args) -> list[dict]:
    path = log_path(args)
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def key_of(args, stage: str, method: str, point: dict, mode: str = "pooled") -> str:
    return json.dumps(
        {
            "stage": stage,
            "method": method,
            "point": point,
            "mode": mode,
            "train": args.train,
            "epsilon": args.epsilon,
            "seed": args.seed,
            "dataset": args.dataset,
        },
        sort_keys=True,
    )


def append(args, record: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(log_path(args), "a") as fh:
        fh.write(json.dumps(record) + "\n")


def grid_points() -> list[dict]:
    return [dict(zip(GRID, values, strict=True)) for values in itertools.product(*GRID.values())]


def winners(records: list[dict]) -> dict[str, dict]:
    """Each method's best tuning point by validation balanced accuracy (ties: accuracy)."""
    best = {}
    for r in records:
        if r["stage"] != "tune":
            continue
        score = (r["val_balanced_accuracy"], r["val_accuracy"])
        if r["method"] not in best or score > best[r["method"]][0]:
            best[r["method"]] = (score, r["point"])
    return {m: p for m, (_, p) in best.items()}


def write_table(args, records: list[dict]) -> Path:
    finals = [r for r in records if r["stage"] == "final"]
    tunes = [r for r in records if r["stage"] == "tune"]
    lines = [
        f"# Small data: {args.dataset} cut to {args.train} training images, 3 sites, "
        f"epsilon {args.epsilon:g}",
        "",
        "Written by `benchmarks/small_data.py`. Tuned on the validation split (the library's "
        "loop on the pooled images, equal grids for GEP and GP, one seed), then the winner of "
        "each method run once in real federated simulations and scored on the test split. "
        "The non-private row runs GEP's winning setting with the same clipping and no noise.",
        "",
        "| method | mode | setting | test accuracy | balanced accuracy | AUROC | majority "
        "class | epsilon |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in finals:
        p = r["point"]
        setting = (
            f"{p['model']}, q={p['sample_rate']}, {p['steps']} rounds, clip "
            f"{p['clip']}, lr {p['lr_times_clip'] / p['clip']:g}"
        )
        eps = "-" if r["method"] == "nonprivate" else f"{r['epsilon']:.3f}"
        lines.append(
            f"| {r['method']} | {r['mode']} | {setting} | {100 * r['test_accuracy']:.2f} | "
            f"{100 * r['test_balanced_accuracy']:.2f} | {r['test_auroc']:.3f} | "
            f"{100 * r['majority_rate']:.2f} | {eps} |"
        )
    best = {
        m: max(r["val_balanced_accuracy"] for r in tunes if r["method"] == m)
        for m in sorted({r["method"] for r in tunes})
    }
    lines += [
        "",
        f"{len(tunes)} tuning runs logged; best validation balanced accuracy per method: "
        + ", ".join(f"{m} {100 * v:.2f}" for m, v in best.items()),
    ]
    path = OUT / f"{args.dataset}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="pneumonia", choices=["pneumonia", "fashion-mnist"])
    ap.add_argument("--train", type=int, default=1000)
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stage", choices=["tune", "final", "all"], default="all")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="small-data-"))
    records = read_log(args)
    done = {r["key"] for r in records}
    if args.stage in ("tune", "all"):
        path = cut_file(args.dataset, args.train, "val", args.seed, folder)
        for method in ("gep", "gp"):
            for point in grid_points():
                key = key_of(args, "tune", method, point)
                if key in done:
                    continue
                record = {
                    "key": key,
                    "stage": "tune",
                    "method": method,
                    "point": point,
                    **tune_one(args, method, point, path),
                }
                append(args, record)
                records.append(record)
                print(
                    f"tune {method} {point}: val balanced "
                    f"{100 * record['val_balanced_accuracy']:.2f}",
                    flush=True,
                )
    if args.stage in ("final", "all"):
        path = cut_file(args.dataset, args.train, "test", args.seed, folder)
        best = winners(records)
        runs = [(m, best[m], mode) for m in ("gep", "gp") for mode in ("central", "client")]
        runs.append(("nonprivate", best["gep"], "central"))
        for method, point, mode in runs:
            key = key_of(args, "final", method, point, mode)
            if key in done:
                continue
            record = {
                "key": key,
                "stage": "final",
                "method": method,
                "point": point,
                "mode": mode,
                **final_one(args, method, point, mode, path, folder / "runs"),
            }
            append(args, record)
            records.append(record)
            print(
                f"final {method} {mode}: test acc {100 * record['test_accuracy']:.2f} "
                f"balanced {100 * record['test_balanced_accuracy']:.2f} "
                f"(majority {100 * record['majority_rate']:.2f})",
                flush=True,
            )
    print(write_table(args, records).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
