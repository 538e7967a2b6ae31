"""The ``gep-fed`` command line: simulate, compare, report, calibrate."""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
import time
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from gep_fed.accounting.events import ImpossibleTargetError, pld_text
from gep_fed.cli import site_tools
from gep_fed.cli.site_tools import add_keygen_parser, add_ledger_parser
from gep_fed.validation import ConfigError

if TYPE_CHECKING:
    from gep_fed.federation.config import FederationConfig


def _field_type(f) -> type:
    from gep_fed.federation.config import FederationConfig

    hint = typing.get_type_hints(FederationConfig)[f.name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def task_recommendations() -> dict[str, dict[str, object]]:
    """For each ``FederationConfig`` field some task recommends: which tasks set it, and to
    what (the built-in tasks by name; "a task of your own" for ``SMALL_DATA_RECIPE``, which a
    user's task gets unless it declares its own)."""
    from gep_fed.data.registry import BUILT_IN_TASKS
    from gep_fed.data.task import SMALL_DATA_RECIPE

    out: dict[str, dict[str, object]] = {}
    for name, cls in BUILT_IN_TASKS.items():
        for key, value in cls.recommended_settings.items():
            out.setdefault(key, {})[name] = value
    for key, value in SMALL_DATA_RECIPE.items():
        out.setdefault(key, {})["a task of your own"] = value
    return out


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_federation_options(parser: argparse.ArgumentParser) -> None:
    """One ``--kebab-case`` option per ``FederationConfig`` field, with its help text and its
    default: the field's own, or the task's recommendation where a task sets one; shown in
    the fields' groups (``FIELD_GROUPS``)."""
    from gep_fed.federation.config import FIELD_GROUPS, FederationConfig

    recommended = task_recommendations()
    titles = {name: title for title, names in FIELD_GROUPS.values() for name in names}
    groups = {title: parser.add_argument_group(title) for title, _ in FIELD_GROUPS.values()}
    for f in fields(FederationConfig):
        group = groups[titles[f.name]]
        flag = "--" + f.name.replace("_", "-")
        kind = _field_type(f)
        default = f"default: {_shown(f.default)}"
        if f.name in recommended:
            by = "; ".join(f"{t} {_shown(v)}" for t, v in recommended[f.name].items())
            default = f"default: the task's recommendation ({by}), else {_shown(f.default)}"
        help_text = f"{f.metadata.get('help', '')} ({default})".replace("%", "%%")
        if kind is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif f.name == "noise_multiplier":
            group.add_argument(flag, default=None, metavar="SIGMA|auto", help=help_text)
        else:
            group.add_argument(flag, type=kind, default=None, help=help_text)


def _given(args: argparse.Namespace) -> dict:
    from gep_fed.federation.config import FederationConfig

    values = {}
    for f in fields(FederationConfig):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        if f.name == "noise_multiplier":
            value = None if value == "auto" else _float(value, "--noise-multiplier")
        if f.name == "task":
            from gep_fed.data.registry import task_file_name

            value = task_file_name(value)
        values[f.name] = value
    return values


def federation_config(args: argparse.Namespace, announce: bool = True) -> FederationConfig:
    """The options given, over the task's recommended settings, over the defaults."""
    from gep_fed.federation.config import FederationConfig

    values = _given(args)
    fed = FederationConfig.for_task(**values)
    from gep_fed.data.registry import resolve_task

    applied = {
        k: v for k, v in resolve_task(fed.task).recommended_settings.items() if k not in values
    }
    if applied and announce:
        shown = ", ".join(f"{k.replace('_', '-')}={_shown(v)}" for k, v in applied.items())
        print(f"task {fed.task} recommends (override with the options): {shown}", file=sys.stderr)
    return fed


def settings_lines(args: argparse.Namespace) -> list[str]:
    """Every setting a run with these options would use, and where each comes from."""
    from gep_fed.data.registry import resolve_task
    from gep_fed.federation.config import FederationConfig

    given = _given(args)
    fed = federation_config(args, announce=False)
    recommended = resolve_task(fed.task).recommended_settings
    rows = []
    for f in fields(FederationConfig):
        if f.name in given:
            source = "option"
        elif f.name in recommended:
            source = f"task {fed.task}"
        else:
            source = "default"
        value = getattr(fed, f.name)
        rows.append((f.name.replace("_", "-"), "auto" if value is None else _shown(value), source))
    width = max(len(name) for name, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    lines = [f"settings of a run of task {fed.task} (nothing is run):"]
    lines += [f"  {n:<{width}}  {v:<{value_width}}  ({s})" for n, v, s in rows]
    return lines


def _float(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{flag} must be a number or 'auto', got {text!r}") from None


def _quiet_logs() -> None:
    for name in ("flwr", "ray", "datasets"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _simulate(args: argparse.Namespace) -> int:
    from gep_fed.federation.report import nothing_trained, render_report, summary_lines
    from gep_fed.flower.simulation import simulate, site_data_from_pairs

    if args.show_settings:
        print("\n".join(settings_lines(args)))
        # what a run refuses before its first round (an unreachable budget) is refused here
        federation_config(args, announce=False).resolve()
        return 0
    site_data = site_data_from_pairs(args.site_data)
    if site_data:  # the sites given their own data are the federation
        n = len(site_data)
        if args.num_sites not in (None, n) or (args.min_sites or 0) > n:
            flag, given = (
                ("--num-sites", args.num_sites)
                if args.num_sites not in (None, n)
                else ("--min-sites", args.min_sites)
            )
            raise ConfigError(
                f"{flag} {given} with {n} --site-data sites: the sites given their own data "
                f"are the federation; leave out {flag}, or give at most that many sites"
            )
    fed = federation_config(args)
    _quiet_logs()
    began = time.perf_counter()
    result = simulate(
        fed,
        progress=True,
        site_data=site_data,
        drop_bad_examples=args.drop_bad_examples,
        engine=args.engine,
    )
    wall = time.perf_counter() - began
    report = render_report(result.run_dir)
    lines = summary_lines(
        fed, result.metrics, result.stop_reason, result.site_rounds, result.run_dir, wall
    )
    print("\n".join(["", *lines]))
    print(f"run directory: {result.run_dir}\nreport:        {report}")
    failures = result.failures()
    for line in failures:
        print(f"FAILED: {line}", file=sys.stderr)
    if failures and args.allow_site_failures and not nothing_trained(result.metrics):
        print("(site failures allowed: --allow-site-failures)", file=sys.stderr)
        failures = []
    return 0 if result.stop_reason is None and not failures else 1


def _report(args: argparse.Namespace) -> int:
    from gep_fed.federation.report import render_report

    print(render_report(args.run_dir))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from gep_fed.accounting.events import epsilon_pld, epsilon_rdp
    from gep_fed.mechanisms.mechanism import calibrate_noise_multiplier, mechanism_class

    sigma = calibrate_noise_multiplier(
        args.epsilon, args.delta, args.sample_rate, args.steps, args.mechanism
    )
    events = [mechanism_class(args.mechanism).event(sigma, args.sample_rate, args.steps)]
    print(
        f"noise multiplier sigma = {sigma:.4f}  ({args.mechanism}, q={args.sample_rate:g}, "
        f"{args.steps} steps)"
    )
    print(
        f"epsilon at delta={args.delta:g}: RDP {epsilon_rdp(events, args.delta):.4f}, "
        f"PLD {epsilon_pld(events, args.delta):.4f}"
    )
    return 0


def _site_check(args: argparse.Namespace) -> int:
    from flwr.common.config import parse_config_args
    from tqdm import tqdm

    from gep_fed.federation.site_check import check_site

    # A task named by import path lives in the app the site reviewed, as the ClientApp sees it.
    sys.path.insert(0, str(Path(args.app_dir).resolve()))
    try:
        node_config = parse_config_args([args.node_config])
    except Exception as err:  # Flower's parser raises click's exception, whose text says why
        raise ConfigError(f"--node-config {args.node_config!r}: {err}") from None
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        bar = bar or tqdm(total=total, desc="reading the site's examples", unit="ex")
        bar.update(1)

    expected = [c.strip() for c in args.classes.split(",")] if args.classes else None
    result = check_site(node_config, progress, expected)
    if bar is not None:
        bar.close()
    print("\n".join(result.lines()))
    return 0 if result.ok else 1


def _audit(args: argparse.Namespace) -> int:
    import json

    from gep_fed.audit.harness import AuditSetup, report_lines, run_audit

    setup = AuditSetup(
        mechanism=args.mechanism,
        mode=args.mode,
        epsilon=args.epsilon,
        delta=args.delta,
        canaries=args.canaries,
        steps=args.steps,
        sample_rate=args.sample_rate,
        canary_kinds=tuple(args.canary_kinds) if args.canary_kinds else None,
        seed=args.seed,
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.run_dir) / f"audit-{stamp}-{args.mechanism}-{args.mode}-eps{args.epsilon:g}"
    out.mkdir(parents=True, exist_ok=False)
    began = time.perf_counter()
    try:
        result = run_audit(setup, run_dir=str(out))
    except BaseException:
        if not any(out.iterdir()):  # a failed audit leaves no empty folder behind
            out.rmdir()
        raise
    (out / "audit.json").write_text(json.dumps(result.to_dict(), indent=1))
    title = f"# gep-fed audit `{out.name}`"
    (out / "report.md").write_text("\n".join([title, "", *report_lines(result)]))
    rows = [
        ("audited", f"{result.mechanism}, mode {result.mode} ({result.placement} noise)"),
        (
            "claimed epsilon",
            f"{result.claimed_epsilon_rdp:.4f} (RDP), {pld_text(result.claimed_epsilon_pld)} "
            f"at delta={result.delta:g}",
        ),
        (
            "audited epsilon",
            f">= {result.epsilon_lower_bound:.4f} ({result.confidence:.0%} confidence; "
            f"{result.correct} of {result.guesses} guesses right, {result.canaries} canaries)",
        ),
        (
            "audited mu (GDP)",
            f"f-DP >= {result.gdp_mu_lower_bound:.4f}, Gaussian fit >= "
            f"{result.fitted_mu_lower_bound:.4f}, claimed {result.claimed_mu:.4f} "
            "(q = 1 only)",
        ),
        (
            "releases",
            f"{result.steps} at q={result.sample_rate:g}, sigma={result.noise_multiplier:.4f}",
        ),
        ("wall time", f"{time.perf_counter() - began:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    if result.caught_by:
        print(
            "AUDIT FAILED: the run leaks more than it claims "
            f"(bound above the claim: {', '.join(result.caught_by)})"
        )
    print(f"run directory: {out}")
    return 1 if result.epsilon_lower_bound > result.claimed_epsilon_rdp else 0


def _compare(args: argparse.Namespace) -> int:
    from gep_fed.cli.compare import run_comparison

    _quiet_logs()
    base = federation_config(args)
    table, failures = run_comparison(
        base,
        epsilons=args.epsilons,
        out_dir=args.out,
        central_reference=not args.no_reference,
        equal=args.equal,
        mechanisms=tuple(args.mechanisms),
        modes=tuple(args.modes),
    )
    print(table)
    for line in failures:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failures else 0


def build_parser() -> argparse.ArgumentParser:
    """The whole ``gep-fed`` parser (every command: it loads the library)."""
    from gep_fed.federation.modes import MODE_NAMES
    from gep_fed.federation.policy import NODE_CONFIG_KEYS

    parser = argparse.ArgumentParser(
        prog="gep-fed",
        description="Federated training with Gradient Embedding Perturbation (GEP) "
        "differential privacy, on Flower and PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser(
        "simulate",
        help="run a federated simulation (defaults: bundled digits, 3 sites, "
        "client-side GEP, offline)",
        description="Run a federated simulation on the Flower Simulation Engine. Every "
        "setting below has a default that needs no download.",
    )
    add_federation_options(sim)
    sim.add_argument(
        "--allow-site-failures",
        action="store_true",
        help="exit 0 even when a round did not update the model (fewer valid replies than "
        "--min-sites) or a site was refused in every round (the failures are still printed)",
    )
    sim.add_argument(
        "--site-data",
        action="append",
        metavar="NAME=PATH",
        help="a simulated site with its own data (a folder or file the task's site_dataset "
        "reads, as a deployed site's data-path), named NAME; repeat it for each site. "
        "Default: shares of the task's pooled data",
    )
    sim.add_argument(
        "--drop-bad-examples",
        action="store_true",
        help="run even when a site's data has examples that cannot be read or do not suit "
        "the task (checked before round 1): they are dropped from every sample",
    )
    sim.add_argument(
        "--engine",
        choices=["ray", "in-process"],
        default="ray",
        help="ray: Flower's Simulation Engine (the sites in parallel worker processes); "
        "in-process: the same server and site apps exchanging Flower's messages in this "
        "process, one site after another (no start-up: quick runs and tests)",
    )
    sim.add_argument(
        "--show-settings",
        action="store_true",
        help="print every setting the run would use (the options, the task's recommendation, "
        "the defaults), each with where it comes from, and exit without running",
    )
    sim.set_defaults(func=_simulate)

    cmp = sub.add_parser(
        "compare",
        help="run non-private, GP, B-GEP and GEP in each mode on the same data",
        description="Run a matrix of configurations on the same data, sites and seeds and "
        "write one Markdown table and one plot. A run whose rounds did not update the model, "
        "or whose site was refused in every round, is marked in the table with its cause, "
        "and the command exits 1.",
    )
    add_federation_options(cmp)
    cmp.add_argument(
        "--epsilons",
        type=float,
        nargs="+",
        default=[2.0, 8.0],
        help="privacy budgets to compare (default: 2 8)",
    )
    cmp.add_argument("--out", default="comparisons", help="where the table and plot go")
    cmp.add_argument(
        "--equal",
        choices=["steps", "rounds"],
        default="steps",
        help="compare the modes at equal private steps per party (default: central mode runs "
        "rounds x local-steps rounds of one step) or at equal rounds",
    )
    cmp.add_argument(
        "--mechanisms",
        nargs="+",
        choices=["gp", "bgep", "gep"],
        default=["gp", "bgep", "gep"],
        help="the private mechanisms to run (default: all three)",
    )
    cmp.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODE_NAMES),
        default=list(MODE_NAMES),
        help="the noise placements to run (default: all three)",
    )
    cmp.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the centralised (pooled-data) GEP and GP reference runs",
    )
    cmp.set_defaults(func=_compare)

    from gep_fed.cli.tune import add_tune_parser

    add_tune_parser(sub)

    rep = sub.add_parser("report", help="re-render report.md and plots of a run directory")
    rep.add_argument("run_dir", help="a run directory (holds config.json, metrics.jsonl)")
    rep.set_defaults(func=_report)

    cal = sub.add_parser(
        "calibrate", help="print the noise multiplier sigma that meets a target epsilon"
    )
    cal.add_argument(
        "--epsilon",
        type=float,
        required=True,
        help="target epsilon: the privacy loss bound to stay within",
    )
    cal.add_argument(
        "--delta",
        type=float,
        default=1e-5,
        help="target delta: the probability the epsilon bound may fail",
    )
    cal.add_argument(
        "--sample-rate",
        type=float,
        required=True,
        help="q: each example's chance to be in a step's Poisson sample",
    )
    cal.add_argument("--steps", type=int, required=True, help="number of noisy releases")
    cal.add_argument(
        "--mechanism",
        choices=["gep", "bgep", "gp"],
        default="gep",
        help="gep releases two vectors per step and is accounted at sigma/sqrt(2)",
    )
    cal.set_defaults(func=_calibrate)

    aud = sub.add_parser(
        "audit",
        help="measure a lower bound on the epsilon a run really has (one-run canary audit)",
        description="Train with m gradient canaries through the real code path and turn the "
        "auditor's guesses into an epsilon lower bound at 95%% confidence (Steinke, Nasr & "
        "Jagielski 2023). A bound above the claimed epsilon proves the run leaks more than "
        "it accounts; a bound below it proves nothing about the claim.",
    )
    aud.add_argument(
        "--mechanism",
        choices=["gep", "bgep", "gp", "langevin"],
        default="gep",
        help="langevin: multi-pass on a linear model, mode single",
    )
    aud.add_argument(
        "--mode",
        choices=["single", "central", "client", "distributed"],
        default="client",
        help="single: GEPStep; central: site sums noised by the server; client: site noise",
    )
    aud.add_argument("--epsilon", type=float, default=8.0, help="the claim to audit")
    aud.add_argument("--delta", type=float, default=1e-5, help="delta of the claim")
    aud.add_argument("--canaries", type=int, default=1000, help="m, canary gradients")
    aud.add_argument("--steps", type=int, default=1, help="T, private releases audited")
    aud.add_argument(
        "--canary-kinds",
        nargs="+",
        choices=("embedding", "residual", "both", "gradient"),
        default=None,
        help="aim the canaries at these kinds (default: every kind the mechanism releases)",
    )
    aud.add_argument(
        "--sample-rate", type=float, default=1.0, help="q, Poisson rate of every example"
    )
    aud.add_argument(
        "--seed", type=int, default=0, help="fixes canaries, sampling and noise (repeatable)"
    )
    aud.add_argument("--run-dir", default="runs", help="where the audit's run directory goes")
    aud.set_defaults(func=_audit)

    add_ledger_parser(sub)
    site = sub.add_parser("site", help="check a hospital's site before it joins a federation")
    site_sub = site.add_subparsers(dest="site_command", required=True)
    check = site_sub.add_parser(
        "check",
        help="check a site's node config, task, every example of its data, and its ledger",
        description="Run at the site with the node config its SuperNode will use. During a run "
        "an example that cannot be read or does not suit the task is dropped silently (a "
        "failed reply would reveal it), so fix what this reports before joining. Exit status "
        "0: ready; 1: problems found. Nothing leaves the site.",
        epilog="node config keys:\n"
        + "\n".join(
            textwrap.fill(f"{key}: {meaning}", 88, initial_indent="  ", subsequent_indent="    ")
            for key, meaning in NODE_CONFIG_KEYS.items()
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument(
        "--node-config",
        required=True,
        help='the SuperNode\'s --node-config string, e.g. \'site-id="h1" task="digits" ...\'',
    )
    check.add_argument(
        "--app-dir",
        default=".",
        help="the folder of the app the site reviewed, where a task named by import path "
        "lives (default: the current folder)",
    )
    check.add_argument(
        "--classes",
        help="the federation's class names in label order, comma-separated (e.g. "
        "'normal,pneumonia'): a site whose class folders name others fails the check",
    )
    check.set_defaults(func=_site_check)
    add_keygen_parser(site_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _run(argv)
    except KeyboardInterrupt:  # while the command was still being read
        print("\ngep-fed: interrupted before it began", file=sys.stderr)
        return 130


def _run(argv: list[str]) -> int:
    from gep_fed.flower.interrupt import RunInterrupted

    parser = site_tools.build_parser() if site_tools.handles(argv) else build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except RunInterrupted as stopped:
        print(f"\n{stopped.line()}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # before the run's first round began
        print(f"\ngep-fed {args.command}: interrupted before round 1", file=sys.stderr)
        return 130
    except (ConfigError, ImpossibleTargetError, ValueError, OSError) as err:
        # LedgerError is a ValueError: a damaged or missing ledger is named, never replaced.
        # OSError: a path that is a file where a folder is needed, a folder not writable.
        print(f"gep-fed {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
