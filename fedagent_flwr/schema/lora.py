"""Federated LoRA's settings (``model.lora``): declared once, for the run's ``model`` group and the jobs.

With ``rank`` > 0 every client trains a fresh low-rank adapter on top of the round's global model
and uploads only the adapter; the server reads each adapter as the full model it stands for and
aggregates full models (:mod:`fedagent_flwr.checkpoint.lora_reader`). ``rank`` 0 (the default)
trains the full model, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedagent_flwr.schema.fields import SettingError, setting

#: what a target module is named by (peft matches a module whose name is it or ends with ".<it>")
_MODULE_NAME = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*"
#: the attention projections of Llama-style models (Llama, Qwen2, SmolLM2, Mistral)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class Lora:
    """peft's ``LoraConfig`` as the run sets it: ``r``, ``lora_alpha``, ``target_modules``, ``lora_dropout``."""

    rank: int = setting(0, ge=0, note="0 trains the full model, LoRA off")
    alpha: int = setting(16, ge=1)  # the update is (alpha / rank) B @ A (an int, as peft types lora_alpha)
    # the linear layers that get an adapter, by module name (peft's matching: the name or its last parts)
    target_modules: list[str] = setting(factory=lambda: list(DEFAULT_TARGETS), pattern=_MODULE_NAME,
                                        note="a module name such as q_proj")
    dropout: float = setting(0.0, ge=0, lt=1)  # dropout on the adapter's input while training

    def check_together(self, prefix: str) -> None:
        """An adapter needs at least one module to attach to."""
        if self.rank > 0 and not self.target_modules:
            raise SettingError(f"config key '{prefix}.target_modules' is empty but {prefix}.rank = {self.rank}: "
                               f"name the linear layers to adapt, e.g. {prefix}.target_modules=[q_proj,v_proj]")


@dataclass
class LoraKnobs:
    """The ``lora`` field, shared by the run's ``model`` group and the jobs' settings (one declaration)."""

    lora: Lora = setting(factory=Lora)
