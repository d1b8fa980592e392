"""A tiny random-weight causal LM with the real SmolLM2 tokenizer, for tests and smoke runs.

Random weights make the policy emit noise, but every code path (chat template, masks, sampling,
GRPO update, checkpoint layout, aggregation) runs on a real tokenizer and a real transformers
model in a fraction of a second per step.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from fedagent_flwr.atomic import fsync_dir, fsync_file, parent_problem, replace_dir, temporary_dir
from fedagent_flwr.cli import program
from fedagent_flwr.models.smollm2 import smollm2_tokenizer_dir

#: The tiny model's size, in its config.json: also how :func:`_holds_tiny_model` recognises one.
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
#: The largest seed: ``torch.manual_seed`` takes 0 to 2**64 - 1 (a larger one ends in an OverflowError
#: traceback; a negative one it takes as 2**64 plus it, the weights of another seed under a second name).
MAX_SEED = 2**64 - 1


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    tokenizer_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Write a tiny Qwen2 causal LM (hidden 64, 2 layers, 4/2 heads, tied embeddings) to ``out_dir``.

    The weights are a pure function of ``seed`` (the global torch RNG is left untouched), saved as
    fp32 safetensors next to the tokenizer (SmolLM2's by default), so ``from_pretrained`` and the
    trainers load it like any other model directory. They are written to a temporary folder and
    renamed into place (:func:`_write`), so a failure midway leaves no half model there. Refused
    before the model is built: a seed outside 0 to :data:`MAX_SEED` (:class:`ValueError`), a file
    where ``out_dir`` or one of its parents should be a folder, or a folder one may not write
    (:class:`NotADirectoryError`), and an ``out_dir`` holding anything but an earlier tiny model
    (:class:`FileExistsError`).
    """
    out = Path(out_dir)
    if problem := seed_problem(seed):
        raise ValueError(f"seed {problem}")
    _check_parents(out)
    if out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
        raise NotADirectoryError(f"{out}: cannot write in it (permission denied); name a directory you may write")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not _holds_tiny_model(out))):
        raise FileExistsError(f"{out} exists and is not an empty directory or a tiny model written here, and "
                              "writing the model there would overwrite or remove its files: name a new directory")
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir or smollm2_tokenizer_dir()))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=SHAPE["hidden_size"],
        intermediate_size=SHAPE["intermediate_size"],
        num_hidden_layers=SHAPE["num_hidden_layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # transformers' .to wrapper stub
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    _write(out, [model, tokenizer])
    return out


def _write(out: Path, parts: list[Any]) -> None:
    """Save each of ``parts`` (``save_pretrained``) to ``out`` through a temporary folder, so that a
    failure midway (a full disk) leaves no half model. A new ``out`` is the renamed folder
    (:func:`~fedagent_flwr.atomic.replace_dir`); an existing one (empty, or an earlier tiny model) is
    written into, each file renamed over its namesake, since it may be a mount point, the working
    directory or a folder with its own owner and mode, which renaming a new folder in would lose."""
    def save(folder: Path) -> None:
        for part in parts:
            part.save_pretrained(str(folder))

    if not out.is_dir():
        replace_dir(out.resolve(), save)  # a link's target's parent gets the temporary folder
        return
    staged = temporary_dir(out, ".tiny-model.tmp-")
    try:
        save(staged)
        for path in staged.iterdir():
            fsync_file(path)
        for path in staged.iterdir():
            os.replace(path, out / path.name)
        fsync_dir(out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def seed_problem(seed: int) -> str | None:
    """Why ``seed`` cannot seed the weights (outside 0 to :data:`MAX_SEED`), or None: checked with the
    other inputs, before torch is imported, so that a wrong seed costs no model build and no traceback."""
    if 0 <= seed <= MAX_SEED:
        return None
    return f"must be an integer from 0 to {MAX_SEED} (2**64 - 1, what torch.manual_seed takes), got {seed}"


def _check_parents(out: Path) -> None:
    """Refuse ``out`` where its folder can neither be found nor made (:func:`~fedagent_flwr.atomic.parent_problem`):
    ``mkdir`` would fail only after the model was built, with the bare errno of a path the user did not type."""
    if problem := parent_problem(out):
        raise NotADirectoryError(f"{out}: {problem}")


def _holds_tiny_model(directory: Path) -> bool:
    """Whether ``directory``'s config.json is this module's shape (then rewriting it loses nothing of
    value). transformers' ``save_pretrained`` also deletes weight shards it did not write, so a real
    model's directory must never be written over."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict) and config.get("model_type") == "qwen2"
            and all(config.get(key) == value for key, value in SHAPE.items()))


def main(argv: list[str] | None = None) -> int:
    """``python -m fedagent_flwr.models.tiny DIR [--seed S]``: write the smoke model to ``DIR``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog=program("python -m fedagent_flwr.models.tiny"),
        description="Write a tiny random-weight model with the SmolLM2 tokenizer, for smoke runs "
                    "(e.g. model.path=DIR): every code path runs in seconds, nothing is learned.")
    parser.add_argument("directory", help="where to write it (written beside it, then renamed into place; a tiny "
                                          "model there is replaced, any other non-empty directory refused)")
    parser.add_argument("--seed", type=int, default=0,
                        help=f"the weights are a pure function of this seed (0 to {MAX_SEED}, default 0)")
    args = parser.parse_args(argv)
    if problem := seed_problem(args.seed):
        print(f"tiny-model: --seed {problem}", file=sys.stderr)
        return 2
    try:
        print(make_tiny_model(args.directory, seed=args.seed))
    except (FileExistsError, NotADirectoryError) as exc:  # raised by the checks above, with their sentence
        print(f"tiny-model: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # while writing (a full disk): one line, not a traceback
        print(f"tiny-model: writing the model to {args.directory} failed ({exc.strerror or exc}): free space or "
              "name another directory", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
