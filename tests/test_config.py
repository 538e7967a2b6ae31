"""Configuration: validation errors that name the field, and defaults kept in one place."""

import tomllib
from pathlib import Path

import pytest

from gep_fed.config import ConfigError, FederationConfig, GEPConfig


def test_flower_run_config_in_pyproject_matches_the_defaults():
    data = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    run_config = data["tool"]["flwr"]["app"]["config"]
    assert FederationConfig.from_record(run_config) == FederationConfig()
    assert run_config == FederationConfig().to_record()


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"mode": "trusted"}, "mode"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"target_epsilon": -1.0}, "target_epsilon"),
        ({"rounds": 0}, "rounds"),
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
        ({"mechanism": "dpsgd"}, "mechanism"),
        ({"num_basis": 0}, "num_basis"),
        ({"clip_quantile": 2.0}, "clip_quantile"),
        ({"noise_multiplier": -1}, "noise_multiplier"),
    ],
)
def test_bad_step_settings_name_the_field(settings, field):
    with pytest.raises(ConfigError, match=field):
        GEPConfig(**settings)
