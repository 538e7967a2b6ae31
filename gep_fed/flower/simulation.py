"""Run a federation on the Flower Simulation Engine (Ray backend) from Python."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from gep_fed.data.formats import DataError, class_disagreement, folder_dataset
from gep_fed.data.task import CheckedExamples
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.policy import (
    DEFAULT_MAX_AUGMENTATION_COPIES,
    DEFAULT_MAX_LOCAL_STEPS,
)
from gep_fed.federation.rundir import (
    CHECKPOINT,
    LOCK,
    SITES,
    RunDirectory,
    read_site_rounds,
    rounds_not_applied,
    site_line,
)
from gep_fed.federation.site import pooled_shares
from gep_fed.flower.interrupt import RunInterrupted, StopRequest
from gep_fed.mechanisms.per_example import validate_model
from gep_fed.validation import ConfigError


@dataclass(frozen=True)
class SimulationResult:
    """A finished simulation: its run directory, per-round metrics, why it stopped early
    (None: it ran every round), and each simulated site's rounds (``site_rounds``: site name
    to ``{"round", "node", "outcome", "cause"}`` rows; the outcome is "accepted" or the
    refusal's reason, the cause the site's own error text: a simulation's user owns every
    site, so it may see them)."""

    run_dir: Path
    metrics: list[dict]
    stop_reason: str | None
    seconds: float
    site_rounds: dict[str, list[dict]] = field(default_factory=dict)

    @classmethod
    def of(cls, run: RunDirectory, stop_reason: str | None, began: float) -> SimulationResult:
        """A run as its run directory holds it, ``began`` (``time.perf_counter``) its start."""
        seconds = time.perf_counter() - began
        return cls(run.path, run.read_metrics(), stop_reason, seconds, read_site_rounds(run.path))

    def failures(self) -> list[str]:
        """One line per problem that makes the run a failure: rounds that did not update the
        model (too few valid replies), a site refused in every round it was asked (with its
        cause)."""
        not_applied = rounds_not_applied(self.metrics)
        lines = [not_applied] if not_applied else []
        for site, rows in sorted(self.site_rounds.items()):
            refused = [r for r in rows if r["outcome"] != "accepted"]
            if rows and len(refused) == len(rows):
                lines.append(f"{site}: refused in every round ({site_line(rows)})")
        return lines


NO_USABLE = "no usable example"  # a site none of whose first examples can be read


def _site_check_text(bad: Mapping[str, list[str]], dropped: bool = False, shown: int = 10) -> str:
    lines = [
        "the simulated sites' data loses these examples (--drop-bad-examples):"
        if dropped
        else "the simulated sites' data would lose examples (--drop-bad-examples runs anyway):"
    ]
    for site, found in sorted(bad.items()):
        count = "" if found[0].startswith(NO_USABLE) else f"{len(found)} example(s): "
        lines.append(f"  {site}: {count}" + "; ".join(found[:shown]))
        if len(found) > shown:
            lines[-1] += f"; ... {len(found) - shown} more"
    return "\n".join(lines)


log = logging.getLogger("gep_fed.simulation")

# Where the simulated sites run: Flower's Simulation Engine, or this process (in_process).
ENGINES = ("ray", "in-process")


class SiteCheckFailed(ConfigError):
    """A simulated site's data has examples a run would drop (or none it could use)."""


def check_simulated_sites(
    fed: FederationConfig, site_data: Mapping[str, str] | None = None
) -> dict[str, list[str]]:
    """Before round 1, what ``gep-fed site check`` would say of each simulated site: its
    examples that cannot be read or do not suit the task (``{site: [problem, ...]}``, empty
    lists for sites without problems). The task's parts the server needs are checked first
    (its model, BatchNorm refused by name; its evaluation and public data), each failure one
    ``ConfigError`` line. Sites given their own data must open it (a folder matching no
    declared class is an error) and, where it comes from class folders, name the same classes
    (``class_disagreement``): else ``SiteCheckFailed`` naming the site, whatever
    ``--drop-bad-examples`` says, since the labels themselves would be wrong."""
    task = fed.make_task()
    model = task.build_model()
    validate_model(model)
    for part in ("eval_dataset", "public_dataset"):
        method = getattr(task, part, None)
        if not callable(method):
            raise ConfigError(f"task {fed.task!r}: {part}() is needed: it is {method!r}")
        try:
            method()
        except NotImplementedError as err:
            raise ConfigError(f"task {fed.task!r}: {part}() is needed: {err}") from None
        except TypeError as err:  # raised inside the task's own code: say where
            raise ConfigError(
                f"task {fed.task!r}: {part}() failed: {type(err).__name__}: {err}"
            ) from None
    if site_data:
        datasets = {}
        for name, path in site_data.items():
            try:
                datasets[name] = task.site_dataset(path)
            except DataError as err:  # e.g. a folder that matches no declared class
                raise SiteCheckFailed(f"{name}: {err}") from None
        folders = {name: folder_dataset(data) for name, data in datasets.items()}
        disagreement = class_disagreement({k: v for k, v in folders.items() if v is not None})
        if disagreement:
            raise SiteCheckFailed(disagreement)
    else:
        shares = pooled_shares(task, fed.num_sites, fed.partition, fed.dirichlet_alpha, fed.seed)
        datasets = {f"site-{i}": share for i, share in enumerate(shares)}
    problems = {}
    for name, data in datasets.items():
        try:
            checked = CheckedExamples.of(data, task.kind, model)
        except DataError as err:
            problems[name] = [f"{NO_USABLE}: {err}"]
            continue
        found = ((i, checked.problem(i)) for i in range(len(checked)))
        problems[name] = [f"example {i}: {p}" for i, p in found if p is not None]
    return problems


def simulated_site_settings(
    fed: FederationConfig, site_data: Mapping[str, str] | None = None
) -> dict:
    """The simulated sites' own settings (node-config keys): the local user runs every site
    of a simulation, so the sites accept the simulated mode and budget; ``site_data`` gives
    each its own data ({name: path}, site i the i-th). A deployed site sets these in its
    node config; nothing here reaches a site through the run config."""
    settings = {
        "epsilon-budget": fed.target_epsilon,
        "delta": fed.delta,
        "accept-modes": fed.mode,
        "release-metrics": fed.release_site_metrics,
        "allow-no-noise": fed.noise_multiplier == 0,
        "max-local-steps": max(fed.local_steps, DEFAULT_MAX_LOCAL_STEPS),
        "max-augmentation-copies": max(fed.augmentation_copies, DEFAULT_MAX_AUGMENTATION_COPIES),
        "ledger-dir": str(Path(fed.run_directory("")) / "sites"),
    }
    if fed.noise_mode.secure_sum:  # the split the simulated sites accept is the run's
        settings["noise-shares"] = fed.shares_needed
    if fed.noise_seed is not None:  # distinct from the server's seed; site i adds i
        settings["noise-seed"] = fed.noise_seed + 1
    if site_data:
        settings["site-data"] = dict(site_data)
    return settings


@contextmanager
def _first_interrupt_stops(stop: StopRequest, committed: list[int], resume: str):
    """While a simulation runs, the first SIGINT (Ctrl-C) requests a stop between rounds
    (``gep_fed.flower.interrupt``); a second one ends the process at once, exit status 130,
    with the same one line (the ledgers and checkpoint are written atomically, so the last
    committed round stands). Outside the main thread, SIGINT is left as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum, frame) -> None:
        if stop.is_set():
            print(f"\n{RunInterrupted(committed[0], resume).line()}", file=sys.stderr, flush=True)
            os._exit(130)
        stop.request()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def site_data_from_pairs(pairs: list[str] | None) -> dict[str, str] | None:
    """``--site-data NAME=PATH`` options (``gep-fed simulate``, ``tune``) as ``simulate``'s
    ``site_data``, ``{name: path}`` (None: none given)."""
    if not pairs:
        return None
    out = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--site-data must be NAME=PATH, got {pair!r}")
        if name in out:
            raise ConfigError(f"--site-data names site {name!r} twice")
        out[name] = path
    return out


def formed_sites(fed: FederationConfig, site_data: Mapping[str, str] | None) -> dict:
    """How a simulation's sites got their data, as its run directory records it
    (``sites.json``): each site's own data by its absolute path, or shares of the task's
    pooled data."""
    if site_data:
        paths = {name: str(Path(p).resolve()) for name, p in site_data.items()}
        seen: dict[str, str] = {}
        for name, path in paths.items():
            if path in seen:  # one data set trained twice, under two ledgers
                raise ConfigError(
                    f"sites {seen[path]!r} and {name!r} are given the same data ({path}): "
                    "give each site its own"
                )
            seen[path] = name
        return {"site-data": paths}
    return {"shares": fed.partition}


def check_same_sites(fed: FederationConfig, formed: dict) -> None:
    """A resumed run keeps the sites and data it was trained on: other sites' data would
    train on under ledgers started afresh (a renamed site's), and the record of which data
    trained the earlier rounds would be overwritten. Raises ``ConfigError`` naming both, or
    naming the missing record of a run that has trained (a checkpoint without ``sites.json``).
    The record is written before anything trains, so a run whose sites have released anything
    (a checkpoint, or a site ledger in it) is compared with it; one that released nothing has
    its record written again."""
    run = RunDirectory(fed.run_directory(""))
    if not run.file(SITES).exists():
        if run.file(CHECKPOINT).exists():
            raise ConfigError(
                f"{run.path} has trained (it holds a checkpoint) but has no record of which "
                f"sites' data trained it ({SITES}): restore that file to resume it, or start a "
                "new run (another --run-name)"
            )
        return
    if not (run.file(CHECKPOINT).exists() or any(run.path.glob("sites/*/ledger.json"))):
        return  # nothing released yet
    before = run.read_json(SITES)
    if "site-data" in before:  # runs recorded before paths were made absolute
        before = {"site-data": {n: str(Path(p).resolve()) for n, p in before["site-data"].items()}}
    if before != formed:
        raise ConfigError(
            f"{run.path} was trained on {_described(before)}, and this run gives "
            f"{_described(formed)}: resume it with the same sites and data, or start a new "
            "run (another --run-name)"
        )


def _site_ledgers(sites: Mapping[str, object]) -> list[Path]:
    """The simulated sites' ledgers that exist in their folder."""
    return list(Path(str(sites["ledger-dir"])).glob("*/ledger.json"))


def check_site_ledgers_kept(
    sites: Mapping[str, object], site_data: Mapping[str, str] | None, num_sites: int, trained: int
) -> None:
    """A resumed simulation's sites keep their ledgers: a simulated site creates its ledger
    where it finds none, so one deleted after the run trained ``trained`` round(s) or its
    other sites recorded releases would start from zero though its data has spent budget.
    Raises ``ConfigError`` naming each missing ledger."""
    names = list(site_data) if site_data else [f"site-{i}" for i in range(num_sites)]
    folder = Path(str(sites["ledger-dir"]))
    missing = [str(folder / n / "ledger.json") for n in names]
    missing = [p for p in missing if not Path(p).exists()]
    if missing:
        raise ConfigError(
            f"this run has trained {trained} round(s) and its sites have recorded releases, "
            f"but site ledger(s) {', '.join(missing)} are missing: a site would start from zero "
            "what its data has spent. Restore them (with their keys and marks), or start a new "
            "run (another --run-name)"
        )


def _described(formed: dict) -> str:
    if "site-data" in formed:
        pairs = ", ".join(f"{n}={p}" for n, p in formed["site-data"].items())
        return f"the sites' own data ({pairs})"
    shares = {"iid": "IID", "dirichlet": "Dirichlet"}.get(
        formed.get("shares"), formed.get("shares")
    )
    return f"{shares} shares of the task's pooled data"


def checked_simulation(
    fed: FederationConfig,
    engine: str,
    site_data: Mapping[str, str] | None = None,
    drop_bad_examples: bool = False,
    check_sites: bool = True,
) -> FederationConfig:
    """``fed`` as a simulation runs it, once its simulated sites' data passed
    ``check_simulated_sites`` (``check_sites=False``: already checked for this task, model
    and data): ``num_sites`` (and the declared N unless given) from ``site_data``. Raises
    ``SiteCheckFailed`` (see ``simulate``)."""
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {list(ENGINES)}, got {engine!r}")
    if site_data:
        fed = replace(fed, num_sites=len(site_data), min_sites=min(fed.min_sites, len(site_data)))
    problems = check_simulated_sites(fed, site_data) if check_sites else {}
    bad = {site: found for site, found in problems.items() if found}
    if bad and not drop_bad_examples:
        raise SiteCheckFailed(_site_check_text(bad))
    if bad:  # dropped as asked, never silently
        log.warning("%s", _site_check_text(bad, dropped=True))
    if site_data and fed.total_examples is None:  # every mode normalises by the declared N
        task = fed.make_task()
        total = sum(len(task.site_dataset(path)) for path in site_data.values())
        fed = replace(fed, total_examples=total)
    return fed


def launch(server_app, client_app, num_sites: int, engine: str, cpus_per_site: float) -> None:
    """Run ``server_app`` with ``num_sites`` simulated nodes of ``client_app``: on Flower's
    Simulation Engine (Ray) or in this process (``engine``, see ``simulate``)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if engine == "in-process":
        from gep_fed.flower.in_process import run_in_process

        run_in_process(server_app, client_app, num_sites)
        return
    from flwr.simulation import run_simulation

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=num_sites,
        backend_config={
            "client_resources": {"num_cpus": cpus_per_site, "num_gpus": 0.0},
            "init_args": {"num_cpus": max(1, os.cpu_count() or 1), "include_dashboard": False},
        },
    )


@contextmanager
def quiet_flower(stop: StopRequest, committed: list[int], resume: str):
    """While a simulation runs: gep_fed's INFO lines shown, Flower's chatter and deprecation
    notices hidden, and the first Ctrl-C a stop request (``_first_interrupt_stops``)."""
    logging.getLogger("gep_fed").setLevel(logging.INFO)
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    flwr_log.setLevel(logging.ERROR)  # Flower's deprecation notice and debug chatter
    try:
        with warnings.catch_warnings(), _first_interrupt_stops(stop, committed, resume):
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        flwr_log.setLevel(level)


def simulate(
    fed: FederationConfig,
    progress: bool = True,
    on_round=None,
    cpus_per_site: float = 1.0,
    *,
    site_data: Mapping[str, str] | None = None,
    drop_bad_examples: bool = False,
    engine: str = "ray",
    site_settings: Mapping[str, object] | None = None,
    score_sites: bool = False,
) -> SimulationResult:
    """Run ``fed`` with ``fed.num_sites`` virtual sites; returns the run directory and metrics.

    ``engine``: "ray" (Flower's Simulation Engine) or "in-process" (the same ServerApp and
    ClientApps exchanging Flower messages in this process, one site after another, without
    Ray: ``gep_fed.flower.in_process``; for tests and quick experiments).

    ``site_data``: the sites' own data, ``{site name: path}`` read by the task's
    ``site_dataset`` (as a deployed site reads its node config's ``data-path``), instead of
    shares of the task's pooled data; ``num_sites`` is their number, and in central mode the
    declared N their total size unless ``total_examples`` says otherwise.

    Before round 1 every site's data is checked (``check_simulated_sites``): a site with
    examples a run would drop stops the simulation (``SiteCheckFailed``, naming each site and
    example) unless ``drop_bad_examples``. A fresh ``run_name`` (time, mode, mechanism) is
    chosen when ``fed.run_name`` is empty.

    The first Ctrl-C (SIGINT, when called from the main thread) stops the run between
    rounds within seconds and raises ``RunInterrupted`` (its ``line()`` says after which
    round and how to resume); running the same ``fed`` again resumes after that round.

    ``site_settings``: the simulated sites' own settings (node-config keys such as
    ``epsilon-budget`` or ``ledger-dir``) over ``simulated_site_settings``' (``gep-fed tune``
    keeps every trial's site ledgers in one folder, each site's budget the tuning's total).
    ``score_sites``: after the last round, the sites score the final model on the examples
    they hold out (their ``validation-fraction`` and ``score-noise``), into the run
    directory's ``site_score.json``.
    """
    fed = checked_simulation(fed, engine, site_data, drop_bad_examples)

    resume = "rerun the same command"
    if not fed.run_name:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        fed = replace(fed, run_name=f"{stamp}-{fed.mode}-{fed.mechanism}")
        resume += f" with --run-name {fed.run_name}"
    formed = formed_sites(fed, site_data)
    run = RunDirectory(fed.run_directory(""))
    fresh = not run.path.exists()
    run.path.mkdir(parents=True, exist_ok=True)
    with run.lock():  # held from the sites' record to the run's last file
        try:
            return _simulate_locked(
                fed, run, formed, resume, progress, on_round, engine, site_data, site_settings,
                cpus_per_site, score_sites,
            )  # fmt: skip
        finally:  # (only by the holder: a process refused the lock removes nothing)
            if fresh and {p.name for p in run.path.iterdir()} <= {SITES, LOCK}:
                shutil.rmtree(run.path)  # a run that never started leaves nothing behind


def _simulate_locked(
    fed, run, formed, resume, progress, on_round, engine, site_data, site_settings,
    cpus_per_site, score_sites,
) -> SimulationResult:  # fmt: skip
    from gep_fed.flower.clientapp import make_client_app
    from gep_fed.flower.serverapp import make_server_app

    check_same_sites(fed, formed)
    fed.resolve()  # the privacy contract, sigma calibrated: an unreachable budget stops here
    done: dict = {}
    began = time.perf_counter()
    stop = StopRequest()
    committed = [run.checkpoint_round()]
    began_before = run.file(SITES).exists()  # an earlier attempt of this run started
    # before anything can train: no release may be recorded without the record of which
    # sites' data made it (a renamed site would otherwise resume under a fresh ledger)
    run.write_json(SITES, formed)

    def on_committed(record: dict) -> None:
        committed[0] = record["round"] if record.get("applied") else committed[0]
        if on_round is not None:
            on_round(record)

    with quiet_flower(stop, committed, resume):
        server_app = make_server_app(
            fed,
            progress,
            on_committed,
            on_done=lambda o: done.update(outcome=o),
            stop=stop,
            score_sites=score_sites,
        )
        sites = {**simulated_site_settings(fed, site_data), **(site_settings or {})}
        if committed[0] > 0 or (began_before and _site_ledgers(sites)):  # a fresh ledger forgets
            check_site_ledgers_kept(sites, site_data, fed.num_sites, committed[0])
        client_app = make_client_app(fed, sites)
        launch(server_app, client_app, fed.num_sites, engine, cpus_per_site)
    outcome = done.get("outcome")
    if outcome is None:
        raise RuntimeError("the simulation ended without finishing its server app (see the log)")
    if outcome.interrupted is not None:
        raise RunInterrupted(outcome.interrupted.completed_round, resume)
    return SimulationResult.of(run, outcome.strategy.stop_reason, began)
