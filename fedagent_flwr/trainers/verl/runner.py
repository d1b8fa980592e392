"""Running one verl job as a process: start it in a session of its own, tee its output, follow its
per-step metrics file, stop what is left of its private Ray cluster afterwards, and say in one
line why it failed."""

from __future__ import annotations

import hashlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedagent_flwr.gpu_memory import (
    HOST_RAN_OUT,
    RAN_OUT,
    TORCH_OOM,
    VLLM_KV_CACHE,
    VLLM_STARTUP,
    is_host_memory_shortage,
)
from fedagent_flwr.procs import kill_matching, stop_group
from fedagent_flwr.trainers.verl.verl_log import StepCallback, StepWatch

_ERROR_LINE = re.compile(r"\b[A-Za-z_.]*(Error|Exception): ")
#: The prefix Ray puts on a line it forwards from one of its processes (``(TaskRunner pid=11744)``,
#: coloured on a terminal, ``, ip=...`` on a cluster). verl's stdout and stderr share verl.log, so
#: such a line can land in the middle of an error line that had not ended yet.
_RAY_FORWARDED = re.compile(r"(?:\x1b\[[0-9;]*m)?\([\w:.-]+ pid=\d+(?:, ip=[\w.:-]+)?\)")
#: How much of a log's end :func:`logged_cause` reads (vLLM's traceback precedes the failure by a few hundred lines).
LOG_SCAN_BYTES = 4 * 2**20
#: How long :func:`logged_cause` may wait for a root cause to reach a log that Ray writes into: Ray's
#: log monitor forwards a worker's lines asynchronously, so they can arrive after the exception that
#: they explain. A bound, not a delay: the wait ends as soon as a known cause is there.
CAUSE_WAIT_S = 5.0
#: How often the log is read again while waiting.
CAUSE_POLL_S = 0.2

def ray_temp_dir(output_dir: str) -> str:
    """A short per-job Ray temp dir: Ray puts Unix sockets under it (paths must stay < 108 bytes)."""
    digest = hashlib.sha256(str(Path(output_dir).resolve()).encode()).hexdigest()[:10]
    return f"/tmp/fa-ray-{digest}"


def cleanup_ray(temp_dir: str) -> None:
    """Stop what is left of the job's private Ray cluster (found by its temp dir)."""
    kill_matching(temp_dir)


def run_verl(command: list[str], env: dict[str, str], cwd: Path, log_path: Path, temp_dir: str,
             step_file: Path, on_step: StepCallback | None = None,
             ) -> tuple[int, float | None, list[str], dict[int, dict[str, float]]]:
    """Run verl in its own session; tee its output to ``log_path`` and our stdout, and follow the
    per-step metrics its file logger writes to ``step_file`` (``on_step`` runs for each step).

    Returns (exit code, seconds from launch to the end of the first training step or None, the
    last lines, per-step metrics). A SIGTERM to this process stops the job's whole process group.
    """
    started = time.monotonic()
    tail: deque[str] = deque(maxlen=40)
    step_file.unlink(missing_ok=True)  # an earlier attempt's steps are not this job's
    watch = StepWatch(step_file, on_step)
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1, start_new_session=True)

    def forward_term(signum: int, frame: Any) -> None:
        stop_group(process.pid, grace_s=5.0)
        cleanup_ray(temp_dir)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, forward_term)
    succeeded = False
    try:
        with watch, open(log_path, "w") as log_file:
            assert process.stdout is not None
            for line in process.stdout:
                log_file.write(line)
                log_file.flush()
                sys.stdout.write(line)
                tail.append(line.rstrip())
            code = process.wait()
        succeeded = code == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_group(process.pid, grace_s=5.0)  # verl if still running, and helpers left in its session
        cleanup_ray(temp_dir)
        if succeeded:
            # Each job makes a new dir in /tmp, outside the run. After a success its worker output is
            # already in verl.log (RAY_DEDUP_LOGS=0); after a failure Ray's own logs are kept to debug.
            shutil.rmtree(temp_dir, ignore_errors=True)
    first_step = None if watch.first_step is None else watch.first_step - started
    return code, first_step, list(tail), watch.steps


def known_cause(text: str) -> str | None:
    """A root cause recognised in verl's output (GPU or host memory), phrased for the operator; else None."""
    if is_host_memory_shortage(text):  # Ray's error is an OutOfMemoryError too: tell it apart first
        return (f"{HOST_RAN_OUT}: Ray's memory monitor killed the trainer's workers; run fewer sessions on "
                "the machine at once")
    startup = VLLM_STARTUP.search(text)
    if startup is not None:
        return (f"{RAN_OUT}: vLLM could not start ({startup.group(0)}); run fewer sessions on "
                "the GPU at once or lower trainer.gpu_memory_utilization")
    if TORCH_OOM.search(text):
        return f"{RAN_OUT} (CUDA out of memory)"
    if VLLM_KV_CACHE.search(text):
        return ("could not start vLLM: its KV-cache sizing failed because another process on the GPU "
                "changed its memory use meanwhile (set trainer.kv_cache_gib > 0 when clients share a GPU)")
    return None


def logged_cause(log_path: Path, offset: int = 0, wait_s: float = 0.0) -> str | None:
    """:func:`known_cause` of what ``log_path`` holds from byte ``offset`` on (at most its last
    :data:`LOG_SCAN_BYTES`); None when the file is missing or names no known cause.

    An exception raised through Ray often says only that something failed ("Engine core
    initialization failed. See root cause above."): the root cause was printed by another process
    (a vLLM worker) into the log, which is where this looks for it. A log that is still being
    written (Ray forwards its workers' lines asynchronously) is read again every
    :data:`CAUSE_POLL_S` until a known cause is in it or ``wait_s`` seconds have passed; then the
    answer is what the log held by that time.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(log_path, "rb") as log:
                size = log.seek(0, 2)
                log.seek(max(offset, size - LOG_SCAN_BYTES, 0))
                text = log.read().decode(errors="replace")
        except OSError:
            return None
        known = known_cause(text)
        left = deadline - time.monotonic()
        if known is not None or left <= 0:
            return known
        time.sleep(min(CAUSE_POLL_S, left))


def failure_reason(code: int, tail: Sequence[str], log_path: Path | None = None) -> str:
    """One line for why verl failed: a known root cause (in the tail, else anywhere in the end of
    ``log_path``), else the first error line of the tail (chained tracebacks print the root cause
    first), else the last line."""
    known = known_cause("\n".join(tail)) or (logged_cause(log_path) if log_path is not None else None)
    if known is not None:
        return known
    if code < 0:
        return f"was killed by signal {-code}"
    errors = [line for line in tail if _ERROR_LINE.search(line)]
    line = (errors[:1] or [line for line in tail if line.strip()][-1:] or ["no output"])[0]
    match = _ERROR_LINE.search(line)
    text = line[match.start():] if match else line
    # Another process's line written into this one: cut it off, so that clients failing the same
    # way give the same reason (the server stops a run on that), whatever the interleaving.
    interleaved = _RAY_FORWARDED.search(text, 1)
    return f"exited with code {code}: {(text[:interleaved.start()] if interleaved else text).strip()[:400]}"

