"""The bounded read-ahead of the aggregation: every tensor arrives intact and in order through a
ring much smaller than the model, the content hash still covers every byte, errors reach the
averaging thread, and the mean (and its statistics) is bitwise the same as with reads in turn."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedagent_flwr.checkpoint import CheckpointError, CheckpointRef, open_checkpoint, shard_file, weighted_mean
from fedagent_flwr.checkpoint.content_hash import FileHashStream
from fedagent_flwr.checkpoint.read_ahead import ReadAhead, ReadItem, ring_bytes
from fedagent_flwr.checkpoint.reader import CheckpointReader
from testkit.ckpt_factory import Suite


def _open(path: Path, check_hash: bool | str = "while-reading") -> CheckpointReader:
    return open_checkpoint(CheckpointRef.for_directory(path), check_hash=check_hash)  # type: ignore[arg-type]


def _plan(readers: list[CheckpointReader]) -> list[ReadItem]:
    head = readers[0]
    dtypes = {key: torch.float32 if head.dtype(key).is_floating_point else head.dtype(key) for key in head.keys()}
    return [
        ReadItem(key, index, reader, head.shape(key), dtypes[key])
        for key in head.keys()
        for index, reader in enumerate(readers)
    ]


def _read_ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ckpt-read-ahead"]


@pytest.mark.parametrize("ring", ["one-tensor", "default"])
def test_every_tensor_arrives_intact_in_order_and_the_hash_covers_every_byte(
    suite: Suite, ring: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shard_file, "_HASHED_READ_CHUNK", 4099)  # many hashing tasks per tensor
    # A slow hash: a slot reused before its hash is done would be hashed with the next bytes.
    feed = FileHashStream.feed

    def slow_feed(self: FileHashStream, offset: int, data: memoryview) -> None:
        time.sleep(0.0005)
        feed(self, offset, data)

    monkeypatch.setattr(FileHashStream, "feed", slow_feed)
    names = ["qwen_a", "qwen_b", "qwen_plain"]  # world sizes 1, 2, 1
    readers = [_open(suite.ckpt(name)) for name in names]
    plan = _plan(readers)
    largest = max(item.nbytes for item in plan)
    # A ring of one tensor makes the reader wait for every release; the default wraps around.
    capacity = -(-largest // 64) * 64 if ring == "one-tensor" else ring_bytes(largest)
    assert capacity < sum(item.nbytes for item in plan) / 4  # far smaller than what flows through
    expected = [suite.expected(name) for name in names]
    try:
        with ReadAhead(plan, capacity) as ahead:
            for item in plan:
                slot = ahead.take(item.key, item.index)
                assert slot.tensor.dtype == torch.float32 and slot.tensor.is_contiguous()
                assert torch.equal(slot.tensor, expected[item.index][item.key]), (item.key, item.index)
                slot.release()
        for reader in readers:
            reader.verify_content()  # the hash of every byte, read ahead or in the gaps, matches
    finally:
        for reader in readers:
            reader.close()
    assert _read_ahead_threads() == []


def test_asking_out_of_order_is_refused(suite: Suite) -> None:
    reader = _open(suite.ckpt("qwen_a"), check_hash=False)
    plan = _plan([reader])
    try:
        with pytest.raises(RuntimeError, match="out of step"), ReadAhead(plan, ring_bytes(10**8)) as ahead:
            ahead.take(plan[1].key, 0)
    finally:
        reader.close()
    assert _read_ahead_threads() == []


def test_closing_before_the_end_of_the_plan_does_not_wait_for_releases(suite: Suite) -> None:
    reader = _open(suite.ckpt("qwen_a"))
    plan = _plan([reader])
    try:
        # A ring of one tensor: the reader thread waits for the consumer after every read.
        with ReadAhead(plan, -(-max(i.nbytes for i in plan) // 64) * 64) as ahead:
            ahead.take(plan[0].key, 0).release()
        assert _read_ahead_threads() == []
    finally:
        reader.close()


def test_stopping_half_way_leaves_the_hash_consistent(suite: Suite) -> None:
    reader = _open(suite.ckpt("qwen_b"))  # world size 2, hashed while reading
    plan = _plan([reader])
    try:
        with pytest.raises(KeyboardInterrupt), ReadAhead(plan, ring_bytes(max(i.nbytes for i in plan))) as ahead:
            for item in plan[:3]:
                ahead.take(item.key, item.index).release()
            raise KeyboardInterrupt  # the consumer fails: the thread stops, no hash left running
        assert _read_ahead_threads() == []
        for key in reader.keys():  # read on, on this thread: bytes already hashed count once
            reader.read(key)
        reader.verify_content()
    finally:
        reader.close()


@pytest.mark.parametrize("stats", ["none", "full", "norms"])
def test_read_ahead_and_reads_in_turn_write_the_same_bits(suite: Suite, tmp_path: Path, stats: str) -> None:
    # odd_shapes mixes an empty block, Shard(1), Replicate and an int64 buffer.
    odd = suite.copy("odd_shapes", tmp_path)
    shutil.copytree(suite.ckpt("qwen_a") / "huggingface", odd / "huggingface")
    cases = [(["qwen_a", "qwen_b", "qwen_plain", "qwen_c"], suite.ckpt), (["odd"], lambda _: odd)]
    for names, where in cases:
        outputs, reports = [], []
        for read_ahead in (True, False):
            readers = [_open(where(name)) for name in names]
            reference = _open(where(names[0]), check_hash=True) if stats != "none" else None
            out = tmp_path / f"{names[0]}-{stats}-{read_ahead}"
            try:
                report = weighted_mean(
                    [(r, 1.0 + i / 3) for i, r in enumerate(readers)] + [(readers[0], 0.25)], out,
                    reference=reference, stats_max_bytes=1 if stats == "norms" else 1 << 30, read_ahead=read_ahead,
                )
            finally:
                for reader in readers + ([reference] if reference is not None else []):
                    reader.close()
            outputs.append(load_file(str(out / "model.safetensors")))
            reports.append(report)
        assert outputs[0].keys() == outputs[1].keys()
        for key in outputs[0]:
            assert outputs[0][key].dtype == outputs[1][key].dtype
            first, second = (o[key].reshape(-1).view(torch.uint8) for o in outputs)
            assert torch.equal(first, second), key  # bitwise, NaN payloads and signed zeros included
        assert reports[0].update_stats == reports[1].update_stats
        assert reports[0].bytes_read == reports[1].bytes_read
        if stats == "full":
            assert reports[0].update_stats is not None and reports[0].update_stats.cosine is not None
    assert _read_ahead_threads() == []


def test_a_mean_that_overflows_float32_is_written_and_the_keys_after_it_are_exact(
    suite: Suite, tmp_path: Path
) -> None:
    # Ten copies of FLT_MAX with weights 0.1 sum to Inf in float32 although no source holds a
    # non-finite value: no source may be refused, and the keys after it (read on the calling
    # thread once the read-ahead has stopped to look for a culprit) must be exact.
    directory = suite.copy("qwen_plain", tmp_path)
    rank_file = directory / "model_world_size_1_rank_0.pt"
    state = torch.load(rank_file, weights_only=True)
    keys = list(state)
    big = keys[len(keys) // 2]
    state[big] = torch.full_like(state[big], torch.finfo(torch.float32).max)
    torch.save(state, rank_file)
    outputs = []
    for read_ahead in (True, False):
        reader = _open(directory)
        out = tmp_path / f"out-{read_ahead}"
        try:
            weighted_mean([(reader, 1.0)] * 10, out, read_ahead=read_ahead)
        finally:
            reader.close()
        outputs.append(load_file(str(out / "model.safetensors")))
    written = outputs[0]
    assert torch.isinf(written[big]).all()
    for key in written:
        assert torch.equal(written[key], outputs[1][key]), key
        if key != big:
            assert torch.isfinite(written[key]).all(), key
    assert _read_ahead_threads() == []


def test_a_read_error_on_the_reader_thread_is_raised_by_name(suite: Suite, tmp_path: Path) -> None:
    directory = suite.copy("qwen_b", tmp_path)
    good = _open(suite.ckpt("qwen_a"))
    bad = _open(directory)
    shard = directory / "model_world_size_2_rank_0.pt"
    os.truncate(shard, shard.stat().st_size * 3 // 4)
    out = tmp_path / "out"
    try:
        with pytest.raises(CheckpointError, match="model_world_size_2_rank_0.pt is truncated"):
            weighted_mean([(good, 1.0), (bad, 1.0)], out)
    finally:
        good.close()
        bad.close()
    assert not out.exists() and _read_ahead_threads() == []


@pytest.mark.parametrize("read_ahead", [True, False])
def test_an_integer_key_stored_as_float_by_one_source_is_refused(
    suite: Suite, tmp_path: Path, read_ahead: bool
) -> None:
    # Integer buffers must agree across sources. Source 1 stores the counter as float 1.5: read in
    # source 0's dtype it would pass as 1, so each source's tensor is read as that source stores it.
    directories = [suite.copy("qwen_plain", tmp_path / name) for name in ("a", "b")]
    for directory, counter in zip(directories, (torch.tensor([1, 2, 3]), torch.tensor([1.5, 2.0, 3.0]))):
        rank_file = directory / "model_world_size_1_rank_0.pt"
        state = torch.load(rank_file, weights_only=True)
        state["step_counter"] = counter
        torch.save(state, rank_file)
    readers = [_open(directory) for directory in directories]
    out = tmp_path / "out"
    try:
        with pytest.raises(CheckpointError,
                           match="integer tensor 'step_counter' differs between source 0 and source 1"):
            weighted_mean([(reader, 1.0) for reader in readers], out, read_ahead=read_ahead)
    finally:
        for reader in readers:
            reader.close()
    assert not out.exists() and _read_ahead_threads() == []
