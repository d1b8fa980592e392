"""Start-up checks of a run: what would otherwise fail on every client, checked once before round 0.

Config validation (:mod:`fedagent_flwr.config`) checks each value's type and range. The checks here
need more than the config: they build every environment of the train and val specs with its config
(``BaseTextEnv.check_config``: TinyGuess with ``lo`` > ``hi``, a WebShop or ALFWorld data directory
that does not exist) and look at the base model's directory (and, with ``model.lora``, at the modules
its adapters would attach to). A failure is a :class:`ConfigError`
whose one-line message names the run-config key (``env.data_dir``, not the env's own ``data_dir``)
and what to do about it.

Data files are a property of a machine. In a simulation the clients run on the ServerApp's machine,
so missing data refuses the run; across machines (deployment) the data may exist only on the
clients, so it is reported as a warning and each client checks its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedagent_flwr.checkpoint import CheckpointError, CheckpointRef
from fedagent_flwr.checkpoint.ref import ADAPTER_CONFIG
from fedagent_flwr.config import ConfigError, RunSettings
from fedagent_flwr.envs.base import EnvConfigError, EnvDataError
from fedagent_flwr.envs.registry import UnknownEnvError, get_env_class
from fedagent_flwr.envs.service import DEFAULT_CREATE_TIMEOUT_S
from fedagent_flwr.per_client import PER_CLIENT_KEY
from fedagent_flwr.trainers.verl.overrides import split_group_error

SPLITS = ("train", "val")


def env_config_key(raw_env: Mapping[str, Any], split: str, index: int, entry_config: Mapping[str, Any],
                   field: str | None) -> tuple[str, Any]:
    """The run-config key (and its value) behind an env-spec entry's config ``field``.

    Env groups set shared values once (``env.data_dir``) and interpolate them into every entry, so
    a field whose value equals the group-level key of the same name is named by that key; otherwise
    the entry's own key (``env.train.envs.0.config.split``), or the whole entry's config when the
    environment named no field.
    """
    where = f"env.{split}.envs.{index}.config"
    if field is None:
        return where, None
    value = entry_config.get(field)
    if field in raw_env and not isinstance(raw_env[field], (dict, list)) and raw_env[field] == value:
        return f"env.{field}", value
    return f"{where}.{field}", value


def check_env_specs(settings: RunSettings, data_is_local: bool) -> list[str]:
    """Check every env-spec entry (train and val) with its config, as the clients would build it.

    Raises :class:`ConfigError` naming the run-config key at fault. ``data_is_local`` (a simulation:
    the clients share this machine) makes missing data files an error; otherwise they are returned
    as warnings, once each.
    """
    raw_env = settings.raw.get("env", {})
    warnings: list[str] = []
    for split in SPLITS:
        spec = settings.train_env_spec if split == "train" else settings.val_env_spec
        for index, entry in enumerate(spec["envs"]):
            config = {"max_turns": entry["max_turns"], **entry["config"]}  # EnvSpecEntry.env_config()
            try:
                get_env_class(entry["name"]).check_config(config)
            except EnvConfigError as exc:
                key, value = env_config_key(raw_env, split, index, entry["config"], exc.key)
                shown = f" = {value!r}" if exc.key is not None else ""
                message = f"config key '{key}'{shown}: {exc}"
                if isinstance(exc, EnvDataError) and not data_is_local:
                    note = f"{message} (on the ServerApp's machine; every client needs it on its own machine)"
                    if note not in warnings:
                        warnings.append(note)
                    continue
                raise ConfigError(message) from None
            except UnknownEnvError as exc:  # validated at composition; a plugin may have changed since
                raise ConfigError(f"config key 'env.{split}.envs.{index}.name': {exc}") from None
            except Exception as exc:  # noqa: BLE001 - a third-party environment's own failure
                where = f"env.{split}.envs.{index}.config"
                message = f"config key '{where}': environment {entry['name']} cannot be built with it: " \
                          f"{type(exc).__name__}: {exc}"
                if isinstance(exc, OSError) and not data_is_local:
                    warnings.append(f"{message} (on the ServerApp's machine)")
                    continue
                raise ConfigError(message) from None
    return warnings


def service_pool_warnings(settings: RunSettings) -> list[str]:
    """Warn when a verl step plays more episodes of an env-spec entry than its env service can hold.

    verl's agent loop starts all of a step's episodes at once; past the pool they queue for a slot
    (the reference trainer, which would stall, is refused by the config check instead). Queueing
    is allowed, an env may be too big for one instance per episode, but it serializes the step,
    and an episode that waits longer than the service's create timeout fails the client's job.
    """
    service = settings.raw.get("env", {}).get("service", {})
    if settings.trainer_backend != "verl" or not service.get("enabled"):
        return []
    pool, rollout_n = int(service["pool_size"]), int(settings.trainer["rollout_n"])
    warnings = []
    for index, entry in enumerate(settings.train_env_spec["envs"]):
        need = int(entry["n_envs"]) * rollout_n
        if need > pool:
            warnings.append(
                f"config key 'env.service.pool_size' = {pool}: a verl step plays {need} episodes of "
                f"env.train.envs.{index} at once (n_envs {entry['n_envs']} x trainer.rollout_n {rollout_n}), but "
                f"only {pool} can hold an env: the rest wait for a slot (a slower step), and one waiting more "
                f"than {DEFAULT_CREATE_TIMEOUT_S:g} s fails the client's job; set env.service.pool_size={need} "
                "unless one env per episode does not fit in memory")
    return warnings


def client_count_warnings(settings: RunSettings) -> list[str]:
    """Warn about client counts that run, but not as a reader of the config might expect."""
    clients = settings.run.clients
    warnings = []
    if clients.per_round > clients.total:  # sampling takes everyone (FedAgent's M >= N rule), as documented
        warnings.append(f"config key 'clients.per_round' = {clients.per_round} is more than clients.total = "
                        f"{clients.total}: every round trains all {clients.total} clients")
    if clients.total > 100:
        warnings.append("with more than 100 clients FedAgent's data seed rule (seed + 100 * round + client) "
                        "gives some clients the seed another client had a round later")
    return warnings


def check_request_seed_groups(settings: RunSettings) -> None:
    """Refuse ``trainer.request_seeds`` with a client whose agent-loop workers would split a GRPO group.

    verl hands each agent-loop worker an equal chunk of a step's rows; a group split over two
    chunks restarts its rollout index and two of its rollouts would share their seeds
    (:func:`~fedagent_flwr.trainers.verl.overrides.split_group_error`). Checked for the run's
    ``trainer.agent_workers`` and every client's own (``trainer.per_client``); the job checks again.
    """
    trainer = settings.trainer
    if settings.trainer_backend != "verl" or not trainer.get("request_seeds"):
        return
    batch_size = sum(int(entry["n_envs"]) for entry in settings.train_env_spec["envs"])
    workers = {"trainer.agent_workers": int(trainer["agent_workers"])}
    for client, values in sorted((trainer.get(PER_CLIENT_KEY) or {}).items()):
        if "agent_workers" in values:
            workers[f"trainer.{PER_CLIENT_KEY}.{client}.agent_workers"] = int(values["agent_workers"])
    for key, count in workers.items():
        if error := split_group_error(batch_size, count, key):
            raise ConfigError(error)


def base_model(model_dir: Path, configured: str) -> CheckpointRef:
    """The base model's checkpoint reference, refusing a directory the trainers cannot load.

    ``configured`` is the ``model.path`` value the message names.
    """
    shown = configured or "<bundled SmolLM2-135M-Instruct>"
    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"config key 'model.path' = {shown!r}: {model_dir} is not a Hugging Face model directory (no "
            "config.json); give a local model directory, a hub id, or '' for the bundled SmolLM2-135M-Instruct"
        )
    if (model_dir / ADAPTER_CONFIG).is_file():  # with peft installed, transformers would load that adapter
        raise ConfigError(  # on every client's model, while the server reads the weights alone
            f"config key 'model.path' = {shown!r}: {model_dir} holds {ADAPTER_CONFIG}, so the clients' trainers would "
            "load that adapter on top of the weights while the server aggregates the weights alone; merge the adapter "
            "into the model (peft's merge_and_unload, then save_pretrained) or point model.path at the plain model")
    try:
        return CheckpointRef.for_directory(model_dir, "actor", "hf-safetensors")
    except CheckpointError as exc:
        raise ConfigError(f"config key 'model.path' = {shown!r}: {exc}") from None


def check_lora_targets(settings: RunSettings, model_dir: Path) -> None:
    """Refuse ``model.lora.target_modules`` that the clients' adapters could not use, before round 0.

    Each entry must match (peft's rule: a module named so, or whose name ends with ``.<entry>``) at
    least one linear layer of the base model, and none of the matched layers may be a weight the model
    ties to another (``lm_head`` of a model with tied embeddings: the global model stores only the
    embedding, so an update of the head alone has no tensor to land in), nor anything but a linear
    layer (the server reads ``W + s B @ A`` of linear weights only). The model is built on the meta
    device: no weights are read. Nothing to check with ``model.lora.rank`` 0.
    """
    lora = settings.run.model.lora
    if lora.rank == 0:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from peft import LoraConfig
        from peft.tuners.tuners_utils import check_target_module_exists
    except ImportError:
        raise ConfigError(f"config key 'model.lora.rank' = {lora.rank} needs peft, which is not installed on the "
                          "ServerApp's machine: pip install 'fedagent-flwr[lora]' (on every node)") from None

    from fedagent_flwr.checkpoint.config_answers import quiet_transformers
    from fedagent_flwr.checkpoint.hf_files import tied_weight_keys

    key = "model.lora.target_modules"
    with quiet_transformers():
        config = AutoConfig.from_pretrained(str(model_dir))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    modules = dict(model.named_modules())
    tied = tied_weight_keys(model_dir)
    for target in lora.target_modules:
        matcher = LoraConfig(r=lora.rank, target_modules=[target])
        matched = [name for name in modules if name and check_target_module_exists(matcher, name)]
        if not matched:
            linear = sorted({name.rsplit(".", 1)[-1] for name, module in modules.items()
                             if isinstance(module, torch.nn.Linear)})
            raise ConfigError(f"config key '{key}' entry {target!r} matches no module of the base model {model_dir} "
                              f"(its linear layers: {', '.join(linear)})")
        for name in matched:
            module = modules[name]
            if not isinstance(module, torch.nn.Linear):
                raise ConfigError(f"config key '{key}' entry {target!r} matches {name} ({type(module).__name__}): "
                                  "federated LoRA adapts linear layers only")
            if f"{name}.weight" in tied:
                raise ConfigError(f"config key '{key}' entry {target!r} matches {name}, whose weight the base model "
                                  f"ties to {tied[f'{name}.weight']}: an adapter of it has no tensor of its own to "
                                  "update in the global model; leave it out")
