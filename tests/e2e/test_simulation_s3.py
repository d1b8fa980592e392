"""End to end with ``storage.kind=s3``: one round of a real Flower simulation whose checkpoints
travel through a bucket.

No real S3 can run here: moto's S3 server, a subprocess on a free loopback port
(:mod:`testkit.s3_harness`), stands in for the service, reached through the real s3fs/boto stack.
The fake key pair is in the environment of the SuperLink's processes only, never in the run's
config, its messages or its summary.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedagent_flwr.checkpoint.ref import is_sha256
from fedagent_flwr.checkpoint.s3_store import open_filesystem
from testkit.flower_harness import REPO, simulation_superlink
from testkit.run_end import ran_every_round
from testkit.s3_harness import FAKE_CREDENTIALS, moto_s3
from testkit.simulation_runs import run_job

pytestmark = pytest.mark.slow

SECRET = "fedagent-e2e-secret-never-in-a-message"


def test_one_round_through_an_s3_bucket(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The clients fetch the base model from the bucket into their node cache and upload their
    checkpoints to their own upload locations; the server downloads, checks and averages them, and
    once the round is committed removes its local copies and, from the bucket, the uploads and the
    base model (storage.keep_client_checkpoints=false, storage.keep_last_k=1): the run's prefix holds
    only the newest global model, and nothing else in the bucket is touched."""
    # moto accepts any key pair: a distinctive secret, to look for it where it must never be.
    environment = {**FAKE_CREDENTIALS, "AWS_SECRET_ACCESS_KEY": SECRET,
                   "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none")}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with moto_s3(tmp_path) as endpoint, \
            simulation_superlink(tmp_path, pythonpath=[REPO], env_extra=environment) as link:
        fs = open_filesystem(endpoint)
        fs.mkdir("fedagent-e2e")
        others = {"fedagent-e2e/fed/runs/7/uploads/1/0/actor/_commit-x.json": b"{}",  # another run's
                  "fedagent-e2e/fed/notes.txt": b"not a run's"}
        for key, data in others.items():
            fs.pipe_file(key, data)
        summary, run_dir, output = run_job(
            link, tmp_path,
            f"model.path={tiny_model_dir} num_rounds=1 eval.num_episodes=2 trainer.max_new_tokens=8 "
            f"storage.kind=s3 storage.url=s3://fedagent-e2e/fed storage.endpoint_url={endpoint} "
            "storage.keep_last_k=1", supernodes=2)
        assert ran_every_round(summary), output[-4000:]
        run = summary["run_id"]
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
        assert summary["store_freed_bytes"] == sum(entry["store_removed"].values())
        assert all(fs.cat_file(key) == data for key, data in others.items())
        for client in (0, 1):
            slot = run_dir / "round_1" / f"client_{client}"
            # The trainer ran in the node's own work dir (no shared filesystem), under the run's id.
            node_slot = tmp_path / "fedagent-work" / f"run-{run}" / "round_1" / f"client_{client}"
            assert (node_slot / "train_result.json").is_file()
            assert not (slot / "actor").exists() and not list(slot.glob(".download-*"))  # downloaded, then removed
        # A bucket that does not exist stops the next run before round 0, naming the settings.
        failed, _, failed_output = run_job(
            link, tmp_path / "missing",
            f"model.path={tiny_model_dir} num_rounds=1 storage.kind=s3 storage.url=s3://no-such-bucket/fed "
            f"storage.endpoint_url={endpoint}", supernodes=2)
        assert failed["status"] == "failed", failed_output[-3000:]
        assert failed["error"].startswith("cannot start the checkpoint store: config keys 'storage.url' = "
                                          "'s3://no-such-bucket/fed' and 'storage.endpoint_url'"), failed["error"]
        assert "the bucket does not exist" in failed["error"] and "[ROUND 0]" not in failed_output
    # Simulated nodes work in "fedagent-work" in the app's cwd: the base model is in their cache.
    cache = tmp_path / "fedagent-work" / "cache"
    assert [p for p in cache.iterdir() if is_sha256(p.name)], sorted(cache.iterdir())
    # The secret is in no file the run wrote and in nothing it logged.
    written = [p for p in run_dir.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".yaml", ".log")]
    assert written and not [p for p in written if SECRET in p.read_text(errors="replace")]
    assert SECRET not in output
