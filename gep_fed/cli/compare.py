"""Compare private training setups on the same data, sites and seeds.

The matrix: non-private FedAvg (per-example gradients clipped at S as in GP, no noise: the
step sizes tuned for clipped gradients stay meaningful, and the row shows what the noise
alone costs); GP, B-GEP and GEP in central, client-side and distributed mode at each
epsilon (``mechanisms`` and ``modes`` choose a part); and, as the reference a federation is
measured against, centralised GEP and GP on the pooled data on one machine (same steps and
sampling rate as central mode). Writes one Markdown table and one plot; every run keeps its
own run directory.

    gep-fed compare --task mnist --partition dirichlet --epsilons 2 8
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from gep_fed.data.metrics import predict
from gep_fed.data.task import stack_examples
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.modes import MODE_NAMES, mode_named
from gep_fed.flower.simulation import simulate
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.training import OptimizerConfig, train_private

MECHANISMS = ("gp", "bgep", "gep")


EQUAL = ("steps", "rounds")


def matrix(
    base: FederationConfig,
    epsilons: list[float],
    equal: str = "steps",
    mechanisms: tuple[str, ...] = MECHANISMS,
    modes: tuple[str, ...] = MODE_NAMES,
) -> list[tuple[str, FederationConfig]]:
    """(label, config) for every federated run of the comparison.

    ``equal="steps"`` (default) gives every mode the same number of private steps per party:
    central and distributed mode take ``rounds * local_steps`` rounds of one step, as client
    mode takes ``rounds`` of ``local_steps``. ``"rounds"`` runs every mode for ``rounds``
    rounds (then client mode takes ``local_steps`` times the steps, and reads as better)."""
    if equal not in EQUAL:
        raise ValueError(f"equal must be one of {EQUAL}, got {equal!r}")

    def of_mode(fed: FederationConfig, mode: str) -> FederationConfig:
        # a mode of one step a round runs local_steps times the rounds (equal steps)
        one_step = mode_named(mode).steps_per_round(base.local_steps) == 1 and equal == "steps"
        rounds = base.rounds * base.local_steps if one_step else None
        return replace(fed, mode=mode, rounds=rounds or base.rounds)

    runs = [
        (
            "FedAvg (non-private, clipped)",
            replace(base, mode="client", mechanism="gp", noise_multiplier=0.0, run_name=""),
        )
    ]
    for eps in epsilons:
        for mode in modes:
            for mech in mechanisms:
                fed = replace(
                    base, mechanism=mech, target_epsilon=eps, noise_multiplier=None, run_name=""
                )
                runs.append((f"{mech.upper()} {mode}", of_mode(fed, mode)))
    return runs


def centralised(base: FederationConfig, mechanism: str, eps: float, rounds: int) -> dict:
    """GEP or GP on the pooled data on one machine, accounted like central mode of
    ``rounds`` rounds (one step each)."""
    fed = replace(
        base,
        mode="central",
        mechanism=mechanism,
        target_epsilon=eps,
        noise_multiplier=None,
        rounds=rounds,
    )
    resolved = fed.resolve()  # sigma calibrated for this mechanism's budget
    task = fed.make_task()
    torch.manual_seed(fed.seed)
    model = task.build_model()
    x, y = stack_examples(task.train_dataset())
    test = stack_examples(task.eval_dataset())
    # the Poisson coins must be secret for the epsilon this reference reports: only a run
    # whose noise is seeded (tests, benchmarks) fixes them too
    gen = torch.Generator().manual_seed(fed.seed) if fed.noise_seed is not None else None
    began = time.perf_counter()
    result = train_private(
        model,
        x,
        y,
        stack_examples(task.public_dataset())[0],
        replace(resolved.anchor_config, basis_refresh=fed.basis_refresh),
        fed.rounds,
        OptimizerConfig(lr=fed.server_lr, momentum=fed.server_momentum),
        delta=fed.delta,
        generator=gen,
        noise=NoiseSource(fed.noise_seed),
        evaluate_fn=lambda m: task.metrics(*predict(m, test)),
    )
    final = task.metrics(*predict(model, test))
    return {
        "test_accuracy": final["accuracy"],
        "test_auc": final.get("auroc"),
        "epsilon": result.epsilon,
        "steps": fed.rounds,
        "seconds": time.perf_counter() - began,
    }


def run_comparison(
    base: FederationConfig,
    epsilons: list[float],
    out_dir: str | Path = "comparisons",
    central_reference: bool = True,
    name: str | None = None,
    equal: str = "steps",
    mechanisms: tuple[str, ...] = MECHANISMS,
    modes: tuple[str, ...] = MODE_NAMES,
    engine: str = "ray",
) -> tuple[str, list[str]]:
    """Run the matrix (``matrix``: modes at equal private steps by default); write
    ``<out>/<name>.md``, ``.json`` and ``.png``; return the table and one line per failure
    of a run (``SimulationResult.failures``: rounds that did not update the model, a site
    refused in every round), which the table lists too. ``engine``: where each run's sites
    run (``simulate``'s)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = name or f"{time.strftime('%Y%m%d-%H%M%S')}-{base.task}"
    rows = []
    runs = matrix(base, epsilons, equal, mechanisms, modes)
    for i, (label, fed) in enumerate(runs, 1):
        eps = None if fed.noise_multiplier == 0 else fed.target_epsilon
        print(f"[{i}/{len(runs)}] {label} epsilon={eps}", file=sys.stderr, flush=True)
        fed = replace(
            fed,
            run_dir=str(out / name / "runs"),
            run_name=f"{i:02d}-{fed.mode}-{fed.mechanism}-eps{eps}",
        )
        res = simulate(fed, progress=False, engine=engine)
        last = res.metrics[-1] if res.metrics else {}
        per_round = [m.get("bytes_sent", 0) + m.get("bytes_received", 0) for m in res.metrics]
        rows.append(
            {
                "setup": label,
                "epsilon": eps,
                "test_accuracy": last.get("test_accuracy"),
                "test_auc": last.get("test_auroc"),
                "epsilon_spent": last.get("epsilon"),
                "rounds": len(res.metrics),
                "steps": len(res.metrics) * fed.noise_mode.steps_per_round(fed.local_steps),
                "seconds": res.seconds,
                "round_seconds": _mean([m.get("round_seconds") for m in res.metrics]),
                "round_bytes_per_site": _mean(per_round) / fed.num_sites if per_round else None,
                "run_dir": str(res.run_dir),
                "failures": res.failures(),
            }
        )
    if central_reference:
        for eps in epsilons:
            for mech in ("gp", "gep"):
                print(f"[ref] centralised {mech} epsilon={eps}", file=sys.stderr, flush=True)
                central = next((f for _, f in runs if f.noise_mode.server_steps), runs[-1][1])
                ref = centralised(base, mech, eps, central.rounds)
                rows.append(
                    {
                        "setup": f"{mech.upper()} centralised (pooled data)",
                        "epsilon": eps,
                        "test_accuracy": ref["test_accuracy"],
                        "test_auc": ref["test_auc"],
                        "epsilon_spent": ref["epsilon"],
                        "rounds": ref["steps"],
                        "steps": ref["steps"],
                        "seconds": ref["seconds"],
                        "run_dir": "",
                    }
                )
    table = _table(base, rows)
    (out / f"{name}.md").write_text(table)
    (out / f"{name}.json").write_text(
        json.dumps({"config": base.to_record(), "rows": rows}, indent=1)
    )
    _plot(rows, out / f"{name}.png")
    return table, _failed(rows)


def _failed(rows: list[dict]) -> list[str]:
    return [
        f"{r['setup']}, epsilon {r['epsilon']}: {f}" for r in rows for f in r.get("failures", [])
    ]


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _fmt(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(base: FederationConfig, rows: list[dict]) -> str:
    auc = any(r["test_auc"] is not None for r in rows)
    head = (
        f"# Comparison: task {base.task}, {base.num_sites} sites ({base.partition}"
        f"{f', alpha={base.dirichlet_alpha}' if base.partition == 'dirichlet' else ''}), "
        f"{base.rounds} rounds, q={base.sample_rate}, delta={base.delta}, "
        f"local steps {base.local_steps} (client mode), k={base.num_basis}; modes compared "
        "at the private steps of the table's column\n\n"
    )
    cols = (
        "| setup | epsilon | test accuracy |"
        + (" test AUC |" if auc else "")
        + " epsilon spent | rounds | private steps | seconds | s/round | MB/round/site |\n"
    )
    sep = "|---|---|---|" + ("---|" if auc else "") + "---|---|---|---|---|---|\n"
    lines = []
    for r in rows:
        eps = "inf" if r["epsilon"] is None else f"{r['epsilon']:g}"
        spent = "inf" if r["epsilon"] is None else _fmt(r["epsilon_spent"], 3)
        setup = r["setup"] + (" (FAILED: see below)" if r.get("failures") else "")
        lines.append(
            f"| {setup} | {eps} | {_fmt(r['test_accuracy'])} |"
            + (f" {_fmt(r['test_auc'])} |" if auc else "")
            + f" {spent} | {r['rounds']} | {r.get('steps', '-')} | {r['seconds']:.0f} |"
            + f" {_fmt(r.get('round_seconds'), 2)} | {_megabytes(r.get('round_bytes_per_site'))} |"
        )
    failed = _failed(rows)
    if failed:  # such a cell's accuracy is not that of its setup, trained
        lines += ["", "Failed runs:", *(f"- {line}" for line in failed)]
    return head + cols + sep + "\n".join(lines) + "\n"


def _megabytes(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.3f}"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = list(dict.fromkeys(r["setup"] for r in rows if r["epsilon"] is not None))
    epsilons = sorted({r["epsilon"] for r in rows if r["epsilon"] is not None})
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    width = 0.8 / max(1, len(epsilons))
    for j, eps in enumerate(epsilons):
        values = [
            next((r["test_accuracy"] for r in rows if r["setup"] == s and r["epsilon"] == eps), 0)
            for s in setups
        ]
        ax.bar([i + j * width for i in range(len(setups))], values, width, label=f"eps={eps:g}")
    for r in rows:
        if r["epsilon"] is None:
            ax.axhline(r["test_accuracy"], color="k", ls="--", lw=1, label=r["setup"])
    ax.set_xticks([i + width * (len(epsilons) - 1) / 2 for i in range(len(setups))])
    ax.set_xticklabels(setups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("test accuracy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
