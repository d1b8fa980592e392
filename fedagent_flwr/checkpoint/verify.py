"""Audit a finished (or running) federated run: recompute every round's aggregate.

    python -m fedagent_flwr.checkpoint.verify outputs/run-123 [--tolerance 1e-6]

Each global model records its sources (path, sha256, weight) in its safetensors header; this
command re-opens those client checkpoints (hashes checked), recomputes the weighted mean
independently in float64 and prints the max abs error per round. Exit status 1 if any round is
off by more than the tolerance or cannot be checked. A round whose client checkpoints (or global
model) the run removed after its commit (``storage.keep_client_checkpoints=false``, the default,
or ``storage.keep_last_k``) is reported as removed and not checked; keep the client checkpoints to
audit a run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from safetensors import safe_open

from fedagent_flwr.checkpoint.content_hash import CONTENT_HASH_VERSION
from fedagent_flwr.checkpoint.hf_files import MODEL_FILE
from fedagent_flwr.checkpoint.key_checks import verify_mean
from fedagent_flwr.checkpoint.open_ref import open_checkpoint
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointRef


def recorded_sources(global_dir: Path) -> list[dict[str, Any]]:
    """The (path, sha256, weight) list written into an aggregate's safetensors header."""
    with safe_open(str(global_dir / MODEL_FILE), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if "fedagent.sources" not in metadata:
        raise CheckpointError(f"{global_dir / MODEL_FILE} records no sources (not written by weighted_mean)")
    rule = metadata.get("fedagent.aggregation", "weighted_mean")
    if rule != "weighted_mean":
        # A strategy's own rule (aggregate_by_key): a weighted mean would not be expected to match.
        raise CheckpointError(f"{global_dir / MODEL_FILE} was written by the rule {rule!r}; this audit "
                              "recomputes weighted means only")
    return list(json.loads(metadata["fedagent.sources"]))


def verify_round(global_dir: Path, run_root: Path, check_hashes: bool = True) -> float:
    """Max abs error of one aggregate against its recorded sources, hash-checked unless
    ``check_hashes`` is False (a run recorded with another content-hash version)."""
    sources = []
    try:
        for source in recorded_sources(global_dir):
            ref = CheckpointRef.for_directory(source["path"])
            if check_hashes and source["sha256"] and ref.sha256 != source["sha256"]:
                raise CheckpointError(f"{source['path']} changed since it was aggregated (hash differs)")
            sources.append((open_checkpoint(ref, root=run_root), float(source["weight"])))
        return verify_mean(sources, global_dir)
    finally:
        for reader, _ in sources:
            reader.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedagent_flwr.checkpoint.verify",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory holding federated_summary.json")
    parser.add_argument("--tolerance", type=float, default=1e-6)
    args = parser.parse_args(argv)
    summary_path = args.run_dir / "federated_summary.json"
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"verify: cannot read {summary_path}: {exc}", file=sys.stderr)
        return 2
    ok = True
    hashed_as = summary.get("content_hash", "v1")  # records before the field hashed as v1
    check_hashes = hashed_as == CONTENT_HASH_VERSION
    if not check_hashes:
        print(f"note: this run recorded checkpoint content hashes {hashed_as} and this fedagent-flwr computes "
              f"{CONTENT_HASH_VERSION}: the sources' hashes are not compared, only the means are recomputed")
    for entry in summary.get("rounds", []):
        if not entry.get("aggregated_actor"):
            print(f"round {entry['round']}: no aggregate (previous global model kept)")
            continue
        removed = entry.get("removed", {})
        if "global_model" in removed:
            print(f"round {entry['round']}: global model removed by the run (storage.keep_last_k); not checked")
            continue
        try:
            if "client_checkpoints" in removed:
                recorded_sources(Path(entry["aggregated_actor"]))  # a rule this audit cannot check is still reported
                print(f"round {entry['round']}: client checkpoints removed by the run after the round was committed "
                      "(storage.keep_client_checkpoints=false); not checked")
                continue
            error = verify_round(Path(entry["aggregated_actor"]), args.run_dir.resolve(), check_hashes)
        except CheckpointError as exc:
            print(f"round {entry['round']}: cannot verify: {exc}")
            ok = False
            continue
        good = error <= args.tolerance
        ok &= good
        print(f"round {entry['round']}: clients {entry['client_actor_ids']} max abs error {error:.3e} "
              f"{'ok' if good else 'ABOVE TOLERANCE'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
