"""Flower's run config → the Hydra config: typed keys for what people change most, ``overrides`` for the rest.

A Flower user's first command is ``flwr run . --run-config num-server-rounds=3``; the app declares
such keys in ``pyproject.toml`` (``[tool.flwr.app.config]``) with the empty string as "not set"
(the Hydra config under ``conf/`` keeps the one default), and each key that is set becomes one Hydra
override. Everything else still goes through ``overrides`` (a Hydra override string). A setting
given both ways is an error: which one wins would otherwise depend on the order of two strings.

    flwr run . --run-config "num-server-rounds=3 clients-total=4 env='webshop'"
    flwr run . --run-config run.toml        # the same keys in a TOML file (examples/run-config.toml)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedagent_flwr.config import ConfigError, parse_overrides

# Flower run-config key -> the Hydra key it sets (a config group's name selects that group's file).
RUN_CONFIG_KEYS: dict[str, str] = {
    "num-server-rounds": "num_rounds",
    "clients-total": "clients.total",
    "clients-per-round": "clients.per_round",
    "local-steps": "train.local_steps",
    "strategy": "strategy",
    "env": "env",
    "trainer": "trainer",
    "algorithm": "algorithm",
    "model-path": "model.path",
    "partition": "partition",
    "experiment": "experiment",
    "recipe": "recipe",
    "seed": "seed",
    "eval-episodes": "eval.num_episodes",
    "output-dir": "output_dir",
    "run-name": "run_name",
}
# the keys Flower's run config carries besides the typed ones
PASSTHROUGH_KEYS = ("config-name", "overrides")
UNSET = ""


def _hydra_value(key: str, value: Any) -> str:
    """One run-config value as Hydra override text (TOML types map onto Hydra's grammar)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # quoted so that Hydra reads paths and names with ':' ',' '=' or spaces as one string
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    raise ConfigError(f"run config key {key!r} = {value!r}: give a number, a string or true/false")


def _override_key(item: str) -> str:
    """The Hydra key an override sets (``+a.b=1`` and ``~a.b`` -> ``a.b``; ``env=x`` -> ``env``)."""
    return item.split("=", 1)[0].lstrip("+~").split("@", 1)[0].strip()


def hydra_arguments(run_config: Mapping[str, Any]) -> tuple[str, list[str]]:
    """``(config_name, overrides)`` for :func:`fedagent_flwr.config.load_settings` from Flower's run config.

    Typed keys come first (in :data:`RUN_CONFIG_KEYS` order), then the ``overrides`` string's items.
    Unknown keys never reach here (Flower refuses keys ``pyproject.toml`` does not declare), but a
    key declared there and missing from this table is reported, so the two cannot drift apart.
    """
    unknown = sorted(set(run_config) - set(RUN_CONFIG_KEYS) - set(PASSTHROUGH_KEYS))
    if unknown:
        raise ConfigError(f"run config keys {unknown} are not mapped onto the Hydra config "
                          "(fedagent_flwr/run_config.py RUN_CONFIG_KEYS); use overrides=\"...\" for them")
    config_name = str(run_config.get("config-name", "config") or "config")
    free = parse_overrides(str(run_config.get("overrides", "") or ""))
    given_freely = {_override_key(item): item for item in free}
    typed = []
    for flower_key, hydra_key in RUN_CONFIG_KEYS.items():
        value = run_config.get(flower_key, UNSET)
        if value == UNSET:
            continue
        if hydra_key in given_freely:
            raise ConfigError(
                f"run config key {flower_key!r} and overrides item {given_freely[hydra_key]!r} both set "
                f"{hydra_key!r}; give it one way (e.g. drop it from overrides)")
        typed.append(f"{hydra_key}={_hydra_value(flower_key, value)}")
    return config_name, typed + free
