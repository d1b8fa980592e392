"""Real peft LoRA adapters for the tests, and the plain-torch oracle of the model an adapter stands for.

:func:`write_adapter` trains nothing: it attaches a seeded adapter with peft and gives ``B`` random
values (peft starts it at zero, so an untrained adapter changes nothing), then saves it with peft's
own ``save_pretrained``, the files a peft user would have, and records the base model's content hash
in the factors' metadata as the reference trainer does (:func:`record_base`). :func:`adapter_oracle` reads those files
with safetensors and json only and computes ``W + (lora_alpha / r) B @ A`` in float64 (``lora_alpha /
sqrt(r)`` with rsLoRA), the value the
server's reader must give, without any of the code under test.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
PEFT_PREFIX = "base_model.model."


def write_adapter(base_dir: Path, out_dir: Path, seed: int, rank: int = 4, alpha: float = 8.0,
                  targets: Sequence[str] = DEFAULT_TARGETS, **lora_kwargs: object) -> Path:
    """Save a seeded LoRA adapter of the model in ``base_dir`` (``B`` non-zero) to ``out_dir`` with peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        **lora_kwargs)  # type: ignore[arg-type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.05)
    peft_model.save_pretrained(str(out_dir))
    record_base(out_dir, base_dir)
    return out_dir


def record_base(adapter_dir: Path, base_dir: Path | None, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Write the adapter's factors (``tensors``; None: those in the file) with the content hash of
    ``base_dir`` as the model it was trained on, as the reference trainer records it (None: no hash)."""
    from safetensors.torch import save_file

    from fedagent_flwr.checkpoint.ref import ADAPTER_BASE_SHA256, hash_checkpoint_dir

    path = adapter_dir / "adapter_model.safetensors"
    factors = load_file(str(path)) if tensors is None else tensors
    metadata = {"format": "pt"} if base_dir is None else {"format": "pt",
                                                          ADAPTER_BASE_SHA256: hash_checkpoint_dir(base_dir)}
    save_file(factors, str(path), metadata=metadata)


def base_state(base_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model directory's safetensors files."""
    state: dict[str, torch.Tensor] = {}
    for path in sorted(base_dir.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def adapter_oracle(base_dir: Path, adapter_dir: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The full model (float64) an adapter stands for, from the files alone, and the keys it changes."""
    settings = json.loads((adapter_dir / "adapter_config.json").read_text())
    # peft's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA
    scale = settings["lora_alpha"] / (settings["r"] ** 0.5 if settings.get("use_rslora") else settings["r"])
    factors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    state = {key: value.double() for key, value in base_state(base_dir).items()}
    changed = set()
    for key in factors:
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            b = factors[module + ".lora_B.weight"].double()
            target = module.removeprefix(PEFT_PREFIX) + ".weight"
            state[target] = state[target] + scale * (b @ factors[key].double())
            changed.add(target)
    return state, changed
