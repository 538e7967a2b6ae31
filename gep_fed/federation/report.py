"""What a finished run shows: the summary it prints (the same from ``gep-fed simulate`` and
``flwr run``) and ``report.md`` with PNG plots for its run directory (accuracy, epsilon,
projection error)."""

from __future__ import annotations

from pathlib import Path

from gep_fed.accounting.events import pld_text
from gep_fed.accounting.ledger import LedgerError, PrivacyLedger
from gep_fed.federation.modes import mode_named
from gep_fed.federation.rundir import (
    CONFIG,
    LOST_ROUND,
    OUTCOME,
    REPORT,
    SITES,
    RunDirectory,
    latest_attempts,
    read_site_rounds,
    site_line,
)

# (metric keys drawn together, y label, file, caption): the task's metrics on the server's
# test data, the privacy spent, the subspace's fit
PLOTS = (
    (
        ("test_accuracy", "test_balanced_accuracy", "test_auroc"),
        "the task's metrics (test data)",
        "accuracy.png",
        "The task's metrics on the server's test data after each round; the dashed line is "
        "what always predicting the most frequent class scores.",
    ),
    (
        ("epsilon",),
        "epsilon spent (RDP)",
        "epsilon.png",
        "Epsilon spent after each round (RDP accountant), against the budget (dashed line): "
        "the run stops before a round that would pass it. The first round already costs a "
        "large share: turning the accountant's bound into (epsilon, delta) adds a fixed "
        "cost of about log(1/delta)/(alpha - 1) whatever the number of steps, so later rounds "
        "add less and less (epsilon grows about as the square root of the steps).",
    ),
    (
        ("anchor_projection_error",),
        "projection error on anchors",
        "projection_error.png",
        "Projection error: the share of the public anchors' gradient energy the subspace "
        "misses (0: it holds all of it, 1: none), each time the subspace is computed. Lower "
        "is better: GEP noises the part inside the subspace far less than the rest.",
    ),
)
# A longer run's report table shows every N-th round (the full table is metrics.jsonl).
MAX_TABLE_ROWS = 20
LABELS = {
    "test_accuracy": "accuracy",
    "test_balanced_accuracy": "balanced accuracy",
    "test_auroc": "AUROC",
}


NO_PRIVACY = (
    "NO PRIVACY: the noise multiplier is 0 (the noise switched off), so this run has no "
    "guarantee and its epsilon is infinite"
)


NOTHING_TRAINED = (
    "NOTHING TRAINED: no round updated the model, so the metrics below are the initial model's"
)


def nothing_trained(rows: list[dict]) -> bool:
    """Whether rounds ran and none of them (each round's latest attempt) updated the model."""
    latest = latest_attempts(rows)
    return bool(latest) and not any(r.get("applied") for r in latest)


def lost_rounds_lines(rows: list[dict]) -> list[str]:
    """A line naming the rounds whose metrics were lost (``RunDirectory.note_lost_rounds``)."""
    lost = [r["round"] for r in rows if r.get("metrics_lost")]
    if not lost:
        return []
    return [f"round(s) {', '.join(map(str, lost))}: {LOST_ROUND}"]


def released_unapplied_text(rows: list[dict]) -> str:
    """Client mode: rounds the sites replied to (and recorded in their own ledgers) that did
    not update the model, which the server's figure leaves out; "" when there are none."""
    unapplied = [
        r for r in latest_attempts(rows) if not r.get("applied") and r.get("site_epsilon_max")
    ]
    if not unapplied:
        return ""
    largest = max(r["site_epsilon_max"] for r in rows if r.get("site_epsilon_max") is not None)
    return (
        f"; in applied rounds only: the sites' own ledgers also hold {len(unapplied)} "
        f"round(s) they replied to that did not update the model (largest epsilon a site "
        f"reported: {largest:.3f})"
    )


def seeded_noise_line(seed: int) -> str:
    """What a run whose noise was fixed by a seed (tests and benchmarks) must say first."""
    return (
        f"NOISE SEEDED (noise-seed {seed}; tests and benchmarks only): whoever knows the seed "
        "can remove the noise, so the epsilon below holds only against those who do not"
    )


def _plot(
    rows: list[dict], keys: tuple[str, ...], label: str, path: Path, budget: float | None = None
) -> bool:
    """One line per key over the rounds; the accuracy plot also draws the majority-class
    rate, what always predicting the most frequent class scores, the epsilon plot the
    budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = False
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=100)
    for key in keys:
        points = [(r["round"], r[key]) for r in rows if _finite(r.get(key))]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=LABELS.get(key, key))
            drawn = True
    majority = [r["test_majority_rate"] for r in rows if _finite(r.get("test_majority_rate"))]
    if drawn and "test_accuracy" in keys and majority:
        ax.axhline(majority[-1], color="grey", linestyle="--", label="majority class")
    if drawn and "epsilon" in keys and _finite(budget):
        ax.axhline(budget, color="grey", linestyle="--", label="budget")
        ax.set_ylim(bottom=0)
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xlabel("round")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0] and (len(keys) > 1 or budget is not None):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _finite(value) -> bool:
    return isinstance(value, int | float) and value == value and abs(value) != float("inf")


def _f(value) -> str:
    return f"{value:.4f}" if _finite(value) else "-"


def best_model_line(rows: list[dict]) -> str | None:
    """The model kept on the task's validation set (``best_model.pt``) and its test
    figures, or None when the task has no validation set."""
    best = rows[-1].get("best_round") if rows else None
    if best is None:
        return None
    row = next(r for r in latest_attempts(rows) if r["round"] == best)
    return (
        f"round {best} (validation balanced accuracy {_f(row.get('val_balanced_accuracy'))}, "
        f"accuracy {_f(row.get('val_accuracy'))}): test accuracy {_f(row.get('test_accuracy'))}, "
        f"balanced {_f(row.get('test_balanced_accuracy'))}, AUROC {_f(row.get('test_auroc'))} "
        "(best_model.pt)"
    )


def replies_line(rows: list[dict]) -> str:
    """How many rounds had accepted replies from every asked site, from some, from none
    (each round's latest attempt: a resumed run plays an unapplied round again)."""
    rows = latest_attempts(rows)
    asked = [r.get("sites_asked", r.get("sites_ok", 0)) for r in rows]
    ok = [r.get("sites_ok", 0) for r in rows]
    every = sum(o == a and o > 0 for o, a in zip(ok, asked, strict=True))
    none = sum(o == 0 for o in ok)
    applied = sum(bool(r.get("applied")) for r in rows)
    return (
        f"replies accepted from every site in {every} round(s), from some in "
        f"{len(rows) - every - none}, from none in {none}; the model was updated in {applied}"
    )


def table_step(n_rows: int) -> int:
    """Show every N-th round: the smallest N of 1, 2, 5, 10, 20, 50, ... that keeps the
    table within ``MAX_TABLE_ROWS`` rows."""
    step, factors = 1, iter((2, 2.5, 2) * 20)
    while n_rows / step > MAX_TABLE_ROWS:
        step = round(step * next(factors))
    return step


def sites_formed(run: RunDirectory, config: dict) -> str:
    """How many sites, and how they got their data: their own folders (``--site-data``),
    IID or Dirichlet shares of the task's pooled data (a simulation), or a deployment's."""
    n = config.get("num-sites")
    formed = run.read_json(SITES) if run.file(SITES).exists() else {}
    if "site-data" in formed:
        return f"{n} sites with their own data (`--site-data` {', '.join(formed['site-data'])})"
    if config.get("partition") == "dirichlet":
        shares = (
            f"shares of the task's pooled data with Dirichlet label skew "
            f"(alpha = {config.get('dirichlet-alpha')})"
        )
    else:
        shares = "IID shares of the task's pooled data"
    if formed or (run.path / "sites").is_dir():  # simulated sites keep their ledgers here
        return f"{n} sites holding {shares}"
    return f"{n} sites (if simulated, holding {shares}; if deployed, each its own data)"


def render_report(run_dir: str | Path) -> Path:
    """Write ``report.md`` and its plots into ``run_dir``; returns the report's path."""
    run = RunDirectory.open(run_dir)
    config = run.read_json(CONFIG)
    rows = run.read_metrics()
    lines = [f"# gep-fed run `{run.path.name}`", ""]
    mode, mech = config.get("mode"), config.get("mechanism")
    outcome = run.read_json(OUTCOME) if run.file(OUTCOME).exists() else {}
    refused = refusal_before_round_1(outcome.get("stop_reason"), rows)
    if refused:
        lines += [f"**{refused}**", ""]
    elif nothing_trained(rows):
        lines += [f"**{NOTHING_TRAINED}**", ""]
    if config.get("resolved-noise-multiplier") == 0:
        lines += [f"**{NO_PRIVACY}**", ""]
    elif config.get("noise-seed", -1) >= 0:  # -1: the OS-keyed noise
        lines += [f"**{seeded_noise_line(config['noise-seed'])}**", ""]
    lines += [
        f"- task **{config.get('task')}**, {sites_formed(run, config)}, mode **{mode}**, "
        f"mechanism **{mech}**",
        f"- noise multiplier sigma = {config.get('resolved-noise-multiplier', 0):.4f}, "
        f"q = {config.get('sample-rate')}, budget epsilon = {config.get('target-epsilon')} at "
        f"delta = {config.get('delta')}",
        f"- noise source: {config.get('noise')}",
    ]
    ledger_path = run.ledger_path
    if mech == "langevin":
        lines.append(
            "- privacy spent: Langevin's steps are each accounted by the sites themselves (each "
            "with its own noise), so only the sites' own ledgers hold it (the table shows the "
            "largest a site reported)"
        )
    elif ledger_path.exists():
        ledger = PrivacyLedger.load(ledger_path)
        who = mode_named(mode).spender
        lines.append(
            f"- privacy spent by {who}: epsilon = {ledger.epsilon():.4f} (RDP), "
            f"{pld_text(ledger.epsilon('pld'))} at delta = {ledger.delta:g} over "
            f"{ledger.steps} accounted step(s)"
        )
    for name, spent in simulated_site_spending(run.path):
        lines.append(f"  - site `{name}` (its own ledger): {spent}")
    if rows:
        last = rows[-1]
        lines.append(
            f"- final round {last['round']}: test accuracy {_f(last.get('test_accuracy'))}, "
            f"balanced accuracy {_f(last.get('test_balanced_accuracy'))}, AUROC "
            f"{_f(last.get('test_auroc'))}; always predicting the majority class scores "
            f"{_f(last.get('test_majority_rate'))} (the final round is the result: no round "
            "is picked on the test data)"
        )
        best = best_model_line(rows)
        if best is not None:
            lines.append(f"- best model on the task's validation set: {best}")
        lines.append(f"- {replies_line(rows)}")
    lines += [f"- **{line}**" for line in lost_rounds_lines(rows)]
    if outcome.get("interrupted"):
        lines.append(f"- **{outcome['interrupted']}**")
    elif outcome.get("stop_reason") and not refused:
        lines.append(f"- **stopped early:** {outcome['stop_reason']}")
    if any("site_train_loss_OUTSIDE_PRIVACY_GUARANTEE" in r for r in rows):
        lines.append(
            "- **warning:** sites released raw training losses: those values are "
            "OUTSIDE the privacy guarantee"
        )
    every = table_step(len(rows))
    shown = [r for i, r in enumerate(rows) if r["round"] % every == 0 or i == len(rows) - 1]
    if every > 1:
        lines += ["", f"One round in {every} and the last; every round is in `metrics.jsonl`."]
    lines += [
        "",
        "| round | accuracy | balanced accuracy | AUROC | majority class | epsilon (RDP) | "
        "sites ok / asked | rejected | basis bytes / site | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in shown:
        per_site = r.get("basis_bytes_per_site") or [0]
        lines.append(
            f"| {r['round']} | {_f(r.get('test_accuracy'))} | "
            f"{_f(r.get('test_balanced_accuracy'))} | {_f(r.get('test_auroc'))} | "
            f"{_f(r.get('test_majority_rate'))} | {_f(r.get('epsilon'))} | "
            f"{r.get('sites_ok', '')} / {r.get('sites_asked', '')} | "
            f"{len(r.get('rejected', []))} | {max(per_site)} | "
            f"{r.get('round_seconds', 0):.1f} |"
        )
    rejected = [(r["round"], why) for r in rows for why in r.get("rejected", [])]
    if rejected:
        lines += ["", "## Rejected replies", ""]
        lines += [f"- round {rnd}: {why}" for rnd, why in rejected]
    refused = {
        site: site_rows
        for site, site_rows in read_site_rounds(run.path).items()
        if any(r["outcome"] != "accepted" for r in site_rows)
    }
    if refused:
        lines += ["", "## Simulated sites that were refused", ""]
        lines += [f"- {site}: {site_line(rows_)}" for site, rows_ in sorted(refused.items())]
    lines.append("")
    budget = config.get("target-epsilon")
    for keys, label, name, caption in PLOTS:
        if _plot(rows, keys, label, run.file(name), budget if "epsilon" in keys else None):
            lines += [f"![{label}]({name})", "", caption, ""]
    path = run.file(REPORT)
    path.write_text("\n".join(lines))
    return path


def refusal_before_round_1(stop_reason: str | None, rows: list[dict]) -> str | None:
    """``"refused before round 1: <reason>"`` for a run that stopped before any round was
    played (its budget too small for one round), else None."""
    prefix = "stopped before round 1: "
    if rows or not stop_reason or not stop_reason.startswith(prefix):
        return None
    return f"refused before round 1: {stop_reason.removeprefix(prefix)}"


def summary_lines(
    fed,
    rows: list[dict],
    stop_reason: str | None,
    site_rounds: dict[str, list[dict]],
    run_dir: Path,
    wall: float,
) -> list[str]:
    """The lines of a run's summary: the task's metrics on the test data (accuracy, balanced
    accuracy, AUROC), the model kept on validation, the rounds, the privacy spent (the
    server's ledger and each simulated site's own), the wall time; then each refused site."""
    refused = refusal_before_round_1(stop_reason, rows)
    if refused:
        return [refused]
    out = [f"stopped early: {stop_reason}"] if stop_reason else []
    out += lost_rounds_lines(rows)
    if nothing_trained(rows):
        out.insert(0, NOTHING_TRAINED)
    if fed.noise_multiplier == 0:
        out.append(NO_PRIVACY)
    elif fed.noise_seed is not None:
        out.append(seeded_noise_line(fed.noise_seed))
    last = rows[-1] if rows else {}
    nan = float("nan")
    table = [
        (
            "test accuracy",
            f"{last.get('test_accuracy', nan):.4f} (balanced "
            f"{last.get('test_balanced_accuracy', nan):.4f}, AUROC "
            f"{last.get('test_auroc', nan):.4f}; majority class "
            f"{last.get('test_majority_rate', nan):.4f})",
        ),
        ("rounds", f"{len(latest_attempts(rows))} of {fed.rounds}: {replies_line(rows)}"),
        ("mode / mechanism", f"{fed.mode} / {fed.mechanism}"),
    ]
    best = best_model_line(rows)
    if best is not None:
        table.insert(1, ("best on validation", best))
    ledger = Path(run_dir) / "ledger.json"
    budget = f"at delta={fed.delta:g}, budget {fed.target_epsilon:g}"
    if fed.mechanism == "langevin":  # only the sites' ledgers hold it (they account it)
        table.append(("epsilon spent (largest site)", f"{last.get('epsilon', nan):.4f} {budget}"))
    elif ledger.exists():
        spent = PrivacyLedger.load(ledger)
        who = fed.noise_mode.spender
        table.append(
            (
                f"epsilon spent ({who})",
                f"{spent.epsilon():.3f} (RDP), {pld_text(spent.epsilon('pld'), 3)} {budget}"
                + released_unapplied_text(rows),
            )
        )
    for name, spent in simulated_site_spending(Path(run_dir)):
        table.append((f"  {name} (its own ledger)", spent))
    table.append(("wall time", f"{wall:.1f} s"))
    width = max(len(k) for k, _ in table)
    out += [f"  {key:<{width}}  {value}" for key, value in table]
    for site, site_rows in sorted(site_rounds.items()):
        if any(r["outcome"] != "accepted" for r in site_rows):
            out.append(f"  {site}: {site_line(site_rows)}")
    return out


def simulated_site_spending(run_dir: Path) -> list[tuple[str, str]]:
    """(site, what its own ledger says it spent) for each simulated site of the run. A
    ledger that cannot be read is named with its problem (and left untouched): the rest of
    the report still stands."""
    out = []
    for path in sorted((run_dir / "sites").glob("*/ledger.json")):
        try:
            site = PrivacyLedger.load_keyed(path)
        except LedgerError as err:
            out.append((path.parent.name, f"its ledger cannot be read: {err}"))
            continue
        out.append(
            (path.parent.name, f"epsilon {site.epsilon():.4f} (RDP) over {site.steps} step(s)")
        )
    return out
