"""Flower run-config keys → Hydra overrides (fedagent_flwr/run_config.py), checked against the
app's declared keys in pyproject.toml, Flower's own parser and the real Hydra composition."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.common.config import parse_config_args

from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.run_config import PASSTHROUGH_KEYS, RUN_CONFIG_KEYS, hydra_arguments
from testkit.app_config import declared_run_config

REPO = Path(__file__).resolve().parents[1]


def _flower_run_config(*pairs: str) -> dict[str, object]:
    """What the ServerApp's ``context.run_config`` holds: the declared defaults fused with the
    command line, parsed by Flower's own parser (values are TOML)."""
    return {**declared_run_config(), **parse_config_args(list(pairs))}


def test_pyproject_declares_exactly_the_mapped_keys_all_unset() -> None:
    declared = declared_run_config()
    assert set(declared) == set(RUN_CONFIG_KEYS) | set(PASSTHROUGH_KEYS)
    assert all(declared[key] == "" for key in RUN_CONFIG_KEYS)  # conf/ keeps the one default
    name, overrides = hydra_arguments(declared)
    assert (name, overrides) == ("config", [])


def test_typed_keys_become_hydra_overrides_that_compose() -> None:
    run_config = _flower_run_config(
        "num-server-rounds=3 clients-total=4 clients-per-round=2 local-steps=2 seed=11 "
        "env='webshop' model-path='/models/my model:v2' strategy='fedprox'",
        "overrides='eval.seed=3 strategy.proximal_mu=0.2'")
    name, overrides = hydra_arguments(run_config)
    assert overrides[:3] == ["num_rounds=3", "clients.total=4", "clients.per_round=2"]
    assert overrides[-2:] == ["eval.seed=3", "strategy.proximal_mu=0.2"]  # the free form comes last
    settings = load_settings(name, overrides)
    assert (settings.run.num_rounds, settings.run.clients.total, settings.clients_per_round) == (3, 4, 2)
    assert (settings.run.train.local_steps, settings.run.seed, settings.run.eval.seed) == (2, 11, 3)
    assert settings.run.env.name == "webshop" and settings.run.model.path == "/models/my model:v2"
    assert settings.run.strategy.name == "fedprox" and settings.run.strategy.proximal_mu == 0.2


def test_a_setting_given_both_ways_is_refused_by_name() -> None:
    run_config = _flower_run_config("num-server-rounds=3", "overrides='num_rounds=5 seed=1'")
    with pytest.raises(ConfigError, match=r"'num-server-rounds' and overrides item 'num_rounds=5' both set"):
        hydra_arguments(run_config)
    # a group key and a field inside that group are different settings
    name, overrides = hydra_arguments(_flower_run_config("env='webshop'", "overrides='env.search_return_n=200'"))
    assert overrides == ["env='webshop'", "env.search_return_n=200"]
    with pytest.raises(ConfigError, match="'env' and overrides item '\\+?env=alfworld'"):
        hydra_arguments(_flower_run_config("env='webshop'", "overrides='env=alfworld'"))


def test_values_flower_cannot_type_and_unmapped_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match="'seed' = \\[1, 2\\]"):
        hydra_arguments({"seed": [1, 2]})
    with pytest.raises(ConfigError, match=r"\['num-rounds'\] are not mapped"):
        hydra_arguments({"num-rounds": 3})
    with pytest.raises(ConfigError, match="unknown config key 'num_roundz'"):
        load_settings(*hydra_arguments(_flower_run_config("overrides='num_roundz=3'")))
    # a typed group key's value reaches Hydra quoted; the refusal names it as the user wrote it
    refusal = "^config group 'recipe' has no option 'webshop' .*did you mean 'webshop_verl'"
    with pytest.raises(ConfigError, match=refusal):
        load_settings(*hydra_arguments(_flower_run_config("recipe='webshop'")))


def test_the_example_run_config_file_composes() -> None:
    run_config = {**declared_run_config(), **parse_config_args([str(REPO / "examples" / "run-config.toml")])}
    settings = load_settings(*hydra_arguments(run_config))
    assert (settings.run.num_rounds, settings.run.clients.total, settings.clients_per_round) == (3, 4, 2)
    assert settings.run.strategy.name == "fedprox" and settings.run.strategy.proximal_mu == 0.05
    assert settings.trainer["max_new_tokens"] == 16 and settings.run.eval.num_episodes == 16
