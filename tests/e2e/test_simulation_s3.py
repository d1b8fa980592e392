"""End to end with ``storage.kind=s3``: one round of a real Flower simulation whose checkpoints
travel through a bucket, killed once and resumed.

No real S3 can run here: moto's S3 server, a subprocess on a free loopback port
(:mod:`testkit.s3_harness`), stands in for the service, reached through the real s3fs/boto stack.
The fake key pair is in the environment of the SuperLink's processes only, never in the run's
config, its messages or its summary. The trainers run persistent (one per node for a run, not one
per job): what is checked here is the store, which the ClientApp drives, not the trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedagent_flwr.checkpoint.ref import is_sha256
from fedagent_flwr.checkpoint.s3_store import open_filesystem
from fedagent_flwr.serverapp.crashpoint import CRASH_FILE_ENV
from testkit.flower_harness import REPO, run_to_crash_point, simulation_superlink
from testkit.run_end import ran_every_round
from testkit.s3_harness import FAKE_CREDENTIALS, moto_s3
from testkit.simulation_runs import run_job

pytestmark = pytest.mark.slow

SECRET = "fedagent-e2e-secret-never-in-a-message"


def test_one_round_through_an_s3_bucket_killed_and_resumed(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The clients fetch the base model from the bucket into their node cache and upload their
    checkpoints to their own upload locations; the server downloads, checks and averages them. The
    first attempt is killed once round 1's model is in place (not committed): the re-run, under a
    new run id, removes that attempt's objects from the bucket before its first round, redoes the
    round, and once it is committed removes its local copies and, from the bucket, the uploads and
    the base model (storage.keep_client_checkpoints=false, storage.keep_last_k=1): the bucket holds
    only the newest global model of the run, and nothing else in it is touched."""
    # moto accepts any key pair: a distinctive secret, to look for it where it must never be.
    environment = {**FAKE_CREDENTIALS, "AWS_SECRET_ACCESS_KEY": SECRET,
                   "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none")}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    crash_file = tmp_path / "crash-point"
    crash_file.write_text("aggregated@1")  # the first attempt's ServerApp kills itself there
    with moto_s3(tmp_path) as endpoint, simulation_superlink(
            tmp_path, pythonpath=[REPO], env_extra={**environment, CRASH_FILE_ENV: str(crash_file)}) as link:
        fs = open_filesystem(endpoint)
        fs.mkdir("fedagent-e2e")
        others = {"fedagent-e2e/fed/runs/7/uploads/1/0/actor/_commit-x.json": b"{}",  # another run's
                  "fedagent-e2e/fed/notes.txt": b"not a run's"}
        for key, data in others.items():
            fs.pipe_file(key, data)
        overrides = (f"model.path={tiny_model_dir} num_rounds=1 eval.num_episodes=2 trainer.max_new_tokens=8 "
                     f"storage.kind=s3 storage.url=s3://fedagent-e2e/fed storage.endpoint_url={endpoint} "
                     "storage.keep_last_k=1 trainer.mode=persistent")
        # A node-local store's clients (and their trainers) work in the node's directory, which in a
        # simulation is "fedagent-work" in the apps' cwd (tmp_path): the killed run's trainers are
        # waited for there.
        run_to_crash_point(link, f"output_dir={tmp_path} run_name=job {overrides}", 2, tmp_path / "crashed.log",
                           tmp_path / "fedagent-work")
        assert not crash_file.exists(), (tmp_path / "crashed.log").read_text()[-4000:]
        killed = json.loads((tmp_path / "job" / "federated_summary.json").read_text())["run_id"]
        fs.invalidate_cache()
        left = {key.rsplit("/_", 1)[0] for key in fs.find(f"fedagent-e2e/fed/runs/{killed}")}
        assert {f"fedagent-e2e/fed/runs/{killed}/uploads/1/{c}/actor" for c in (0, 1)} <= left, left

        summary, run_dir, output = run_job(link, tmp_path, overrides, supernodes=2)
        assert ran_every_round(summary), output[-4000:]
        run = summary["run_id"]
        (resumed,) = summary["resumed"]
        assert run != killed and resumed["earlier_run_id"] == killed, summary["resumed"]
        assert resumed["store_removed_objects"] >= len(left) and "store_retention_failed" not in resumed
        fs.invalidate_cache()
        assert not fs.find(f"fedagent-e2e/fed/runs/{killed}")  # the killed attempt's objects: all gone
        base = f"fedagent-e2e/fed/runs/{run}"
        (entry,) = summary["rounds"]
        assert entry["client_actor_ids"] == [0, 1] and not entry["rejected"], entry
        assert entry["removed"]["client_checkpoints"] > 0
        # The bucket keeps what retention keeps: round 1's global model; the uploads (commit and
        # files of each client) and the base model went once the round was committed.
        fs.invalidate_cache()
        kept = {key.rsplit("/_", 1)[0] for key in fs.find(base)}
        assert kept == {f"{base}/models/round_1/global"}, kept
        assert entry["store_removed"]["client_checkpoints"] > 0 and entry["store_removed"]["global_model"] > 0
        assert entry["store_removed_objects"] >= 2 * 2 + 2 and "store_retention_failed" not in entry
        assert summary["store_freed_bytes"] == sum(entry["store_removed"].values()) + sum(
            resumed["store_removed"].values())
        assert all(fs.cat_file(key) == data for key, data in others.items())
        for client in (0, 1):
            slot = run_dir / "round_1" / f"client_{client}"
            # The trainer ran in the node's own work dir (no shared filesystem), under the run's id.
            node_slot = tmp_path / "fedagent-work" / f"run-{run}" / "round_1" / f"client_{client}"
            assert (node_slot / "train_result.json").is_file()
            assert not (slot / "actor").exists() and not list(slot.glob(".download-*"))  # downloaded, then removed
    # Simulated nodes work in "fedagent-work" in the app's cwd: the base model is in their cache.
    cache = tmp_path / "fedagent-work" / "cache"
    assert [p for p in cache.iterdir() if is_sha256(p.name)], sorted(cache.iterdir())
    # The secret is in no file the run wrote and in nothing it logged.
    written = [p for p in run_dir.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".yaml", ".log")]
    assert written and not [p for p in written if SECRET in p.read_text(errors="replace")]
    assert SECRET not in output
