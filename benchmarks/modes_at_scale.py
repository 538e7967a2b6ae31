"""The three noise placements at growing federation sizes (issue 22): central, client-side and
distributed (secure sum) mode on the same data, sites and seeds, at equal private steps.

Each run is one Flower simulation of the task's recommended settings, the cell ``gep-fed
compare`` runs for that mode (``gep_fed.cli.compare.matrix``); its figures (test
accuracy, epsilon, seconds and megabytes per round per site) go to
``benchmarks/results/modes/runs.jsonl`` as it finishes, and a run already there is skipped, so
an interrupted benchmark resumes where it stopped. ``--table`` writes the Markdown table from
what is there.

    python benchmarks/modes_at_scale.py --sites 3 10 20 --partitions iid dirichlet
    python benchmarks/modes_at_scale.py --table
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from gep_fed.cli.compare import matrix
from gep_fed.federation.config import FederationConfig
from gep_fed.flower.simulation import simulate

OUT = Path(__file__).parent / "results" / "modes"
MODES = ("central", "distributed", "client")


# Distributed mode's secure sum: Flower's SecAgg+ until issue 50, then the project's own
# (pairwise masks over pinned peers' signed keys, no dropout recovery). Rows name theirs.
SECURE_SUM = "pairwise"


def key(
    task: str,
    mechanism: str,
    sites: int,
    partition: str,
    epsilon: float,
    mode: str,
    rounds: int | None = None,
    settings: dict | None = None,
) -> str:
    """A run's key; distributed runs of the current secure sum, runs of a length other
    than the task's and runs with settings of their own (``--set``) carry it (older rows
    keep theirs)."""
    suffix = f"/{SECURE_SUM}" if mode == "distributed" else ""
    length = f"/r{rounds}" if rounds else ""
    own = "".join(
        f"/{k}={v:g}" if isinstance(v, float) else f"/{k}={v}"
        for k, v in sorted((settings or {}).items())
    )
    return f"{task}/{mechanism}/{sites}-{partition}/eps{epsilon:g}{length}{own}/{mode}{suffix}"


def parse_settings(items: list[str]) -> dict:
    """``--set clip_residual=0.02 basis_refresh=5``: FederationConfig fields over the
    task's recommended settings (e.g. a mechanism's tuned levers), typed as JSON values."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--set {item}: expected NAME=VALUE")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out


def done_runs(log: Path) -> dict[str, dict]:
    if not log.exists():
        return {}
    return {row["key"]: row for row in map(json.loads, log.read_text().splitlines()) if row}


def compare_cell(
    base: FederationConfig, epsilon: float, mechanism: str, mode: str, run_key: str
) -> FederationConfig:
    """The run ``gep-fed compare`` makes for this mode and mechanism (at equal private steps),
    under the benchmark's own run name."""
    ((_, fed),) = matrix(base, [epsilon], mechanisms=(mechanism,), modes=(mode,))[1:]
    return replace(fed, run_name=run_key.replace("/", "_"))


def run_one(fed: FederationConfig, run_key: str, log: Path) -> dict:
    began = time.perf_counter()
    result = simulate(fed, progress=False)
    rows = result.metrics
    per_round = [r.get("bytes_sent", 0) + r.get("bytes_received", 0) for r in rows]
    row = {
        "key": run_key,
        "mode": fed.mode,
        "secure_sum": SECURE_SUM if fed.mode == "distributed" else None,
        "sites": fed.num_sites,
        "partition": fed.partition,
        "mechanism": fed.mechanism,
        "settings": run_key_settings(run_key),
        "epsilon_target": fed.target_epsilon,
        "epsilon": rows[-1]["epsilon"] if rows else None,
        "test_accuracy": rows[-1]["test_accuracy"] if rows else None,
        "rounds": len(rows),
        "steps": fed.steps_per_party,
        "applied_rounds": sum(bool(r.get("applied")) for r in rows),
        "failures": result.failures(),
        "seconds": time.perf_counter() - began,
        "round_seconds": sum(r["round_seconds"] for r in rows) / max(len(rows), 1),
        "round_megabytes_per_site": sum(per_round) / max(len(rows), 1) / fed.num_sites / 2**20,
        "sigma": json.loads((result.run_dir / "config.json").read_text())[
            "resolved-noise-multiplier"
        ],
        "dimension": quantised_dimension(result.run_dir),
        "run_dir": str(result.run_dir),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    with log.open("a") as fh:
        fh.write(json.dumps(row) + "\n")
    return row


def run_key_settings(run_key: str) -> str:
    """The ``--set`` part of a run key ("" for the task's recommended settings)."""
    return "/".join(part for part in run_key.split("/") if "=" in part)


def quantised_dimension(run_dir: Path) -> int | None:
    """The length of a distributed run's quantised shares, from its ledger (None otherwise)."""
    events = json.loads((Path(run_dir) / "ledger.json").read_text())["events"]
    return events[0].get("dimension") if events else None


def table(rows: list[dict]) -> str:
    lines = [
        "# Noise placements at growing federation sizes",
        "",
        "Each row: one Flower simulation of the task's recommended settings, modes at "
        "equal private steps per party (central and distributed: one step per round; client: "
        "`local-steps` per round). Megabytes per round per site count every message's arrays "
        "and byte strings, both ways (`gep_fed.flower.strategy.MeteredGrid`). Seeds fixed "
        "(partition, anchors, model, the central and client noise); the distributed noise is "
        "OpenDP's, seeded by the operating system. Quantised d: the length of a distributed "
        "share (padded first to a power of two, then, from commit 'Distributed shares padded "
        "to c 2**b', to the next c 2**b with c in 1, 3, 5). Rounds applied: rounds whose "
        "update reached the model, of those run; a run resumed after an interruption applies "
        "fewer when its sites had recorded the interrupted round (their ledgers over-count, "
        "never under-count), and then ends refused as over budget. A resumed run also sends "
        "each site one basis more (the server computes a fresh subspace at the first round "
        "after the resume), so it meters more bytes per round than an uninterrupted run. "
        "Secure sum: distributed rows of Flower's SecAgg+ (4 message exchanges, int64 arrays; "
        "superseded by issue 50) and of the project's pairwise masks over pinned peers' signed "
        "keys (2 exchanges, uint32 arrays). Rows of fewer rounds than the task's 300 time the "
        "rounds; their accuracy compares only with rows of the same length.",
        "",
        "| task | mechanism | sites | partition | epsilon | mode | sigma | test accuracy | "
        "epsilon spent | rounds applied | s/round | MB/round/site | quantised d | secure sum |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {m: i for i, m in enumerate(MODES)}

    def place(r: dict) -> tuple:
        task = r["key"].split("/")[0]
        return (
            task,
            r["mechanism"],
            r["partition"],
            r["epsilon_target"],
            r["rounds"],
            r["sites"],
            order[r["mode"]],
            r.get("secure_sum") or "",
        )

    for r in sorted(rows, key=place):
        task = r["key"].split("/")[0]
        applied = r.get("applied_rounds", r["rounds"])
        rounds = f"{applied}" if applied == r["rounds"] else f"{applied} of {r['rounds']}"
        lines.append(
            f"| {task} | {r['mechanism']}{' (' + r['settings'] + ')' if r.get('settings') else ''} "
            f"| {r['sites']} | {r['partition']} | "
            f"{r['epsilon_target']:g} | {r['mode']} "
            f"| {r['sigma']:.3f} | {r['test_accuracy']:.4f} | {r['epsilon']:.3f} | {rounds} | "
            f"{r['round_seconds']:.2f} | {r['round_megabytes_per_site']:.3f} | "
            f"{r.get('dimension') or '-'} | {secure_sum(r)} |"
        )
    return "\n".join(lines) + "\n"


def secure_sum(row: dict) -> str:
    if row["mode"] != "distributed":
        return "-"
    return "pairwise, pinned keys" if row.get("secure_sum") == SECURE_SUM else "SecAgg+ (old)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="fashion-mnist")
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--mechanism", default="gep", choices=["gep", "bgep", "gp"])
    parser.add_argument("--sites", type=int, nargs="+", default=[3, 10, 20])
    parser.add_argument("--partitions", nargs="+", default=["iid", "dirichlet"])
    parser.add_argument("--epsilon", type=float, default=2.0)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--rounds", type=int, default=None, help="default: the task's")
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="NAME=VALUE",
        help="FederationConfig fields over the task's recommended settings (in the run key)",
    )
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--table", action="store_true", help="only write the table")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    settings = parse_settings(args.set)
    if not args.table:
        for sites in args.sites:
            for partition in args.partitions:
                for mode in args.modes:
                    run_key = key(
                        args.task,
                        args.mechanism,
                        sites,
                        partition,
                        args.epsilon,
                        mode,
                        args.rounds,
                        settings,
                    )
                    if run_key in done_runs(log):
                        print(f"done already: {run_key}", file=sys.stderr)
                        continue
                    base = FederationConfig.for_task(
                        args.task,
                        data_dir=args.data_dir,
                        mechanism=args.mechanism,
                        num_sites=sites,
                        partition=partition,
                        target_epsilon=args.epsilon,
                        run_dir=str(out / "runs"),
                        run_name=run_key.replace("/", "_"),
                        **({"rounds": args.rounds} if args.rounds else {}),
                        **{"noise_seed": 5, **settings},  # a second seed: --set seed=1 noise_seed=6
                    )
                    fed = compare_cell(base, args.epsilon, args.mechanism, mode, run_key)
                    print(f"running {run_key}", file=sys.stderr, flush=True)
                    row = run_one(fed, run_key, log)
                    print(
                        f"  {row['test_accuracy']:.4f} in {row['seconds']:.0f} s", file=sys.stderr
                    )
    (out / "modes.md").write_text(table(list(done_runs(log).values())))
    print((out / "modes.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
