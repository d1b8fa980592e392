"""A trainer backend for the backend tests: prints a line, then sleeps or fails as told.

The mode (the backend's first argument) is a number of seconds to sleep, ``fail``, or, for the
progress watchdog: ``hang`` (one line, then silence), ``warn`` (one line, then only vLLM's stall
warning, as a stuck verl job prints it), ``tick`` (a progress line every 0.5 s for 4 s, then done)
or ``bar`` (a tqdm-style progress bar redrawn after ``\r`` every 0.4 s for 4.8 s, no newline until
it is full: :func:`progress_bar`); ``killed``: one line, then SIGKILL, as the out-of-memory killer
ends a process.
"""

import os
import signal
import sys
import time

BAR_STEPS = 12


def progress_bar(steps: int = BAR_STEPS, every_s: float = 0.4) -> None:
    """Draw a progress bar as tqdm does on a terminal-less stream: each redraw starts with ``\r``
    and none ends with a newline until the bar is full."""
    for step in range(steps + 1):
        if step:
            time.sleep(every_s)
        filled = "█" * (10 * step // steps)
        sys.stdout.write(f"\rTraining Progress: {100 * step // steps:3d}%|{filled:<10}| {step}/{steps}")
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()

# vLLM's message while its engine waits for a stuck worker (vllm/distributed/device_communicators/shm_broadcast.py).
STALL_WARNING = ("INFO 12-01 10:00:00 [shm_broadcast.py:582] No available shared memory broadcast block found "
                 "in 60 seconds. This typically happens when some processes are hanging or doing some "
                 "time-consuming work (e.g. compilation, weight/kv cache quantization).")

if __name__ == "__main__":
    mode, job = sys.argv[1], sys.argv[2]
    print(f"sleepy backend {mode} {job}", flush=True)
    if mode == "killed":  # as the out-of-memory killer ends a process: SIGKILL, no last words
        print("step 1 done", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "fail":
        print("something went wrong in the trainer", flush=True)
        sys.exit(3)
    if mode in ("hang", "warn"):
        print("step 1 done", flush=True)
        while True:
            time.sleep(0.2)
            if mode == "warn":
                print(STALL_WARNING, flush=True)
    if mode == "bar":
        progress_bar()
        sys.exit(0)
    if mode == "tick":
        for i in range(8):
            time.sleep(0.5)
            print(f"tick {i}", flush=True)
        sys.exit(0)
    time.sleep(float(mode))
    print("finished sleeping", flush=True)
