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
from pathlib import Path
from typing import Any

from fedagent_flwr.atomic import temporary_dir

ACTOR_SHARD = "model_world_size_1_rank_0.pt"


def write_fsdp_checkpoint(model: Any, tokenizer: Any, step_dir: Path) -> Path:
    """Write ``step_dir/actor`` in verl's FSDP layout (world size 1); return the actor dir.

    Written into a temporary sibling and renamed, so a reader never sees a partial checkpoint.
    """
    import torch

    step_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_dir(step_dir.parent, f".{step_dir.name}.tmp-")  # 0755 as a result, not mkdtemp's 0700
    try:
        actor = staging / "actor"
        (actor / "huggingface").mkdir(parents=True)
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
        torch.save(state, actor / ACTOR_SHARD)
        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}, indent=2))
        model.config.save_pretrained(str(actor / "huggingface"))
        model.generation_config.save_pretrained(str(actor / "huggingface"))
        tokenizer.save_pretrained(str(actor / "huggingface"))
        if step_dir.exists():
            shutil.rmtree(step_dir)
        os.replace(staging, step_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return step_dir / "actor"

