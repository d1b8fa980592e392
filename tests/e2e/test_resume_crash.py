"""Crash tests: SIGKILL the ServerApp of a real simulation run while clients train, right after
a round's aggregate was renamed into place, inside the summary write that commits a round, and,
with the http checkpoint store, once a client's upload of the round was committed to the store;
re-run the same config; the run completes with the same round records and bit-identical global
models and server optimiser states as an uninterrupted run with the same seeds, each round exactly
once, and the completed rounds untouched.

Every case runs 2 rounds with 3 clients (2 a round, so the selection differs per round) and is
killed in round 2, so the re-run recomputes round 2 only; the crash-point case kills the re-run
too, at the next point, so a run resumed twice is checked as well. Every run uses a server
optimiser, FedAdam, whose state (``round_<r>/server_optimizer/``: m and v) must survive the crash
as well: the re-run's round 2 steps from round 1's model and state and ends with the uninterrupted
run's model and state, bit for bit (the round-2 state would differ had the moments restarted).
One uninterrupted run, shared by the cases and run on the session's SuperLink with the
shared-filesystem store and persistent trainers, is the reference (for the http case too: the store
moves files and changes no weight). The http case's runs keep subprocess trainers (a round-2
client's trainer process may still be working when its ServerApp is killed), so a subprocess-mode
run is resumed too, and its result is compared with the persistent reference across modes; the other
cases run persistent (one trainer per node for a run instead of one per job, ~4.5 s of CPU saved on
each job). Each case has a SuperLink of its own: the re-run goes to the SuperLink that outlived the
killed ServerApp, and stopping it afterwards clears whatever the killed simulation left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fedagent_flwr.procs import pids_with_cmdline
from fedagent_flwr.seeding import select_clients
from fedagent_flwr.serverapp.crashpoint import CRASH_FILE_ENV
from testkit.audit import audit_run
from testkit.flower_harness import REPO, SuperLink, is_running, simulation_superlink, wait_until
from testkit.run_end import ran_every_round

pytestmark = pytest.mark.slow

SETTINGS = ("clients.total=3 clients.per_round=2 num_rounds=2 eval.num_episodes=1 "
            "trainer.max_new_tokens=8 trainer.lr=1e-3 storage.keep_client_checkpoints=true "  # audited after
            "strategy=fedadam +strategy.kwargs.eta=1e-3")
# The server optimiser's state a round writes beside its global model (kept for the audit:
# keep_client_checkpoints keeps every round's state; retention's removal of it is test_retention's).
STATE = Path("server_optimizer") / "global.safetensors"
SUPERNODES = 3
PERSISTENT = "trainer.mode=persistent"


def _overrides(workdir: Path, model: Path, extra: str = "") -> str:
    return f"output_dir={workdir / 'out'} run_name=job model.path={model} {SETTINGS} {extra}".strip()


def _summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "federated_summary.json").read_text())


def _events(run_dir: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for event in events:
        event.get("metrics", {}).pop("train-seconds", None)  # wall-clock time, not a result
    return events


# Per-run by nature: timings, and the global models' content hashes (their safetensors header
# names the source checkpoints by absolute path, so equal weights in two run directories hash apart;
# the weights themselves are compared bit for bit below).
_PER_RUN_KEYS = ("wall_seconds", "aggregated_sha256", "aggregated_critic_sha256")


def _portable(value: Any, run_dir: Path, leave_out: tuple[str, ...] = ()) -> Any:
    """``value`` with the run directory's absolute path replaced and what differs between any two
    runs left out (:data:`_PER_RUN_KEYS`, and ``leave_out``), to compare two runs."""
    portable = json.loads(json.dumps(value).replace(str(run_dir), "<run>"))
    if isinstance(portable, list):
        portable = [{k: v for k, v in e.items() if k not in _PER_RUN_KEYS + leave_out} if isinstance(e, dict) else e
                    for e in portable]
    return portable


def _unchanged_part(run_dir: Path) -> dict[str, int]:
    """Modification times of everything the completed rounds 0 and 1 wrote."""
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns
            for part in ("round_0", "round_1") for p in sorted((run_dir / part).rglob("*"))}


def _crash(link: SuperLink, workdir: Path, model: Path, kill_when: Callable[[Path], bool] | None,
           extra: str = "", trainers_in: Path | None = None) -> Path:
    """Start the run; SIGKILL its ServerApp from outside once ``kill_when(run_dir)`` holds (or, with
    ``None``, let it kill itself at its armed crash point); wait until no trainer of it works in
    ``trainers_in`` (by default the run directory; with the http store, the clients' own work
    directory) any more."""
    run_dir = workdir / "out" / "job"
    log = workdir / f"crashed-run-{len(list(workdir.glob('crashed-run-*.log'))) + 1}.log"  # one per crash
    job = link.start(_overrides(workdir, model, extra), SUPERNODES, log)
    try:
        serverapp = wait_until(lambda: next(iter(link.simulation_pids()), 0), "the ServerApp to start")
        if kill_when is not None:
            wait_until(lambda: kill_when(run_dir), "the moment to kill the ServerApp")
            os.kill(serverapp, signal.SIGKILL)
        wait_until(lambda: not is_running(serverapp), "the ServerApp to die")
        # Subprocess trainers go down with the simulation; persistent ones finish their job and
        # exit when they see their node (the raylet) gone. Be sure before re-running.
        wait_until(lambda: not pids_with_cmdline(str(trainers_in or run_dir)), "the killed run's trainers to exit")
    finally:
        job.terminate()  # `flwr run --stream` would wait for the dead run for ever
        job.wait()
    return run_dir


def _resume_and_compare(link: SuperLink, workdir: Path, model: Path, run_dir: Path, baseline: Path,
                        resumes: int = 1, extra: str = "", store_keys: tuple[str, ...] = ()) -> str:
    """Re-run the same config and check it against the uninterrupted run (``resumes``: how many
    attempts resumed it after round 1, this one included; ``store_keys``: keys of the summary's
    round entries that name where the checkpoint store put a file, left out, for the caller to
    check, when the run uses another store than the uninterrupted one); return the re-run's output."""
    untouched = _unchanged_part(run_dir)
    rerun = link.run(_overrides(workdir, model, extra), supernodes=SUPERNODES)
    output = rerun.stdout + rerun.stderr
    summary, reference = _summary(run_dir), _summary(baseline)
    assert ran_every_round(summary), output[-4000:]
    assert summary["last_completed_round"] == 2
    assert [entry["after_round"] for entry in summary["resumed"]] == [1] * resumes
    for key in ("rounds", "val_curve", "client_curve", "final_model"):
        assert _portable(summary[key], run_dir, store_keys) == _portable(reference[key], baseline, store_keys), key
    assert [e["round"] for e in summary["rounds"]] == [1, 2]
    assert [e["clients"] for e in summary["rounds"]] == [select_clients(r, 3, 2, 42) for r in (1, 2)]
    assert [p["round"] for p in summary["val_curve"]] == [0, 1, 2]
    events = _events(run_dir)
    assert _portable(events, run_dir) == _portable(_events(baseline), baseline)
    keys = [(e["event"], e["round"], e.get("client")) for e in events]
    assert len(keys) == len(set(keys))  # no round's line twice
    for r in (1, 2):
        mine = load_file(str(run_dir / f"round_{r}" / "global" / "model.safetensors"))
        theirs = load_file(str(baseline / f"round_{r}" / "global" / "model.safetensors"))
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        # FedAdam's state too (its header names no path: the whole file is compared): round 2 was
        # redone from round 1's state, not from fresh moments.
        state = Path(f"round_{r}") / STATE
        assert (run_dir / state).read_bytes() == (baseline / state).read_bytes(), state
    # Rounds 0 and 1 were completed: neither re-trained nor re-evaluated, not a file rewritten.
    assert _unchanged_part(run_dir) == untouched
    assert "round 1 was completed by an earlier attempt" in output, output[-4000:]
    assert "configure_train: round 1 trains" not in output and "[ROUND 0]" not in output
    assert "configure_train: round 2 trains" in output
    assert not list(run_dir.glob(".federated_summary.json.*"))
    assert not list(run_dir.glob("round_*/.global.staging-*"))
    audit = audit_run(run_dir)
    assert audit.returncode == 0 and audit.stdout.count(" ok") == 2, audit.stdout + audit.stderr
    assert audit.stdout.count(" fedadam step ") == 2, audit.stdout  # both rounds recomputed, state included
    return output


@pytest.fixture(scope="module")
def baseline(superlink: SuperLink, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The uninterrupted run every crash case is compared with (on the session's SuperLink: nothing
    is killed in it)."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    proc = superlink.run(_overrides(workdir, tiny_model_dir, PERSISTENT), supernodes=SUPERNODES)
    run_dir = workdir / "out" / "job"
    summary = _summary(run_dir)
    assert ran_every_round(summary) and summary["resumed"] == [], (proc.stdout + proc.stderr)[-4000:]
    return run_dir


def test_killed_while_clients_train(baseline: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    """With persistent trainers, which the killed simulation does not own: they notice their node
    (the raylet) is gone and exit by themselves (``_crash`` waits for that), the re-run starts new
    ones, and the result still equals the uninterrupted run bit for bit."""
    with simulation_superlink(tmp_path, pythonpath=[REPO]) as link:
        # Killed once both round-2 trainers are working on their jobs (one of them first started
        # for this job), so every trainer of the run has been started and watches the raylet.
        round_2 = select_clients(2, 3, 2, 42)

        def both_training(run: Path) -> bool:
            logs = [run / "round_2" / f"client_{c}" / "train.log" for c in round_2]
            return all(log.exists() and "train begin" in log.read_text(errors="replace") for log in logs)

        run_dir = _crash(link, tmp_path, tiny_model_dir, kill_when=both_training, extra=PERSISTENT)
        summary = _summary(run_dir)
        assert summary["status"] == "running" and summary["last_completed_round"] == 1
        assert [e["round"] for e in summary["rounds"]] == [1]
        assert not (run_dir / "round_2" / "global").exists()
        gone = {}
        for channel in sorted(run_dir.glob("trainers/client_*")):
            closing = json.loads((channel / "closing.json").read_text())
            assert closing["reason"].startswith("raylet (pid "), closing  # not the idle timeout
            gone[channel.name] = closing["pid"]
        assert gone  # the nodes that trained had trainers
        _resume_and_compare(link, tmp_path, tiny_model_dir, run_dir, baseline, extra=PERSISTENT)
        restarted = 0
        for name, pid in gone.items():  # the nodes that work in the re-run start new trainers
            starts = [json.loads(line)
                      for line in (run_dir / "trainers" / name / "starts.jsonl").read_text().splitlines()]
            if len(starts) > 1:
                assert starts[-1]["reason"].startswith(f"restart: trainer pid {pid} is gone (raylet (pid "), starts
                restarted += 1
        assert restarted


def test_killed_between_the_new_global_model_and_its_record_then_while_committing_the_re_run(
    baseline: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    crash_file = tmp_path / "crash-point"
    crash_file.write_text("aggregated@2")
    with simulation_superlink(tmp_path, pythonpath=[REPO], env_extra={CRASH_FILE_ENV: str(crash_file)}) as link:
        run_dir = _crash(link, tmp_path, tiny_model_dir, kill_when=None, extra=PERSISTENT)
        assert not crash_file.exists()  # the ServerApp reached the point and killed itself there
        summary = _summary(run_dir)
        assert summary["last_completed_round"] == 1 and [e["round"] for e in summary["rounds"]] == [1]
        assert (run_dir / "round_2" / "global" / "model.safetensors").exists()  # in place, not recorded
        assert (run_dir / "round_2" / STATE).is_file()  # its optimiser state too: written, uncommitted
        assert (run_dir / "round_1" / STATE).is_file()  # what the re-run's round 2 steps from

        # The re-run redoes round 2 and is killed inside the summary write that commits it.
        untouched = _unchanged_part(run_dir)
        crash_file.write_text("commit@2")
        _crash(link, tmp_path, tiny_model_dir, kill_when=None, extra=PERSISTENT)
        assert not crash_file.exists()
        assert _unchanged_part(run_dir) == untouched
        summary = _summary(run_dir)
        # Round 2 was trained, aggregated and evaluated, and all of it recorded; only the commit
        # was lost, with the new summary half-way to its name.
        assert summary["last_completed_round"] == 1
        assert [e["after_round"] for e in summary["resumed"]] == [1]
        assert [e["round"] for e in summary["rounds"]] == [1, 2]
        assert [p["round"] for p in summary["val_curve"]] == [0, 1, 2]
        assert list(run_dir.glob(".federated_summary.json.*"))
        _resume_and_compare(link, tmp_path, tiny_model_dir, run_dir, baseline, resumes=2, extra=PERSISTENT)


HTTP_STORE = "storage.kind=http storage.host=127.0.0.1"  # loopback: no TLS needed; port 0 picks a free one


def test_killed_after_round_2_uploads_to_the_http_store(baseline: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    """With ``storage.kind=http``: the clients download global models into their node's cache and
    upload their checkpoints into the store's slots (``<run dir>/round_<r>/client_<c>/actor``). The
    ServerApp is killed once a round-2 upload was committed, so the killed attempt leaves final
    upload slots that the re-run's clients, retraining round 2, could not upload into again. The
    re-run discards them, serves its store under its own Flower run id, and ends bit-identical to
    the uninterrupted shared-filesystem run: the store moves files, it changes no weight."""
    # Simulated clients have no node config, so each works in "fedagent-work" in the app's cwd
    # (the SuperLink's working directory, here tmp_path), all three nodes in the same one.
    node_dir = tmp_path / "fedagent-work"
    with simulation_superlink(tmp_path, pythonpath=[REPO]) as link:

        def uploaded(run: Path) -> bool:
            return any((run / "round_2").glob("client_*/actor"))

        run_dir = _crash(link, tmp_path, tiny_model_dir, kill_when=uploaded, extra=HTTP_STORE, trainers_in=node_dir)
        summary = _summary(run_dir)
        killed_run = summary["run_id"]
        assert summary["status"] == "running" and summary["last_completed_round"] == 1
        assert [e["round"] for e in summary["rounds"]] == [1]
        # What the killed attempt's store received in round 2: at least one committed slot, maybe
        # another client's upload half-way (its staging folder).
        slots = sorted(p for p in (run_dir / "round_2").glob("client_*/*")
                       if p.name in ("actor", "critic") or p.name.startswith(".upload-"))
        committed = {p: p.stat().st_ino for p in slots if p.name == "actor"}
        assert committed, slots
        # The killed attempt's clients worked under its run id, in their node's directory only.
        assert (node_dir / f"run-{killed_run}" / "round_2").is_dir()
        # Every node of a simulation shares this cache, and it already holds round 1's global model
        # (round 2's clients fetched it): emptied, the re-run's clients must download it again, from
        # the re-run's store.
        round_1_global = summary["rounds"][0]["aggregated_sha256"]
        assert (node_dir / "cache" / round_1_global).is_dir()
        shutil.rmtree(node_dir / "cache")

        # The one difference from the shared-filesystem run is where the server read the clients'
        # checkpoints: the trainer's own folder there, the store's upload slot here (checked below).
        output = _resume_and_compare(link, tmp_path, tiny_model_dir, run_dir, baseline, extra=HTTP_STORE,
                                     store_keys=("client_actors",))

        for slot in slots:
            assert f"[fedagent] removed {slot} (written after the last completed round)" in output, slot
        # The slots the killed attempt committed hold the re-run's uploads now: new directories.
        for slot, inode in committed.items():
            assert slot.is_dir() and slot.stat().st_ino != inode, slot
        assert not list((run_dir / "round_2").glob("client_*/.upload-*"))
        summary = _summary(run_dir)
        for entry in summary["rounds"]:
            assert entry["client_actors"] == [str(run_dir / f"round_{entry['round']}" / f"client_{c}" / "actor")
                                              for c in entry["clients"]], entry
        rerun = summary["run_id"]
        assert rerun != killed_run and [e["run_id"] for e in summary["resumed"]] == [rerun]
        # The re-run's clients worked under the new run id (a store instruction names its run, and a
        # node refuses one of another run), from round 1's global model downloaded through it.
        assert (node_dir / "cache" / round_1_global).is_dir()
        for client in select_clients(2, 3, 2, 42):
            client_dir = node_dir / f"run-{rerun}" / "round_2" / f"client_{client}"
            job = json.loads((client_dir / "train_job.json").read_text())
            assert job["model_path"] == str(node_dir / "cache" / round_1_global), job["model_path"]
        assert not (node_dir / f"run-{rerun}" / "round_1").exists()  # round 1 not retrained
