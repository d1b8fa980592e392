"""The reference trainer's checkpoint: verl's FSDP layout at world size 1, so the server
aggregates it like any verl client's::

    <step_dir>/actor/
        model_world_size_1_rank_0.pt   torch.save of the fp32 state_dict (HF key names)
        fsdp_config.json               {"FSDP_version": 2, "world_size": 1}
        huggingface/                   config.json, generation_config.json, tokenizer files
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedagent_flwr.atomic import temporary_dir

ACTOR_SHARD = "model_world_size_1_rank_0.pt"


def write_actor_dir(step_dir: Path, fill: Callable[[Path], None]) -> Path:
    """Write ``step_dir/actor`` with ``fill(actor_dir)``; return the actor dir.

    Filled in a temporary sibling and renamed into place (an older ``step_dir`` replaced), so a
    reader never sees a partial checkpoint: the full model's layout here and the LoRA adapter's
    (:mod:`.lora`) both go through it.
    """
    step_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_dir(step_dir.parent, f".{step_dir.name}.tmp-")  # 0755 as a result, not mkdtemp's 0700
    try:
        actor = staging / "actor"
        actor.mkdir()
        fill(actor)
        if step_dir.exists():
            shutil.rmtree(step_dir)
        os.replace(staging, step_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return step_dir / "actor"


def write_fsdp_checkpoint(model: Any, tokenizer: Any, step_dir: Path) -> Path:
    """Write ``step_dir/actor`` in verl's FSDP layout (world size 1); return the actor dir."""
    import torch

    def fill(actor: Path) -> None:
        (actor / "huggingface").mkdir()
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
        torch.save(state, actor / ACTOR_SHARD)
        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}, indent=2))
        model.config.save_pretrained(str(actor / "huggingface"))
        model.generation_config.save_pretrained(str(actor / "huggingface"))
        tokenizer.save_pretrained(str(actor / "huggingface"))

    return write_actor_dir(step_dir, fill)
