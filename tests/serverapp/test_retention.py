"""Disk retention on a real simulation: a committed round's client checkpoints go, only the newest
``storage.keep_last_k`` global models stay, and of a server optimiser's states (FedAdam's m and v)
only the newest committed one, a run killed between two commits resumes from the global model and
the state it kept, and everything the run writes is readable by the group."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from safetensors import safe_open

from fedagent_flwr.serverapp.crashpoint import CRASH_FILE_ENV
from fedagent_flwr.serverapp.recorder import RunRecorder
from testkit.audit import audit_run
from testkit.flower_harness import REPO, run_to_crash_point, simulation_superlink
from testkit.run_end import ran_every_round

# Persistent trainers (one start per node, not one per job: this run and its re-run would start ~18
# of ~4.5 s of CPU each): retention is the ServerApp's work, whichever way the trainers run. FedAdam,
# so that each round also writes a server optimiser state for retention to keep or remove.
SETTINGS = ("clients.total=2 clients.per_round=2 num_rounds=3 eval.num_episodes=2 trainer.max_new_tokens=8 "
            "trainer.lr=1e-3 storage.keep_last_k=1 trainer.mode=persistent "  # keep_client_checkpoints: false
            "strategy=fedadam +strategy.kwargs.eta=1e-3")
STATE = Path("server_optimizer") / "global.safetensors"  # a round's state, beside its global model



def _sizes(run_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): p.stat().st_size for p in run_dir.rglob("*") if p.is_file()}


def _not_group_readable(root: Path) -> list[str]:
    """Paths under ``root`` whose mode is not a plain open/mkdir's (0644/0755 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return [f"{p.relative_to(root)} {stat.filemode(p.stat().st_mode)}" for p in [root, *root.rglob("*")]
            if not p.is_symlink() and stat.S_IMODE(p.stat().st_mode) != (0o777 if p.is_dir() else 0o666) & ~umask]


def test_results_are_readable_by_the_group(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The summary, metrics and curve (atomic writes) and a trainer's checkpoint (renamed from a
    temporary directory) used to be 0600 / 0700."""
    from fedagent_flwr.trainers.common.evaluator import load_model
    from fedagent_flwr.trainers.reference.checkpoint import write_fsdp_checkpoint

    run_dir = tmp_path / "job"  # pytest's tmp_path itself is private
    model, tokenizer = load_model(tiny_model_dir, 1)
    write_fsdp_checkpoint(model, tokenizer, run_dir / "round_1" / "client_0" / "checkpoints" / "global_step_1")
    recorder = RunRecorder(run_dir, {"base_model": str(tiny_model_dir), "env_kind": "test"})
    recorder.record_eval(server_round=0, model="base", metrics={"num-examples": 2, "success-rate": 0.5})
    recorder.complete_round(0)
    assert {p.name for p in run_dir.iterdir()} >= {"federated_summary.json", "metrics.jsonl", "learning_curve.png"}
    assert _not_group_readable(run_dir) == []


@pytest.mark.slow
def test_committed_rounds_keep_only_what_a_resume_needs(tmp_path: Path, tiny_model_dir: Path) -> None:
    crash_file = tmp_path / "crash-point"
    crash_file.write_text("aggregated@3")  # the ServerApp kills itself once round 3's model is in place
    run_dir = tmp_path / "out" / "job"
    overrides = f"output_dir={tmp_path / 'out'} run_name=job model.path={tiny_model_dir} {SETTINGS}"
    with simulation_superlink(tmp_path, pythonpath=[REPO], env_extra={CRASH_FILE_ENV: str(crash_file)}) as link:
        run_to_crash_point(link, overrides, 2, tmp_path / "crashed.log", run_dir)
        assert not crash_file.exists(), (tmp_path / "crashed.log").read_text()[-4000:]

        summary = json.loads((run_dir / "federated_summary.json").read_text())
        assert summary["last_completed_round"] == 2
        killed_id = summary["run_id"]
        first, second = summary["rounds"]
        # Round 1's global model went when round 2 committed; round 2's is the one a resume needs.
        assert not (run_dir / "round_1" / "global").exists() and (run_dir / "round_2" / "global").is_dir()
        assert first["removed"]["global_model"] > 0 and "global_model" not in second.get("removed", {})
        for r, entry in ((1, first), (2, second)):
            assert entry["removed"]["client_checkpoints"] > 0
            for client in (0, 1):
                client_dir = run_dir / f"round_{r}" / f"client_{client}"
                assert not (client_dir / "checkpoints").exists()
                assert (client_dir / "train_result.json").is_file() and (client_dir / "train.log").is_file()
        # Round 1's optimiser state went too (whatever keep_last_k); round 2's is what a resume steps from.
        assert not (run_dir / "round_1" / STATE).exists() and (run_dir / "round_2" / STATE).is_file()
        assert first["removed"]["server_optimizer_state"] > 0
        assert "server_optimizer_state" not in second.get("removed", {})
        # Round 3 is not committed: its clients' checkpoints, its global model and its state are still there.
        assert all((run_dir / "round_3" / f"client_{c}" / "checkpoints").is_dir() for c in (0, 1))
        assert (run_dir / "round_3" / "global").is_dir() and (run_dir / "round_3" / STATE).is_file()

        # The re-run resumes from round 2's global model (hash-checked), redoes round 3, and its
        # commit removes what round 3 no longer needs.
        rerun = link.run(overrides, supernodes=2)
    output = rerun.stdout + rerun.stderr
    summary = json.loads((run_dir / "federated_summary.json").read_text())
    assert ran_every_round(summary) and summary["last_completed_round"] == 3, output[-4000:]
    assert all(e["client_actor_ids"] == [0, 1] and not e["rejected"] for e in summary["rounds"])  # real configs pass
    assert summary["resumed"] == [{"after_round": 2, "run_id": summary["run_id"], "earlier_run_id": killed_id}]
    assert summary["rounds"][2]["started_from"] == str(run_dir / "round_2" / "global")
    assert summary["final_model"] == str(run_dir / "round_3" / "global")
    assert sorted(p.name for p in run_dir.glob("round_*/global*")) == ["global"]  # round 3's only
    assert (run_dir / "round_3" / "global" / "model.safetensors").is_file()
    assert not list(run_dir.glob("round_*/client_*/checkpoints"))
    # Round 3 was redone from round 2's state (its step counts on from it: fresh moments would be
    # step 1), which its commit then removed: only the newest state stays.
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.glob("round_*/server_optimizer/*")) == [
        f"round_3/{STATE.as_posix()}"]
    with safe_open(str(run_dir / "round_3" / STATE), framework="pt") as handle:
        assert (handle.metadata() or {})["fedagent.step"] == "3"
    assert summary["rounds"][1]["removed"]["server_optimizer_state"] > 0
    freed = summary["disk_freed_bytes"]
    assert freed == sum(sum(e.get("removed", {}).values()) for e in summary["rounds"])
    kept = sum(_sizes(run_dir).values())
    print(f"\nretention: {freed / 1e6:.1f} MB removed, {kept / 1e6:.1f} MB kept in {run_dir}")
    assert freed > 2 * kept / 3  # 6 client checkpoints and 2 of 3 global models of 3 rounds

    # The audit says what it could not check, and why, instead of failing.
    audit = audit_run(run_dir)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "round 1: global model removed by the run (storage.keep_last_k)" in audit.stdout
    assert "round 3: content hash as committed; client checkpoints removed by the run" in audit.stdout

    assert _not_group_readable(run_dir) == []  # files 0644, directories 0755 under the usual umask 022


def test_retention_keys_are_checked_at_start() -> None:
    from fedagent_flwr.config import ConfigError, load_settings

    assert load_settings().storage.keep_client_checkpoints is False and load_settings().storage.keep_last_k == 0
    with pytest.raises(ConfigError, match=r"'storage.keep_last_k' = -1 is invalid: expected >= 0"):
        load_settings(overrides="storage.keep_last_k=-1")
    with pytest.raises(ConfigError, match="'storage.keep_client_checkpoints' must be bool"):
        load_settings(overrides="storage.keep_client_checkpoints=sometimes")
