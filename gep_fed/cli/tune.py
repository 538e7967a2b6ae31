"""``gep-fed tune``: choose among declared settings privately (``gep_fed.flower.tuning``,
``gep_fed.federation.tuning``)."""

from __future__ import annotations

import argparse
import logging
import math
import sys

from gep_fed.federation.config import FederationConfig
from gep_fed.federation.modes import MODE_NAMES
from gep_fed.validation import ConfigError

# --trials-law: a truncated negative binomial's shape eta, or Poisson
TRIAL_LAWS = {"geometric": 1.0, "logarithmic": 0.0, "poisson": None}

EXAMPLE = """\
a candidates file (TOML): an optional [base] table of the settings every trial shares, and
one [[candidate]] table per candidate, with the run config's keys (kebab- or snake-case):

  [base]
  num-sites = 3
  rounds = 20

  [[candidate]]
  mechanism = "gep"
  server-lr = 2.0

  [[candidate]]
  mechanism = "gp"
  clip-norm = 0.5
  sample-rate = 0.05
"""


def add_tune_parser(sub) -> None:
    """The ``tune`` subcommand, on the ``gep-fed`` parser's subparsers ``sub``."""
    p = sub.add_parser(
        "tune",
        help="choose among declared settings privately: each trial a federated run, all "
        "within one total budget that every site's ledger records",
        description="Run T trials, one after another in one federated simulation, each a "
        "federated run of one declared candidate, all sharing one total privacy budget "
        "(each trial gets the same calibrated share, and every site's ledger records every "
        "trial it took part in and refuses one beyond its budget; with --random-trials, in "
        "central mode, a secret random number of trials accounted as one selection). The "
        "candidate whose run scores best on the server's own validation data (with "
        "--site-validation: on the sites' noised counts) is chosen; its model and test "
        "figures are reported, never used to choose. Writes tune.json and tune.md. Exit "
        "status 1 when no trial finished.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--candidates",
        required=True,
        metavar="FILE.toml",
        help="the candidates: [[candidate]] tables of settings over an optional [base] table",
    )
    p.add_argument(
        "--task",
        help="the task, which must have validation data (e.g. pneumonia; default: [base]'s task)",
    )
    p.add_argument(
        "--trials",
        type=int,
        help="T, the number of trials: each costs a share of the budget (default: every "
        "candidate once, in the file's order; otherwise each trial's candidate is drawn "
        "uniformly by the OS's random number generator)",
    )
    p.add_argument(
        "--random-trials",
        type=float,
        metavar="MEAN",
        help="instead of --trials, a secret random number of trials of this mean (>= 1, "
        "drawn by the OS), of which only the best is published: accounted as one selection "
        "(Papernot & Steinke), tighter than composing the trials. Central mode only (the "
        "server sees every trial, so it must be one the sites trust)",
    )
    p.add_argument(
        "--trials-law",
        choices=TRIAL_LAWS,
        default="geometric",
        help="the law of --random-trials: geometric or logarithmic (truncated negative "
        "binomials of shape 1 and 0; logarithmic costs less privacy, with a heavier tail), "
        "or poisson (for very private trials)",
    )
    p.add_argument(
        "--epsilon",
        type=float,
        help="the total epsilon of the whole tuning at every site: the composition of all "
        "its trials (default: [base]'s target-epsilon, else 8)",
    )
    p.add_argument(
        "--delta", type=float, help="the delta of that total (default: [base]'s, else 1e-5)"
    )
    p.add_argument(
        "--mode",
        choices=list(MODE_NAMES),
        help="the noise placement of every trial (default: [base]'s, else client)",
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="also run every candidate once at the whole budget and report the best on "
        "validation: a non-private selection, labelled OUTSIDE THE GUARANTEE",
    )
    p.add_argument(
        "--site-validation",
        type=float,
        metavar="FRACTION",
        help="score each trial on this share of every site's examples, held out from its "
        "training, by the sites' noised per-class counts (one release per site and trial, "
        "in its ledger and in the budget); for a task whose server has no validation data. "
        "Needs --score-noise",
    )
    p.add_argument(
        "--score-noise",
        type=float,
        metavar="STD",
        help="with --site-validation: the Gaussian noise's std on each count a site releases "
        "(larger: more private, a noisier score)",
    )
    p.add_argument(
        "--site-data",
        action="append",
        metavar="NAME=PATH",
        help="a simulated site with its own data (as gep-fed simulate's), the same in every "
        "trial; repeat it for each site. Default: shares of the task's pooled data",
    )
    p.add_argument(
        "--engine",
        choices=("ray", "in-process"),
        default="ray",
        help="how the search's simulation runs (as gep-fed simulate's)",
    )
    p.add_argument("--run-dir", help="where the tuning's folder goes (default: runs)")
    p.add_argument(
        "--out",
        help="the tuning's folder (default: <run-dir>/tune-<time>); an interrupted tuning's "
        "folder, with the same settings, resumes it where it stopped",
    )
    p.set_defaults(func=run_tune)


def base_config(args: argparse.Namespace, table: dict) -> FederationConfig:
    """The settings every trial shares: the file's [base] table under the options given."""
    from gep_fed.data.registry import task_file_name

    given = {"task": args.task, "mode": args.mode, "run-dir": args.run_dir}
    values = {**table, **{k: v for k, v in given.items() if v is not None}}
    if "task" in values and isinstance(values["task"], str):
        values["task"] = task_file_name(values["task"])
    try:
        return FederationConfig.from_record(values)
    except ConfigError as err:
        raise ConfigError(f"{args.candidates} [base]: {err}") from None


def _number(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.4f}"


def random_trials(args: argparse.Namespace):
    """``--random-trials MEAN`` under ``--trials-law`` (None without it)."""
    from gep_fed.accounting.selection import PoissonTrials, TruncatedNegativeBinomial

    if args.random_trials is None:
        return None
    mean = args.random_trials
    if not (math.isfinite(mean) and mean >= 1):
        raise ConfigError(f"--random-trials must be a mean number of trials >= 1, got {mean:g}")
    if args.trials_law == "poisson":
        return PoissonTrials(mean)
    return TruncatedNegativeBinomial.from_mean(TRIAL_LAWS[args.trials_law], mean)


def site_score(args: argparse.Namespace):
    """``--site-validation FRACTION --score-noise STD`` as a ``SiteScore`` (None: neither)."""
    from gep_fed.federation.site_score import SiteScore

    given = (args.site_validation is not None, args.score_noise is not None)
    if given == (False, False):
        return None
    if given != (True, True):
        raise ConfigError("--site-validation and --score-noise go together")
    return SiteScore(args.site_validation, args.score_noise)


def run_tune(args: argparse.Namespace) -> int:
    from gep_fed.federation.tuning import TuneConfig, candidates_from_toml
    from gep_fed.flower.tuning import OUTSIDE, TUNE_MD, tune

    table, candidates = candidates_from_toml(args.candidates)
    config = TuneConfig(
        base_config(args, table),
        candidates,
        trials=args.trials,
        random_trials=random_trials(args),
        target_epsilon=args.epsilon,
        delta=args.delta,
        reference=args.reference,
        out_dir=args.out or "",
        site_score=site_score(args),
    )
    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from gep_fed.flower.simulation import site_data_from_pairs

    options = {"progress": sys.stderr.isatty(), "engine": args.engine}
    site_data = site_data_from_pairs(args.site_data)
    if site_data:
        options["site_data"] = site_data
    result = tune(config, log=print, simulate_options=options)
    print("")
    if result.stopped:
        print(f"stopped early: {result.stopped}")
    if result.chosen is not None:
        c = result.chosen
        settings = ", ".join(f"{k.replace('_', '-')}={v}" for k, v in c.settings.items())
        test = ", ".join(f"{k} {v:.4g}" for k, v in result.test_metrics.items())
        print(
            f"chosen: trial {c.trial}, candidate {c.candidate} ({settings or 'the base'}), "
            f"validation score {c.validation_score:.4f} (round {c.best_round})"
        )
        print(f"its test metrics (never used to choose): {test}")
        print(f"model: {result.model_path}")
    covers = (
        "the selection, what the trusted server publishes"
        if result.selection
        else "every trial it took part in, the guarantee against the server"
    )
    print(
        f"epsilon of the whole tuning (each site's ledger: {covers}): "
        f"{_number(result.epsilon_rdp)} (RDP), {_number(result.epsilon_pld)} (PLD), "
        f"delta {result.delta:g}"
    )
    reference = (result.reference or {}).get("chosen")
    if reference is not None:
        test = ", ".join(f"{k} {v:.4g}" for k, v in reference["test"].items())
        print(
            f"non-private reference, {OUTSIDE}: candidate {reference['candidate']}, "
            f"validation {reference['validation_score']:.4f}; test: {test}"
        )
    print(f"tuning directory: {result.out_dir}\nreport:           {result.out_dir / TUNE_MD}")
    if result.chosen is None:
        why = result.stopped or "every trial failed (see tune.md)"
        print(f"FAILED: no trial finished: {why}", file=sys.stderr)
        return 1
    return 0
