"""A node's cache of global models bounded by node config ``cache-keep``, on a real http store
(uvicorn on loopback): the least recently used models go after each fetch, never a model this
process fetched, never one another process holds the lock of, and ``0`` keeps everything."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.checkpoint.http_server import HttpServerStore
from fedagent_flwr.checkpoint.node_cache import lock_path
from fedagent_flwr.checkpoint.store import StorageSettings
from testkit.store_harness import RUN, node


@pytest.fixture
def store(tmp_path: Path) -> Iterator[HttpServerStore]:
    (tmp_path / "run").mkdir()
    with HttpServerStore(StorageSettings(kind="http"), tmp_path / "run", RUN) as running:
        yield running  # type: ignore[misc]


def _models(store: HttpServerStore, tmp_path: Path, names: str) -> dict[str, CheckpointRef]:
    """One small shared model per letter of ``names`` (distinct contents, so distinct hashes)."""
    shared = {}
    for name in names:
        directory = tmp_path / "run" / f"round_{ord(name)}" / "global"
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(f'{{"model": "{name}"}}')
        (directory / "model.safetensors").write_bytes(name.encode() * 50_000)
        shared[name] = store.share(CheckpointRef.for_directory(directory))
    return shared


def _cached(work: Path, models: dict[str, CheckpointRef]) -> str:
    """The letters of the models in ``work``'s cache, sorted."""
    return "".join(sorted(n for n, ref in models.items() if (work / "cache" / ref.sha256).is_dir()))


def test_the_least_recently_used_models_go_after_each_fetch(
        store: HttpServerStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    models = _models(store, tmp_path, "ABCD")
    work = tmp_path / "node0"
    for name in "AB":  # one message each, as rounds go
        node(store, work, cache_keep=2).fetch(models[name])
    hit = node(store, work, cache_keep=2)
    hit.fetch(models["A"])  # evaluation or the next round: a use, so A is now newer than B
    assert hit.report.cache_hit and _cached(work, models) == "AB"
    node(store, work, cache_keep=2).fetch(models["C"])
    assert _cached(work, models) == "AC"
    assert "removed 1 older global model(s), 0.1 MB, to keep the 2 most recently used" in capsys.readouterr().out
    again = node(store, work, cache_keep=2)
    assert again.fetch(models["B"]) == work / "cache" / models["B"].sha256  # downloaded again, whole
    assert not again.report.cache_hit and again.report.bytes_received >= 50_000
    assert _cached(work, models) == "BC"
    assert not list((work / "cache").glob(".evicting-*"))


def test_a_model_this_process_fetched_is_never_evicted_by_it(store: HttpServerStore, tmp_path: Path) -> None:
    """A PPO training message fetches the actor, then the critic: with ``cache-keep=1`` the second
    fetch must leave the first where its trainer will read it."""
    models = _models(store, tmp_path, "ABC")
    work = tmp_path / "node0"
    node(store, work, cache_keep=1).fetch(models["A"])  # an older round
    message = node(store, work, cache_keep=1)
    actor, critic = message.fetch(models["B"]), message.fetch(models["C"])
    assert actor.is_dir() and critic.is_dir()
    assert _cached(work, models) == "BC"  # A went; both of this message's models stay


def test_a_model_another_process_holds_the_lock_of_is_left(
        store: HttpServerStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    models = _models(store, tmp_path, "AB")
    work = tmp_path / "node0"
    node(store, work, cache_keep=1).fetch(models["A"])
    holder = subprocess.Popen(  # another ClientApp process of this node, e.g. checking model A
        [sys.executable, "-c", "import sys; from filelock import FileLock; lock = FileLock(sys.argv[1]); "
         "lock.acquire(); print('held', flush=True); sys.stdin.read()",
         str(lock_path(work / "cache", models["A"].sha256))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        node(store, work, cache_keep=1).fetch(models["B"])
        assert _cached(work, models) == "AB"
        assert "removed 0 older global model(s), 0.0 MB, to keep the 1 most recently used " \
               "(node config 'cache-keep'); 1 in use elsewhere left" in capsys.readouterr().out
    finally:
        holder.communicate("")
    node(store, work, cache_keep=1).fetch(models["A"])  # a later fetch (a hit): the lock is free now
    assert _cached(work, models) == "A"


def test_without_cache_keep_every_model_stays(store: HttpServerStore, tmp_path: Path) -> None:
    models = _models(store, tmp_path, "ABC")
    work = tmp_path / "node0"
    for name in "ABC":
        node(store, work).fetch(models[name])
    assert _cached(work, models) == "ABC"


def test_a_partial_download_older_than_the_models_kept_goes_too(
        store: HttpServerStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A download cut off half-way leaves ``.partial-<hash>/`` for the next fetch to resume; once
    the cache holds ``keep`` models and the partial is older than every one of them, it is removed
    too (a half-way pass's ``.evicting-*`` leftover at once), while a newer partial stays."""
    models = _models(store, tmp_path, "AB")
    work = tmp_path / "node0"
    cache = work / "cache"
    cache.mkdir(parents=True)
    old_partial = cache / f".partial-{'d' * 64}"
    old_partial.mkdir()
    (old_partial / "model.safetensors.part").write_bytes(b"D" * 1000)
    os.utime(old_partial, (1, 1))  # interrupted long ago
    leftover = cache / ".evicting-0123"
    (leftover / "sub").mkdir(parents=True)
    node(store, work, cache_keep=2).fetch(models["A"])
    assert old_partial.is_dir()  # one model of two: room left, the partial may still be resumed
    assert not leftover.exists()
    new_partial = cache / f".partial-{'e' * 64}"
    new_partial.mkdir()  # a download interrupted after A's
    capsys.readouterr()
    node(store, work, cache_keep=2).fetch(models["B"])
    assert _cached(work, models) == "AB"
    assert not old_partial.exists() and new_partial.is_dir()
    assert "removed 1 older global model(s) (1 of them partial downloads), 0.0 MB" in capsys.readouterr().out


def test_two_passes_at_once_on_one_cache_both_finish_and_leave_one_model(tmp_path: Path) -> None:
    """SuperNodes sharing a work dir fetch the same model at a round's start, so their eviction
    passes overlap: both finish, each skipping what the other holds or already moved, and one
    model is left. (Whether the passes interleave is up to the scheduler; the sweep of leftovers
    that could break a pass in progress is pinned by the next test.)"""
    cache = tmp_path / "cache"
    for index in range(6):
        model = cache / (f"{index:x}" * 64)
        model.mkdir(parents=True)
        for part in range(1500):  # many small files: removal takes long enough to overlap
            (model / f"f{part}").write_bytes(b"x")
        os.utime(model, (1000 + index, 1000 + index))
    start = tmp_path / "go"
    script = ("import sys, time, pathlib; from fedagent_flwr.checkpoint.node_cache import evict\n"
              "go = pathlib.Path(sys.argv[2])\n"
              "while not go.exists(): time.sleep(0.001)\n"
              "print(evict(pathlib.Path(sys.argv[1]), 1, set()).describe(1))\n")
    passes = [subprocess.Popen([sys.executable, "-c", script, str(cache), str(start)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    start.touch()
    outputs = [p.communicate(timeout=120) for p in passes]
    assert [p.returncode for p in passes] == [0, 0], outputs
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == ["5" * 64], outputs


def test_a_leftover_another_pass_is_removing_is_left_to_it(store: HttpServerStore, tmp_path: Path) -> None:
    models = _models(store, tmp_path, "A")
    work = tmp_path / "node0"
    cache = work / "cache"
    digest = "c" * 64
    leftover = cache / f".evicting-{digest}"
    (leftover / "sub").mkdir(parents=True)
    holder = subprocess.Popen(  # the pass that is removing it, holding the model's lock
        [sys.executable, "-c", "import sys; from filelock import FileLock; lock = FileLock(sys.argv[1]); "
         "lock.acquire(); print('held', flush=True); sys.stdin.read()", str(lock_path(cache, digest))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        node(store, work, cache_keep=1).fetch(models["A"])
        assert leftover.is_dir()
    finally:
        holder.communicate("")
    node(store, work, cache_keep=1).fetch(models["A"])
    assert not leftover.exists()


def test_an_eviction_pass_that_fails_never_fails_the_fetch(
        store: HttpServerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Eviction is housekeeping: the message already has its model when a pass fails (a folder
    another process removed under it, a permission error), so the fetch returns it and says so."""
    from fedagent_flwr.checkpoint import node_cache

    def broken(cache_dir: Path, keep: int, protected: set[str]) -> node_cache.Eviction:
        raise PermissionError(13, "Permission denied", str(cache_dir / ("9" * 64)))

    monkeypatch.setattr(node_cache, "evict", broken)
    models = _models(store, tmp_path, "A")
    work = tmp_path / "node0"
    assert node(store, work, cache_keep=1).fetch(models["A"]) == work / "cache" / models["A"].sha256
    assert "[store] node cache: eviction skipped this time ([Errno 13] Permission denied" in capsys.readouterr().out
