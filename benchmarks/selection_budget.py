"""What a random number of trials buys (issue 53): the per-trial epsilon a tuning leaves each
trial, with T trials composed (any mode) or with a secret random number of mean T, only the
best published (central mode; Papernot & Steinke), at the same total.

Pure accounting, no training: each trial's sigma is calibrated to the per-trial epsilon over
its own steps (``gep_fed.federation.tuning``), for two candidates of equal length (GEP and GP,
``--rounds`` rounds at q ``--sample-rate``) on the digits task with a validation split
(``tests/tune_task.py``). Writes ``results/small_data/selection_budget.md``.

    python benchmarks/selection_budget.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gep_fed.accounting.selection import PoissonTrials, TruncatedNegativeBinomial
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.tuning import (
    TuneConfig,
    calibrate_selection_epsilon,
    calibrate_trial_epsilon,
)

OUT = Path(__file__).parent / "results" / "small_data" / "selection_budget.md"
LAWS = {
    "geometric": lambda mean: TruncatedNegativeBinomial.from_mean(1.0, mean),
    "logarithmic": lambda mean: TruncatedNegativeBinomial.from_mean(0.0, mean),
    "Poisson": PoissonTrials,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--totals", type=float, nargs="+", default=[4.0, 8.0])
    parser.add_argument("--means", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sample-rate", type=float, default=0.2)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # tune_task.py
    fed = FederationConfig(
        task="tune_task:ValidatedDigits",
        mode="central",
        rounds=args.rounds,
        sample_rate=args.sample_rate,
    )
    candidates = [{"mechanism": "gep"}, {"mechanism": "gp"}]
    rows = [
        f"# Per-trial epsilon: T trials composed, or a random number of mean T\n\n"
        f"Two candidates (GEP, GP), {args.rounds} central rounds at q = {args.sample_rate}, "
        "delta 1e-5; each trial's sigma calibrated to the per-trial epsilon over its own "
        "steps. Composed: the guarantee against a server that sees every trial (any mode). "
        "Random: only the best trial published by a trusted server (central mode), one "
        "Papernot & Steinke selection in each site's ledger. `benchmarks/selection_budget.py`."
        "\n",
        "| total epsilon | T (or mean) | composed | " + " | ".join(LAWS) + " |",
        "|---" * (3 + len(LAWS)) + "|",
    ]
    for total in args.totals:
        for mean in args.means:
            fixed = TuneConfig(fed, candidates, trials=mean, target_epsilon=total)
            cells = [f"{calibrate_trial_epsilon(fixed, fixed.plan())[0]:.3f}"]
            for law in LAWS.values():
                random_k = TuneConfig(
                    fed, candidates, random_trials=law(mean), target_epsilon=total
                )
                cells.append(f"{calibrate_selection_epsilon(random_k)[0]:.3f}")
            rows.append(f"| {total:g} | {mean} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    OUT.write_text("\n".join(rows) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
