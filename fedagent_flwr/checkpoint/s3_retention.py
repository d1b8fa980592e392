"""Retention in the bucket (``storage.kind=s3``): after each commit, this run's objects that nothing
reads any more are deleted, by the rules the run directory follows (:mod:`fedagent_flwr.serverapp.retention`).

What goes, under the run's own prefix ``<storage.url>/runs/<run id>/`` only (nothing outside it is
listed or deleted, so other runs and unrelated objects in the bucket are never touched):

- ``uploads/<round>/<client>/<kind>/``: the clients' uploads of committed rounds, unless
  ``storage.keep_client_checkpoints``. The server downloaded and checked them before the commit and
  never reads them again; a late upload (a client that missed its round) goes at the next commit.
- ``models/<model id>/``: shared global models (and PPO critics) that are not among the ``keep_last_k``
  newest aggregated ones, the base model included once a round has aggregated one; nothing when
  ``keep_last_k`` is 0. The newest aggregate always stays: the next round's clients fetch it. A
  resumed run needs nothing here: it starts from the run directory's copy of its last committed
  model and shares it again under its own run id (:mod:`fedagent_flwr.serverapp.resume`).

Order: the objects are grouped by slot or model, and each group's marker (``_commit-<sha256>.json``,
``_manifest-<sha256>.json``), which a reference pins and a reader reads first, is deleted before its
files, in a request of its own; a group's files go only once its marker is gone. A reference to a
half-deleted group therefore finds no marker ("does not exist"), never a marker whose files are
missing. Whatever fails (a policy without ``s3:DeleteObject``, the network) stays, is reported in
one line, and is listed and tried again at the next commit: the run goes on. After the last
commit nothing tries again: what stays then (a failed last release, an upload that arrived after
the last commit, a run stopped before committing its last round) is removed by hand or a lifecycle
rule.

A resumed run runs under a new Flower run id; its earlier attempts' prefixes ``runs/<earlier id>/``
(the exact ids its summary records, never a prefix match) are emptied by the same rules once, when
it starts (:func:`release_earlier_attempts`): every upload slot unless
``storage.keep_client_checkpoints``, every model the store shared unless ``keep_last_k`` is 0 (the
run directory keeps the models retention keeps; the new attempt shares again what it needs).
Objects there that the store does not lay out stay. What fails there is tried again by the next
resume of the run.

On a versioned bucket a delete only adds a delete marker: the bytes counted as freed stay as
noncurrent versions until a lifecycle rule expires them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedagent_flwr.checkpoint.s3_store import FILES_DIR, from_s3_client
from fedagent_flwr.checkpoint.store import Release, Released

_BATCH = 1000  # keys one DeleteObjects request takes (S3's limit)
_MARKERS = ("_manifest-", "_commit-")  # s3_store.marker_object's names
_ROUND_MODEL = re.compile(r"round_(\d+)/(global|global_critic)")
_KIND_LABEL = {"actor": "global_model", "critic": "global_critic"}  # retention's kinds
_EXTERNAL_MODEL = re.compile(r"external/[0-9a-f]{16}")  # s3_store's id of a model outside the run root
_NEXT_COMMIT = "the next commit tries again (the run goes on; after the last round, nothing does)"
_NEXT_RESUME = "the next resume of this run tries again (the run goes on)"


@dataclass
class _Group:
    """A client's upload slot or a shared model: the objects deleted together, marker first."""

    key: str
    server_round: int  # the summary entry the bytes are noted in
    label: str  # retention's kind: client_checkpoints, global_model, global_critic
    objects: dict[str, int] = field(default_factory=dict)  # key -> bytes

    def markers(self) -> list[str]:
        return [key for key in self.objects if key.rpartition("/")[2].startswith(_MARKERS)]


def release_bucket(fs: Any, run_key: str, plan: Release, models: Mapping[str, tuple[Path, str]],
                   run_root: Path) -> tuple[Released, list[str], list[str]]:
    """Delete what ``plan`` no longer needs under ``run_key`` (``bucket/prefix/runs/<run>``); return what
    was removed, the model ids that went (the store forgets them) and those whose marker may have
    gone (all the models sent for deletion: a request that raises may still have deleted them, so
    the store drops its references to them and shares them again if asked). ``models``: model id ->
    (local directory, checkpoint kind) of the models this store shared. Never raises."""
    released = Released(where=f"s3://{run_key}/")
    gone: list[str] = []
    stale: list[str] = []
    doing = "list"
    try:
        groups = []
        if plan.client_uploads:
            groups += _upload_groups(_sizes(fs, f"{run_key}/uploads"), f"{run_key}/uploads", plan.committed_round)
        if plan.keep_models is not None:
            keep, last = plan.keep_models, plan.committed_round
            groups += _model_groups(_sizes(fs, f"{run_key}/models"), f"{run_key}/models",
                                    lambda model_id: _model_fate(model_id, keep, models, run_root, last))
        doing = "delete"
        stale += [group.key[len(f"{run_key}/models/"):] for group in groups if group.label != "client_checkpoints"]
        _delete_groups(fs, run_key, groups, released, gone, _NEXT_COMMIT)
    except Exception as exc:  # noqa: BLE001 -- the run goes on whatever the bucket answers
        released.failure = _failed(run_key, doing, exc, _NEXT_COMMIT)
    fs.invalidate_cache()  # no listing of deleted objects survives in s3fs's cache
    return released, gone, stale


def release_earlier_attempts(fs: Any, base: str, run_keys: Sequence[str], client_uploads: bool,
                             models: bool) -> Released:
    """Delete the objects of a resumed run's earlier attempts, each under its own
    ``base/runs/<run key>/`` only: every upload slot (``client_uploads``: the attempt is over, and
    the rounds it did not commit are run again under the new run id) and every shared model
    (``models``: the run directory keeps the models ``keep_last_k`` keeps, and the new attempt shares
    again what it needs). The caller passes the exact run keys (:meth:`S3ServerStore.release_earlier`).
    Bytes are noted under the round of each upload or aggregate (0: the base model or an initial
    critic). Never raises; the first failure is :attr:`Released.failure`."""
    released = Released(where=", ".join(f"s3://{base}/runs/{key}/" for key in run_keys))
    for key in run_keys:
        run_key = f"{base}/runs/{key}"
        doing = "list"
        try:
            groups = []
            if client_uploads:
                groups += _upload_groups(_sizes(fs, f"{run_key}/uploads"), f"{run_key}/uploads", None)
            if models:
                groups += _model_groups(_sizes(fs, f"{run_key}/models"), f"{run_key}/models", _earlier_fate)
            doing = "delete"
            _delete_groups(fs, run_key, groups, released, [], _NEXT_RESUME)
        except Exception as exc:  # noqa: BLE001 -- the run goes on whatever the bucket answers
            released.failure = released.failure or _failed(run_key, doing, exc, _NEXT_RESUME)
    fs.invalidate_cache()
    return released


def _delete_groups(fs: Any, run_key: str, groups: list[_Group], released: Released, gone: list[str],
                   retry: str) -> None:
    """Delete ``groups``, every marker first (one pass), then each group's files; note what went in
    ``released`` and the model ids whose marker went in ``gone``. A request that raises ends the pass."""
    failed = _delete(fs, [key for group in groups for key in group.markers()])
    # A group whose marker went is unreadable from here on, whatever happens to its files: its
    # model is forgotten (shared again, it is uploaded again) and its marker counted before any
    # file request, which may raise and end this pass (its files are found again next time).
    going = [group for group in groups if not any(key in failed for key in group.markers())]
    gone += [group.key[len(f"{run_key}/models/"):] for group in going if group.label != "client_checkpoints"]
    for group in going:
        _note(released, group, group.markers())
    for group in going:
        files = [key for key in group.objects if key not in group.markers()]
        missed = _delete(fs, files)
        failed.update(missed)
        _note(released, group, [key for key in files if key not in missed])
    if failed:
        released.failure = released.failure or _advice(
            run_key, f"could not delete {len(failed)} object(s)", next(iter(failed.values())), retry)


def _failed(run_key: str, doing: str, exc: Exception, retry: str) -> str:
    what = "could not list the run's objects" if doing == "list" else "deleting the run's objects failed"
    origin = "" if from_s3_client(exc) or isinstance(exc, OSError) else " (not an S3 error: please report it)"
    return _advice(run_key, what, f"{type(exc).__name__}: {str(exc)[:200]}{origin}", retry)


def _note(released: Released, group: _Group, keys: list[str]) -> None:
    """Count ``keys`` of ``group`` as removed, in the summary entry of the group's round."""
    for key in keys:
        kinds = released.removed.setdefault(group.server_round, {})
        kinds[group.label] = kinds.get(group.label, 0) + group.objects[key]
        released.objects[group.server_round] = released.objects.get(group.server_round, 0) + 1


def _advice(run_key: str, what: str, reason: str, retry: str) -> str:
    bucket, _, prefix = run_key.partition("/")
    # IAM: ListBucket is granted on the bucket (narrowed by an s3:prefix condition), DeleteObject on
    # the objects' ARNs; a ListBucket on "bucket/prefix/*" would never match a listing.
    return (f"{what} in s3://{run_key}/ ({reason}); they stay there and {retry}: "
            "the ServerApp's credentials need s3:ListBucket on "
            f"arn:aws:s3:::{bucket} (condition s3:prefix \"{prefix}/*\") and s3:DeleteObject on "
            f"arn:aws:s3:::{run_key}/* (an IAM or bucket policy without DeleteObject keeps every checkpoint in "
            f"the bucket), or remove them yourself after the run (aws s3 rm --recursive s3://{run_key}/) or "
            "with a lifecycle rule")


def _sizes(fs: Any, prefix: str) -> dict[str, int]:
    """Every object under ``prefix/`` and its size, listed afresh (s3fs caches listings)."""
    fs.invalidate_cache()
    try:
        found = fs.find(prefix, detail=True)
    except FileNotFoundError:
        return {}
    return {key: int(info.get("size") or 0) for key, info in found.items()
            if info.get("type") != "directory" and key.startswith(f"{prefix}/")}  # never a sibling's


def _upload_groups(objects: dict[str, int], uploads: str, committed_round: int | None) -> list[_Group]:
    """``uploads/<round>/<client>/<kind>/`` slots of rounds up to ``committed_round`` (None: of every round)."""
    groups: dict[str, _Group] = {}
    for key, size in objects.items():
        parts = key[len(uploads) + 1:].split("/")
        if len(parts) < 4 or not parts[0].isdigit() or (committed_round is not None
                                                         and int(parts[0]) > committed_round):
            continue  # a later round's (in progress), or nothing the store writes
        slot = "/".join((uploads, *parts[:3]))
        groups.setdefault(slot, _Group(slot, int(parts[0]), "client_checkpoints")).objects[key] = size
    return list(groups.values())


def _model_groups(objects: dict[str, int], prefix: str,
                  fate: Callable[[str], tuple[int, str] | None]) -> list[_Group]:
    """Shared models (``models/<model id>/``, the id possibly of several segments) whose ``fate``
    (model id -> ``(round noted, kind label)``, or None: kept) lets them go."""
    groups: dict[str, _Group] = {}
    for key, size in objects.items():
        parts = key[len(prefix) + 1:].split("/")
        ends = [i for i, part in enumerate(parts) if part == FILES_DIR or part.startswith(_MARKERS)]
        if not ends or ends[0] == 0:
            continue  # not laid out by the store: left alone
        model_id = "/".join(parts[:ends[0]])
        if model_id not in groups:
            going = fate(model_id)
            if going is None:
                groups[model_id] = _Group("", 0, "")  # kept
                continue
            groups[model_id] = _Group(f"{prefix}/{model_id}", *going)
        if groups[model_id].key:
            groups[model_id].objects[key] = size
    return [group for group in groups.values() if group.key]


def _model_fate(model_id: str, keep: Mapping[str, frozenset[Path]], models: Mapping[str, tuple[Path, str]],
                run_root: Path, committed_round: int) -> tuple[int, str] | None:
    """``(round noted, kind label)`` when the model may go; None when it stays (kept, of a kind
    without an aggregate yet, of a round not committed yet, or a model this store cannot place)."""
    match = _ROUND_MODEL.fullmatch(model_id)
    if match and int(match.group(1)) > committed_round:
        return None
    if match:  # an aggregate: its kind is where the aggregation wrote it
        directory, kind = run_root / model_id, "actor" if match.group(2) == "global" else "critic"
    elif model_id in models:  # the base model (or an initial critic), outside the run root
        directory, kind = models[model_id]
    else:
        return None
    kept = keep.get(kind)
    if kept is None or kind not in _KIND_LABEL or directory.resolve() in {path.resolve() for path in kept}:
        return None
    return (int(match.group(1)) if match else committed_round), _KIND_LABEL[kind]


def _earlier_fate(model_id: str) -> tuple[int, str] | None:
    """An earlier attempt's shared model goes if the store named it: an aggregate (noted under its
    round) or a model from outside the run root (the base model or an initial critic, noted as a
    global model under round 0); anything else under ``models/`` stays."""
    match = _ROUND_MODEL.fullmatch(model_id)
    if match:
        return int(match.group(1)), "global_model" if match.group(2) == "global" else "global_critic"
    return (0, "global_model") if _EXTERNAL_MODEL.fullmatch(model_id) else None


def _delete(fs: Any, keys: list[str]) -> dict[str, str]:
    """Delete ``keys`` (``bucket/key``) in DeleteObjects requests; return the keys not deleted and why.
    s3fs's own ``rm`` drops the per-key errors of such a request, so it is called directly."""
    failed: dict[str, str] = {}
    for start in range(0, len(keys), _BATCH):
        batch = keys[start:start + _BATCH]
        bucket = batch[0].split("/", 1)[0]
        answer = fs.call_s3("delete_objects", Bucket=bucket, Delete={
            "Objects": [{"Key": key.split("/", 1)[1]} for key in batch], "Quiet": True})
        for error in answer.get("Errors", []):
            failed[f"{bucket}/{error.get('Key')}"] = f"{error.get('Code')}: {error.get('Message')}"
    return failed
