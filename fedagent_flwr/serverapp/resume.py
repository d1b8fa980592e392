"""Resuming a run: what a completed round is, what a re-run keeps, and how it starts after it.

Re-running a run (the same ``output_dir``/``run_name`` and the same resolved config) continues
after its last *completed* round instead of starting over.

**Completed.** Round r is completed when ``federated_summary.json`` says
``last_completed_round >= r``. The recorder writes that field once per round, after the round's
new global model was renamed into place and its training and evaluation results were recorded
(round 0, the base model's evaluation, likewise). The summary is replaced by one atomic rename,
and that rename is the round's single commit point: a crash anywhere leaves the summary of
before or after it, never a half. Anything of a later round (a global model already in place, a
summary entry, curve points, metrics lines, client outputs) is uncommitted and is recomputed.

**A re-run** therefore
1. checks the config fingerprint stored in the summary (a different config is refused);
2. keeps the summary entries and metrics lines of completed rounds only, and the totals they make
   (``initial_eval_seconds`` once round 0 completed, ``disk_freed_bytes``, ``store_freed_bytes``);
3. removes the server's uncommitted outputs (global models of later rounds, aggregation
   staging directories, temporary files of interrupted writes);
4. checks that global model (and PPO critic) against the content hash recorded when its round
   was committed (a file truncated or altered since stops the run with one line naming it);
5. starts from the last completed round's global model, and the ServerApp's round loop
   (:mod:`.rounds`) skips the completed rounds. Client selection and seeds are functions of the round number alone
   (``fedagent_flwr.seeding``), so round k+1 is sent exactly what an uninterrupted run sends.
   With a remote store the start model is shared again from the run directory's copy (the s3 store
   uploads it under the new Flower run id's prefix, ``runs/<run id>/``), so a re-run needs nothing a
   store removed after a commit. The earlier attempts' objects in the store are removed by
   retention's rules when the re-run starts (:meth:`.retention.Retention.after_resume`); their run
   ids are those :func:`earlier_run_ids` reads from the summary.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedagent_flwr.checkpoint import CheckpointError, CheckpointRef, open_checkpoint
from fedagent_flwr.schema import declared_default
from fedagent_flwr.serverapp.recorder import CURVE_FILE, METRICS_FILE, SUMMARY_FILE

LOCK_FILE = ".serverapp.lock"
_ROUND_DIR = re.compile(r"round_(\d+)")

#: The directory beside a round's ``global`` (and ``global_critic``) holding a server optimiser's
#: state (:mod:`fedagent_flwr.serverapp.strategy.server_optimizer`); uncommitted rounds' go too.
STATE_DIR = "server_optimizer"


def state_file(global_dir: str | Path) -> Path:
    """The server optimiser's state written with the global model (or critic) at ``global_dir``."""
    directory = Path(global_dir)
    return directory.parent / STATE_DIR / f"{directory.name}.safetensors"


class ResumeError(ValueError):
    """The run directory holds a run that this run cannot continue."""


def config_fingerprint(config: dict[str, Any], base_model_sha256: str) -> str:
    """sha256 of the resolved config and the base model's content, as canonical JSON."""
    canonical = json.dumps({"config": config, "base_model_sha256": base_model_sha256},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class PreviousRun:
    """What a re-run keeps of an earlier attempt at the same run: its completed rounds only."""

    run_dir: Path
    last_completed_round: int | None  # None: not even round 0 (base-model evaluation) completed
    status: str
    total_rounds: int
    val_curve: list[dict[str, Any]]
    client_curve: list[dict[str, Any]]
    rounds: list[dict[str, Any]]
    events: list[dict[str, Any]]  # metrics.jsonl lines
    resumed: list[dict[str, Any]]
    wall_seconds: float
    client_val_curve: list[dict[str, Any]] = field(default_factory=list)  # per-client validation
    eval_failures: list[dict[str, Any]] = field(default_factory=list)  # evaluations that recorded nothing
    initial_eval_seconds: float | None = None  # round 0's time, once round 0 was committed
    disk_freed_bytes: int | None = None  # what retention removed after the completed rounds' commits
    store_freed_bytes: int | None = None  # what it removed from the store's own copies (s3: the bucket)
    store_freed_objects: int | None = None
    run_id: Any = None  # the Flower run id of the attempt that wrote the summary (the one resumed)

    @property
    def last_aggregate(self) -> dict[str, Any] | None:
        """The entry of the last completed round that produced a new global model, if any."""
        aggregated = [entry for entry in self.rounds if entry.get("aggregated_actor")]
        return aggregated[-1] if aggregated else None

    def global_model(self, base: CheckpointRef) -> CheckpointRef:
        """The global model after the last completed round (``base`` if no round changed it),
        checked against the hash recorded when that round was committed."""
        entry = self.last_aggregate
        if entry is None:
            return base
        return self._committed(entry, "aggregated_actor", "aggregated_sha256", "actor", "global model")

    def global_critic(self) -> CheckpointRef | None:
        """PPO: the aggregated critic after the last completed round that produced one, if any
        (checked like :meth:`global_model`)."""
        critics = [entry for entry in self.rounds if entry.get("aggregated_critic")]
        if not critics:
            return None
        return self._committed(critics[-1], "aggregated_critic", "aggregated_critic_sha256", "critic", "global critic")

    def _committed(self, entry: dict[str, Any], path_key: str, hash_key: str, kind: str, what: str) -> CheckpointRef:
        """The model ``entry[path_key]`` as its round committed it, or ResumeError in one line that
        names the file and what to do."""
        path = Path(entry[path_key])
        where = f"round {entry['round']}'s {what} {path}"
        advice = (f"{self.run_dir} cannot be resumed from it: restore that directory from a copy, or "
                  "start over with another run_name or output_dir")
        if not path.is_dir():
            raise ResumeError(f"{where} is missing; {advice}")
        try:
            ref = CheckpointRef.for_directory(path, kind, "hf-safetensors")  # type: ignore[arg-type]
            recorded = entry.get(hash_key)
            if recorded:
                if ref.sha256 != recorded:
                    raise CheckpointError(
                        f"its content hash is {ref.sha256[:16]}..., not the {str(recorded)[:16]}... recorded when "
                        f"round {entry['round']} was committed (a file was truncated or changed since)"
                    )
            else:  # a summary written before hashes were recorded: it must at least open
                open_checkpoint(ref, check_hash=False).close()
        except (CheckpointError, OSError) as exc:
            raise ResumeError(f"{where} is damaged: {exc}; {advice}") from None
        return ref


def load_previous_run(run_dir: Path, header: dict[str, Any]) -> PreviousRun | None:
    """The earlier attempt at this run in ``run_dir``, cut back to its completed rounds.

    ``None`` when ``run_dir`` holds no run yet. Raises :class:`ResumeError` when it holds a run of
    another configuration (naming the first differing config key) or an unreadable summary.
    """
    summary_path = run_dir / SUMMARY_FILE
    if not summary_path.exists():
        return None
    try:
        stored = json.loads(summary_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResumeError(f"{summary_path} cannot be read ({exc}); choose another run_name or output_dir") from None
    hashed_as = stored.get("content_hash", "v1")  # records before the field hashed as v1
    if "config_sha256" in stored and hashed_as != header.get("content_hash", hashed_as):
        # every recorded hash (base model, committed models) was computed another way, so none can
        # be checked, and a mismatch would wrongly read as another base model or a damaged file
        raise ResumeError(
            f"output directory {run_dir} holds a run recorded with checkpoint content hash {hashed_as}, "
            f"and this fedagent-flwr computes {header.get('content_hash')}: its recorded hashes cannot be "
            "checked, so it cannot be resumed; choose another run_name or output_dir")
    if stored.get("config_sha256") != header["config_sha256"] and not _only_new_defaults(stored, header):
        raise ResumeError(
            f"output directory {run_dir} already holds a run of another configuration "
            f"({_difference(stored, header)}); choose another run_name or output_dir, or re-run "
            "with the same configuration to resume that run"
        )
    last = stored.get("last_completed_round")

    def kept(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [item for item in items if last is not None and int(item["round"]) <= last]

    metrics_path = run_dir / METRICS_FILE
    lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
    rounds = kept(stored.get("rounds", []))
    resumed = list(stored.get("resumed", []))
    store_freed = store_freed_totals(rounds, resumed)
    return PreviousRun(
        run_dir=run_dir,
        last_completed_round=last,
        status=str(stored.get("status", "")),
        total_rounds=int(header["total_rounds"]),
        val_curve=kept(stored.get("val_curve", [])),
        client_curve=kept(stored.get("client_curve", [])),
        rounds=rounds,
        events=kept([json.loads(line) for line in lines if line.strip()]),
        resumed=resumed,
        wall_seconds=float(stored.get("wall_seconds", 0.0)),
        client_val_curve=kept(stored.get("client_val_curve", [])),
        eval_failures=kept(stored.get("eval_failures", [])),
        initial_eval_seconds=stored.get("initial_eval_seconds") if last is not None else None,
        # retention's own total over the kept rounds' ``removed`` (it notes committed rounds only)
        disk_freed_bytes=(sum(sum(e.get("removed", {}).values()) for e in rounds)
                          if any("removed" in e for e in rounds) else None),
        # and the store's (an s3 bucket's) beside it, with what resumes removed of earlier attempts
        store_freed_bytes=store_freed[0] if store_freed else None,
        store_freed_objects=store_freed[1] if store_freed else None,
        run_id=stored.get("run_id"),
    )


def store_freed_totals(rounds: list[dict[str, Any]], resumed: list[dict[str, Any]]) -> tuple[int, int] | None:
    """``(store_freed_bytes, store_freed_objects)``: what the store removed after the commits of
    ``rounds`` (their entries' ``store_removed``) and, when the run resumed, of its earlier attempts
    (the ``resumed`` entries' ``store_removed``); None when nothing was noted."""
    noted = [entry for entry in (*rounds, *resumed) if "store_removed" in entry]
    if not noted:
        return None
    return (sum(sum(entry["store_removed"].values()) for entry in noted),
            sum(int(entry.get("store_removed_objects", 0)) for entry in noted))


def earlier_run_ids(summary: dict[str, Any]) -> list[int]:
    """The Flower run ids of the run's earlier attempts, as its summary records them: each
    ``resumed`` entry's ``run_id`` (the attempt that resumed) and ``earlier_run_id`` (the attempt
    it continued, the summary's ``run_id`` before that resume), but this attempt's own ``run_id``.
    An entry written before ``earlier_run_id`` was recorded names no first attempt."""
    ids: list[int] = []
    for entry in summary.get("resumed", []):
        for key in ("earlier_run_id", "run_id"):
            run_id = entry.get(key)
            if type(run_id) is int and run_id != summary.get("run_id") and run_id not in ids:
                ids.append(run_id)
    return ids


def _difference(stored: dict[str, Any], header: dict[str, Any]) -> str:
    """The first config key whose value differs, for the error message."""
    if "config_sha256" not in stored:
        return "its summary has no config fingerprint: it was written by an older fedagent-flwr"
    before, now = _flatten(stored.get("config", {})), _flatten(header["config"])
    keys = sorted(set(before) | set(now))
    for key in keys:
        if key not in before and now[key] == declared_default(key):
            continue  # a setting added since, at the default the older run had in effect
        if {} in (before.get(key), now.get(key)) and any(k.startswith(key + ".") for k in keys):
            continue  # an empty mapping on one side, keys under it on the other: name those keys
        if before.get(key, "<unset>") != now.get(key, "<unset>"):
            return f"config key '{key}' = {before.get(key, '<unset>')!r} there, {now.get(key, '<unset>')!r} now"
    return (f"the base model's content differs: sha256 {stored.get('base_model_sha256')} there, "
            f"{header.get('base_model_sha256')} now")


def _only_new_defaults(stored: dict[str, Any], header: dict[str, Any]) -> bool:
    """Whether the configs differ only by run keys the schema gained after ``stored`` was recorded,
    each at its declared default (``max_empty_rounds`` = 2 for a run recorded before it existed):
    such a run is the same run, and refusing it would strand every run of an older version."""
    if "config" not in stored or stored.get("base_model_sha256") != header.get("base_model_sha256"):
        return False
    before, now = _flatten(stored["config"]), _flatten(header["config"])
    added = set(now) - set(before)
    if set(before) - set(now) or any(before[key] != now[key] for key in before):
        return False
    return bool(added) and all(now[key] == declared_default(key) for key in added)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    # an empty mapping is a value of its own (model.chat_template_kwargs = {}, a key a run recorded
    # before it existed lacks), not nothing
    if not isinstance(tree, dict) or (not tree and prefix):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def discard_uncommitted(run_dir: Path, last_completed_round: int | None) -> list[Path]:
    """Remove what the server wrote for rounds after ``last_completed_round``; return the paths.

    Those are the global models (and PPO critics) renamed into place by a round that never
    committed (the rerun aggregates again, and aggregation refuses to overwrite) with a server
    optimiser's state written beside them (``round_<r>/server_optimizer``), the staging
    directories of an interrupted aggregation, the http store's upload slots of such rounds
    (``round_<r>/client_<c>/{actor,critic,.upload-*}``: a committed slot is final, so a client
    re-training the round could not upload again) and the s3 store's downloads of them
    (``actor``, ``critic``, ``.download-*``), the stores' receipts of those slots, and the
    temporary files of interrupted summary, metrics and plot writes. Client outputs of such rounds
    are left alone: their trainer replaces its checkpoint and result on the rerun, and a client of
    a deployment may be on another machine.
    """
    removed: list[Path] = []
    for round_dir in sorted(run_dir.glob("round_*")):
        match = _ROUND_DIR.fullmatch(round_dir.name)
        if not match or not round_dir.is_dir():
            continue
        # weighted_mean writes the aggregate into ".global.staging-<id>" beside "global" and renames.
        leftovers = list(round_dir.glob(".global.staging-*")) + list(round_dir.glob(".global_critic.staging-*"))
        # a server optimiser's state (strategy/server_optimizer.py), streamed to ".<name>.partial-<pid>"
        leftovers += list((round_dir / STATE_DIR).glob(".*.partial-*"))
        if last_completed_round is None or int(match.group(1)) > last_completed_round:
            leftovers += [round_dir / "global", round_dir / "global_critic", round_dir / STATE_DIR]
            for client_dir in sorted(round_dir.glob("client_*")):
                leftovers += [client_dir / "actor", client_dir / "critic", *client_dir.glob(".upload-*"),
                              *client_dir.glob(".download-*"), *client_dir.glob(".receipt-*.json"),
                              *client_dir.glob("..receipt-*.json")]  # receipts of the slots removed here
        for path in leftovers:
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
            else:
                continue
            removed.append(path)
    # atomic_path's temporary names: ".<target name>.<random><suffix>" beside the target.
    for name in (SUMMARY_FILE, METRICS_FILE, CURVE_FILE):
        for path in sorted(run_dir.glob(f".{name}.*")):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


@contextmanager
def exclusive_run_directory(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``run_dir`` while the ServerApp runs in it.

    Two ServerApps resuming the same run would both write its rounds. The lock is a ``flock``,
    which the kernel drops when its process dies, by SIGKILL too, so a crash never leaves a stale
    lock that would stop the resume.
    """
    handle = open(run_dir / LOCK_FILE, "a")  # held until the run ends
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ResumeError(
                f"output directory {run_dir} is in use by another ServerApp that is still running; "
                "wait for it to end (or stop it) before re-running"
            ) from None
        yield
    finally:
        handle.close()
