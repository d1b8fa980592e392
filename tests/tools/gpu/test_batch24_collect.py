"""tools/gpu/batch24_collect.sh: one seed's files, from a reply folder laid out as
``batch24_session.sh`` brings it back (``outWL.tgz`` packed as ``collect.sh`` packs it, the warm
start's log and record, the GPU memory log), land under the names the earlier seeds have; a seed
already filed, a run without its summary and a card that is not a card are refused, with nothing
written."""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tools" / "gpu" / "batch24_collect.sh"
SEED = 9
EXPERT_SHA256 = "0efebc81be2d9d5bc9333bb3558d6c03dba1804a0590b8dc70ee980b030c39a8"  # seeds 4-8's (warm_start-s*.json)


def _reply(root: Path, leave_out: str | None = None) -> Path:
    """A reply folder of seed :data:`SEED` (``leave_out``: an archive member not to pack)."""
    results = root / "stage" / "results"
    for arm, clients in (("federated", 2), ("local", 1)):
        run = results / f"{arm}-s{SEED}"
        (run / "steps").mkdir(parents=True)
        (run / "federated_summary.json").write_text(json.dumps({"status": "completed", "last_completed_round": 5}))
        (run / "metrics.jsonl").write_text('{"round": 0}\n')
        (run / "learning_curve.png").write_bytes(b"\x89PNG")
        for r in range(1, 6):
            for c in range(clients):
                (run / "steps" / f"round_{r}-client_{c}.jsonl").write_text(f'{{"round": {r}}}\n')
    (results / f"federated-s{SEED}" / "client_1-hooks.log").write_text("[vllm sleep] tolerated\n")
    for name in ("arms.md", "arms.png", "hostmem.jsonl", "phases.md"):
        (results / name).write_text(name)
    reply = root / "reply"
    (reply / "warm").mkdir(parents=True)
    with tarfile.open(reply / "outWL.tgz", "w:gz") as archive:
        archive.add(results, arcname="results",
                    filter=lambda member: None if leave_out and member.name.endswith(leave_out) else member)
    (reply / "smi.log").write_text("22:00:00 1 MiB\n")
    (reply / "warm" / "ws-warm.log").write_text("ws-warm: ...\n")
    (reply / "warm" / "warm_start.json").write_text(json.dumps({"seed": 9, "data_sha256": EXPERT_SHA256}))
    return reply


def _collect(reply: Path, dest: Path, card: str = "h200", force: bool = False) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "DEST": str(dest), **({"FORCE": "1"} if force else {})}
    return subprocess.run(["bash", str(SCRIPT), str(SEED), card, str(reply)], capture_output=True, text=True,
                          timeout=60, env=env)


def test_a_seed_is_filed_under_the_earlier_seeds_names_and_not_twice(tmp_path: Path) -> None:
    reply, dest = _reply(tmp_path), tmp_path / "dest"
    done = _collect(reply, dest)
    assert done.returncode == 0, done.stderr
    expected = {f"{arm}-s9-{kind}" for arm in ("federated", "local") for kind in
                ("summary.json", "metrics.jsonl", "curve.png")}
    expected |= {f"steps-federated-s9/round_{r}-client_{c}.jsonl" for r in range(1, 6) for c in (0, 1)}
    expected |= {f"steps-local-s9/round_{r}-client_0.jsonl" for r in range(1, 6)}
    expected |= {"federated-s9-client_1-hooks.log", "batch24-s9-arms.md", "batch24-s9-arms.png",
                 "batch24-s9-hostmem.jsonl", "phases-s9.md", "gpu-memory-s9.log", "warm_start-s9-h200.json",
                 "warm-start-s9.log"}
    assert {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()} == expected
    assert json.loads((dest / "warm_start-s9-h200.json").read_text()) == {"seed": 9, "data_sha256": EXPERT_SHA256}
    assert "warm start: the batch's expert episodes (data_sha256 0efebc81be2d9d5b...)" in done.stdout
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in dest.rglob("*") if p.is_file())
    assert "federated-s9: status completed last completed round 5" in done.stdout
    assert "local-s9: status completed last completed round 5" in done.stdout

    # Other episodes are named, not hidden (the seed is filed: its record says what it trained on).
    (reply / "warm" / "warm_start.json").write_text(json.dumps({"seed": 9, "data_sha256": "1" * 64}))
    other = _collect(reply, tmp_path / "other")
    assert other.returncode == 0 and "warm start: NOT the batch's expert episodes: data_sha256 1111" in other.stdout

    again = _collect(reply, dest)
    assert again.returncode == 1 and "already holds files of seed 9; FORCE=1 overwrites" in again.stderr
    assert _collect(reply, dest, force=True).returncode == 0


def test_a_run_without_its_metrics_or_a_wrong_card_files_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    missing = _collect(_reply(tmp_path / "a", leave_out="local-s9/metrics.jsonl"), dest)
    assert missing.returncode == 1 and "no results/local-s9/metrics.jsonl: nothing filed" in missing.stderr
    card = _collect(_reply(tmp_path / "b"), dest, card="a100")
    assert card.returncode == 2 and "CARD must be h100 or h200" in card.stderr
    no_reply = _collect(tmp_path / "nowhere", dest)
    assert no_reply.returncode == 1 and "has no outWL.tgz" in no_reply.stderr
    assert not dest.exists()
