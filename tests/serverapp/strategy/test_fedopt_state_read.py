"""A server optimiser's state file is read key by key after its hash is checked: one rewritten in
place after that check, or during it (in bytes the hash had already read, so the hash still
matched), or shortened, stops the run naming the file, and nothing of that round is committed
(neither the new global model nor its state). Before, the step was built from the rewritten buffers
and committed, and the shortened file's memory map killed the server (SIGBUS)."""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fedagent_flwr.checkpoint import content_hash
from fedagent_flwr.serverapp.strategy import FedAdamFSDP
from fedagent_flwr.serverapp.strategy.server_optimizer import ServerOptimizerStateError, _PreviousState, state_file
from testkit.ckpt_factory import Suite
from testkit.strategy_setup import connected_strategy, initial_checkpoint, suite_replies

# (client checkpoint names, episodes) of client 0 and 1 in rounds 1 and 2
ROUNDS = [(("qwen_a", "qwen_b"), (4, 12)), (("qwen_b", "qwen_c"), (6, 6))]


def _finite_positive(old: float) -> float:
    return abs(old) * 2 + 1e-3


def _rewrite_in_place(path: Path, value: Callable[[float], float] = _finite_positive) -> None:
    """Replace the file's last value (the last buffer's, fp32) in place by ``value`` of it: same size,
    same inode. The default keeps it finite and positive (a valid Adam second moment)."""
    with path.open("r+b") as handle:
        handle.seek(-4, os.SEEK_END)
        (old,) = struct.unpack("<f", handle.read(4))
        handle.seek(-4, os.SEEK_END)
        handle.write(struct.pack("<f", value(old)))


def _after_its_hash(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _rewritten_before_the_first_read(state, monkeypatch, _finite_positive)


def _after_its_hash_non_finite(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a negative second moment: the step's sqrt gives NaN, so the aggregation itself fails first
    _rewritten_before_the_first_read(state, monkeypatch, lambda old: -abs(old) - 1.0)


def _rewritten_before_the_first_read(state: Path, monkeypatch: pytest.MonkeyPatch,
                                     value: Callable[[float], float]) -> None:
    read: Callable[[_PreviousState, str], dict] = _PreviousState.read
    done: list[bool] = []

    def rewritten_before_the_first_read(self: _PreviousState, key: str) -> dict:
        if not done:
            _rewrite_in_place(state, value)
            done.append(True)
        return read(self, key)

    monkeypatch.setattr(_PreviousState, "read", rewritten_before_the_first_read)


def _shortened_after_its_hash(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Cut to its header and half its data before the first read: read through a memory map (before
    # stop 56) the first buffer past the new end killed the server process (SIGBUS).
    read: Callable[[_PreviousState, str], dict] = _PreviousState.read
    done: list[bool] = []

    def shortened_before_the_first_read(self: _PreviousState, key: str) -> dict:
        if not done:
            (length,) = struct.unpack("<Q", state.read_bytes()[:8])
            os.truncate(state, 8 + length + (state.stat().st_size - 8 - length) // 2)
            done.append(True)
        return read(self, key)

    monkeypatch.setattr(_PreviousState, "read", shortened_before_the_first_read)


def _during_its_hash(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (The code before this check hashed through its own imported file_digest, which this does not
    # patch: there the rewrite never happened and the round was committed, so the case failed for
    # that reason, not by reading a rewritten file.)
    hasher = content_hash.file_digest

    def rewritten_once_hashed(path: str | os.PathLike[str]) -> bytes:
        digest = hasher(path)
        if Path(path).resolve() == state.resolve():
            _rewrite_in_place(state)
        return digest

    monkeypatch.setattr(content_hash, "file_digest", rewritten_once_hashed)


@pytest.mark.parametrize(
    ("rewrite", "failed_first"),
    [(_after_its_hash, None), (_during_its_hash, None), (_after_its_hash_non_finite, "non-finite"),
     (_shortened_after_its_hash, "shortened after it was opened")],
    ids=["after its hash", "during its hash", "after its hash, to a non-finite step", "shortened after its hash"])
def test_a_state_file_rewritten_while_a_round_reads_it_stops_the_run_and_commits_nothing(
    suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    rewrite: Callable[[Path, pytest.MonkeyPatch], None], failed_first: str | None,
) -> None:
    """``failed_first``: the aggregation's own error when the rewritten step fails before the check
    after the reads (a CheckpointError, which alone would refuse every client for the round): the
    state's change is what the run stops with, that failure chained to it."""
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), FedAdamFSDP, clients=2,
                                            eta=1e-2, beta_1=0.9, beta_2=0.99)
    strategy.aggregate_train(1, suite_replies(run_root, suite, *ROUNDS[0], 1))
    state = state_file(run_root / "round_1" / "global")
    # Its times an hour back (content unchanged, so its hash still matches): the rewrite's mtime then
    # differs whatever the filesystem's timestamp granularity.
    hour_ago = time.time_ns() - 3_600 * 10**9
    os.utime(state, ns=(hour_ago, hour_ago))
    rewrite(state, monkeypatch)

    with pytest.raises(ServerOptimizerStateError,
                       match=r"optimiser state \S*round_1/server_optimizer/global.safetensors changed while it "
                             "was read") as raised:
        strategy.aggregate_train(2, suite_replies(run_root, suite, *ROUNDS[1], 2))
    if failed_first is not None:
        assert failed_first in str(raised.value.__context__)
        assert "the step from it was not committed (the step had failed: " in str(raised.value)
    assert not (run_root / "round_2" / "global").exists()
    assert not state_file(run_root / "round_2" / "global").exists()
    assert not list((run_root / "round_2").glob("**/*.safetensors*")), "a temporary file was left behind"
    assert strategy.global_model.path == str(run_root / "round_1" / "global")
