"""Run configuration: Flower run config -> Hydra composition under ``conf/`` -> one checked config.

Flower's run config carries only ``config-name`` and ``overrides`` (a Hydra override string such
as ``"num_rounds=3 clients.total=4 strategy=fedprox"``). Composition is strict: an unknown key
or a bad value stops the run at start with one message that names the key, because a typo in a
multi-hour RL run should never silently fall back to a default.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedagent_flwr.checkpoint.store import STORE_KINDS, StorageSettings, is_loopback
from fedagent_flwr.clientapp.backend import CLIENTAPP_TRAINER_KEYS, TRAINER_MODES
from fedagent_flwr.config_keys import ConfigError
from fedagent_flwr.config_keys import get_key as _get
from fedagent_flwr.config_keys import typed_key as _typed
from fedagent_flwr.trainers import BACKEND_MODULES

MODES = ("federated", "centralized", "local")
ALGORITHMS = ("grpo", "ppo")


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
    items = parse_overrides(overrides)
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = compose(config_name=config_name, overrides=items)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain_hydra_error(exc, items)) from None
    OmegaConf.set_struct(cfg, True)
    return cfg


def _explain_hydra_error(exc: Exception, items: list[str]) -> str:
    """Turn Hydra's multi-line errors into one line that names the culprit."""
    text = " ".join(str(exc).split())
    for item in items:
        key = item.split("=", 1)[0].lstrip("+~")
        if f"'{key}'" in text or f"override '{key}'" in text.lower():
            if "not in struct" in text or "Could not override" in text:
                return f"unknown config key '{key}' (from override '{item}')"
            if "Could not find" in text or "not found" in text:
                found = re.search(r"Available options in '[^']*': (.*?) Config search path", text)
                options = f" (available: {found.group(1).strip()})" if found else ""
                return f"config group '{key}' has no option '{item.split('=', 1)[1]}'{options}"
    return f"configuration error: {text}"


@dataclass(frozen=True)
class RunSettings:
    """The checked configuration of one federated run (plus the raw composed tree)."""

    config_name: str
    run_name: str
    output_dir: str
    num_rounds: int
    seed: int
    model_path: str
    total_clients: int
    clients_per_round: int
    mode: str
    local_client_id: int
    algorithm: str
    local_steps: int
    env_name: str
    train_env_spec: dict[str, Any]
    val_env_spec: dict[str, Any]
    env_service: dict[str, Any]
    trainer: dict[str, Any]
    strategy_name: str
    strategy_class: str
    proximal_mu: float
    fixed_weights: tuple[float, ...]
    strategy_kwargs: dict[str, Any]
    partition: dict[str, Any]
    eval_enabled: bool
    eval_before_train: bool
    eval_num_episodes: int
    eval_seed: int
    round_timeout: float
    storage: StorageSettings
    raw: dict[str, Any]
    tracking: tuple[str, ...] = ("jsonl",)
    epochs: int = 1  # E: passes over the round's instances (train.epochs)
    eval_per_client: bool = False  # validate each trained client's model too (eval.per_client)

    @property
    def trainer_backend(self) -> str:
        return str(self.trainer["backend"])


_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HOST = re.compile(r"^[A-Za-z0-9.:-]{1,253}$")


def _path_text(cfg: dict[str, Any], key: str, required: bool = False) -> str:
    """A config string that becomes a path: no control characters (a newline or NUL in a path
    is a mistake or an attack, never a directory name)."""
    value = _typed(cfg, key, str)
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ConfigError(f"config key '{key}' = {value!r} holds control characters")
    if required and not value.strip():
        raise ConfigError(f"config key '{key}' must be a non-empty path")
    return value


def _existing_file(cfg: dict[str, Any], key: str) -> str:
    """An optional path that must name a readable file when set; returned absolute."""
    value = _path_text(cfg, key)
    if value and not Path(value).expanduser().is_file():
        raise ConfigError(f"config key '{key}' = {value!r} is not a file")
    return str(Path(value).expanduser().resolve()) if value else ""


def _host(cfg: dict[str, Any], key: str) -> str:
    return _typed(cfg, key, str, lambda v: bool(_HOST.match(v)), "an IP address or host name")


def _storage(raw: dict[str, Any]) -> StorageSettings:
    """The ``storage`` group: the http store serves checkpoints and tokens, so it binds to
    loopback unless configured otherwise, and anywhere else only with TLS."""
    kind = _typed(raw, "storage.kind", str, lambda v: v in STORE_KINDS, f"one of {STORE_KINDS}")
    settings = StorageSettings(
        kind=kind,
        keep_client_checkpoints=_typed(raw, "storage.keep_client_checkpoints", bool),
        keep_last_k=_typed(raw, "storage.keep_last_k", int, lambda v: v >= 0,
                           ">= 0 (the number of newest global models kept; 0 keeps all)"),
        host=_host(raw, "storage.host"),
        port=_typed(raw, "storage.port", int, lambda v: 0 <= v <= 65535, "a port in [0, 65535]"),
        url=_typed(raw, "storage.url", str, lambda v: v == "" or re.match(r"^https?://[A-Za-z0-9.:\[\]-]+/?$", v)
                   is not None, "'' or http(s)://host:port"),
        ssl_certfile=_existing_file(raw, "storage.ssl_certfile"),
        ssl_keyfile=_existing_file(raw, "storage.ssl_keyfile"),
        ssl_ca_certfile=_existing_file(raw, "storage.ssl_ca_certfile"),
        max_file_bytes=_typed(raw, "storage.max_file_bytes", int, lambda v: v >= 1, ">= 1"),
        upload_idle_timeout_s=_typed(raw, "storage.upload_idle_timeout_s", float,
                                     lambda v: 0 < v < float("inf"), "seconds > 0"),
    )
    if kind != "http":
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


_TRAINER_NUMBERS: dict[str, tuple[type, Callable[[Any], bool], str]] = {
    "timeout_s": (float, lambda v: v > 0, "> 0"),
    "persistent_idle_s": (float, lambda v: v > 0, "> 0"),
    "stall_timeout_s": (float, lambda v: v >= 0, ">= 0 (0 disables the progress watchdog)"),
    "rollout_n": (int, lambda v: v >= 1, ">= 1"),
    "lr": (float, lambda v: v > 0, "> 0"),
    "weight_decay": (float, lambda v: v >= 0, ">= 0"),
    "kl_coef": (float, lambda v: v >= 0, ">= 0"),
    "entropy_coeff": (float, lambda v: v >= 0, ">= 0"),
    "clip_ratio": (float, lambda v: v > 0, "> 0"),
    "ppo_epochs": (int, lambda v: v >= 1, ">= 1"),
    "max_new_tokens": (int, lambda v: v >= 1, ">= 1"),
    "temperature": (float, lambda v: v > 0, "> 0"),
    "top_p": (float, lambda v: 0 < v <= 1, "in (0, 1]"),
    "val_temperature": (float, lambda v: v > 0, "> 0"),
    "max_model_len": (int, lambda v: v >= 16, ">= 16"),
    "num_threads": (int, lambda v: v >= 0, ">= 0"),
}


def _tracking(raw: dict[str, Any]) -> tuple[str, ...]:
    """``tracking``: where the run's metrics go besides ``metrics.jsonl`` (always written)."""
    from fedagent_flwr.serverapp.tracking import TRACKERS, missing_packages  # local: serverapp imports this module

    value = _get(raw, "tracking")
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"config key 'tracking' = {value!r} is invalid: expected a list such as [jsonl, tensorboard]")
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"config key 'tracking' = {value!r}: {unknown} not available; choose from {list(TRACKERS)}")
    if missing := missing_packages(names):
        raise ConfigError(f"config key 'tracking' = {value!r}: {missing} not installed on the ServerApp's machine; "
                          "install the tracking extra (pip install 'fedagent-flwr[tracking]') or leave them out")
    return tuple(dict.fromkeys(["jsonl", *names]))


def _rollout(raw: dict[str, Any]) -> dict[str, Any]:
    """The ``rollout`` group, as the trainer keys both backends read (``rollout_mode``,
    ``history_length``): every job, training and evaluation, runs the same agent loop."""
    from fedagent_flwr.rollout.windowed import DEFAULT_HISTORY_LENGTH, ROLLOUT_MODES

    for key, user_key in (("rollout_mode", "rollout.mode"), ("history_length", "rollout.history_length")):
        if key in (raw.get("trainer") or {}):  # would be overwritten below without a word
            raise ConfigError(f"config key 'trainer.{key}' is set from '{user_key}'; set {user_key} instead")
    if "rollout" not in raw:  # a config composed before the group existed: concat, as it ran then
        raw = {**raw, "rollout": {"mode": "concat", "history_length": DEFAULT_HISTORY_LENGTH}}
    return {
        "rollout_mode": _typed(raw, "rollout.mode", str, lambda v: v in ROLLOUT_MODES, f"one of {ROLLOUT_MODES}"),
        "history_length": _typed(raw, "rollout.history_length", int, lambda v: v >= 0,
                                 ">= 0 (the (observation, action) pairs a windowed prompt shows; FedAgent uses 2)"),
    }


def _check_trainer(trainer: dict[str, Any], where: str) -> None:
    """Type the numbers of a trainer group (in place) and, for verl, check the job's own knobs
    here, so a bad value stops the run before a client spends minutes starting Ray and vLLM."""
    nested: dict[str, Any] = trainer  # errors name the key where it is: trainer.x, trainer.per_client.0.x
    for part in reversed(where.split(".")):
        nested = {part: nested}
    for name, (kind, check, expect) in _TRAINER_NUMBERS.items():
        if name in trainer:
            trainer[name] = _typed(nested, f"{where}.{name}", kind, check, expect)
    if trainer.get("backend") == "verl":
        from fedagent_flwr.trainers.verl.settings import VerlSettings, VerlSettingsError  # torch- and verl-free

        try:
            VerlSettings.from_mapping({k: v for k, v in trainer.items() if k not in CLIENTAPP_TRAINER_KEYS})
        except VerlSettingsError as exc:
            raise ConfigError(f"config key {str(exc).replace('trainer.', f'{where}.', 1)}") from None


def validate(cfg: DictConfig, config_name: str = "config") -> RunSettings:
    """Check every value the run uses; return typed settings or raise ConfigError naming the key."""
    from fedagent_flwr.envs.spec import load_env_spec  # local: envs import torch-free helpers only

    raw: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    total = _typed(raw, "clients.total", int, lambda v: v >= 1, ">= 1")
    per_round = _typed(raw, "clients.per_round", int, lambda v: v >= 1, ">= 1")
    local_id = _typed(raw, "experiment.local_client_id", int, lambda v: -1 <= v < total,
                      f"-1 (off) or a client id in [0, {total - 1}]")
    mode = "local" if local_id >= 0 else ("centralized" if total == 1 else "federated")
    declared = str(_get(raw, "experiment.name"))
    if declared not in MODES:
        raise ConfigError(f"config key 'experiment.name' = {declared!r} is invalid: expected one of {MODES}")
    if declared != mode:
        raise ConfigError(
            f"experiment '{declared}' does not match the other keys, which describe a '{mode}' run "
            f"(clients.total={total}, experiment.local_client_id={local_id})"
        )
    algorithm = _typed(raw, "algorithm", str, lambda v: v in ALGORITHMS, f"one of {ALGORITHMS}")
    trainer = dict(_get(raw, "trainer"))
    backend = _typed(raw, "trainer.backend", str)
    if backend not in BACKEND_MODULES:
        raise ConfigError(
            f"config key 'trainer.backend' = {backend!r}: available backends are {tuple(BACKEND_MODULES)}"
        )
    trainer.setdefault("mode", "subprocess")  # configs written before the persistent trainer
    trainer["mode"] = _typed({"trainer": trainer}, "trainer.mode", str, lambda v: v in TRAINER_MODES,
                             f"one of {TRAINER_MODES}")
    if algorithm == "ppo" and backend == "reference":
        raise ConfigError("config key 'algorithm' = 'ppo' needs the verl backend; the reference trainer is GRPO only")
    _check_trainer(trainer, "trainer")
    trainer.update(_rollout(raw))  # the jobs carry the agent loop as trainer keys
    from fedagent_flwr.trainers.common.client_rule import ClientRuleError, load_client_rule

    try:
        load_client_rule(trainer)  # built once here, so a bad rule stops the run before any client trains
    except ClientRuleError as exc:
        raise ConfigError(f"config key {exc}") from None
    from fedagent_flwr.per_client import PER_CLIENT_KEY, resolve

    if PER_CLIENT_KEY in trainer:  # +trainer.per_client: a client's own resources, checked like the run's
        trainer[PER_CLIENT_KEY] = resolve(trainer, total, _check_trainer)
    proximal_mu = _typed(raw, "strategy.proximal_mu", float, lambda v: v >= 0, ">= 0")
    weights = _get(raw, "strategy.weights")
    if not isinstance(weights, list) or any(
        isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0 for w in weights
    ):
        raise ConfigError(f"config key 'strategy.weights' must be a list of positive numbers, got {weights!r}")
    if weights and len(weights) != total:
        raise ConfigError(
            f"config key 'strategy.weights' has {len(weights)} entries but clients.total is {total}"
        )
    partition = dict(_get(raw, "partition"))
    from fedagent_flwr.hetero import STRATEGIES, PartitionError, check_strategy
    from fedagent_flwr.hetero.env_level import ENV_LEVEL_STRATEGIES
    from fedagent_flwr.plugins import is_dotted_path

    known = sorted({*STRATEGIES, *ENV_LEVEL_STRATEGIES})
    strategy = _typed(raw, "partition.strategy", str, lambda v: v in known or is_dotted_path(v),
                      f"one of {known}, or the dotted path of a partition function")
    if is_dotted_path(strategy):
        try:
            check_strategy(strategy)
        except PartitionError as exc:
            raise ConfigError(f"config key 'partition.strategy': {exc}") from None
    min_goals = _typed(raw, "partition.min_goals_per_client", int, lambda v: v >= 1, ">= 1")
    if strategy == "coverage" and min_goals > 500:
        raise ConfigError(f"config key 'partition.min_goals_per_client' = {min_goals} must be <= 500 for coverage "
                          "(FedAgent's sizes centre on 500)")
    if strategy == "env_disjoint":
        from fedagent_flwr.hetero.env_disjoint import FALLBACKS, UNITS

        for knob, allowed in (("fallback", FALLBACKS), ("unit", UNITS)):
            if knob in partition and partition[knob] not in allowed:
                raise ConfigError(f"config key 'partition.{knob}' = {partition[knob]!r} must be one of {list(allowed)}")
    for knob, check, expect in (("omega", lambda v: 0 < v < 1, "in (0, 1)"),
                                ("env_div", lambda v: 0 <= v <= 1, "in [0, 1]"),
                                ("keep_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
                                ("size_std", lambda v: v > 0, "> 0"), ("success_std", lambda v: v > 0, "> 0")):
        if knob in partition:
            partition[knob] = _typed(raw, f"partition.{knob}", float, check, expect)
    if strategy == "hardness":
        labels = _typed(raw, "partition.trajectories_file", str)
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
    _check_partition_fits_envs(strategy, specs["train"], bool(_get(raw, "env.service.enabled")))
    epochs = _typed(raw, "train.epochs", int, lambda v: v >= 1, ">= 1 (passes over the round's instances)")
    per_client = _typed(raw, "eval.per_client", bool)
    if per_client and _typed(raw, "eval.num_episodes", int) < 1:
        raise ConfigError("config key 'eval.per_client' = true validates each trained client on the "
                          "eval.num_episodes validation episodes: set eval.num_episodes >= 1")
    if _get(raw, "env.service.enabled") is True and backend == "reference":
        # per-client validation plays every validation episode on each client
        _check_pool_fits_lockstep(raw, specs, int(trainer.get("rollout_n", 1)), 1 if per_client else total)
    kwargs = _get(raw, "strategy.kwargs")
    if not isinstance(kwargs, dict):
        raise ConfigError(f"config key 'strategy.kwargs' must be a mapping, got {kwargs!r}")
    return RunSettings(
        config_name=config_name,
        run_name=_typed(raw, "run_name", str, lambda v: v == "" or bool(_PLAIN_NAME.match(v)),
                        "'' or a plain directory name (letters, digits, '.', '_', '-'; not starting with '.')"),
        output_dir=_path_text(raw, "output_dir", required=True),
        num_rounds=_typed(raw, "num_rounds", int, lambda v: v >= 1, ">= 1"),
        seed=_typed(raw, "seed", int),
        model_path=_path_text(raw, "model.path"),
        total_clients=total,
        clients_per_round=min(per_round, total),
        mode=mode,
        local_client_id=local_id,
        algorithm=algorithm,
        local_steps=_typed(raw, "train.local_steps", int, lambda v: v >= 1, ">= 1"),
        env_name=_typed(raw, "env.name", str),
        train_env_spec=specs["train"],
        val_env_spec=specs["val"],
        env_service={
            "enabled": _typed(raw, "env.service.enabled", bool),
            "pool_size": _typed(raw, "env.service.pool_size", int, lambda v: v >= 1, ">= 1"),
            "host": _host(raw, "env.service.host"),
            "startup_timeout_s": _typed(raw, "env.service.startup_timeout_s", float, lambda v: v > 0, "> 0"),
        },
        trainer=trainer,
        strategy_name=_typed(raw, "strategy.name", str),
        strategy_class=_typed(raw, "strategy.class_path", str,
                              lambda v: "." in v and all(part.isidentifier() for part in v.split(".")),
                              "a dotted path such as mypkg.module.MyStrategy"),
        proximal_mu=proximal_mu,
        fixed_weights=tuple(float(w) for w in weights),
        strategy_kwargs=dict(kwargs),
        partition=partition,
        eval_enabled=_typed(raw, "eval.enabled", bool),
        eval_before_train=_typed(raw, "eval.before_train", bool),
        eval_num_episodes=_typed(raw, "eval.num_episodes", int, lambda v: v >= 0, ">= 0"),
        eval_seed=_typed(raw, "eval.seed", int),
        round_timeout=_typed(raw, "round_timeout", float, lambda v: v > 0, "> 0"),
        storage=_storage(raw),
        raw=raw,
        tracking=_tracking(raw),
        epochs=epochs,
        eval_per_client=per_client,
    )


def _check_pool_fits_lockstep(raw: dict[str, Any], specs: dict[str, Any], rollout_n: int, clients: int) -> None:
    """Refuse an env-service pool smaller than what the reference trainer plays at once.

    It samples all episodes of a step in lockstep (one batch waits for every running episode), so
    an episode still waiting for a pool slot would stall the others until the service's create
    timeout; one service serves each env-spec entry.
    """
    pool = _typed(raw, "env.service.pool_size", int, lambda v: v >= 1, ">= 1")
    episodes = _typed(raw, "eval.num_episodes", int, lambda v: v >= 0, ">= 0")
    for index, entry in enumerate(specs["train"]["envs"]):
        need = entry["n_envs"] * rollout_n
        if need > pool:
            raise ConfigError(
                f"config key 'env.service.pool_size' = {pool} is smaller than the {need} episodes the reference "
                f"trainer plays at once on one service (env.train.envs.{index}.n_envs={entry['n_envs']} x "
                f"trainer.rollout_n={rollout_n}); set env.service.pool_size={need}"
            )
    per_client = -(-episodes // clients)  # validation episodes are split across the clients
    if per_client > pool:
        split = f"over {clients} clients" if clients > 1 else "on one client"
        raise ConfigError(
            f"config key 'env.service.pool_size' = {pool} is smaller than the {per_client} validation episodes "
            f"each client plays at once (eval.num_episodes={episodes} {split}); set "
            f"env.service.pool_size={per_client} or lower eval.num_episodes"
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
