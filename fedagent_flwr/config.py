"""Run configuration: Flower run config -> Hydra composition under ``conf/`` -> one checked config.

Flower's run config carries only ``config-name`` and ``overrides`` (a Hydra override string such
as ``"num_rounds=3 clients.total=4 strategy=fedprox"``). Composition is strict: an unknown key
or a bad value stops the run at start with one message that names the key, because a typo in a
multi-hour RL run should never silently fall back to a default.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_type_hints

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from fedagent_flwr.checkpoint.store import StorageSettings, is_loopback
from fedagent_flwr.config_groups import check_selections
from fedagent_flwr.config_keys import ConfigError
from fedagent_flwr.config_keys import get_key as _get
from fedagent_flwr.per_client import PER_CLIENT_KEY, resolve
from fedagent_flwr.schema import RunSchema, SettingError, check, declared_keys, declared_type, register
from fedagent_flwr.schema.run import Partition, Storage, StrategyKwargs
from fedagent_flwr.schema.trainer import AGENT_LOOP_KEYS, CHAT_TEMPLATE_KEY, CHAT_TEMPLATE_USAGE, ClientAppKeys
from fedagent_flwr.schema.trainer import trainer_settings as check_trainer


def conf_dir() -> Path:
    """Locate the Hydra config directory.

    ``$FEDAGENT_CONF_DIR`` wins; otherwise ``conf/`` beside the package (source checkout and
    Flower's installed app bundle) or ``fedagent_flwr/_conf`` (a wheel install).
    """
    if env := os.environ.get("FEDAGENT_CONF_DIR"):
        return Path(env).resolve()
    package = Path(__file__).resolve().parent
    for candidate in (package.parent / "conf", package / "_conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise ConfigError(
        f"no Hydra config directory found beside {package}; set FEDAGENT_CONF_DIR to the conf/ folder"
    )


def parse_overrides(overrides: str | Sequence[str]) -> list[str]:
    """Split a Flower run-config override string with shell quoting rules."""
    if isinstance(overrides, str):
        try:
            return shlex.split(overrides)
        except ValueError as exc:
            raise ConfigError(f"overrides {overrides!r} cannot be parsed: {exc}") from exc
    return [str(item) for item in overrides]


def compose_config(config_name: str = "config", overrides: str | Sequence[str] = "") -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with Hydra overrides; unknown keys are errors."""
    # "+trainer.per_client=...": the form from before per_client was a schema field (Hydra refuses "+"
    # for a key the schema declares); it sets the key as it always did. strategy.kwargs is an open
    # mapping (Hydra wants "+" to add a key to it), but the keys StrategyKwargs declares are
    # settings: "strategy.kwargs.discovery_timeout=..." sets one whether a file set it or not. So are
    # model.chat_template_kwargs and its keys ("model.chat_template_kwargs.enable_thinking=false").
    items = [_declared_form(item) for item in parse_overrides(overrides)]
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, _, value = item.lstrip("+~").partition("=")
        if declared_type(key) is bool and value.strip().lower() not in ("true", "false"):
            # Hydra would also read yes/no/on/off/1/0; a setting here is true or false
            raise ConfigError(f"config key '{key}' must be bool, got {value!r}")
        if key == CHAT_TEMPLATE_KEY:
            _check_mapping_override(item, key, value)
    conf = conf_dir()
    items = check_selections(items, conf)
    register()
    try:
        with initialize_config_dir(config_dir=str(conf), version_base=None):
            cfg = compose(config_name=config_name, overrides=items)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain_hydra_error(exc, items)) from None
    OmegaConf.set_struct(cfg, True)
    return cfg


def _check_mapping_override(item: str, key: str, value: str) -> None:
    """ConfigError unless the override ``item`` gives ``model.chat_template_kwargs`` a mapping (Hydra
    would refuse anything else with a message that names neither the key nor the form it takes)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([item])[0].value()
    except HydraException as exc:
        raise ConfigError(f"config key '{key}' = {value!r} cannot be parsed ({' '.join(str(exc).split())[:120]}): "
                          f"{CHAT_TEMPLATE_USAGE}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"config key '{key}' = {value!r} is not a mapping: {CHAT_TEMPLATE_USAGE}")


def _explain_hydra_error(exc: Exception, items: list[str]) -> str:
    """Turn Hydra's multi-line errors into one line that names the culprit."""
    cause: BaseException | None = exc
    while cause is not None:  # the schema's refusal (OmegaConf) carries the key it was about
        key = getattr(cause, "full_key", None)
        if key and isinstance(cause, ConfigKeyError):
            return _unknown_key(key)
        if key and isinstance(cause, ValidationError):
            schema, name = getattr(cause, "object_type", None), str(getattr(cause, "key", ""))
            hint = get_type_hints(schema).get(name) if is_dataclass(schema) else None
            kind = getattr(hint, "__name__", None) if hint is not None and not get_args(hint) else hint
            return f"config key '{key}' must be {kind or 'of the declared type'}, got {getattr(cause, 'value', None)!r}"
        cause = cause.__cause__
    text = " ".join(str(exc).split())
    for item in items:
        key = item.split("=", 1)[0].lstrip("+~")
        if f"'{key}'" in text or f"override '{key}'" in text.lower():
            if "not in struct" in text or "Could not override" in text:
                return _unknown_key(key, f" (from override '{item}')")
            if "Could not find" in text or "not found" in text:
                found = re.search(r"Available options in '[^']*': (.*?) Config search path", text)
                options = found.group(1).split() if found else []
                missing = re.search(rf"Could not find '{re.escape(key)}/([^']*)'", text)  # which one, of several
                name = missing.group(1) if missing else item.split("=", 1)[1].strip("'\"")  # a typed key's is quoted
                close = difflib.get_close_matches(name, options, n=1)
                return (f"config group '{key}' has no option '{name}'" + (f" (available: {' '.join(options)})"
                        if options else "") + (f"; did you mean '{close[0]}'?" if close else ""))
    return f"configuration error: {text}"


_STRATEGY_KWARGS = "strategy.kwargs."


def _declared_form(item: str) -> str:
    """An override as Hydra takes it for a declared key of an open mapping (see compose_config)."""
    if item.startswith("+trainer.per_client="):
        return item.removeprefix("+")
    key = item.partition("=")[0]
    if key == CHAT_TEMPLATE_KEY or key.startswith(f"{CHAT_TEMPLATE_KEY}."):
        return f"++{item}"  # an open mapping (the template's own keywords), set or extended as verl's is
    if key.startswith(_STRATEGY_KWARGS) and key.removeprefix(_STRATEGY_KWARGS) in StrategyKwargs.__dataclass_fields__:
        return f"++{item}"
    if key.startswith("partition.") and key.removeprefix("partition.") in Partition.__dataclass_fields__:
        return f"++{item}"  # a declared knob that the chosen group's file leaves out (omega on coverage)
    return item


def _unknown_key(key: str, given: str = "") -> str:
    """An unknown key (``given``: where it came from, e.g. " (from override 'x=1')"), with the closest
    declared one; or a trainer key that the run sets from another key (``rollout.*``, ``model.*``)."""
    if (source := AGENT_LOOP_KEYS.get(key.removeprefix("trainer."))) and key.startswith("trainer."):
        return f"config key '{key}' is set from '{source}'; set {source} instead{given}"
    if key.startswith(_STRATEGY_KWARGS):
        return (f"unknown config key '{key}': strategy.kwargs is an open mapping for a custom Strategy's own "
                f"arguments; add a key to it with '+{key}=...'{given}")
    close = difflib.get_close_matches(key, declared_keys(), n=1)
    return f"unknown config key '{key}'{given}" + (f"; did you mean '{close[0]}'?" if close else "")


@dataclass(frozen=True)
class RunSettings:
    """The checked configuration of one run: the schema's values as checked (``run``), what
    validation derives from them, and the raw composed tree."""

    config_name: str
    run: RunSchema  # every setting, typed (run.clients.total, run.eval.seed, run.env.service, ...)
    mode: str  # federated | centralized | local, as the keys describe
    clients_per_round: int  # clients.per_round, at most clients.total
    train_env_spec: dict[str, Any]
    val_env_spec: dict[str, Any]
    trainer_settings: ClientAppKeys  # the checked trainer group and agent loop, typed: what instructions carry
    trainer: dict[str, Any]  # the same as a mapping (what a job file carries)
    partition: dict[str, Any]  # the group as given (a custom strategy's own keys too), known ones checked
    storage: StorageSettings
    tracking: tuple[str, ...]
    raw: dict[str, Any]

    @property
    def trainer_backend(self) -> str:
        return str(self.trainer["backend"])


def _path_text(value: str, key: str, required: bool = False) -> str:
    """A config string that becomes a path: no control characters (a newline or NUL in a path
    is a mistake or an attack, never a directory name)."""
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ConfigError(f"config key '{key}' = {value!r} holds control characters")
    if required and not value.strip():
        raise ConfigError(f"config key '{key}' must be a non-empty path")
    return value


def _existing_file(value: str, key: str) -> str:
    """An optional path that must name a readable file when set; returned absolute."""
    if _path_text(value, key) and not Path(value).expanduser().is_file():
        raise ConfigError(f"config key '{key}' = {value!r} is not a file")
    return str(Path(value).expanduser().resolve()) if value else ""


def _storage(store: Storage) -> StorageSettings:
    """The ``storage`` group: the http store serves checkpoints and tokens, so it binds to
    loopback unless configured otherwise, and anywhere else only with TLS; the s3 store needs its
    bucket URL (whether the bucket is usable is checked when the ServerApp opens the store)."""
    settings = StorageSettings(**{**asdict(store), **{
        name: _existing_file(getattr(store, name), f"storage.{name}")
        for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certfile")}})
    if settings.kind == "s3":
        if not settings.url.startswith("s3://"):
            raise ConfigError(f"config key 'storage.url' = {settings.url!r} must name the run's bucket, "
                              "s3://<bucket>/<prefix>, when storage.kind is s3")
        return settings
    if settings.url.startswith("s3://") or settings.endpoint_url:
        raise ConfigError(f"config keys 'storage.url' = {settings.url!r} and 'storage.endpoint_url' = "
                          f"{settings.endpoint_url!r} name a bucket, which only storage.kind=s3 uses "
                          f"(storage.kind is {settings.kind!r})")
    if settings.kind != "http":
        return settings
    if bool(settings.ssl_certfile) != bool(settings.ssl_keyfile):
        raise ConfigError("config keys 'storage.ssl_certfile' and 'storage.ssl_keyfile' must be set together")
    if not settings.tls and not is_loopback(settings.host):
        raise ConfigError(
            f"config key 'storage.host' = {settings.host!r} exposes the checkpoint store beyond this "
            "machine: set storage.ssl_certfile and storage.ssl_keyfile (TLS), or bind to 127.0.0.1"
        )
    if settings.url and settings.url.startswith("http://") and settings.tls:
        raise ConfigError(f"config key 'storage.url' = {settings.url!r} must be https:// when the store uses TLS")
    if settings.url.startswith("https://") and not settings.tls:
        raise ConfigError(f"config key 'storage.url' = {settings.url!r} is https:// but no storage.ssl_certfile is set")
    if not settings.url and settings.host in ("0.0.0.0", "::"):
        raise ConfigError(
            f"config key 'storage.url' must name the address clients reach when storage.host is {settings.host!r}"
        )
    return settings


def _tracking(names: list[str]) -> tuple[str, ...]:
    """``tracking``: where the run's metrics go besides ``metrics.jsonl`` (always written)."""
    from fedagent_flwr.serverapp.tracking import TRACKERS, missing_packages  # local: serverapp imports this module

    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"config key 'tracking' = {names!r}: {unknown} not available; choose from {list(TRACKERS)}")
    if missing := missing_packages(names):
        raise ConfigError(f"config key 'tracking' = {names!r}: {missing} not installed on the ServerApp's machine; "
                          "install the tracking extra (pip install 'fedagent-flwr[tracking]') or leave them out")
    return tuple(dict.fromkeys(["jsonl", *names]))


def _run_value(run: RunSchema, dotted: str) -> Any:
    """The checked value of the run key ``dotted`` (``rollout.mode``); a group (``model.lora``) as a mapping,
    the form a trainer group's value takes."""
    node: Any = run
    for part in dotted.split("."):
        node = getattr(node, part)
    return asdict(node) if is_dataclass(node) and not isinstance(node, type) else node


def _check_client_trainer(trainer: dict[str, Any], where: str) -> None:
    """One client's trainer group (the run's with its ``per_client`` values) checked by its backend's
    schema; typed in place (:func:`fedagent_flwr.per_client.resolve` keeps the typed values)."""
    try:
        trainer.update(asdict(check_trainer(trainer, where)))
    except SettingError as exc:
        raise ConfigError(str(exc)) from None


def validate(cfg: DictConfig, config_name: str = "config") -> RunSettings:
    """Check every value the run uses; return typed settings or raise ConfigError naming the key.

    Types and bounds come from the schema (:mod:`fedagent_flwr.schema`); what is checked here
    is what one field cannot say (keys that constrain each other, registries, files).
    """
    from fedagent_flwr.envs.spec import load_env_spec  # local: envs import torch-free helpers only

    raw: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    if isinstance(raw.get("trainer"), dict) and raw["trainer"].get(PER_CLIENT_KEY, {}) is None:
        del raw["trainer"][PER_CLIENT_KEY]  # unset: the run's config (and its resume fingerprint) as without the key
    for key in AGENT_LOOP_KEYS:  # added with "+": would be overwritten by the run key without a word
        if key in (raw.get("trainer") or {}):
            raise ConfigError(_unknown_key(f"trainer.{key}"))
    try:
        run, _ = check(RunSchema, raw)  # trainer: checked next, by its backend's schema
        # the jobs carry the agent loop (the rollout group, the chat template's arguments) as trainer keys
        # trainer.per_client (single clients' own resources) is resolved below, against the checked group
        trainer_settings = check_trainer({**{k: v for k, v in _get(raw, "trainer").items() if k != PER_CLIENT_KEY},
                                          **{key: _run_value(run, source) for key, source in AGENT_LOOP_KEYS.items()}})
    except SettingError as exc:
        raise ConfigError(str(exc)) from None
    total = run.clients.total
    local_id = run.experiment.local_client_id
    if local_id >= total:
        raise ConfigError(f"config key 'experiment.local_client_id' = {local_id} is invalid: expected "
                          f"-1 (off) or a client id in [0, {total - 1}]")
    mode = "local" if local_id >= 0 else ("centralized" if total == 1 else "federated")
    if run.experiment.name != mode:
        raise ConfigError(
            f"experiment '{run.experiment.name}' does not match the other keys, which describe a '{mode}' run "
            f"(clients.total={total}, experiment.local_client_id={local_id})"
        )
    backend = trainer_settings.backend
    if run.algorithm == "ppo" and backend == "reference":
        raise ConfigError("config key 'algorithm' = 'ppo' needs the verl backend; the reference trainer is GRPO only")
    trainer = asdict(trainer_settings)
    if raw["trainer"].get(PER_CLIENT_KEY):  # checked with the run's rules, client by client
        trainer[PER_CLIENT_KEY] = resolve({**trainer, PER_CLIENT_KEY: raw["trainer"][PER_CLIENT_KEY]},
                                          total, _check_client_trainer)
    from fedagent_flwr.trainers.common.client_rule import ClientRuleError, load_client_rule

    try:
        load_client_rule(trainer)  # built once here, so a bad rule stops the run before any client trains
    except ClientRuleError as exc:
        raise ConfigError(f"config key {exc}") from None
    if run.strategy.weights and len(run.strategy.weights) != total:
        raise ConfigError(
            f"config key 'strategy.weights' has {len(run.strategy.weights)} entries but clients.total is {total}"
        )
    # the group as given (a custom strategy's own keys too), with the checked values of the known ones
    partition = {**raw["partition"], **{k: v for k, v in asdict(run.partition).items() if k in raw["partition"]}}
    from fedagent_flwr.hetero import STRATEGIES, PartitionError, check_strategy
    from fedagent_flwr.hetero.common import unknown_knob
    from fedagent_flwr.hetero.env_level import ENV_LEVEL_STRATEGIES
    from fedagent_flwr.plugins import is_dotted_path

    known = sorted({*STRATEGIES, *ENV_LEVEL_STRATEGIES})
    strategy = run.partition.strategy
    if strategy not in known and not is_dotted_path(strategy):
        raise ConfigError(f"config key 'partition.strategy' = {strategy!r} is invalid: expected one of {known}, "
                          "or the dotted path of a partition function")
    if is_dotted_path(strategy):
        try:
            check_strategy(strategy)
        except PartitionError as exc:
            raise ConfigError(f"config key 'partition.strategy': {exc}") from None
    elif unknown := unknown_knob(raw["partition"]):
        raise ConfigError(f"config key 'partition.{unknown[0]}' {unknown[1]}")
    min_goals = run.partition.min_goals_per_client
    if strategy == "coverage" and min_goals > 500:
        raise ConfigError(f"config key 'partition.min_goals_per_client' = {min_goals} must be <= 500 for coverage "
                          "(FedAgent's sizes centre on 500)")
    if strategy == "hardness":
        labels = run.partition.trajectories_file or ""
        if not labels or not Path(labels).expanduser().is_file():
            raise ConfigError(
                f"config key 'partition.trajectories_file' = {labels!r} must name the success-label file "
                "(e.g. <webshop data dir>/hardness/qwen2.5-1.5b_webshop_trajectories.json)"
            )
        partition["trajectories_file"] = str(Path(labels).expanduser().resolve())
    specs = {}
    for split in ("train", "val"):
        try:
            specs[split] = load_env_spec(_get(raw, f"env.{split}")).to_dict()
        except ValueError as exc:
            raise ConfigError(f"config key 'env.{split}': {exc}") from None
    service = run.env.service
    _check_partition_fits_envs(strategy, specs["train"], service.enabled)
    per_client = run.eval.per_client
    if per_client and run.eval.num_episodes < 1:
        raise ConfigError("config key 'eval.per_client' = true validates each trained client on the "
                          "eval.num_episodes validation episodes: set eval.num_episodes >= 1")
    if service.enabled and backend == "reference":
        _check_pool_fits_lockstep(service.pool_size, specs, int(trainer["rollout_n"]))
    _path_text(run.output_dir, "output_dir", required=True)
    _path_text(run.model.path, "model.path")
    return RunSettings(config_name=config_name, run=run, mode=mode, clients_per_round=min(run.clients.per_round, total),
                       train_env_spec=specs["train"], val_env_spec=specs["val"], trainer_settings=trainer_settings,
                       trainer=trainer, partition=partition, storage=_storage(run.storage),
                       tracking=_tracking(run.tracking), raw=raw)


def _check_pool_fits_lockstep(pool: int, specs: dict[str, Any], rollout_n: int) -> None:
    """Refuse an env-service pool smaller than what the reference trainer plays at once.

    It samples all episodes of a step in lockstep (one batch waits for every running episode), so
    an episode still waiting for a pool slot would stall the others until the service's create
    timeout; one service serves each env-spec entry. (Validation plays each entry in waves of
    the pool: :func:`fedagent_flwr.trainers.common.evaluator.episode_waves`.)
    """
    for index, entry in enumerate(specs["train"]["envs"]):
        need = entry["n_envs"] * rollout_n
        if need > pool:
            raise ConfigError(
                f"config key 'env.service.pool_size' = {pool} is smaller than the {need} episodes the reference "
                f"trainer plays at once on one service (env.train.envs.{index}.n_envs={entry['n_envs']} x "
                f"trainer.rollout_n={rollout_n}); set env.service.pool_size={need}"
            )


def _check_partition_fits_envs(strategy: str, train_spec: dict[str, Any], served: bool) -> None:
    """Refuse a partition strategy the configured environments cannot honour, at start."""
    from fedagent_flwr.envs.registry import get_env_class
    from fedagent_flwr.hetero import needs_goal_info
    from fedagent_flwr.hetero.env_level import ENV_LEVEL_STRATEGIES

    if strategy in ENV_LEVEL_STRATEGIES and not served:
        raise ConfigError(
            f"config key 'partition.strategy' = {strategy!r} changes the client's environment, "
            "which its env service builds: set env.service.enabled=true (env=webshop does)"
        )
    for entry in train_spec["envs"]:
        env_cls = get_env_class(entry["name"])
        if strategy not in ENV_LEVEL_STRATEGIES and needs_goal_info(strategy) and not hasattr(env_cls, "goal_info"):
            raise ConfigError(
                f"config key 'partition.strategy' = {strategy!r} needs goal metadata, which "
                f"environment {entry['name']} does not provide (use it with env=webshop)"
            )
        if strategy in ENV_LEVEL_STRATEGIES and not hasattr(env_cls, "service_setup"):
            raise ConfigError(
                f"config key 'partition.strategy' = {strategy!r} is an environment-level arm that "
                f"environment {entry['name']} does not support (use it with env=webshop)"
            )


def load_settings(config_name: str = "config", overrides: str | Sequence[str] = "") -> RunSettings:
    """Compose and validate in one call (what the ServerApp does at start)."""
    return validate(compose_config(config_name, overrides), config_name)
