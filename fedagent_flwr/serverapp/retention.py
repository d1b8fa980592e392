"""Disk retention: what the run directory stops keeping once a round is committed.

A round's commit (:mod:`.resume`) is the moment some of its files stop being needed:

- **Client checkpoints** of rounds up to the committed one. Their aggregate is written and its
  provenance recorded; a re-run never recomputes a committed round; the next round's clients start
  from the global model (a persistent trainer reloads the global model, never its own output).
  Removed unless ``storage.keep_client_checkpoints`` (keep them to audit every round's mean with
  ``python -m fedagent_flwr.checkpoint.verify``). What goes: ``round_<r>/client_<c>/checkpoints/``
  (what the trainers write) and ``actor/``, ``critic/``, ``.upload-*`` and ``.receipt-*.json``
  (the http store's upload slots; the s3 store's downloads and ``.download-*``; both stores' receipts).
  Jobs, results, logs and episode records stay.
- **Global models** older than the last ``storage.keep_last_k`` aggregated ones (0 keeps them all).
  The newest aggregate is the next round's starting model and what a re-run resumes from, so it is
  never removed, whatever ``k``; the critics of PPO follow the same rule.
- **Server optimiser states** (``round_<r>/server_optimizer/``: FedAvgM's momentum, FedAdam's m
  and v, ...) of committed rounds, but the one beside the newest global model (and critic),
  whatever ``keep_last_k``: only that one is stepped from, by the next round or by a re-run
  redoing it, and for a 7B model with Adam they are 56 GB a round. Kept with
  ``storage.keep_client_checkpoints``: auditing a round with ``checkpoint.verify`` needs the state
  it stepped from as much as the clients' checkpoints (a state is one or two models' size, the
  clients' checkpoints of a round M of them).

Files are removed only after the commit, so a crash in between leaves files that the next commit
removes, never a committed round without its global model. What was removed is noted in the
round's summary entry (``removed``: bytes per kind) and totalled in ``disk_freed_bytes``.

**The store's own copies.** A store that keeps copies outside the run directory (the s3 store's
bucket: the clients' uploads, the shared global models) is then told the same rules through
:meth:`~fedagent_flwr.checkpoint.store.ServerStore.release` (a :class:`~fedagent_flwr.checkpoint.store.Release`:
the committed round, whether client checkpoints go, the global models kept). What it removed is
noted beside ``removed``: ``store_removed`` (bytes per kind) and ``store_removed_objects`` in the
entry of the round the objects belonged to, totalled in ``store_freed_bytes`` and
``store_freed_objects``. A failure (no delete permission, the network) never fails the run: one
warning line, and the committed round's entry keeps it as ``store_retention_failed``.

**Earlier attempts.** A resumed run runs under a new Flower run id, so the store's copies of its
earlier attempts (the s3 store's ``runs/<earlier id>/``) are no longer this run's: when it starts,
:meth:`Retention.after_resume` tells the store to remove them by the same rules (uploads unless
``keep_client_checkpoints``, shared models unless ``keep_last_k`` is 0: the run directory keeps the
models kept, and the resumed run shares again what it needs). That is noted in this resume's
``resumed`` entry (``store_removed``, ``store_removed_objects``, or ``store_retention_failed``), not
in a round's: those objects were no committed round's, and the entries of the rounds run again
are replaced. ``store_freed_bytes``/``store_freed_objects`` count them too.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.common import log

from fedagent_flwr.checkpoint.store import Release, Released
from fedagent_flwr.schema.run import Storage
from fedagent_flwr.serverapp.resume import STATE_DIR, earlier_run_ids, store_freed_totals

if TYPE_CHECKING:
    from fedagent_flwr.checkpoint.store import ServerStore, StorageSettings
    from fedagent_flwr.serverapp.recorder import RunRecorder

_ROUND_DIR = re.compile(r"round_(\d+)")
_CLIENT_DIR = re.compile(r"client_\d+")
CLIENT_CHECKPOINT_DIRS = ("checkpoints", "actor", "critic")


@dataclass(frozen=True)
class Retention:
    """What a run keeps after each commit (the ``storage.keep_*`` keys)."""

    run_dir: Path
    keep_client_checkpoints: bool = Storage.keep_client_checkpoints
    keep_last_k: int = Storage.keep_last_k  # global models kept (the newest aggregated ones); 0: all
    store: ServerStore | None = field(default=None, compare=False)  # told to release its own copies

    @classmethod
    def from_settings(cls, storage: StorageSettings, run_dir: Path, store: ServerStore | None = None) -> Retention:
        return cls(Path(run_dir), storage.keep_client_checkpoints, storage.keep_last_k, store)

    def after_commit(self, recorder: RunRecorder, server_round: int) -> int:
        """Remove what nothing needs once rounds up to ``server_round`` are committed; return the
        bytes freed. Never raises: a file that cannot be removed is logged and left."""
        entries = {int(e["round"]): e for e in recorder.summary.get("rounds", []) if int(e["round"]) <= server_round}
        freed: dict[int, dict[str, int]] = {}
        if not self.keep_client_checkpoints:
            for r, path in self._client_checkpoints(server_round):
                self._note(freed, r, "client_checkpoints", _remove(path))
        if self.keep_last_k > 0:
            for key, label in (("aggregated_actor", "global_model"), ("aggregated_critic", "global_critic")):
                aggregated = [e for r, e in sorted(entries.items()) if e.get(key)]
                for entry in aggregated[:-self.keep_last_k]:
                    path = Path(entry[key])
                    kind_dir = "global" if label == "global_model" else "global_critic"
                    expected = self.run_dir / f"round_{entry['round']}" / kind_dir
                    if path == expected:  # only what the server itself wrote
                        self._note(freed, int(entry["round"]), label, _remove(path))
        for r, state in self._old_optimizer_states(entries, server_round):
            self._note(freed, r, "server_optimizer_state", _remove(state))
        total = sum(sum(kinds.values()) for kinds in freed.values())
        released = self._release_store(entries, server_round)
        noted = self._note_released(released, entries, server_round)
        if not freed and not noted:
            return 0
        for r, kinds in freed.items():
            if r in entries:
                removed = entries[r].setdefault("removed", {})
                for kind, size in kinds.items():
                    removed[kind] = removed.get(kind, 0) + size
        rounds = recorder.summary.get("rounds", [])
        if freed:
            recorder.summary["disk_freed_bytes"] = sum(sum(e.get("removed", {}).values()) for e in rounds)
        if released is not None and released.objects:
            self._store_totals(recorder)
        recorder.write()
        settings = self._settings()
        if freed:
            log(INFO, "[fedagent] round %d committed: removed %s no longer needed (%.1f MB; %s)", server_round,
                _describe(freed), total / 1e6, settings)
        if released is not None and released.objects:
            log(INFO, "[fedagent] round %d committed: removed %s from %s (%d objects, %.1f MB; %s)", server_round,
                _describe(released.removed), released.where, sum(released.objects.values()),
                sum(sum(kinds.values()) for kinds in released.removed.values()) / 1e6, settings)
        return total

    def after_resume(self, recorder: RunRecorder) -> None:
        """When the run resumed: tell the store to remove its copies of the run's earlier attempts
        (:func:`~.resume.earlier_run_ids`), and note what went in this resume's ``resumed`` entry.
        Never raises: a failure is one warning line and the entry's ``store_retention_failed``."""
        resumed = recorder.summary.get("resumed") or []
        if self.store is None or not resumed or (self.keep_client_checkpoints and self.keep_last_k == 0):
            return
        try:
            released = self.store.release_earlier(earlier_run_ids(recorder.summary), not self.keep_client_checkpoints,
                                                  self.keep_last_k > 0)
        except Exception as exc:  # noqa: BLE001 -- a store's cleanup never fails the run
            released = Released(where=self.store.describe(), failure=f"{type(exc).__name__}: {exc}")
        if released is None or not (released.objects or released.failure):
            return
        entry = resumed[-1]
        if released.objects:
            kinds: dict[str, int] = {}
            for found in released.removed.values():
                for kind, size in found.items():
                    kinds[kind] = kinds.get(kind, 0) + size
            entry["store_removed"] = kinds
            entry["store_removed_objects"] = sum(released.objects.values())
            self._store_totals(recorder)
            log(INFO, "[fedagent] resumed: removed the earlier attempts' %s from %s (%d objects, %.1f MB; %s)",
                ", ".join(kind.replace("_", " ") for kind in sorted(kinds)), released.where,
                entry["store_removed_objects"], sum(kinds.values()) / 1e6, self._settings())
        if released.failure:
            entry["store_retention_failed"] = released.failure
            log(WARNING, "[fedagent] resumed, but %s", released.failure)
        recorder.write()

    @staticmethod
    def _store_totals(recorder: RunRecorder) -> None:
        totals = store_freed_totals(recorder.summary.get("rounds", []), recorder.summary.get("resumed", []))
        if totals is not None:
            recorder.summary["store_freed_bytes"], recorder.summary["store_freed_objects"] = totals

    def _settings(self) -> str:
        return (f"storage.keep_client_checkpoints={str(self.keep_client_checkpoints).lower()}, "
                f"storage.keep_last_k={self.keep_last_k}")

    def _release_store(self, entries: dict[int, dict[str, Any]], server_round: int) -> Released | None:
        """Tell the store the rules above for its own copies; None when it keeps none. Never raises."""
        if self.store is None:
            return None
        keep: dict[str, frozenset[Path]] | None = None
        if self.keep_last_k > 0:
            keep = {}
            for key, kind in (("aggregated_actor", "actor"), ("aggregated_critic", "critic")):
                aggregated = [Path(e[key]) for _, e in sorted(entries.items()) if e.get(key)]
                if aggregated:
                    keep[kind] = frozenset(aggregated[-self.keep_last_k:])
        plan = Release(server_round, not self.keep_client_checkpoints, keep)
        try:
            released = self.store.release(plan)
        except Exception as exc:  # noqa: BLE001 -- a store's cleanup never fails the run
            released = Released(where=self.store.describe(), failure=f"{type(exc).__name__}: {exc}")
        if released is not None and released.failure:
            log(WARNING, "[fedagent] round %d committed, but %s", server_round, released.failure)
        return released

    @staticmethod
    def _note_released(released: Released | None, entries: dict[int, dict[str, Any]], server_round: int) -> bool:
        """Note what the store removed in the rounds' entries (a round without one: the committed
        round's); return whether there was anything to note."""
        if released is None or not (released.objects or released.failure):
            return False
        for r, kinds in released.removed.items():
            entry = entries.get(r, entries.get(server_round))
            if entry is None:
                continue
            removed = entry.setdefault("store_removed", {})
            for kind, size in kinds.items():
                removed[kind] = removed.get(kind, 0) + size
            entry["store_removed_objects"] = entry.get("store_removed_objects", 0) + released.objects.get(r, 0)
        if released.failure and server_round in entries:
            entries[server_round]["store_retention_failed"] = released.failure
        return True

    def _client_checkpoints(self, server_round: int) -> list[tuple[int, Path]]:
        found = []
        for round_dir in sorted(self.run_dir.glob("round_*")):
            match = _ROUND_DIR.fullmatch(round_dir.name)
            if not match or int(match.group(1)) > server_round or round_dir.is_symlink():
                continue
            for client_dir in sorted(round_dir.glob("client_*")):
                if not _CLIENT_DIR.fullmatch(client_dir.name) or client_dir.is_symlink():
                    continue
                paths = [client_dir / name for name in CLIENT_CHECKPOINT_DIRS] + sorted(client_dir.glob(".upload-*")) \
                    + sorted(client_dir.glob(".download-*")) + sorted(client_dir.glob(".receipt-*.json")) \
                    + sorted(client_dir.glob("..receipt-*.json"))  # a receipt's temporary name (atomic_path)
                found += [(int(match.group(1)), p) for p in paths if p.exists() or p.is_symlink()]
        return found

    def _old_optimizer_states(self, entries: dict[int, dict[str, Any]], server_round: int) -> list[tuple[int, Path]]:
        """Server optimiser states of committed rounds that are not beside the newest global model
        (or critic): the older ones, and any a round left without its model. With
        ``keep_client_checkpoints`` (an audit needs them) only the latter."""
        kept: dict[str, set[int]] = {}
        for key, kind_dir in (("aggregated_actor", "global"), ("aggregated_critic", "global_critic")):
            aggregated = [r for r, e in sorted(entries.items()) if e.get(key)]
            kept[kind_dir] = set(aggregated if self.keep_client_checkpoints else aggregated[-1:])
        found = []
        for round_dir in sorted(self.run_dir.glob(f"round_*/{STATE_DIR}")):
            match = _ROUND_DIR.fullmatch(round_dir.parent.name)
            if not match or int(match.group(1)) > server_round or round_dir.is_symlink():
                continue
            for kind_dir, keep in kept.items():
                state = round_dir / f"{kind_dir}.safetensors"
                if int(match.group(1)) not in keep and state.is_file() and not state.is_symlink():
                    found.append((int(match.group(1)), state))
        return found

    @staticmethod
    def _note(freed: dict[int, dict[str, int]], server_round: int, kind: str, size: int | None) -> None:
        if size is not None:
            kinds = freed.setdefault(server_round, {})
            kinds[kind] = kinds.get(kind, 0) + size


def _remove(path: Path) -> int | None:
    """Remove a file or directory tree (a symlink itself, never its target); return the bytes of
    its files, or None when it could not be removed."""
    try:
        if path.is_symlink() or path.is_file():
            size = path.lstat().st_size
            path.unlink()
            return size
        size = sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
        shutil.rmtree(path)
        return size
    except OSError as exc:
        log(WARNING, "[fedagent] could not remove %s: %s", path, exc)
        return None


def _describe(freed: dict[int, dict[str, Any]]) -> str:
    kinds: dict[str, list[int]] = {}
    for r, found in sorted(freed.items()):
        for kind in found:
            kinds.setdefault(kind.replace("_", " "), []).append(r)
    return "; ".join(f"{kind} of round{'s' if len(rounds) > 1 else ''} {', '.join(map(str, rounds))}"
                     for kind, rounds in kinds.items())
