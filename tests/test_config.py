"""Configuration: validation errors that name the field, and defaults kept in one place."""

import re
import tomllib
from pathlib import Path

import pytest

from gep_fed.data.registry import BUILT_IN_TASKS
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.tuning import SEARCH_RUN_CONFIG, run_settings, search_of_run_config
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.step_config import GEPConfig
from gep_fed.validation import ConfigError

ROOT = Path(__file__).parents[1]


def test_flower_run_config_in_pyproject_lists_every_field_and_leaves_each_to_the_resolution():
    """Every FederationConfig field and every search key (``SEARCH_RUN_CONFIG``, none
    given: one run), each left to the resolution."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    run_config = data["tool"]["flwr"]["app"]["config"]
    assert run_config == {**FederationConfig.run_config_template(), **SEARCH_RUN_CONFIG}
    assert run_settings(run_config) == FederationConfig.for_task()
    assert search_of_run_config(run_config, 1) is None


@pytest.mark.parametrize("task", sorted(BUILT_IN_TASKS))
def test_cli_flwr_run_and_library_resolve_the_same_settings_for_every_built_in_task(task):
    """Issue 20: one resolution on every path. ``flwr run`` fuses the app's pyproject run
    config with the overrides (Flower's own function) and the ServerApp reads it;
    ``gep-fed simulate`` and ``compare`` parse their options; the library calls for_task."""
    from flwr.common.config import get_fused_config_from_dir

    from gep_fed.cli.main import build_parser, federation_config

    library = FederationConfig.for_task(task)
    flwr_run = run_settings(get_fused_config_from_dir(ROOT, {"task": task}))
    for command in ("simulate", "compare"):
        cli = federation_config(build_parser().parse_args([command, "--task", task]))
        assert cli == library, command
    assert flwr_run == library
    # the task's recommendations apply, and options given override them on every path
    for key, value in BUILT_IN_TASKS[task].recommended_settings.items():
        assert getattr(library, key) == value
    given = FederationConfig.for_task(task, rounds=7, clip_residual=0.3)
    overridden = get_fused_config_from_dir(ROOT, {"task": task, "rounds": 7, "clip-residual": 0.3})
    assert run_settings(overridden) == given
    args = build_parser().parse_args(
        ["simulate", "--task", task, "--rounds", "7", "--clip-residual", "0.3"]
    )
    assert federation_config(args) == given


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"mode": "trusted"}, "mode"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"target_epsilon": -1.0}, "target_epsilon"),
        # beyond it no guarantee is left, and calibrating took minutes, then all memory
        ({"target_epsilon": 1001.0}, r"target_epsilon must be a finite number in \(0, 1000\]"),
        ({"run_name": "../../elsewhere"}, "run_name must be a folder name inside run_dir"),
        ({"run_name": ".."}, "run_name"),
        ({"rounds": 0}, "rounds"),
        ({"rounds": 100_001}, "rounds"),  # a site plans its budget over every round
        ({"min_sites": 5, "num_sites": 3}, "min_sites"),
        ({"basis_dtype": "int8"}, "basis_dtype"),
        ({"clip_residual": float("nan")}, "clip_residual"),
        ({"release_site_metrics": "yes"}, "release_site_metrics"),
    ],
)
def test_bad_federation_settings_name_the_field(settings, field):
    with pytest.raises(ConfigError, match=field):
        FederationConfig(**settings)


def test_unknown_run_config_keys_are_named():
    with pytest.raises(ConfigError, match="'roundz'"):
        FederationConfig.from_record({"roundz": 3})


def test_run_config_spellings_for_none_round_trip():
    cfg = FederationConfig.from_record(
        {"noise-multiplier": "auto", "num-anchors": 0, "noise-seed": -1, "target-epsilon": 2}
    )
    assert cfg.noise_multiplier is None and cfg.num_anchors is None and cfg.noise_seed is None
    assert cfg.target_epsilon == 2.0 and isinstance(cfg.target_epsilon, float)


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"num_basis": 0}, "num_basis"),
        ({"clip_quantile": 2.0}, "clip_quantile"),
        ({"contract": PrivacyContract("langevin", 0.0, 0.1, langevin_beta0=1.0)}, "mechanism"),
    ],
)
def test_bad_step_settings_name_the_field(settings, field):
    with pytest.raises(ConfigError, match=field):
        GEPConfig(**{"contract": PrivacyContract("gep", 1.0, 0.1), **settings})


@pytest.mark.parametrize(
    "contract, field",
    [
        ({"mechanism": "dpsgd"}, "mechanism"),
        ({"noise_multiplier": -1}, "noise_multiplier"),
        ({"sample_rate": 0.0}, "sample_rate"),
        ({"clip_residual": 1e31}, "clip_residual"),
    ],
)
def test_bad_contract_settings_name_the_field(contract, field):
    with pytest.raises(ConfigError, match=field):
        base = {"mechanism": "gep", "noise_multiplier": 1.0, "sample_rate": 0.1}
        PrivacyContract(**{**base, **contract})


def test_the_fields_are_grouped_in_the_classs_order_and_each_group_is_a_read_only_view():
    from dataclasses import fields

    from gep_fed.federation.config import FIELD_GROUPS

    grouped = [name for _, names in FIELD_GROUPS.values() for name in names]
    assert grouped == [f.name for f in fields(FederationConfig)]  # each once, in order
    cfg = FederationConfig(delta=1e-6, rounds=3, basis_dtype="float16")
    assert cfg.privacy.delta == cfg.privacy["delta"] == 1e-6
    assert cfg.schedule.rounds == 3 and cfg.transport.basis_dtype == "float16"
    assert dict(cfg.run) == {name: getattr(cfg, name) for name in FIELD_GROUPS["run"][1]}
    assert set(FIELD_GROUPS) == {"data", "privacy", "subspace", "schedule", "transport", "run"}
    with pytest.raises(AttributeError, match="delta"):
        cfg.schedule.delta  # noqa: B018 (another group's field)
    with pytest.raises(AttributeError):
        cfg.privacy.delta = 0.1  # a view: the config is frozen


def test_resolve_is_the_one_explicit_resolution_and_contract_reads_it():
    from dataclasses import replace

    from gep_fed.federation.config import ResolvedRun

    cfg = FederationConfig(rounds=2, local_steps=3, target_epsilon=4.0)
    assert "_resolved" not in vars(cfg)  # nothing is resolved by building the settings
    run = cfg.resolve()
    assert isinstance(run, ResolvedRun) and run.config is cfg
    assert cfg.resolve() is run and cfg.contract is run.contract  # once, then read
    assert run.contract == PrivacyContract.for_budget(
        "gep",
        4.0,
        cfg.delta,
        cfg.sample_rate,
        6,
        clip_embedding=cfg.clip_embedding,
        clip_residual=cfg.clip_residual,
        clip_norm=cfg.clip_norm,
    )
    assert run.anchor_config.contract is run.contract
    assert run.anchor_config.num_basis == cfg.num_basis
    other = replace(cfg, target_epsilon=8.0)
    assert other.resolve() is not run
    assert other.contract.noise_multiplier < run.contract.noise_multiplier
    assert other == replace(other)  # the resolution is no part of the settings


def test_a_range_error_names_an_unbounded_end_as_open():
    from gep_fed.validation import POSITIVE, Range

    with pytest.raises(ConfigError, match=r"must be a finite number in \(0, inf\), got 0"):
        POSITIVE.check("target_epsilon", 0)
    assert str(Range(0, 1)) == "[0, 1]" and str(Range()) == "(-inf, inf)"


def test_the_sites_own_steps_for_a_mode_whose_server_steps_are_refused_on_every_path(capsys):
    """The command line refused them, but a run config and the library took them and ignored
    them: one resolution now refuses them, by name, wherever they come from."""
    from helpers import gep_fed_in_process

    message = "local-steps set(s) the sites' own steps, which central mode does not take"
    with pytest.raises(ConfigError, match=re.escape(message)):
        FederationConfig.from_record({"mode": "central", "local-steps": 3})
    with pytest.raises(ConfigError, match=r"local-lr set\(s\) the sites' own steps"):
        FederationConfig.for_task(mode="distributed", local_lr=0.37)
    code, _, err = gep_fed_in_process(capsys, "simulate", "--mode", "central", "--local-steps", "3")
    assert code == 2 and message in err
    # a record of a whole config (every key, as a run config or a tuning's base gives it)
    central = FederationConfig.for_task(mode="central")
    assert FederationConfig.from_record(central.to_record()) == central
