"""``report.md`` with PNG plots for a run directory (accuracy, epsilon, projection error)."""

from __future__ import annotations

from pathlib import Path

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.federation.rundir import CONFIG, REPORT, RunDirectory

PLOTS = (
    ("test_accuracy", "test accuracy", "accuracy.png"),
    ("epsilon", "epsilon spent (RDP)", "epsilon.png"),
    ("anchor_projection_error", "projection error on anchors", "projection_error.png"),
)


def _plot(rows: list[dict], key: str, label: str, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    ax.plot(*zip(*points, strict=True), marker="o")
    ax.set_xlabel("round")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def render_report(run_dir: str | Path) -> Path:
    """Write ``report.md`` and its plots into ``run_dir``; returns the report's path."""
    run = RunDirectory.open(run_dir)
    config = run.read_json(CONFIG)
    rows = run.read_metrics()
    lines = [f"# gep-fed run `{run.path.name}`", ""]
    mode, mech = config.get("mode"), config.get("mechanism")
    lines += [
        f"- task **{config.get('task')}**, {config.get('num-sites')} sites "
        f"({config.get('partition')}), mode **{mode}**, mechanism **{mech}**",
        f"- noise multiplier sigma = {config.get('resolved-noise-multiplier', 0):.4f}, "
        f"q = {config.get('sample-rate')}, budget epsilon = {config.get('target-epsilon')} at "
        f"delta = {config.get('delta')}",
        f"- noise source: {config.get('noise')}",
    ]
    ledger_path = run.ledger_path
    if mech == "langevin":
        lines.append(
            "- privacy spent: Langevin's epsilon depends on each site's data size, so only the "
            "sites' own ledgers hold it (the table shows the largest a site reported)"
        )
    elif ledger_path.exists():
        ledger = PrivacyLedger.load(ledger_path)
        who = "the federation" if mode == "central" else "each participating site (expected)"
        lines.append(
            f"- privacy spent by {who}: epsilon = {ledger.epsilon():.4f} (RDP), "
            f"{ledger.epsilon('pld'):.4f} (PLD) at delta = {ledger.delta:g} over "
            f"{ledger.steps} accounted step(s)"
        )
    for path in sorted((run.path / "sites").glob("*/ledger.json")):  # simulated sites
        site = PrivacyLedger.load_keyed(path)
        lines.append(
            f"  - site `{path.parent.name}` (its own ledger): epsilon = "
            f"{site.epsilon():.4f} over {site.steps} step(s)"
        )
    if rows:
        last = rows[-1]
        lines.append(
            f"- final test accuracy {last.get('test_accuracy', float('nan')):.4f} after round "
            f"{last['round']}"
        )
    if any("site_train_loss_OUTSIDE_PRIVACY_GUARANTEE" in r for r in rows):
        lines.append(
            "- **warning:** sites released raw training losses: those values are "
            "OUTSIDE the privacy guarantee"
        )
    lines += [
        "",
        "| round | test accuracy | epsilon (RDP) | sites ok | rejected | "
        "basis bytes / site | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_site = r.get("basis_bytes_per_site") or [0]
        lines.append(
            f"| {r['round']} | {r.get('test_accuracy', float('nan')):.4f} | "
            f"{r['epsilon']:.4f} | "
            f"{r.get('sites_ok', '')} | {len(r.get('rejected', []))} | {max(per_site)} | "
            f"{r.get('round_seconds', 0):.1f} |"
        )
    rejected = [(r["round"], why) for r in rows for why in r.get("rejected", [])]
    if rejected:
        lines += ["", "## Rejected replies", ""]
        lines += [f"- round {rnd}: {why}" for rnd, why in rejected]
    lines.append("")
    for key, label, name in PLOTS:
        if _plot(rows, key, label, run.file(name)):
            lines += [f"![{label}]({name})", ""]
    path = run.file(REPORT)
    path.write_text("\n".join(lines))
    return path
