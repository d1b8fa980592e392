"""A stand-in S3 endpoint for tests: moto's S3 server (``python -m moto.server``) started as a
subprocess on a free loopback port.

No real S3 (nor MinIO) can run in CI, so moto's server, which speaks S3's HTTP API to the real
boto/s3fs client stack, stands in for it. It is a test double of the service, not AWS: IAM
policies, consistency and throughput are not what a real bucket has.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from fedagent_flwr.procs import end_process
from testkit.flower_harness import free_port

# moto accepts any key pair; real credentials never belong in a test.
FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@contextmanager
def moto_s3(log_dir: Path) -> Iterator[str]:
    """Run moto's S3 server; yields its endpoint URL (``http://127.0.0.1:<port>``), stopped after."""
    port = free_port()
    log = open(log_dir / "moto.log", "wb")  # noqa: SIM115 -- closed below, after the process
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **FAKE_CREDENTIALS})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60  # a hang guard: moto starts in a few seconds
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"moto's server exited: {(log_dir / 'moto.log').read_text()[-2000:]}")
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto's server did not answer within 60 s") from None
                time.sleep(0.2)
        yield url
    finally:
        end_process(process, grace_s=20)
        log.close()
