"""Run a federation on the Flower Simulation Engine (Ray backend) from Python."""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import RunDirectory


@dataclass(frozen=True)
class SimulationResult:
    run_dir: Path
    metrics: list[dict]
    stop_reason: str | None
    seconds: float


def simulated_site_settings(fed: FederationConfig) -> dict:
    """The simulated sites' own settings (node-config keys): the local user runs every site
    of a simulation, so the sites accept the simulated mode and budget. A deployed site sets
    these in its node config; nothing here reaches a site through the run config."""
    settings = {
        "epsilon-budget": fed.target_epsilon,
        "delta": fed.delta,
        "accept-modes": fed.mode,
        "release-metrics": fed.release_site_metrics,
        "allow-no-noise": fed.noise_multiplier == 0,
        "ledger-dir": str(Path(fed.run_directory("")) / "sites"),
    }
    if fed.noise_seed is not None:  # distinct from the server's seed; site i adds i
        settings["noise-seed"] = fed.noise_seed + 1
    return settings


def simulate(
    fed: FederationConfig,
    progress: bool = True,
    on_round=None,
    cpus_per_site: float = 1.0,
) -> SimulationResult:
    """Run ``fed`` with ``fed.num_sites`` virtual sites; returns the run directory and metrics.

    A fresh ``run_name`` (time, mode, mechanism) is chosen when ``fed.run_name`` is empty.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    from flwr.simulation import run_simulation

    from gep_fed.flower.clientapp import make_client_app
    from gep_fed.flower.serverapp import make_server_app

    if not fed.run_name:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        fed = replace(fed, run_name=f"{stamp}-{fed.mode}-{fed.mechanism}")
    done: dict = {}
    began = time.perf_counter()
    logging.getLogger("gep_fed").setLevel(logging.INFO)
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    flwr_log.setLevel(logging.ERROR)  # Flower's deprecation notice and debug chatter
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            run_simulation(
                server_app=make_server_app(
                    fed, progress, on_round, on_done=lambda strategy: done.update(strategy=strategy)
                ),
                client_app=make_client_app(fed, simulated_site_settings(fed)),
                num_supernodes=fed.num_sites,
                backend_config={
                    "client_resources": {"num_cpus": cpus_per_site, "num_gpus": 0.0},
                    "init_args": {
                        "num_cpus": max(1, os.cpu_count() or 1),
                        "include_dashboard": False,
                    },
                },
            )
    finally:
        flwr_log.setLevel(level)
    strategy = done.get("strategy")
    if strategy is None:
        raise RuntimeError("the simulation ended without finishing its server app (see the log)")
    run = RunDirectory(fed.run_directory(""))
    return SimulationResult(
        run.path, run.read_metrics(), strategy.stop_reason, time.perf_counter() - began
    )
