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

Files are removed only after the commit, so a crash in between leaves files that the resumed run
removes (below), never a committed round without its global model. What was removed is noted in
the summary entry of the round it belonged to (``removed``: bytes per kind) and totalled in
``disk_freed_bytes``.

**Noted before removed.** What a commit lets go is written into the record before any of it goes:
the committed round's entry gets ``removing``, one ``{"round", "kind", "path", "bytes"}`` per file
or directory (the round it belongs to, the kind as in ``removed``, the path relative to the run
directory, its size; :mod:`fedagent_flwr.checkpoint.removal_note`). The ServerApp notes it just
before the commit (:meth:`Retention.before_commit`), so the summary write that commits the round
carries it and retention adds no write; :meth:`Retention.after_commit` called alone writes the note
first. Then the run directory is fsynced (a power cut cannot keep the removals and lose the note),
the files are removed (a directory renamed to ``.removing-<name>`` first and that tree removed, so a
path is whole or gone, never half) and the next write turns the note into ``removed``. Killed in
between (kill -9, OOM, a power cut), the run leaves the note, never files gone that its record does
not account for: the audit reads a noted path that is gone (and what it held) as removed by the
run, path by path (:mod:`fedagent_flwr.checkpoint.removal_note`), and the resumed
run when it starts (:meth:`Retention.after_resume`), or the next commit, removes what the note
lists (what is still there, a ``.removing-*`` left half-way) and counts each path once, at the size
noted. The note is in the committing round's entry, so a round that did not commit after all takes
it with it (a re-run keeps committed rounds' entries only): nothing is removed for a commit that did
not happen. A path that cannot be removed is dropped from the note (one warning line) and noted
again at the next commit. A directory renamed out of its path whose tree then could not be removed
is counted (its path is gone, by the run) and its ``.removing-*`` tree is removed again at each
later commit or resume until it goes.

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

import os
import re
import shutil
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.common import log

from fedagent_flwr.atomic import fsync_dir
from fedagent_flwr.checkpoint.removal_note import REMOVING, noted_path
from fedagent_flwr.checkpoint.store import Release, Released
from fedagent_flwr.schema.run import Storage
from fedagent_flwr.serverapp.recorder import SUMMARY_FILE
from fedagent_flwr.serverapp.resume import STATE_DIR, earlier_run_ids, store_freed_totals

if TYPE_CHECKING:
    from fedagent_flwr.checkpoint.store import ServerStore, StorageSettings
    from fedagent_flwr.serverapp.recorder import RunRecorder

_ROUND_DIR = re.compile(r"round_(\d+)")
_CLIENT_DIR = re.compile(r"client_\d+")
CLIENT_CHECKPOINT_DIRS = ("checkpoints", "actor", "critic")
#: What a directory being removed is renamed to first (``.removing-<name>``, beside it).
TRASH_PREFIX = ".removing-"
_KIND_ORDER = {kind: i for i, kind in enumerate(("client_checkpoints", "global_model", "global_critic",
                                                  "server_optimizer_state"))}


@dataclass(frozen=True)
class Retention:
    """What a run keeps after each commit (the ``storage.keep_*`` keys)."""

    run_dir: Path
    keep_client_checkpoints: bool = Storage.keep_client_checkpoints
    keep_last_k: int = Storage.keep_last_k  # global models kept (the newest aggregated ones); 0: all
    store: ServerStore | None = field(default=None, compare=False)  # told to release its own copies
    # rounds whose removals before_commit noted: after_commit does not list the run's files again
    _noted: set[int] = field(default_factory=set, init=False, repr=False, compare=False)

    @classmethod
    def from_settings(cls, storage: StorageSettings, run_dir: Path, store: ServerStore | None = None) -> Retention:
        return cls(Path(run_dir), storage.keep_client_checkpoints, storage.keep_last_k, store)

    def before_commit(self, recorder: RunRecorder, server_round: int) -> None:
        """Note in the entry of ``server_round`` what its commit lets go (``removing``, module
        docstring), without writing it: the summary write that commits the round carries the note,
        so :meth:`after_commit` removes the files without a write of its own first. A round that is
        not committed after all (the run stopped before) takes the note with it: a re-run keeps the
        entries of committed rounds only. Never raises."""
        entries = self._entries(recorder, server_round)
        if server_round not in entries:  # no entry to carry it: after_commit notes it, once committed
            return
        try:
            self._plan(entries, server_round, entries[server_round])
            self._noted.add(server_round)
        except OSError as exc:  # after_commit plans again
            log(WARNING, "[fedagent] round %d: could not list what its commit lets go: %s", server_round, exc)

    def after_commit(self, recorder: RunRecorder, server_round: int) -> int:
        """Remove what nothing needs once rounds up to ``server_round`` are committed; return the
        bytes freed. What goes is in the record before it goes (module docstring): written here
        first unless :meth:`before_commit` noted it already. Never raises: a file that cannot be
        removed is logged and left."""
        entries = self._entries(recorder, server_round)
        noted_before = server_round in self._noted
        self._noted.discard(server_round)
        if not noted_before and entries and self._plan(entries, server_round, entries[max(entries)]):
            recorder.write()  # not in the record yet: it must be before anything goes
        pending = any(REMOVING in entry for entry in entries.values())
        freed = self._carry_out(entries)
        total = _total(freed)
        released = self._release_store(entries, server_round)
        noted = self._note_released(released, entries, server_round)
        if not pending and not noted:
            return 0
        self._note_freed(recorder, entries, freed)
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
                _total(released.removed) / 1e6, settings)
        return total

    def after_resume(self, recorder: RunRecorder) -> None:
        """When the run starts: finish the removals an earlier attempt noted and did not get to
        record (it died in between, module docstring), and when it resumed, tell the store to remove
        its copies of the run's earlier attempts (:func:`~.resume.earlier_run_ids`), noted in this
        resume's ``resumed`` entry. Never raises: a store's failure is one warning line and the
        entry's ``store_retention_failed``."""
        entries = {int(e["round"]): e for e in recorder.summary.get("rounds", [])}
        pending = any(REMOVING in entry for entry in entries.values())
        freed = self._carry_out(entries)
        if pending:
            self._note_freed(recorder, entries, freed)
        if freed:
            log(INFO, "[fedagent] resumed: removed %s that an earlier attempt noted to remove and did not record as "
                "removed (%.1f MB; %s)", _describe(freed),
                _total(freed) / 1e6, self._settings())
        if not self._release_earlier(recorder) and not pending:
            return
        recorder.write()

    def _release_earlier(self, recorder: RunRecorder) -> bool:
        """The store's part of :meth:`after_resume`; whether it noted anything."""
        resumed = recorder.summary.get("resumed") or []
        if self.store is None or not resumed or (self.keep_client_checkpoints and self.keep_last_k == 0):
            return False
        try:
            released = self.store.release_earlier(earlier_run_ids(recorder.summary), not self.keep_client_checkpoints,
                                                  self.keep_last_k > 0)
        except Exception as exc:  # noqa: BLE001 -- a store's cleanup never fails the run
            released = Released(where=self.store.describe(), failure=f"{type(exc).__name__}: {exc}")
        if released is None or not (released.objects or released.failure):
            return False
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
        return True

    @staticmethod
    def _entries(recorder: RunRecorder, server_round: int) -> dict[int, dict[str, Any]]:
        """The summary entries of the rounds up to ``server_round`` (the record's own dicts)."""
        return {int(e["round"]): e for e in recorder.summary.get("rounds", []) if int(e["round"]) <= server_round}

    def _plan(self, entries: dict[int, dict[str, Any]], server_round: int, noting: dict[str, Any]) -> bool:
        """Add what the commit of ``server_round`` lets go to the ``removing`` note of the entry
        ``noting`` (the committed round's), each path once whatever note lists it already; whether
        any was added (the record must then be written before it goes)."""
        found: list[tuple[int, str, Path]] = []
        if not self.keep_client_checkpoints:
            found += [(r, "client_checkpoints", path) for r, path in self._client_checkpoints(server_round)]
        if self.keep_last_k > 0:
            for key, label in (("aggregated_actor", "global_model"), ("aggregated_critic", "global_critic")):
                aggregated = [e for r, e in sorted(entries.items()) if e.get(key)]
                for entry in aggregated[:-self.keep_last_k]:
                    path = Path(entry[key])
                    kind_dir = "global" if label == "global_model" else "global_critic"
                    # only what the server itself wrote, and only once (the older ones went before)
                    if path == self.run_dir / f"round_{entry['round']}" / kind_dir and os.path.lexists(path):
                        found.append((int(entry["round"]), label, path))
        found += [(r, "server_optimizer_state", path) for r, path in self._old_optimizer_states(entries, server_round)]
        noted = {item["path"] for entry in entries.values() for item in entry.get(REMOVING, [])}
        added = False
        for r, kind, path in found:
            relative = path.relative_to(self.run_dir).as_posix()
            if relative not in noted:  # a note a crash left keeps it: counted once, at the size noted
                noting.setdefault(REMOVING, []).append({"round": r, "kind": kind, "path": relative,
                                                        "bytes": _size(path)})
                noted.add(relative)
                added = True
        return added

    def _carry_out(self, entries: dict[int, dict[str, Any]]) -> dict[int, dict[str, int]]:
        """Remove every path the entries' ``removing`` notes list (already gone: removed by an
        attempt that died before recording it) and drop the notes; the bytes removed, as noted, by
        the round they belonged to (one without an entry: the round whose entry noted them). A path
        that cannot be removed is left out (a later commit notes it again). A noted path that would
        lead out of the run directory (absolute, or up through ``..``: retention writes none, so the
        summary is damaged or was edited by hand) is never removed: one warning line naming the
        summary and the path, and it is dropped from the note like any other."""
        self._sweep_trash()
        noted = [(r, item) for r, entry in sorted(entries.items()) if REMOVING in entry for item in entry.pop(REMOVING)]
        if noted:
            fsync_dir(self.run_dir)  # the note's rename on disk before any removal (a power cut)
        freed: dict[int, dict[str, int]] = {}
        # kind by kind, each over the rounds: the clients' checkpoints (the bulk) first, as ever
        for r, item in sorted(noted, key=lambda n: (_KIND_ORDER.get(n[1]["kind"], len(_KIND_ORDER)), n[1]["round"])):
            relative = noted_path(item["path"])
            if relative is None:
                log(WARNING, "[fedagent] %s: round %s's note of what to remove lists %r, which is outside the run "
                    "directory %s: not removed (the summary is damaged or was edited by hand)",
                    self.run_dir / SUMMARY_FILE, r, item["path"], self.run_dir)
                continue
            if _remove(self.run_dir / relative):
                owner = int(item["round"]) if int(item["round"]) in entries else r
                self._note(freed, owner, str(item["kind"]), int(item["bytes"]))
        return freed

    def _sweep_trash(self) -> None:
        """Remove the ``.removing-*`` trees an earlier removal renamed and could not delete (their
        bytes were counted when their paths went)."""
        for pattern in (f"round_*/{TRASH_PREFIX}*", f"round_*/client_*/{TRASH_PREFIX}*"):
            for trash in self.run_dir.glob(pattern):
                if trash.is_dir() and not trash.is_symlink():
                    shutil.rmtree(trash, ignore_errors=True)
                    if trash.exists():
                        log(WARNING, "[fedagent] could not remove %s (an earlier removal's); delete it by hand",
                            trash)

    def _note_freed(self, recorder: RunRecorder, entries: dict[int, dict[str, Any]],
                    freed: dict[int, dict[str, int]]) -> None:
        """Add ``freed`` to the entries' ``removed`` and total ``disk_freed_bytes``."""
        for r, kinds in freed.items():
            removed = entries[r].setdefault("removed", {})
            for kind, size in kinds.items():
                removed[kind] = removed.get(kind, 0) + size
        if freed:
            rounds = recorder.summary.get("rounds", [])
            recorder.summary["disk_freed_bytes"] = sum(sum(e.get("removed", {}).values()) for e in rounds)

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
    def _note(freed: dict[int, dict[str, int]], server_round: int, kind: str, size: int) -> None:
        kinds = freed.setdefault(server_round, {})
        kinds[kind] = kinds.get(kind, 0) + size


def _size(path: Path) -> int:
    """The bytes of a file (a symlink's own) or of the files of a directory tree; a file that
    vanishes meanwhile counts nothing."""
    try:
        if path.is_symlink() or path.is_file():
            return path.lstat().st_size
        files = [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    except OSError:
        return 0
    total = 0
    for file in files:
        try:
            total += file.lstat().st_size
        except OSError:
            continue
    return total


def _remove(path: Path) -> bool:
    """Remove a file or directory tree (a symlink itself, never its target); whether ``path`` is
    gone. A directory is renamed to ``.removing-<name>`` first and that tree removed, so that a crash
    half-way leaves it whole or gone, never half (a leftover of such a crash: :meth:`Retention._sweep_trash`,
    which runs first)."""
    trash = path.with_name(TRASH_PREFIX + path.name)
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            os.rename(path, trash)
            shutil.rmtree(trash)
    except OSError as exc:
        log(WARNING, "[fedagent] could not remove %s: %s", path, exc)
    return not os.path.lexists(path)


def _total(freed: dict[int, dict[str, int]]) -> int:
    """The bytes of a ``{round: {kind: bytes}}`` mapping."""
    return sum(sum(kinds.values()) for kinds in freed.values())


def _describe(freed: dict[int, dict[str, Any]]) -> str:
    kinds: dict[str, list[int]] = {}
    for r, found in sorted(freed.items()):
        for kind in found:
            kinds.setdefault(kind.replace("_", " "), []).append(r)
    return "; ".join(f"{kind} of round{'s' if len(rounds) > 1 else ''} {', '.join(map(str, rounds))}"
                     for kind, rounds in kinds.items())
