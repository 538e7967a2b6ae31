"""Full-length finals of the standard benchmark in a fixed time, the methods side by side on
one machine (issue 23: ResNet20-GN at the GEP paper's 200 epochs, on a GPU lent for minutes).

Each method's validation winner, as ``benchmarks/standard.py`` chose it on the logged tuning
runs, is retrained for ``--epochs`` epochs (sigma calibrated for those steps) and tested once,
all methods at once. First each runs two epochs, side by side as they will run, and its
second epoch is its pace (the first holds the device's warm-up); if that pace does not fit
``--epochs`` in what is left of ``--minutes``, every method gets the same shorter length, the
longest that fits with a margin, and the record says so (``tuned_epochs`` beside the
setting's ``epochs``). The timing runs' records are dropped and nothing is chosen on their
accuracy.

Every run writes to its own copy of the log in a scratch folder, so parallel runs never
append to one file; the new final records are gathered into ``OUT/full_length.jsonl`` (append
them to the data set's log to tabulate them), with ``OUT/summary.json`` and each method's
output in ``OUT/<method>.log``: a handful of files, as the device tool brings back.

    python benchmarks/full_length.py --device cuda --minutes 8 --out $OUT -- \\
        --dataset cifar10 --features raw --grid resnet --epsilon 8 --tan 8
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS  # noqa: E402

# The timing runs' length: the second epoch is the pace, the first holds the warm-up.
TIMING_EPOCHS = 2
# Launching a run, calibrating, accounting and testing take about this long beyond its epochs.
OVERHEAD_S = 30.0
# The full-length runs may be slowed by sharing the machine more than the timing runs were
# (those start at staggered times): the pace is multiplied by this before choosing a length.
MARGIN = 1.2


def launch(method: str, epochs: int, log_copy: Path, work: Path, args, extra: list[str]):
    """``standard.py --stage final --final-epochs epochs`` for one method, in its own folder
    seeded with a copy of the log (its tuning runs choose the setting)."""
    folder = work / f"{method}-{epochs}"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(log_copy, folder / log_copy.name)
    cmd = [
        sys.executable,
        str(HERE / "standard.py"),
        "--methods",
        method,
        *stage_args(args),
        "--final-epochs",
        str(epochs),
        "--device",
        args.device,
        "--threads",
        str(args.threads),
        "--out",
        str(folder),
        *extra,
    ]
    log = open(args.out / f"{method}.log", "a")  # noqa: SIM115 (closed when the run ends)
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), folder, log


def stage_args(args) -> list[str]:
    """The validation winner of the grid, or with ``--levers`` the winner of the grid plus
    those levers (a method whose levers did not beat its grid on validation gets no run)."""
    if args.levers is None:
        return ["--stage", "final"]
    return ["--stage", "levers", "--levers", *args.levers, "--lever-final"]


def new_records(folder: Path, log_name: str, known: set[str]) -> list[dict]:
    path = folder / log_name
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["key"] not in known]


def run_all(epochs: int, deadline: float, log_copy: Path, known, work: Path, args, extra):
    """Every method at ``epochs`` at once; each is stopped at the deadline. Returns
    ``{method: record or None}``."""
    runs = {m: launch(m, epochs, log_copy, work, args, extra) for m in args.methods}
    results = {}
    for method, (proc, folder, log) in runs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            log.write(f"stopped at the deadline after {epochs}-epoch run began\n")
        log.close()
        found = new_records(folder, log_copy.name, known)
        results[method] = found[-1] if found and proc.returncode == 0 else None
    return results


def epoch_seconds(record: dict) -> float:
    """A method's seconds per epoch from its timing run: its last epoch, which holds GEP's
    one subspace refresh an epoch of these grids and not the device's warm-up. A record
    without it (one epoch) counts every step at the pace of the later ones, plus one at the
    first step's (the warm-up, or the refresh: on a GPU about twice the true pace)."""
    if "last_epoch_seconds" in record:
        return record["last_epoch_seconds"]
    if "later_step_seconds" not in record:
        return record["seconds"]
    return (record["steps"] - 1) * record["later_step_seconds"] + record["first_step_seconds"]


def choose_epochs(target: int, pace: dict[str, float], seconds_left: float) -> int:
    """The longest length up to ``target`` epochs that the slowest method's pace (seconds per
    epoch, side by side) fits into ``seconds_left`` with the margin; 0 if not one epoch."""
    slowest = max(pace.values())
    return max(0, min(target, math.floor((seconds_left - OVERHEAD_S) / (MARGIN * slowest))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["gep", "gp", "opacus"])
    ap.add_argument("--epochs", type=int, default=200, help="the full length (GEP paper: 200)")
    ap.add_argument("--minutes", type=float, required=True, help="wall time for everything")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--threads", type=int, default=4, help="CPU threads per run")
    ap.add_argument(
        "--no-timing",
        action="store_true",
        help="run --epochs at once, without the timing runs (the pace is known from an "
        "earlier run); runs are still stopped at the deadline",
    )
    ap.add_argument(
        "--levers",
        nargs="+",
        default=None,
        metavar="KNOB[=VALUE]",
        help="retrain each method's validation winner among its grid plus these levers "
        "(standard.py --stage levers --levers ... --lever-final), e.g. warm or refresh=5",
    )
    ap.add_argument("--log", type=Path, default=None, help="the log holding the tuning runs")
    ap.add_argument("--out", type=Path, required=True, help="the results and the runs' output")
    ap.add_argument("--work", type=Path, default=None, help="scratch (default: a new temp dir)")
    ap.add_argument("standard_args", nargs=argparse.REMAINDER, help="-- then standard.py's")
    args = ap.parse_args(argv)
    extra = [a for a in args.standard_args if a != "--"]
    deadline = time.time() + 60 * args.minutes
    dataset = extra[extra.index("--dataset") + 1] if "--dataset" in extra else "mnist"
    log = args.log or RESULTS / "standard" / f"{dataset}.jsonl"
    args.out.mkdir(parents=True, exist_ok=True)
    known = {json.loads(line)["key"] for line in log.read_text().splitlines() if line.strip()}

    work = args.work or Path(tempfile.mkdtemp(prefix="full_length-"))
    timing = (
        {} if args.no_timing else run_all(TIMING_EPOCHS, deadline, log, known, work, args, extra)
    )
    failed = [m for m, r in timing.items() if r is None]
    if failed:  # the others still run: a comparison of two methods is worth the machine
        print(f"timing runs failed: {', '.join(failed)} (see their logs)", flush=True)
        args.methods = [m for m in args.methods if m not in failed]
        if not args.methods:
            return 1
    pace = {m: epoch_seconds(r) for m, r in timing.items() if r is not None}
    epochs = (
        args.epochs if args.no_timing else choose_epochs(args.epochs, pace, deadline - time.time())
    )
    summary = {
        "pace_s_per_epoch": pace,
        "failed_timing": failed,
        "target_epochs": args.epochs,
        "epochs": epochs,
    }
    print(f"seconds an epoch side by side: {pace}; running {epochs} epochs", flush=True)
    if epochs < 1:
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print("not one epoch fits in the time left", flush=True)
        return 1
    finals = run_all(epochs, deadline, log, known, work, args, extra)
    with open(args.out / "full_length.jsonl", "a") as fh:
        for record in finals.values():
            if record is not None:
                fh.write(json.dumps(record) + "\n")
    summary["accuracy"] = {m: r and r["accuracy"] for m, r in finals.items()}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1), flush=True)
    return 0 if all(finals.values()) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
