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
:mod:`.verify_optimizer`; the clients' tied copies, as for a mean, against their partners within
the tolerance). PPO's global critics are audited the same way (``round <r> critic``). Exit
status 1 if any round is off by more than the tolerance or cannot be checked. A round whose client
checkpoints, previous global model (a LoRA source's base model: the global model its round started
from) or previous optimiser state the run record says it removed after its commit
(``storage.keep_client_checkpoints=false``, the default, or ``storage.keep_last_k``) is
reported as removed and not recomputed (one missing without that record fails; a global model still
there has its commit checked all the same); keep the client checkpoints to audit a run (that also
keeps every round's optimiser state). Retention notes what it is about to remove before it removes
it (a round entry's ``removing``, :mod:`.removal_note`), so a run killed between the removal and the
record that says so is not failed: an input that the note of a committed round lists (itself, or a
directory holding it) and that is gone counts as removed by the run, with the same words; one still
there is checked as usual. The note is read path by path, not per round and kind: another input of
that round missing, which no note lists (lost, deleted by hand), fails its round as any missing
input does (``checkpoint directory ... does not exist``), even when a noted file of the same round
is gone. The ``removed`` bytes per kind that the record gets once the removals are done keep their
meaning: a kind the round's entry says was removed is reported as removed.

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

#: (summary key of the aggregate, of its content hash, retention's label, the line's suffix)
_KINDS = (("aggregated_actor", "aggregated_sha256", "global_model", ""),
          ("aggregated_critic", "aggregated_critic_sha256", "global_critic", " critic"))


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
    parser = argparse.ArgumentParser(prog=program("python -m fedagent_flwr.checkpoint.verify"),
                                     description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory holding federated_summary.json")
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
    summary_path = args.run_dir / "federated_summary.json"
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"verify: cannot read {summary_path}: {exc}", file=sys.stderr)
        return 2
    ok = True
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
    by_round = {int(e["round"]): e for e in summary.get("rounds", [])}
    # noted for removal and gone: the run removed it (and was killed before recording it); only the
    # notes of committed rounds: a round that did not commit removed nothing (a resume drops its note).
    # Path by path: one noted file gone says nothing of the round's other files of its kind.
    committed = summary.get("last_completed_round")
    noting = [e for e in summary.get("rounds", []) if isinstance(committed, int) and int(e["round"]) <= committed]
    gone = noted_as_gone(noting, args.run_dir)

    def noted(path: Path) -> bool:
        return gone_by_note(path, args.run_dir, gone)

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
    for entry in sorted(summary.get("rounds", []), key=lambda e: int(e["round"])):
        previous = dict(latest)  # what this round stepped from: the latest earlier aggregate of each kind
        for path_key, hash_key, _, _ in _KINDS:
            if entry.get(path_key):
                latest[path_key] = (entry[path_key], entry.get(hash_key))
        if not entry.get("aggregated_actor"):
            print(f"round {entry['round']}: no aggregate (previous global model kept)")
            continue
        for path_key, hash_key, label, what in _KINDS:
            who = (f"clients {entry.get('client_actor_ids')}" if not what
                   else f"critics of {len(entry.get('client_critics', []))} clients")
            if entry.get(path_key):
                ok &= _audit(entry, Path(entry[path_key]), entry.get(hash_key), label, what, who,
                             args.run_dir.resolve(), check_hashes, args.tolerance, removed_by_run, noted,
                             summary, previous[path_key], args.allow_unhashed, digests)
    return 0 if ok else 1


def _audit(entry: dict[str, Any], global_dir: Path, committed: str | None, label: str, what: str, clients: str,
           run_root: Path, check_hashes: bool, tolerance: float, removed_by_run: Callable[[Path], bool],
           noted: Callable[[Path], bool], summary: dict[str, Any], previous: tuple[str, str | None] | None,
           allow_unhashed: bool, digests: AuditDigests) -> bool:
    """Audit one aggregate (the global model or PPO's critic) of one round, print one line; False
    when it fails. ``removed_by_run(path)``: the record says retention removed that global model or
    state; ``noted(path)``: a committed round's removal note lists that path (or a directory
    holding it) and it is gone (:mod:`.removal_note`)."""
    name = f"round {entry['round']}{what}"
    removed = entry.get("removed", {})
    if label in removed or noted(global_dir):
        print(f"{name}: {label.replace('_', ' ')} removed by the run (storage.keep_last_k); not checked")
        return True
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
            return True
        if header_of(global_dir / MODEL_FILE).get("fedagent.aggregation") in OPTIMIZER_RULES:
            return _audit_optimizer(entry, global_dir, name, clients, run_root, check_hashes, tolerance,
                                    removed_by_run, summary, previous, allow_unhashed, notes, digests)
        start = RoundStart(previous, summary.get("base_model"), removed_by_run)
        error = verify_round(global_dir, run_root, check_hashes, allow_unhashed, notes, digests, start)
    except InputRemoved as exc:  # a LoRA source's base model that retention removed
        print(f"{name}: {exc}; not checked")
        return True
    except CheckpointError as exc:
        print(f"{name}: cannot verify: {exc}")
        return False
    good = error <= tolerance
    remarks = "".join(f"; {text}" for text in notes)
    print(f"{name}: {clients} max abs error {error:.3e} {'ok' if good else 'ABOVE TOLERANCE'}{remarks}")
    return good


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
                     digests: AuditDigests) -> bool:
    """A server optimiser's round (:mod:`.verify_optimizer`), its commit already checked (its header
    is an input: the previous global model, the state's hash); one line, False when it fails."""
    try:
        audit = verify_optimizer_round(global_dir, run_root, int(entry["round"]), check_hashes, removed_by_run,
                                       tolerance=tolerance, base_model=summary.get("base_model"),
                                       base_model_sha256=summary.get("base_model_sha256"),
                                       expected_previous=previous, allow_unhashed=allow_unhashed, digests=digests)
    except InputRemoved as exc:
        print(f"{name}: {exc}; not checked")
        return True
    except CheckpointError as exc:
        print(f"{name}: cannot verify: {exc}")
        return False
    good = audit.within_bound and not audit.problems
    remarks = "".join(f"; {text}" for text in audit.problems + notes + audit.notes)
    # the error is judged per element against tolerance + its fp32 bound (verify_optimizer's docstring)
    print(f"{name}: {clients} {audit.rule} step {audit.step} max abs error {audit.error:.3e} (global model "
          f"{audit.global_error:.3e}, state {audit.state_error:.3e}), "
          f"{'within' if audit.within_bound else 'ABOVE TOLERANCE:'} tolerance + fp32 bound (worst {audit.ratio:.3g} "
          f"of it) {'ok' if good else 'FAILED'}{remarks}")
    return good


if __name__ == "__main__":
    raise SystemExit(main())
