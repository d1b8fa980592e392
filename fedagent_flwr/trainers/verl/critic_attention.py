"""PPO critics without flash-attn: verl 0.9.1 loads the value model with a hard-coded
``attn_implementation="flash_attention_2"`` (``verl.utils.model.load_valuehead_model``), ignoring
``critic.model.override_config``; without a flash-attn build (none exists for torch 2.11 / CUDA 13)
every PPO job fails with "is not a value head model". The job's ``sitecustomize`` replaces that
loader, in the processes that import it, with one that uses the configured implementation
(``FEDAGENT_CRITIC_ATTN``, e.g. ``sdpa``) and loads the value head the same way
(``AutoModelForTokenClassification``; verl's trl fallback is not used).
"""

from __future__ import annotations

import os
from typing import Any

from fedagent_flwr.trainers.verl.engine_hooks import patch_when_imported

ENV_ATTN = "FEDAGENT_CRITIC_ATTN"
TARGET_MODULE = "verl.utils.model"


def patch_model_module(module: Any, attn_implementation: str) -> None:
    """Replace ``module.load_valuehead_model`` with a loader using ``attn_implementation``."""
    if getattr(module, "_fedagent_critic_attn", None) is not None:
        return

    def load_valuehead_model(local_path: Any, torch_dtype: Any, model_config: Any, trust_remote_code: bool) -> Any:
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
            attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
        )

    module.load_valuehead_model = load_valuehead_model
    module._fedagent_critic_attn = attn_implementation


def install_from_environment() -> bool:
    """Arm the patch when ``FEDAGENT_CRITIC_ATTN`` names an implementation other than flash-attn 2."""
    attn = os.environ.get(ENV_ATTN, "").strip()
    if not attn or attn == "flash_attention_2":
        return False
    patch_when_imported(TARGET_MODULE, lambda module: patch_model_module(module, attn))
    return True
