"""Everything a run writes is readable by the group: files 0644 and directories 0755 under the
usual umask 022, as a plain open()/mkdir() makes them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from fedagent_flwr.serverapp.recorder import RunRecorder


def _not_group_readable(root: Path) -> list[str]:
    """Paths under ``root`` whose mode is not a plain open/mkdir's (0644/0755 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return [f"{p.relative_to(root)} {stat.filemode(p.stat().st_mode)}" for p in [root, *root.rglob("*")]
            if not p.is_symlink() and stat.S_IMODE(p.stat().st_mode) != (0o777 if p.is_dir() else 0o666) & ~umask]


def test_results_are_readable_by_the_group(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The summary, metrics and curve (atomic writes) and a trainer's checkpoint (renamed from a
    temporary directory) used to be 0600 / 0700."""
    from fedagent_flwr.clientapp.reference_trainer import load_model, write_fsdp_checkpoint

    run_dir = tmp_path / "job"  # pytest's tmp_path itself is private
    model, tokenizer = load_model(tiny_model_dir, 1)
    write_fsdp_checkpoint(model, tokenizer, run_dir / "round_1" / "client_0" / "checkpoints" / "global_step_1")
    recorder = RunRecorder(run_dir, {"base_model": str(tiny_model_dir), "env_kind": "test"})
    recorder.record_eval(server_round=0, model="base", metrics={"num-examples": 2, "success-rate": 0.5})
    recorder.complete_round(0)
    assert {p.name for p in run_dir.iterdir()} >= {"federated_summary.json", "metrics.jsonl", "learning_curve.png"}
    assert _not_group_readable(run_dir) == []
