"""The summary a finished run prints, the same from ``gep-fed simulate`` and ``flwr run``."""

from __future__ import annotations

from pathlib import Path

from gep_fed.accounting.events import pld_text
from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.federation.rundir import latest_attempts


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
    from gep_fed.cli.report import best_model_line, replies_line
    from gep_fed.flower.simulation import site_line

    refused = refusal_before_round_1(stop_reason, rows)
    if refused:
        return [refused]
    out = [f"stopped early: {stop_reason}"] if stop_reason else []
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
    if fed.mechanism == "langevin":  # only the sites' ledgers know it (it depends on n_i)
        table.append(("epsilon spent (largest site)", f"{last.get('epsilon', nan):.4f} {budget}"))
    elif ledger.exists():
        spent = PrivacyLedger.load(ledger)
        who = fed.noise_mode.spender
        table.append(
            (
                f"epsilon spent ({who})",
                f"{spent.epsilon():.3f} (RDP), {pld_text(spent.epsilon('pld'), 3)} {budget}",
            )
        )
    for path in sorted((Path(run_dir) / "sites").glob("*/ledger.json")):  # simulated sites
        site = PrivacyLedger.load_keyed(path)
        table.append(
            (
                f"  {path.parent.name} (its own ledger)",
                f"epsilon {site.epsilon():.3f} (RDP) over {site.steps} step(s)",
            )
        )
    table.append(("wall time", f"{wall:.1f} s"))
    width = max(len(k) for k, _ in table)
    out += [f"  {key:<{width}}  {value}" for key, value in table]
    for site, site_rows in sorted(site_rounds.items()):
        if any(r["outcome"] != "accepted" for r in site_rows):
            out.append(f"  {site}: {site_line(site_rows)}")
    return out
