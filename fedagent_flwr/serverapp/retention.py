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
  redoing it, and for a 7B model with Adam they are 56 GB a round.

Files are removed only after the commit, so a crash in between leaves files that the next commit
removes, never a committed round without its global model. What was removed is noted in the
round's summary entry (``removed``: bytes per kind) and totalled in ``disk_freed_bytes``.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.common import log

from fedagent_flwr.schema.run import Storage
from fedagent_flwr.serverapp.resume import STATE_DIR

if TYPE_CHECKING:
    from fedagent_flwr.checkpoint.store import StorageSettings
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

    @classmethod
    def from_settings(cls, storage: StorageSettings, run_dir: Path) -> Retention:
        return cls(Path(run_dir), storage.keep_client_checkpoints, storage.keep_last_k)

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
        if not freed:
            return 0
        for r, kinds in freed.items():
            if r in entries:
                removed = entries[r].setdefault("removed", {})
                for kind, size in kinds.items():
                    removed[kind] = removed.get(kind, 0) + size
        recorder.summary["disk_freed_bytes"] = sum(
            sum(e.get("removed", {}).values()) for e in recorder.summary.get("rounds", []))
        recorder.write()
        log(INFO, "[fedagent] round %d committed: removed %s no longer needed (%.1f MB; "
            "storage.keep_client_checkpoints=%s, storage.keep_last_k=%d)", server_round, _describe(freed), total / 1e6,
            str(self.keep_client_checkpoints).lower(), self.keep_last_k)
        return total

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
                    + sorted(client_dir.glob(".download-*")) + sorted(client_dir.glob(".receipt-*.json"))
                found += [(int(match.group(1)), p) for p in paths if p.exists() or p.is_symlink()]
        return found

    def _old_optimizer_states(self, entries: dict[int, dict[str, Any]], server_round: int) -> list[tuple[int, Path]]:
        """Server optimiser states of committed rounds that are not beside the newest global model
        (or critic): the older ones, and any a round left without its model."""
        newest = {}
        for key, kind_dir in (("aggregated_actor", "global"), ("aggregated_critic", "global_critic")):
            aggregated = [r for r, e in sorted(entries.items()) if e.get(key)]
            newest[kind_dir] = aggregated[-1] if aggregated else None
        found = []
        for round_dir in sorted(self.run_dir.glob(f"round_*/{STATE_DIR}")):
            match = _ROUND_DIR.fullmatch(round_dir.parent.name)
            if not match or int(match.group(1)) > server_round or round_dir.is_symlink():
                continue
            for kind_dir, keep in newest.items():
                state = round_dir / f"{kind_dir}.safetensors"
                if int(match.group(1)) != keep and state.is_file() and not state.is_symlink():
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
