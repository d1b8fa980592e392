"""The persistent reference trainer's model cache (:class:`.session.ModelCache`): a later global
model's weights are read into the live model, with the package's safetensors reader, and give the
model a fresh load gives; a directory that does not fit is loaded afresh; a damaged file is refused
by name; and a read that fails part-way drops the half-loaded model, so the next job loads afresh
instead of training from a mix of two models. Real tiny Qwen2 models and real files throughout.

Against which code: the damaged-file case fails on the loader before stop 58 (``load_file``: the
library's SafetensorError, no file named); the failed-read case guards the direct reads into the
live model (without dropping it, the half-loaded model would stay cached); the tied-pair case
guards those reads too (one storage, two values: the last read would win)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedagent_flwr.checkpoint.ref import CheckpointError
from fedagent_flwr.checkpoint.safetensors_file import SafetensorsFile
from fedagent_flwr.models.tiny import make_tiny_model
from fedagent_flwr.trainers.common.evaluator import load_model
from fedagent_flwr.trainers.reference.session import ModelCache

WEIGHTS = "model.safetensors"


@pytest.fixture
def models(tmp_path: Path, smollm2_tokenizer_dir: Path) -> tuple[Path, Path]:
    """Two tiny models of one architecture, different weights."""
    return (make_tiny_model(tmp_path / "a", seed=0, tokenizer_dir=smollm2_tokenizer_dir),
            make_tiny_model(tmp_path / "b", seed=1, tokenizer_dir=smollm2_tokenizer_dir))


def _same_weights(model: torch.nn.Module, directory: Path) -> bool:
    fresh, _ = load_model(directory, 1)
    ours, theirs = model.state_dict(), fresh.state_dict()
    return set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_later_model_is_read_into_the_live_model_as_a_fresh_load_gives_it(models: tuple[Path, Path]) -> None:
    first, second = models
    cache = ModelCache()
    model, _ = cache.get(first, 1)
    assert _same_weights(model, first)
    again, _ = cache.get(second, 1)
    assert again is model and (cache.loads, cache.reloads) == (1, 1)
    assert _same_weights(model, second)
    # bf16 weights are cast into the fp32 model on the way, as load_state_dict casts them
    half = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(second / WEIGHTS)).items()}
    save_file(half, str(second / WEIGHTS), metadata={"format": "pt"})
    cache.get(second, 1)
    assert cache.reloads == 2
    assert all(torch.equal(model.state_dict()[k], v.to(torch.float32)) for k, v in half.items())


def _untied_norm(weights: dict[str, torch.Tensor]) -> None:
    del weights["model.norm.weight"]  # tied to none the file holds: the previous model's would stay


def _both_tied(weights: dict[str, torch.Tensor]) -> None:
    # the tiny model ties lm_head to the embeddings and its files hold the embeddings alone; files
    # holding both may hold two values, which the live model's one storage cannot
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1


@pytest.mark.parametrize("change", [_untied_norm, _both_tied], ids=["a-weight-left-out", "both-tied-weights"])
def test_files_that_do_not_fit_the_live_model_are_loaded_afresh(models: tuple[Path, Path], change: Any) -> None:
    first, second = models
    weights = load_file(str(second / WEIGHTS))
    change(weights)
    save_file(weights, str(second / WEIGHTS), metadata={"format": "pt"})
    cache = ModelCache()
    cache.get(first, 1)
    cache.get(second, 1)
    assert (cache.loads, cache.reloads) == (2, 0)


def test_a_damaged_file_is_refused_by_name(models: tuple[Path, Path]) -> None:
    first, second = models
    cache = ModelCache()
    model, _ = cache.get(first, 1)
    data = (second / WEIGHTS).read_bytes()
    (second / WEIGHTS).write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=re.escape(str(second / WEIGHTS))):
        cache.get(second, 1)
    assert cache.model is model and _same_weights(model, first)  # refused at opening: nothing read into it


def test_a_read_that_fails_part_way_drops_the_half_loaded_model(models: tuple[Path, Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = models
    cache = ModelCache()
    cache.get(first, 1)
    plain = SafetensorsFile.read_into
    reads: list[str] = []

    def shortened_after_the_first(handle: SafetensorsFile, key: str, out: torch.Tensor) -> None:
        if len(reads) == 1:  # the file loses its tail while the reload reads it
            with open(handle.path, "r+b") as file:
                file.truncate(handle.path.stat().st_size // 2)
        reads.append(key)
        plain(handle, key, out)

    monkeypatch.setattr(SafetensorsFile, "read_into", shortened_after_the_first)
    with pytest.raises(CheckpointError, match="shortened after it was opened"):
        cache.get(second, 1)
    assert len(reads) == 2 and cache.model is None  # not kept half-loaded
    monkeypatch.setattr(SafetensorsFile, "read_into", plain)
    model, _ = cache.get(first, 1)
    assert cache.loads == 2 and _same_weights(model, first)
