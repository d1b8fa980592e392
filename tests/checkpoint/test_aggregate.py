"""Streamed weighted mean over real FSDP2 checkpoints (world sizes 1 and 2) and HF dirs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fedagent_flwr.checkpoint import (
    CheckpointRef,
    SafetensorsStreamWriter,
    check_compatible,
    open_checkpoint,
    verify_mean,
    weighted_mean,
)
from fedagent_flwr.checkpoint.ref import CheckpointError
from testkit.ckpt_factory import ModelSpec, Suite, max_abs_diff, write_hf_checkpoint


def _open_fsdp(suite: Suite, name: str):  # noqa: ANN202 - a CheckpointReader
    return open_checkpoint(CheckpointRef.for_directory(suite.ckpt(name), fmt="fsdp-shards"), root=suite.root)


def _independent_mean(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    total = sum(weights)
    return {
        key: sum((w / total) * s[key].double() for s, w in zip(states, weights))  # type: ignore[misc]
        for key in states[0]
    }


def _load_hf(out_dir: Path):  # noqa: ANN202 - (model, loading info)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(out_dir), output_loading_info=True)


def test_mean_of_world_sizes_1_and_2_matches_independent_computation(suite: Suite, tmp_path: Path) -> None:
    names, weights = ["qwen_a", "qwen_b", "qwen_plain", "qwen_c"], [1.0, 2.5, 0.5, 3.0]
    readers = [_open_fsdp(suite, n) for n in names]
    out = tmp_path / "global_round_1"
    report = weighted_mean(list(zip(readers, weights)), out)

    expected = _independent_mean([suite.expected(n) for n in names], weights)
    written = load_file(str(out / "model.safetensors"))
    assert set(written) == set(expected)
    assert all(t.dtype == torch.float32 for t in written.values())
    assert max(max_abs_diff(written[k], expected[k]) for k in expected) < 1e-6
    assert verify_mean(list(zip(readers, weights)), out) < 1e-6

    assert report.out_dir == out and report.num_tensors == len(expected)
    assert report.num_params == sum(t.numel() for t in expected.values())
    assert report.weights == pytest.approx([w / 7.0 for w in weights]) and sum(report.weights) == pytest.approx(1.0)
    assert report.bytes_read == 4 * report.num_params * len(names)  # fp32, every source read once
    assert report.seconds > 0 and report.tied_keys == ()

    model, info = _load_hf(out)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.float32
    state = model.state_dict()
    assert max(max_abs_diff(state[k], expected[k]) for k in expected) < 1e-6

    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32"
    assert (out / "generation_config.json").is_file()
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    assert tokenizer("go north").input_ids == [3, 4]
    hf = suite.ckpt("qwen_a") / "huggingface"
    assert (out / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        sources = json.loads(handle.metadata()["fedagent.sources"])
    assert [s["path"] for s in sources] == [str(r.directory) for r in readers]
    for reader in readers:
        reader.close()


def test_tied_embeddings_fsdp_and_hf_sources(suite: Suite, tmp_path: Path) -> None:
    # An HF source written by save_pretrained has no lm_head.weight; FSDP state dicts have it.
    hf_state = write_hf_checkpoint(ModelSpec("tied_hf", "llama", seed=13, tie=True), tmp_path / "hf")
    assert "lm_head.weight" not in load_file(str(tmp_path / "hf" / "model.safetensors"))
    sources = [
        (_open_fsdp(suite, "llama_tied_a"), 1.0),
        (_open_fsdp(suite, "llama_tied_b"), 1.0),
        (open_checkpoint(CheckpointRef.for_directory(tmp_path / "hf"), root=tmp_path), 2.0),
    ]
    out = tmp_path / "global"
    report = weighted_mean(sources, out)
    assert report.tied_keys == ("lm_head.weight",)
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    assert verify_mean(sources, out) < 1e-6

    states = [suite.expected("llama_tied_a"), suite.expected("llama_tied_b"), hf_state]
    expected = _independent_mean(states, [1.0, 1.0, 2.0])
    model, info = _load_hf(out)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    state = model.state_dict()
    assert max(max_abs_diff(state[k], expected[k]) for k in expected) < 1e-6
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # The aggregate (no lm_head) is the next round's reference for FSDP clients (with lm_head).
    with open_checkpoint(CheckpointRef.for_directory(out)) as reference:
        check_compatible(sources[0][0], reference)
        check_compatible(reference, sources[1][0])


def test_hf_safetensors_sources_in_several_files_and_bf16(tmp_path: Path) -> None:
    a = write_hf_checkpoint(ModelSpec("a", "qwen2", seed=31), tmp_path / "a", max_shard_size="40KB")
    b = write_hf_checkpoint(ModelSpec("b", "qwen2", seed=32), tmp_path / "b", dtype=torch.bfloat16)
    readers = [open_checkpoint(CheckpointRef.for_directory(tmp_path / n), root=tmp_path) for n in ("a", "b")]
    out = tmp_path / "mean"
    weighted_mean([(readers[0], 3.0), (readers[1], 1.0)], out, reference=readers[0])
    expected = _independent_mean([a, {k: v.float() for k, v in b.items()}], [3.0, 1.0])
    written = load_file(str(out / "model.safetensors"))
    assert max(max_abs_diff(written[k], expected[k]) for k in expected) < 1e-6
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"  # b was bf16
    assert not list(out.glob("*.index.json"))  # the sources' index must not shadow the new file
    model, info = _load_hf(out)
    assert not info["missing_keys"] and model.dtype == torch.float32


def test_hf_files_come_from_reference_when_source_has_none(suite: Suite, tmp_path: Path) -> None:
    bare = suite.copy("qwen_b", tmp_path)
    for path in (bare / "huggingface").iterdir():
        path.unlink()
    (bare / "huggingface").rmdir()
    reference = _open_fsdp(suite, "qwen_a")
    source = open_checkpoint(CheckpointRef.for_directory(bare), root=tmp_path)
    out = tmp_path / "out"
    weighted_mean([(source, 1.0)], out, reference=reference)
    assert (out / "tokenizer.json").is_file()
    written = load_file(str(out / "model.safetensors"))
    expected = suite.expected("qwen_b")
    assert all(torch.equal(written[k], expected[k]) for k in expected)  # weight 1: exact copy
    with pytest.raises(CheckpointError, match="no config.json"):
        weighted_mean([(source, 1.0)], tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_stream_writer_output_loads_and_enforces_its_header(tmp_path: Path) -> None:
    tensors = {"b.weight": torch.randn(3, 5), "a.bias": torch.randn(7), "scalar": torch.tensor(2.5)}
    path = tmp_path / "model.safetensors"
    entries = [(k, tuple(v.shape)) for k, v in tensors.items()] + [("ids", (4,), torch.int64)]
    with SafetensorsStreamWriter(path, entries) as writer:
        for key, value in tensors.items():
            writer.write(key, value)
        writer.write("ids", torch.arange(4))
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert torch.equal(loaded["ids"], torch.arange(4))
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0  # data section 8-byte aligned

    bad = tmp_path / "bad.safetensors"
    with pytest.raises(CheckpointError, match="expected tensor 'x'"):
        with SafetensorsStreamWriter(bad, [("x", (2,)), ("y", (2,))]) as writer:
            writer.write("y", torch.zeros(2))
    with pytest.raises(CheckpointError, match="header promises"):
        with SafetensorsStreamWriter(bad, [("x", (2,))]) as writer:
            writer.write("x", torch.zeros(3))
    with pytest.raises(CheckpointError, match="only 1 of 2 tensors"):
        with SafetensorsStreamWriter(bad, [("x", (2,)), ("y", (2,))]) as writer:
            writer.write("x", torch.zeros(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no partial files


def test_integer_buffers_are_copied_and_odd_layouts_averaged(suite: Suite, tmp_path: Path) -> None:
    # odd_shapes mixes an empty block, Shard(1), Replicate and an int64 buffer; give it a config
    # so that it can be aggregated at all.
    ckpt = suite.copy("odd_shapes", tmp_path)
    shutil.copytree(suite.ckpt("qwen_a") / "huggingface", ckpt / "huggingface")
    reader = open_checkpoint(CheckpointRef.for_directory(ckpt), root=tmp_path)
    out = tmp_path / "out"
    weighted_mean([(reader, 1.0), (reader, 3.0)], out)
    written = load_file(str(out / "model.safetensors"))
    expected = suite.expected("odd_shapes")
    assert written["steps"].dtype == torch.int64 and torch.equal(written["steps"], expected["steps"])
    for key in ("tiny", "odd", "columns", "replicated"):
        assert max_abs_diff(written[key], expected[key]) < 1e-6, key
    assert verify_mean([(reader, 1.0), (reader, 3.0)], out) < 1e-6


def test_stream_writer_flushes_in_the_background_and_a_failed_flush_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import threading

    from fedagent_flwr.checkpoint import safetensors_writer

    monkeypatch.setattr(safetensors_writer, "FLUSH_EVERY", 1)  # a background fdatasync after every write
    synced: list[int] = []
    real_fdatasync = os.fdatasync

    def counting_fdatasync(fd: int) -> None:
        synced.append(fd)
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", counting_fdatasync)
    tensors = {f"t{i}": torch.randn(64, 33) for i in range(12)}
    path = tmp_path / "model.safetensors"
    with SafetensorsStreamWriter(path, [(k, tuple(v.shape)) for k, v in tensors.items()]) as writer:
        for key, value in tensors.items():
            writer.write(key, value)
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert synced  # the flushes ran (one at a time: a write while one runs skips its turn)
    assert not [t for t in threading.enumerate() if t.name.startswith("safetensors-flush")]

    def failing_fdatasync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing_fdatasync)
    failed = tmp_path / "failed.safetensors"
    with pytest.raises(OSError,
                       match=r"failed\.safetensors\.partial-\d+: background fdatasync failed: Input/output error"):
        with SafetensorsStreamWriter(failed, [(k, tuple(v.shape)) for k, v in tensors.items()]) as writer:
            for key, value in tensors.items():
                writer.write(key, value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no partial file
    assert not [t for t in threading.enumerate() if t.name.startswith("safetensors-flush")]


def test_late_metadata_is_written_into_the_header_at_close_and_a_bad_value_aborts(tmp_path: Path) -> None:
    """A header value known only after the tensors (a state's hash) replaces its placeholder in place:
    offsets unchanged, the tensors intact; a value of another length or with a quote leaves no file."""
    from safetensors import safe_open

    from fedagent_flwr.checkpoint.safetensors_writer import LateMetadata

    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    entries = [(k, tuple(v.shape)) for k, v in tensors.items()]
    path = tmp_path / "model.safetensors"
    digest = "ab" * 32
    late = LateMetadata({"fedagent.late": 64}, lambda: {"fedagent.late": digest})
    with SafetensorsStreamWriter(path, entries, {"format": "pt", "fedagent.late_too": '"fedagent.late":"0"'},
                                 late) as writer:
        for key, value in tensors.items():
            writer.write(key, value)
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    assert metadata == {"format": "pt", "fedagent.late_too": '"fedagent.late":"0"', "fedagent.late": digest}
    assert all(torch.equal(load_file(str(path))[k], v) for k, v in tensors.items())
    for value, problem in (("ab" * 31, "must be 64 printable ASCII"), ('"' * 64, "without quotes")):
        bad = tmp_path / "bad.safetensors"
        with pytest.raises(CheckpointError, match=problem):
            with SafetensorsStreamWriter(bad, entries, None, LateMetadata({"k": 64}, lambda v=value: {"k": v})) as w:
                for key, tensor in tensors.items():
                    w.write(key, tensor)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no partial file
