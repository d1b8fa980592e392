"""A trainer backend for the backend tests: prints a line, then sleeps or fails as told."""

import sys
import time

if __name__ == "__main__":
    mode, job = sys.argv[1], sys.argv[2]
    print(f"sleepy backend {mode} {job}", flush=True)
    if mode == "fail":
        print("something went wrong in the trainer", flush=True)
        sys.exit(3)
    time.sleep(float(mode))
    print("finished sleeping", flush=True)
