"""The audit hashes each file once (:mod:`fedagent_flwr.checkpoint.audit_digests`), on real FSDP
client checkpoints aggregated and recorded by the real strategies over three rounds: every file
the audit checks is hashed exactly once, fewer hashes than when every use hashes again (a client
checkpoint at its reference and at its opening; a global model and its optimiser state in their
round and as the next round's previous ones), with the same output; and a file changed between two
uses is hashed again and caught, its mtime restored or not, in both windows: between a source's
reference and its opening, and between a round and the next round that steps from its files.

``content_hash.file_digest`` is wrapped, never replaced: every hash counted is still computed from
the file. ``RACY_NS`` is 0 where files are meant to be reused: the run is written a moment before
its audit, and a file younger than the margin is never reused (tests/checkpoint/test_audit_digests.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fedagent_flwr.checkpoint import audit_digests, audit_sources, mean_audit, verify, verify_optimizer
from fedagent_flwr.serverapp.strategy import FedAdamFSDP, FedAvgFSDP
from testkit.ckpt_factory import Suite
from testkit.file_change import flip_byte
from testkit.hash_count import count_hashed_files
from testkit.round_harness import train_round
from testkit.strategy_setup import connected_strategy, initial_checkpoint, suite_replies

# client checkpoint names and episodes of clients 0 and 1 in rounds 1..3
ROUNDS = [(("qwen_a", "qwen_b"), (4, 12)), (("qwen_b", "qwen_c"), (6, 6)), (("qwen_c", "qwen_a"), (5, 3))]
ADAM = {"eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}
STRATEGIES: list[tuple[type[FedAvgFSDP], dict[str, float]]] = [(FedAdamFSDP, ADAM), (FedAvgFSDP, {})]


def _run(suite: Suite, tmp_path: Path, cls: type[FedAvgFSDP], settings: dict[str, float]) -> Path:
    """Three rounds of :data:`ROUNDS` by ``cls``, aggregated and recorded; the run root."""
    strategy, run_root = connected_strategy(tmp_path, initial_checkpoint(tmp_path), cls, clients=2, **settings)
    for server_round, (names, episodes) in enumerate(ROUNDS, start=1):
        train_round(strategy, server_round, suite_replies(run_root, suite, names, episodes, server_round))
    return run_root


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[Path]:
    """The files hashed from now on, counted by resolved path (each still hashed from disk)."""
    return count_hashed_files(monkeypatch, Path.resolve)


def _audit(run_root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    status = verify.main([str(run_root)])
    return status, capsys.readouterr().out.splitlines()


@pytest.mark.parametrize(("cls", "settings"), STRATEGIES, ids=[cls.__name__ for cls, _ in STRATEGIES])
def test_each_file_is_hashed_once_per_audit_and_fewer_than_when_every_use_hashes_again(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    hashed: collections.Counter[Path], cls: type[FedAvgFSDP], settings: dict[str, float],
) -> None:
    run_root = _run(suite, tmp_path, cls, settings)
    monkeypatch.setattr(audit_digests, "RACY_NS", 1 << 62)  # no file old enough: every use hashes again
    hashed.clear()
    status, every_use = _audit(run_root, capsys)
    again = collections.Counter(hashed)
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)
    hashed.clear()
    assert _audit(run_root, capsys) == (status, every_use)
    assert status == 0 and len(every_use) == 3 and all(line.endswith(" ok") for line in every_use), every_use
    assert set(hashed) == set(again) and set(hashed.values()) == {1}, hashed  # the same files, once each
    # what was hashed twice without reuse: each client checkpoint (its reference, then its opening),
    # and with the optimiser rounds 1 and 2's global models and states (their round, then the next's)
    twice = {path.relative_to(run_root.resolve()).parts[:2] for path, count in again.items() if count == 2}
    clients = {(f"round_{r}", f"client_{c}") for r in (1, 2, 3) for c in (0, 1)}
    stepped = ({(f"round_{r}", d) for r in (1, 2) for d in ("global", "server_optimizer")} if cls is FedAdamFSDP
               else set())
    assert twice == clients | stepped and set(again.values()) == {1, 2}, again
    assert sum(hashed.values()) < sum(again.values())
    print(f"{cls.__name__}: {sum(again.values())} hashes when every use hashes, {sum(hashed.values())} now")


def _flip_byte(path: Path, restore_mtime: bool) -> None:
    """Flip the bits of one byte of ``path`` in place (:func:`testkit.file_change.flip_byte`): the
    first byte of a safetensors file's tensor data, or one near the end of any other file."""
    at = 8 + int.from_bytes(path.read_bytes()[:8], "little") if path.suffix == ".safetensors" else -64
    flip_byte(path, restore_mtime, at)


def _before_round(monkeypatch: pytest.MonkeyPatch, server_round: int, change: Callable[[], None]) -> None:
    """Run ``change`` just before the audit of round ``server_round`` (after the earlier rounds'
    audits hashed their files)."""
    for module, name in ((verify, "verify_optimizer_round"), (verify, "verify_round")):
        plain = getattr(module, name)

        def wrapped(global_dir: Path, *args: Any, _plain: Any = plain, **kwargs: Any) -> Any:
            if global_dir.parent.name == f"round_{server_round}":
                change()
            return _plain(global_dir, *args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)


@pytest.mark.parametrize("restore_mtime", [False, True], ids=["mtime-moved", "mtime-restored"])
@pytest.mark.parametrize("what", ["state", "global"])
def test_a_round_input_changed_after_its_own_round_was_audited_is_hashed_again_and_caught(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    hashed: collections.Counter[Path], what: str, restore_mtime: bool,
) -> None:
    run_root = _run(suite, tmp_path, FedAdamFSDP, ADAM)
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)
    target = (run_root / "round_1" / "server_optimizer" / "global.safetensors" if what == "state"
              else run_root / "round_1" / "global" / "model.safetensors")
    _before_round(monkeypatch, 2, lambda: _flip_byte(target, restore_mtime))
    hashed.clear()
    status, lines = _audit(run_root, capsys)
    assert status == 1 and lines[0].startswith("round 1: clients [0, 1] fedadam step 1 ") and lines[0].endswith(
        " ok"), lines
    expected = (f"round 2: cannot verify: previous optimiser state {target} changed since it was written"
                if what == "state" else
                f"round 2: cannot verify: previous global model {target.parent} changed since round 2 stepped from it")
    assert lines[1].startswith(expected), lines
    assert hashed[target.resolve()] == 2  # remembered in round 1, hashed again in round 2: its stat moved


@pytest.mark.parametrize("restore_mtime", [False, True], ids=["mtime-moved", "mtime-restored"])
def test_a_source_changed_between_its_reference_and_its_opening_is_hashed_again_and_caught(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    hashed: collections.Counter[Path], restore_mtime: bool,
) -> None:
    run_root = _run(suite, tmp_path, FedAdamFSDP, ADAM)
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)
    source = run_root / "round_1" / "client_0"
    target = next(source.rglob("model_world_size_*_rank_0.pt"))
    plain = audit_sources.open_checkpoint  # where the audits open the sources their headers record

    def changed_first(ref: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(ref.path) == target.parent.resolve():
            _flip_byte(target, restore_mtime)
        return plain(ref, *args, **kwargs)

    monkeypatch.setattr(audit_sources, "open_checkpoint", changed_first)
    hashed.clear()
    status, lines = _audit(run_root, capsys)
    assert status == 1 and lines[0].startswith(f"round 1: cannot verify: content hash of {target.parent.resolve()} "
                                               "is "), lines
    assert hashed[target.resolve()] == 2  # its reference, then its opening: its stat moved in between


@pytest.mark.parametrize(("cls", "settings"), STRATEGIES, ids=[cls.__name__ for cls, _ in STRATEGIES])
def test_a_source_changed_while_the_audit_reads_it_is_caught(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    cls: type[FedAvgFSDP], settings: dict[str, float],
) -> None:
    """A client checkpoint whose digests the audit trusts at its opening (hashed at its reference a
    moment before, stat unchanged), changed once its reads have begun: its values were read
    unchecked and the round passed. Its stat is checked again once the round is read."""
    run_root = _run(suite, tmp_path, cls, settings)
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)
    target = next((run_root / "round_1" / "client_0").rglob("model_world_size_*_rank_0.pt"))
    changed: list[Path] = []
    for module in (mean_audit, verify_optimizer):
        plain = module.reader_rows

        def first_read_then_change(reader: Any, *args: Any, _plain: Any = plain, **kwargs: Any) -> Any:
            rows = _plain(reader, *args, **kwargs)
            if not changed and Path(reader.directory) == target.parent.resolve():
                _flip_byte(target, restore_mtime=True)  # after the first read: the reads go on
                changed.append(target)
            return rows

        monkeypatch.setattr(module, "reader_rows", first_read_then_change)
    status, lines = _audit(run_root, capsys)
    assert changed == [target]
    assert status == 1 and lines[0].startswith(f"round 1: cannot verify: {target.resolve()} changed while it was "
                                               "read"), lines
    assert all(line.endswith(" ok") for line in lines[1:]), lines



STEP_INPUTS = [(FedAdamFSDP, "previous-global"), (FedAdamFSDP, "previous-state"), (FedAdamFSDP, "new-state"),
               (FedAdamFSDP, "written"), (FedAvgFSDP, "written")]


@pytest.mark.parametrize(("cls", "what"), STEP_INPUTS, ids=[f"{cls.__name__}-{what}" for cls, what in STEP_INPUTS])
def test_a_round_file_changed_while_the_audit_reads_it_is_caught(
    suite: Suite, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    cls: type[FedAvgFSDP], what: str,
) -> None:
    """Round 2's previous global model or either optimiser state (a server optimiser's inputs), or
    the global model it wrote (any rule's), hashed a moment before its reads, changed (mtime
    restored) once they have begun: the round was recomputed or compared partly with bytes no hash
    covered, and passed (the previous global model) or failed on its values alone. Each file's stat
    is checked again once the round is read."""
    run_root = _run(suite, tmp_path, cls, ADAM if cls is FedAdamFSDP else {})
    monkeypatch.setattr(audit_digests, "RACY_NS", 0)
    target = {"previous-global": run_root / "round_1" / "global" / "model.safetensors",
              "previous-state": run_root / "round_1" / "server_optimizer" / "global.safetensors",
              "new-state": run_root / "round_2" / "server_optimizer" / "global.safetensors",
              "written": run_root / "round_2" / "global" / "model.safetensors"}[what].resolve()
    armed, changed = [False], []

    def after(read: torch.Tensor, file: Path) -> torch.Tensor:
        if armed[0] and not changed and file.resolve() == target:
            _flip_byte(target, restore_mtime=True)  # after its first read: the reads go on
            changed.append(target)
        return read

    for module in (verify_optimizer, mean_audit):
        plain_reader, plain_handle = module.reader_rows, module.handle_rows
        monkeypatch.setattr(module, "reader_rows", lambda reader, *args, _plain=plain_reader, **kwargs: after(
            _plain(reader, *args, **kwargs), Path(reader.directory) / "model.safetensors"))
        monkeypatch.setattr(module, "handle_rows", lambda handle, *args, _plain=plain_handle: after(
            _plain(handle, *args), handle.path))
    _before_round(monkeypatch, 2, lambda: armed.__setitem__(0, True))  # round 1 read them too: untouched
    status, lines = _audit(run_root, capsys)
    assert changed == [target]
    assert status == 1 and lines[0].endswith(" ok") and lines[1].startswith(
        f"round 2: cannot verify: {target} changed while it was read"), lines
