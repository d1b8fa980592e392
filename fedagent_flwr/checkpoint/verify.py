"""Audit a finished (or running) federated run: recompute every round's aggregate.

    python -m fedagent_flwr.checkpoint.verify outputs/run-123 [--tolerance 1e-6] [--allow-unhashed]

Each global model records its sources (path, sha256, weight) in its safetensors header; this command
re-opens those client checkpoints (hashes checked), checks that the global model still has the
content hash its round committed in the run record (a change below the tolerance would pass the
recomputation), recomputes the weighted mean independently in float64 and prints the max abs error
per round. A round written by a server optimiser (``strategy=fedavgm``, ``fedadam``, ``fedyogi``,
``fedadagrad``) is recomputed from the clients' mean, the previous global model and the previous
optimiser state, all hash-checked, with Flower's formulas restated independently
(:mod:`.verify_optimizer`); both the new global model and the new state are compared (each weight
against the tolerance plus the bound of the strategy's fp32 rounding, which the step amplifies:
:mod:`.verify_optimizer`; the clients' tied copies, as for a mean, against their partners within the
tolerance). PPO's global critics are audited the same way (``round <r> critic``). Exit status 1 if
any round is off by more than the tolerance or cannot be checked, and also when nothing was checked
at all (no round recorded, as in a run that stopped before its first round; no aggregate; every one
removed by the run) or the record lacks an entry for a round its ``last_completed_round`` says was
completed: an audit that checked nothing must not pass. Exit status 2, with one line naming the file
and the key, when the argument is not a run directory (or its ``federated_summary.json``, whose
folder is then the run directory) or the record is not one as the ServerApp writes it (a key of
another type; a round number below 1, or one that two entries record: which of them the round
committed cannot be told, and the audit could pass). A round whose
client checkpoints, previous global model (a LoRA source's base model: the global model its round
started from) or previous optimiser state the run record says it removed after its commit
(``storage.keep_client_checkpoints=false``, the default, or ``storage.keep_last_k``) is reported as
removed and not recomputed (one missing without that record fails; a global model still there has
its commit checked all the same); keep the client checkpoints to audit a run (that also keeps every
round's optimiser state). Retention notes what it is about to remove before it removes it (a round
entry's ``removing``, :mod:`.removal_note`), so a run killed between the removal and the record that
says so is not failed: an input that the note of a committed round lists (itself, or a directory
holding it) and that is gone counts as removed by the run, with the same words; one still there is
checked as usual. The note is read path by path, not per round and kind: another input of that round
missing, which no note lists (lost, deleted by hand), fails its round as any missing input does
(``checkpoint directory ... does not exist``), even when a noted file of the same round is gone. The
``removed`` bytes per kind that the record gets once the removals are done keep their meaning: a
kind the round's entry says was removed is reported as removed.

Hashes are part of the audit: a run record whose ``content_hash`` is not the one this fedagent-flwr
computes (``v1``, or no field: runs recorded before content hash v2), whose hashes therefore cannot
be compared, fails with one line naming the record, and so does a round whose global model records
no hash of its optimiser state (``fedagent.state_sha256``), or any other hash the run should have
recorded (a source's that the header leaves empty, an empty committed hash of a round's global model
or critic, or of the aggregate an optimiser's round stepped from, the previous global model's that
its header leaves empty, a missing ``base_model_sha256`` where a round steps from the base model:
:mod:`.audit_hashes`). Each file is hashed once per audit (:mod:`.audit_digests`): a round's global
model and state are the next round's inputs, and a source's hash is checked at its reference and
again at its opening; the digest is reused only while the file's stat is unchanged, and a source
checked at opening (with reused digests or hashed) has its files' stat checked again once its round
has been read (a file changed while the audit read it fails the round: ``changed while it was read``).
``--allow-unhashed`` accepts a run that predates them: the hashes that cannot be compared are
skipped with a note, and the rounds are still recomputed from the files as they are (a change to a
file then shows only where it moves a value beyond its bound). A NaN or Inf in anything a round's
audit reads or computes fails the round, naming the file and the tensor (NaN compares false with
every bound and would otherwise pass).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

from fedagent_flwr.checkpoint.audit_digests import AuditDigests
from fedagent_flwr.checkpoint.audit_hashes import unhashed
from fedagent_flwr.checkpoint.audit_sources import RoundStart, open_recorded_source
from fedagent_flwr.checkpoint.content_hash import CONTENT_HASH_VERSION
from fedagent_flwr.checkpoint.hf_files import MODEL_FILE
from fedagent_flwr.checkpoint.mean_audit import verify_mean
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef
from fedagent_flwr.checkpoint.removal_note import gone_by_note, noted_as_gone
from fedagent_flwr.checkpoint.safetensors_file import SafetensorsFile
from fedagent_flwr.checkpoint.verify_optimizer import (
    OPTIMIZER_RULES,
    InputRemoved,
    header_of,
    verify_optimizer_round,
)
from fedagent_flwr.cli import program
from fedagent_flwr.outcome import SUMMARY_FILE, json_kind

#: (summary key of the aggregate, of its content hash, retention's label, the line's suffix)
_KINDS = (("aggregated_actor", "aggregated_sha256", "global_model", ""),
          ("aggregated_critic", "aggregated_critic_sha256", "global_critic", " critic"))

#: The end of every refusal of a record that is not as the ServerApp writes it: what to do.
_NOT_A_RECORD = ("not a run record as the ServerApp writes it; give the run directory holding the run's own "
                 f"{SUMMARY_FILE}")
_STR_OR_NULL = (str, type(None))
#: How a refusal names each type a key may have, in JSON's words (the record is JSON).
_WANTED: dict[type, str] = {list: "an array", dict: "an object", str: "a string", int: "an integer",
                            type(None): "null"}
#: The keys of the record this audit reads, with the JSON types it can read them as (a key may be absent).
_RECORD_KEYS: dict[str, tuple[type, ...]] = {
    "rounds": (list,), "last_completed_round": (int, type(None)), "content_hash": (str,),
    "base_model": _STR_OR_NULL, "base_model_sha256": _STR_OR_NULL}
#: The same for each round entry (``round`` is required and checked apart).
_ENTRY_KEYS: dict[str, tuple[type, ...]] = {
    "aggregated_actor": _STR_OR_NULL, "aggregated_sha256": _STR_OR_NULL, "aggregated_critic": _STR_OR_NULL,
    "aggregated_critic_sha256": _STR_OR_NULL, "removed": (dict,), "removing": (list, type(None)),
    "client_critics": (list, type(None))}


class BadRecord(Exception):
    """The run record cannot be audited as given (a path that is no run, a record that is not one):
    one line naming the file, the key and what to do; exit status 2, as for an unreadable record."""


class _Result(Enum):
    """What the audit of one aggregate came to; a run whose audit checked nothing must not pass."""

    FAILED = "failed"
    CHECKED = "checked"  # passed, having verified something: the recomputation, or the commit's hash
    UNCHECKED = "unchecked"  # passed only in that the run removed (or never hashed) what would be checked


def recorded_sources(global_dir: Path, rules: tuple[str, ...] = ("weighted_mean",)) -> list[dict[str, Any]]:
    """The (path, sha256, weight) list written into an aggregate's safetensors header, refused
    (CheckpointError) when a rule other than ``rules`` wrote it."""
    with SafetensorsFile(global_dir / MODEL_FILE) as handle:
        metadata = handle.metadata()
    if "fedagent.sources" not in metadata:
        raise CheckpointError(f"{global_dir / MODEL_FILE} records no sources (not written by weighted_mean)")
    rule = metadata.get("fedagent.aggregation", "weighted_mean")
    if rule not in rules:
        # A strategy's own rule (aggregate_by_key): a weighted mean would not be expected to match.
        raise CheckpointError(f"{global_dir / MODEL_FILE} was written by the rule {rule!r}; this audit "
                              f"recomputes weighted means and the server optimisers {list(OPTIMIZER_RULES)} only")
    return list(json.loads(metadata["fedagent.sources"]))


def verify_round(global_dir: Path, run_root: Path, check_hashes: bool = True, allow_unhashed: bool = False,
                 notes: list[str] | None = None, digests: AuditDigests | None = None,
                 start: RoundStart | None = None) -> float:
    """Max abs error of one aggregate against its recorded sources, hash-checked unless
    ``check_hashes`` is False (a run recorded with another content-hash version); a source whose
    hash the header does not record fails unless ``allow_unhashed``, which appends a note to
    ``notes`` (:func:`.audit_hashes.unhashed`). ``digests``: the audit's, so that each file is
    hashed once (:mod:`.audit_digests`; None: this round's own). ``start``: the run record's starting
    model of the round, which a LoRA source's base must be (inside the run or its base model, the
    committed content); one the run removed raises InputRemoved (the round is not checked) instead
    of CheckpointError (:class:`.audit_sources.RoundStart`; None: not checked)."""
    digests = digests or AuditDigests()
    sources = []
    try:
        for source in recorded_sources(global_dir):
            sources.append((open_recorded_source(source, global_dir / MODEL_FILE, run_root, check_hashes,
                                                 allow_unhashed, [] if notes is None else notes, digests,
                                                 start),
                            float(source["weight"])))
        return verify_mean(sources, global_dir, digests)
    finally:
        for reader, _ in sources:
            reader.close()


def main(argv: list[str] | None = None) -> int:
    """The ``verify`` command: audit every recorded round of a run, one line per aggregate; exit 0
    when every round passed and at least one was checked, 1 when one failed or none was checked (or
    rounds the record says were completed have no entry), 2 when the run record cannot be read (or
    is not one as the ServerApp writes it: :func:`read_record`)."""
    parser = argparse.ArgumentParser(prog=program("python -m fedagent_flwr.checkpoint.verify"),
                                     description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help=f"a run directory holding {SUMMARY_FILE} (or that file itself)")
    parser.add_argument("--tolerance", type=float, default=1e-6)
    parser.add_argument("--allow-unhashed", action="store_true",
                        help="audit a run recorded before content hashes: each hash that cannot be compared is "
                             "skipped with a note instead of failing the round: a run record of content hash v1 or "
                             "without content_hash, a source's empty sha256, an empty committed hash (of a round's "
                             "global model or critic, or of the aggregate a round stepped from), an empty "
                             "previous-global hash, a missing base_model_sha256, a missing or empty optimiser "
                             "state hash (fedagent.state_sha256)")
    args = parser.parse_args(argv)
    if not args.tolerance >= 0:
        parser.error(f"--tolerance must be >= 0, got {args.tolerance}")
    try:
        run_dir, summary_path = locate_record(args.run_dir)
        summary = read_record(summary_path)
    except BadRecord as exc:
        print(f"verify: {exc}", file=sys.stderr)
        return 2
    hashed_as = summary.get("content_hash", "v1")  # records before the field hashed as v1
    check_hashes = hashed_as == CONTENT_HASH_VERSION
    if not check_hashes and not args.allow_unhashed:
        recorded = hashed_as if "content_hash" in summary else f"{hashed_as} (no content_hash field)"
        print(f"verify: {summary_path} records checkpoint content hashes {recorded} and this fedagent-flwr computes "
              f"{CONTENT_HASH_VERSION}, so no hash can be checked; pass --allow-unhashed if the run predates content "
              f"hashes {CONTENT_HASH_VERSION} (the rounds are then recomputed without them)", file=sys.stderr)
        return 1
    if not check_hashes:
        print(f"note: this run recorded checkpoint content hashes {hashed_as} and this fedagent-flwr computes "
              f"{CONTENT_HASH_VERSION}: the sources' hashes are not compared, only the means are recomputed")
    rounds: list[dict[str, Any]] = summary["rounds"]
    by_round = {e["round"]: e for e in rounds}
    # noted for removal and gone: the run removed it (and was killed before recording it); only the
    # notes of committed rounds: a round that did not commit removed nothing (a resume drops its note).
    # Path by path: one noted file gone says nothing of the round's other files of its kind.
    committed = summary.get("last_completed_round")
    noting = [e for e in rounds if isinstance(committed, int) and e["round"] <= committed]
    gone = noted_as_gone(noting, run_dir)

    def noted(path: Path) -> bool:
        return gone_by_note(path, run_dir, gone)

    def removed_by_run(path: Path) -> bool:
        # retention records a global model or state it removed in the entry of the round that wrote it
        is_state = path.parent.name == "server_optimizer"
        match = (path.parent.parent if is_state else path.parent).name.removeprefix("round_")
        entry = by_round.get(int(match)) if match.isdigit() else None
        kind = "server_optimizer_state" if is_state else {"global": "global_model"}.get(path.name, path.name)
        return (entry is not None and kind in entry.get("removed", {})) or noted(path)

    digests = AuditDigests()  # each file hashed once: a round's global model is the next one's input
    latest: dict[str, tuple[str, str | None] | None] = {
        "aggregated_actor": (summary.get("base_model", ""), summary.get("base_model_sha256")),
        "aggregated_critic": None}  # the first critic is a mean: no optimiser round steps from nothing
    results: list[_Result] = []
    for entry in sorted(rounds, key=lambda e: int(e["round"])):
        previous = dict(latest)  # what this round stepped from: the latest earlier aggregate of each kind
        for path_key, hash_key, _, _ in _KINDS:
            if entry.get(path_key):
                latest[path_key] = (entry[path_key], entry.get(hash_key))
        if not entry.get("aggregated_actor"):
            print(f"round {entry['round']}: no aggregate (previous global model kept)")
            continue
        for path_key, hash_key, label, what in _KINDS:
            who = (f"clients {entry.get('client_actor_ids')}" if not what
                   else f"critics of {len(entry.get('client_critics') or [])} clients")
            if entry.get(path_key):
                results.append(_audit(entry, Path(entry[path_key]), entry.get(hash_key), label, what, who,
                                      run_dir.resolve(), check_hashes, args.tolerance, removed_by_run, noted,
                                      summary, previous[path_key], args.allow_unhashed, digests))
    if problem := unaudited(summary, summary_path, results):
        print(f"verify: {problem}", file=sys.stderr)
        return 1
    return 1 if _Result.FAILED in results else 0


def locate_record(given: Path) -> tuple[Path, Path]:
    """The run directory and its record for the audit's argument: a run directory, or its
    ``federated_summary.json`` itself (the run directory is then the file's folder, where the audit
    would have looked for it; the record's removal notes are relative to that folder). Any other file
    is refused (a summary copied elsewhere, as ``docs/gpu-runs`` keeps them: its folder is not its run
    directory), as is a path that does not exist or holds no record (BadRecord)."""
    if given.is_file():
        if given.name != SUMMARY_FILE:
            raise BadRecord(f"{given} is a file, not a run directory: the audit reads a run's {SUMMARY_FILE} beside "
                            "the checkpoints its rounds wrote; give the run directory that holds them")
        return given.parent, given
    if not given.exists():
        raise BadRecord(f"{given} does not exist; give a run directory holding {SUMMARY_FILE}")
    if not given.is_dir():  # a socket, a device: neither a run directory nor a record
        raise BadRecord(f"{given} is neither a run directory nor a file; give a run directory holding {SUMMARY_FILE}")
    summary_path = given / SUMMARY_FILE
    if not summary_path.exists():
        raise BadRecord(f"{summary_path} does not exist: {given} is not a run directory (or its run wrote no record); "
                        f"give a run directory holding {SUMMARY_FILE}")
    return given, summary_path


def read_record(summary_path: Path) -> dict[str, Any]:
    """The run record at ``summary_path``, with every key this audit reads of the type it reads it
    as, and each round numbered from 1 and listed once: BadRecord naming the file and the key (and
    the round) otherwise, so that a damaged or hand-edited record is refused in one line instead of
    failing deep in the audit with a Python error, or passing where nothing can be told: each entry
    of a round listed twice would be audited (its removals looked up in the last), whichever one the
    run committed."""
    try:
        summary = json.loads(summary_path.read_text())
    except OSError as exc:
        raise BadRecord(f"cannot read {summary_path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # not JSON (a torn or hand-edited file), or not UTF-8
        raise BadRecord(f"cannot read {summary_path}: not JSON ({exc}); {_NOT_A_RECORD}") from None
    if not isinstance(summary, dict):
        raise BadRecord(f"{summary_path} holds a JSON {json_kind(summary)}, not an object: {_NOT_A_RECORD}")
    if "rounds" not in summary:  # the ServerApp writes it (empty) before its first round
        raise BadRecord(f"{summary_path} lacks key 'rounds', so no round can be audited: {_NOT_A_RECORD}")
    _check_types(summary, _RECORD_KEYS, f"{summary_path}: key", summary_path)
    entry_of: dict[int, int] = {}  # each round number: the index of the entry that records it
    for index, entry in enumerate(summary["rounds"]):
        where = f"{summary_path}: rounds[{index}]"
        if not isinstance(entry, dict):
            raise BadRecord(f"{where} is a JSON {json_kind(entry)}, not an object: {_NOT_A_RECORD}")
        if "round" not in entry:
            raise BadRecord(f"{where} lacks key 'round' (the round's number): {_NOT_A_RECORD}")
        _check_types(entry, {"round": (int,), **_ENTRY_KEYS}, f"{where} key", summary_path)
        number = entry["round"]
        if number < 1:  # round 0 (the base model's evaluation) has no entry: the ServerApp's rounds count from 1
            raise BadRecord(f"{where} key 'round' is {number}, not a positive integer (the ServerApp numbers rounds "
                            f"from 1): {_NOT_A_RECORD}")
        if number in entry_of:  # each entry would be audited, and pass, whichever one the round committed
            raise BadRecord(f"{where} key 'round' repeats round {number} of rounds[{entry_of[number]}] (the ServerApp "
                            f"records a round once: which entry its commit wrote cannot be told): {_NOT_A_RECORD}")
        entry_of[number] = index
        for item in entry.get("removing") or []:
            if not isinstance(item, dict) or not isinstance(item.get("path"), str):
                raise BadRecord(f"{where} key 'removing' lists {json.dumps(item)[:80]}, not an object with a "
                                f"string 'path': {_NOT_A_RECORD}")
    return summary


def _check_types(record: dict[str, Any], keys: dict[str, tuple[type, ...]], where: str, summary_path: Path) -> None:
    """BadRecord for the first of ``keys`` that ``record`` holds as another JSON type than listed
    (``where``: how the message names the place, ending before the key)."""
    for key, types in keys.items():
        if key not in record:
            continue
        value = record[key]
        # a JSON true or false is a Python bool, which is an int: never a round number
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            wanted = " or ".join(_WANTED[kind] for kind in types)
            raise BadRecord(f"{where} {key!r} is a JSON {json_kind(value)}, not {wanted}: {_NOT_A_RECORD}")


def unaudited(summary: dict[str, Any], summary_path: Path, results: list[_Result]) -> str | None:
    """Why the audit must fail although no round it checked failed, or None: the record says rounds
    were completed that it has no entry for (a truncated or edited record: those rounds cannot be
    audited), or nothing at all was checked (no aggregate, or every one removed by the run or never
    hashed), which must not read as a passed audit."""
    completed = summary.get("last_completed_round") or 0
    missing = _gaps({entry["round"] for entry in summary["rounds"]}, completed)
    if missing:
        return (f"{summary_path} says {completed} round(s) were completed (last_completed_round) but 'rounds' has no "
                f"entry for round(s) {missing}, so they cannot be audited: the record was truncated or edited; "
                f"audit the run's own {SUMMARY_FILE}")
    if _Result.CHECKED in results or _Result.FAILED in results:
        return None
    if not summary["rounds"]:
        # A run that stopped before its first round (refused at start, every client failed in round 1)
        # records "rounds": [] and last_completed_round null, or 0 once the base model's evaluation is
        # committed. It has no aggregate to audit; the audit says so and fails rather than exit 0, so
        # that a script gating on it does not read "verified" for a run that produced nothing. Why the
        # run stopped is `fedagent outcome status`'s to say.
        recorded = (f"last_completed_round {json.dumps(summary.get('last_completed_round'))}, "
                    f"status {json.dumps(summary.get('status'))}")
        return (f"nothing to audit: {summary_path} records no round ({recorded}): the run aggregated nothing, so "
                "nothing was checked; `fedagent outcome status` says why the run ended")
    if not results:
        return (f"nothing was checked: no round {summary_path} records has an aggregate (each kept the previous "
                "global model), so there is nothing to recompute")
    return (f"nothing was checked: every aggregate {summary_path} records was removed by the run or its hashes were "
            "not recorded (the lines above); keep the client checkpoints (storage.keep_client_checkpoints=true) "
            "to audit a run")


def _gaps(recorded: set[int], completed: int) -> str:
    """The rounds 1..``completed`` missing from ``recorded``, as ``1-3, 5`` (empty: none), from the
    gaps between the recorded ones: a hand-edited ``last_completed_round`` may be huge."""
    spans, expected = [], 1
    for number in sorted(r for r in recorded if 1 <= r <= completed) + [completed + 1]:
        if number > expected:
            spans.append(str(expected) if number - 1 == expected else f"{expected}-{number - 1}")
        expected = number + 1
    return ", ".join(spans)


def _audit(entry: dict[str, Any], global_dir: Path, committed: str | None, label: str, what: str, clients: str,
           run_root: Path, check_hashes: bool, tolerance: float, removed_by_run: Callable[[Path], bool],
           noted: Callable[[Path], bool], summary: dict[str, Any], previous: tuple[str, str | None] | None,
           allow_unhashed: bool, digests: AuditDigests) -> _Result:
    """Audit one aggregate (the global model or PPO's critic) of one round, print one line; whether
    it failed, passed having checked something, or passed with nothing checked (what it would check
    was removed by the run). ``removed_by_run(path)``: the record says retention removed that global model or
    state; ``noted(path)``: a committed round's removal note lists that path (or a directory
    holding it) and it is gone (:mod:`.removal_note`)."""
    name = f"round {entry['round']}{what}"
    removed = entry.get("removed", {})
    if label in removed or noted(global_dir):
        print(f"{name}: {label.replace('_', ' ')} removed by the run (storage.keep_last_k); not checked")
        return _Result.UNCHECKED
    # the global model's commit is checked first: a round whose inputs the run removed has that checked at least
    commit_checked = _Result.CHECKED if check_hashes and committed else _Result.UNCHECKED
    try:
        notes: list[str] = []
        if check_hashes:  # first: a run that removed its client checkpoints still has its commits to check
            _check_commit(global_dir, committed, allow_unhashed, notes, digests)
        if "client_checkpoints" in removed or _sources_removed(global_dir, noted):
            recorded_sources(global_dir, ("weighted_mean", *OPTIMIZER_RULES))  # a rule this audit cannot check
            # is still reported
            kept = "content hash as committed; " if check_hashes and committed else ""
            remarks = "".join(f"; {text}" for text in notes)
            print(f"{name}: {kept}client checkpoints removed by the run after the round was committed "
                  f"(storage.keep_client_checkpoints=false); recomputation not checked{remarks}")
            return commit_checked
        if header_of(global_dir / MODEL_FILE).get("fedagent.aggregation") in OPTIMIZER_RULES:
            result = _audit_optimizer(entry, global_dir, name, clients, run_root, check_hashes, tolerance,
                                      removed_by_run, summary, previous, allow_unhashed, notes, digests)
            return commit_checked if result is _Result.UNCHECKED else result
        start = RoundStart(previous, summary.get("base_model"), removed_by_run)
        error = verify_round(global_dir, run_root, check_hashes, allow_unhashed, notes, digests, start)
    except InputRemoved as exc:  # a LoRA source's base model that retention removed
        print(f"{name}: {exc}; not checked")
        return commit_checked
    except CheckpointError as exc:
        print(f"{name}: cannot verify: {exc}")
        return _Result.FAILED
    good = error <= tolerance
    remarks = "".join(f"; {text}" for text in notes)
    print(f"{name}: {clients} max abs error {error:.3e} {'ok' if good else 'ABOVE TOLERANCE'}{remarks}")
    return _Result.CHECKED if good else _Result.FAILED


def _sources_removed(global_dir: Path, noted: Callable[[Path], bool]) -> bool:
    """Whether some of the client checkpoints that ``global_dir``'s header records as its sources
    are missing, each because the run removed it (``noted``: a committed round's removal note lists
    it, or a directory holding it, and that is gone); CheckpointError naming the first missing
    source that no note accounts for (lost, deleted by hand), whatever else of its round the run
    removed. A header this audit cannot read sources from is left to the checks that report it."""
    header = header_of(global_dir / MODEL_FILE)
    if header.get("fedagent.aggregation", "weighted_mean") not in ("weighted_mean", *OPTIMIZER_RULES):
        return False
    try:
        paths = [Path(source["path"]) for source in json.loads(header["fedagent.sources"])]
    except (KeyError, ValueError, TypeError):
        return False
    missing = [path for path in paths if not os.path.lexists(path)]
    for path in missing:
        if not noted(path):
            raise CheckpointError(f"checkpoint directory {path} does not exist (no removal by the run accounts for "
                                  "it: no removal note of a committed round lists it)")
    return bool(missing)


def _check_commit(global_dir: Path, committed: str | None, allow_unhashed: bool, notes: list[str],
                  digests: AuditDigests) -> None:
    """CheckpointError unless ``global_dir`` still has the content hash its round committed in the
    run record (one not recorded: :func:`.audit_hashes.unhashed`). Every round's: a change below the
    tolerance passes the recomputation, and a server optimiser's header is an input of its audit."""
    if not committed:
        unhashed(f"the run record has no content hash of {global_dir} (the round's commit)", allow_unhashed, notes)
    elif CheckpointRef.for_directory(global_dir, hasher=digests.directory_hash).sha256 != committed:
        raise CheckpointError(f"{global_dir} changed since its round was committed (content hash differs from the "
                              "run record)")


def _audit_optimizer(entry: dict[str, Any], global_dir: Path, name: str, clients: str, run_root: Path,
                     check_hashes: bool, tolerance: float, removed_by_run: Any, summary: dict[str, Any],
                     previous: tuple[str, str | None] | None, allow_unhashed: bool, notes: list[str],
                     digests: AuditDigests) -> _Result:
    """A server optimiser's round (:mod:`.verify_optimizer`), its commit already checked (its header
    is an input: the previous global model, the state's hash); one line, and what it came to
    (UNCHECKED: an input the run removed, the round not recomputed)."""
    try:
        audit = verify_optimizer_round(global_dir, run_root, entry["round"], check_hashes, removed_by_run,
                                       tolerance=tolerance, base_model=summary.get("base_model"),
                                       base_model_sha256=summary.get("base_model_sha256"),
                                       expected_previous=previous, allow_unhashed=allow_unhashed, digests=digests)
    except InputRemoved as exc:
        print(f"{name}: {exc}; not checked")
        return _Result.UNCHECKED
    except CheckpointError as exc:
        print(f"{name}: cannot verify: {exc}")
        return _Result.FAILED
    good = audit.within_bound and not audit.problems
    remarks = "".join(f"; {text}" for text in audit.problems + notes + audit.notes)
    # the error is judged per element against tolerance + its fp32 bound (verify_optimizer's docstring)
    print(f"{name}: {clients} {audit.rule} step {audit.step} max abs error {audit.error:.3e} (global model "
          f"{audit.global_error:.3e}, state {audit.state_error:.3e}), "
          f"{'within' if audit.within_bound else 'ABOVE TOLERANCE:'} tolerance + fp32 bound (worst {audit.ratio:.3g} "
          f"of it) {'ok' if good else 'FAILED'}{remarks}")
    return _Result.CHECKED if good else _Result.FAILED


if __name__ == "__main__":
    raise SystemExit(main())
