"""``gep-fed tune``: choose among declared settings privately (``gep_fed.flower.tuning``,
``gep_fed.federation.tuning``)."""

from __future__ import annotations

import argparse
import logging
import sys

from gep_fed.federation.config import FederationConfig
from gep_fed.federation.modes import MODE_NAMES
from gep_fed.federation.tuning import (
    TRIAL_LAWS,
    Rehearsal,
    TuneConfig,
    candidates_from_toml,
    search_base,
    site_score_of,
    trial_law,
)

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
        "binomials of shape 1 and 0; logarithmic costs less privacy, with a heavier tail)",
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
        "--rehearse",
        type=int,
        nargs="?",
        const=2,
        metavar="FOLDS",
        help="choose before any site trains: rehearse every candidate on FOLDS folds (default "
        "2) of the server's own validation data, with the noise its real run would have, and "
        "run only the best at the whole budget (the sites' ledgers record one run). Not with "
        "--trials, --random-trials or --site-validation",
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
        "--drop-bad-examples",
        action="store_true",
        help="run even when a site's data has examples that cannot be read or do not suit "
        "the task (as gep-fed simulate's): they are dropped from every sample, each named",
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
    given = {"task": args.task, "mode": args.mode, "run-dir": args.run_dir}
    return search_base(table, {k: v for k, v in given.items() if v is not None}, args.candidates)


def random_trials(args: argparse.Namespace):
    """``--random-trials MEAN`` under ``--trials-law`` (None without it)."""
    return trial_law(args.random_trials, args.trials_law, "--random-trials")


def site_score(args: argparse.Namespace):
    """``--site-validation FRACTION --score-noise STD`` as a ``SiteScore`` (None: neither)."""
    names = ("--site-validation", "--score-noise")
    return site_score_of(args.site_validation, args.score_noise, names)


def tune_config(args: argparse.Namespace) -> TuneConfig:
    """The search the options declare (under ``flwr run``, its run config's keys declare
    the same: ``gep_fed.federation.tuning.search_of_run_config``)."""
    table, candidates = candidates_from_toml(args.candidates)
    return TuneConfig(
        base_config(args, table),
        candidates,
        trials=args.trials,
        random_trials=random_trials(args),
        target_epsilon=args.epsilon,
        delta=args.delta,
        reference=args.reference,
        out_dir=args.out or "",
        site_score=site_score(args),
        rehearsal=None if args.rehearse is None else Rehearsal(args.rehearse),
    )


def run_tune(args: argparse.Namespace) -> int:
    from gep_fed.flower.tuning import failure_line, result_lines, tune

    config = tune_config(args)
    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from gep_fed.flower.simulation import site_data_from_pairs

    options = {
        "progress": sys.stderr.isatty(),
        "engine": args.engine,
        "drop_bad_examples": args.drop_bad_examples,
    }
    site_data = site_data_from_pairs(args.site_data)
    if site_data:
        options["site_data"] = site_data
    result = tune(config, log=print, simulate_options=options)
    print("\n".join(["", *result_lines(result)]))
    failed = failure_line(result)
    if failed is not None:
        print(failed, file=sys.stderr)
        return 1
    return 0
