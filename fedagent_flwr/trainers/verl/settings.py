"""The verl backend's knobs (the ``trainer`` config group with ``backend: verl``), typed and checked.

Importable without verl or torch, so the server can refuse a bad value when the run is composed
instead of a client finding out minutes into its verl job.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


class VerlSettingsError(ValueError):
    """A verl trainer setting with a wrong type or value; the message names the key."""


@dataclass(frozen=True)
class VerlSettings:
    """Hyper-parameters and resources of one client's verl job (see ``conf/trainer/verl.yaml``)."""

    rollout_n: int = 4
    lr: float = 1e-6
    critic_lr: float = 1e-5
    kl_coef: float = 0.01
    entropy_coeff: float = 0.001
    clip_ratio: float = 0.2
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 8
    micro_batch_size_per_gpu: int = 4
    max_prompt_length: int = 512
    max_response_length: int = 512
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    val_temperature: float = 0.4
    invalid_action_penalty: float = 0.1
    n_gpus_per_node: int = 1
    gpu_memory_utilization: float = 0.3
    kv_cache_gib: float = 4.0
    enforce_eager: bool = True
    # vLLM's CUDA-graph batch sizes when enforce_eager is false (empty: vLLM's own list); fewer
    # sizes, shorter capture at start-up (docs/gpu.md, "Start-up phases").
    cudagraph_capture_sizes: tuple[int, ...] = field(default_factory=tuple)
    # torch.compile of the actor's (and reference's) entropy-from-logits, verl's default; false
    # skips its first-step compile at the price of an eager kernel.
    torch_compile: bool = True
    agent_workers: int = 2
    ray_num_cpus: int = 8
    use_v1: bool = False
    attn_implementation: str = "sdpa"
    use_remove_padding: bool = False
    # The agent loop (config keys rollout.mode / rollout.history_length): concat or windowed.
    rollout_mode: str = "concat"
    history_length: int = 2
    extra_overrides: tuple[str, ...] = field(default_factory=tuple)
    # Modules imported in every verl process right after verl.trainer.ppo.core_algos (user_hooks):
    # where advantage estimators and policy losses get registered.
    plugin_modules: tuple[str, ...] = field(default_factory=tuple)
    # verl's own loggers besides console and file, which are always on (the client reads the file).
    verl_logger: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> tuple[VerlSettings, list[str]]:
        """Checked settings from the trainer group, and the keys it does not know (sorted).

        Unknown keys are returned rather than refused: the group also carries the ClientApp's own
        keys (``backend``, ``timeout_s``) and evaluation knobs of the reference trainer.
        """
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in (raw or {}).items():
            if key not in known:
                continue
            values[key] = _coerce(key, value, cls.__dataclass_fields__[key].default
                                  if key not in _LIST_FIELDS else ())
        settings = cls(**values)
        settings._check()
        return settings, sorted(k for k in (raw or {}) if k not in known)

    def _check(self) -> None:
        for name in ("rollout_n", "ppo_epochs", "ppo_mini_batch_size", "micro_batch_size_per_gpu",
                     "max_prompt_length", "max_response_length", "max_new_tokens", "n_gpus_per_node",
                     "agent_workers", "ray_num_cpus"):
            if getattr(self, name) < 1:
                raise VerlSettingsError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "critic_lr", "temperature", "val_temperature", "clip_ratio"):
            if not getattr(self, name) > 0:
                raise VerlSettingsError(f"trainer.{name} must be > 0, got {getattr(self, name)}")
        for name in ("kl_coef", "entropy_coeff", "invalid_action_penalty", "kv_cache_gib"):
            if getattr(self, name) < 0:
                raise VerlSettingsError(f"trainer.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("top_p", "gpu_memory_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise VerlSettingsError(f"trainer.{name} must be in (0, 1], got {getattr(self, name)}")
        if self.max_new_tokens > self.max_response_length:
            raise VerlSettingsError(
                f"trainer.max_new_tokens ({self.max_new_tokens}) exceeds trainer.max_response_length "
                f"({self.max_response_length}): not even one turn would fit"
            )
        if self.rollout_mode not in ("concat", "windowed"):
            raise VerlSettingsError(f"trainer.rollout_mode must be concat or windowed, got {self.rollout_mode!r}")
        if self.history_length < 0:
            raise VerlSettingsError(f"trainer.history_length must be >= 0, got {self.history_length}")
        if self.rollout_mode == "windowed" and self.use_v1:
            raise VerlSettingsError(
                "trainer.use_v1=true does not support rollout.mode=windowed (its per-turn rows are built for "
                "verl's classic PPO trainer): set trainer.use_v1=false or rollout.mode=concat")
        if self.attn_implementation not in ("sdpa", "eager", "flash_attention_2"):
            raise VerlSettingsError(
                "trainer.attn_implementation must be sdpa, eager or flash_attention_2, "
                f"got {self.attn_implementation!r}"
            )
        for name in self.plugin_modules:
            if not _MODULE_NAME.match(name):
                raise VerlSettingsError(
                    f"trainer.plugin_modules entry {name!r} is not a module name such as mypkg.estimators"
                )
        for name in self.verl_logger:
            if name not in VERL_LOGGERS:
                raise VerlSettingsError(
                    f"trainer.verl_logger entry {name!r} is not one of verl's loggers; choose from "
                    f"{list(VERL_LOGGERS)} (console and file are always on)"
                )
        if self.cudagraph_capture_sizes and self.enforce_eager:
            raise VerlSettingsError(
                "trainer.cudagraph_capture_sizes needs trainer.enforce_eager=false (eager vLLM captures no CUDA "
                "graphs): set enforce_eager to false or leave cudagraph_capture_sizes empty")
        for item in self.extra_overrides:
            if "=" not in item or item.startswith("=") or any(c in item for c in "\n\r\0"):
                raise VerlSettingsError(
                    f"trainer.extra_overrides entry {item!r} is not a Hydra override of the form key=value"
                )

    @property
    def loggers(self) -> list[str]:
        """verl's ``trainer.logger`` list: console (the job's log), file (the per-step metrics the
        client reads, :mod:`.verl_log`), then the user's ``verl_logger`` in its order."""
        return list(dict.fromkeys(("console", "file", *self.verl_logger)))

    @property
    def max_model_len(self) -> int:
        """Token budget of one episode (prompt plus every turn), as the agent loop enforces it."""
        return self.max_prompt_length + self.max_response_length


_LIST_FIELDS = ("extra_overrides", "plugin_modules", "verl_logger", "cudagraph_capture_sizes")
_INT_LIST_FIELDS = ("cudagraph_capture_sizes",)
# The backends verl 0.9.1's Tracking accepts (``Tracking.supported_backend`` in
# verl/utils/tracking.py); a test checks this list against the installed verl.
VERL_LOGGERS = ("wandb", "mlflow", "swanlab", "vemlp_wandb", "tensorboard", "console", "clearml", "trackio",
                "file", "rl_insight")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _coerce(key: str, value: Any, default: Any) -> Any:
    """``value`` converted to ``default``'s type, or a VerlSettingsError naming ``trainer.key``."""
    if key in _INT_LIST_FIELDS:
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):
            raise VerlSettingsError(f"trainer.{key} must be a list of positive integers, got {value!r}")
        return tuple(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise VerlSettingsError(f"trainer.{key} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise VerlSettingsError(f"trainer.{key} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise VerlSettingsError(f"trainer.{key} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise VerlSettingsError(f"trainer.{key} must be a string, got {value!r}")
        return value
    # extra_overrides, plugin_modules, verl_logger: lists of strings
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise VerlSettingsError(f"trainer.{key} must be a list of strings, got {value!r}")
    return tuple(value)
