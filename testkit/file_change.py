"""Changing a file in place the way a stat-keyed cache must notice: one byte's bits flipped, its
size and inode kept, its mtime put back if asked (``utime``), so that only ``ctime`` shows the
change. Used by the tests of the audit's digests (:mod:`fedagent_flwr.checkpoint.audit_digests`).

The change is made only once the filesystem's clock has moved past the file's ``ctime``: on a
kernel with coarse timestamps (one timer tick, before Linux 6.13's fine-grained ones) a write in the
same tick as the file's last change keeps its ``ctime``, and a test of "a changed file is hashed
again" would then fail for the clock's sake, not the code's."""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["flip_byte"]


def _past_ctime(path: Path, limit_s: float = 5.0) -> None:
    """Wait until a file written beside ``path`` gets a ``ctime`` later than ``path``'s."""
    probe = path.with_name(f".tick-{path.name}")
    deadline = time.monotonic() + limit_s
    try:
        while True:
            probe.write_bytes(b"")
            if probe.stat().st_ctime_ns > path.stat().st_ctime_ns:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the filesystem's ctime of {probe} did not move past {path}'s in {limit_s} s")
            time.sleep(0.001)
    finally:
        probe.unlink(missing_ok=True)


def flip_byte(path: Path, restore_mtime: bool, at: int = 0) -> None:
    """Flip the bits of byte ``at`` of ``path`` in place (negative: from the end); its size and inode
    kept; its mtime restored if ``restore_mtime``. Its ``ctime`` moves (asserted)."""
    _past_ctime(path)
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    with open(path, "r+b") as handle:
        handle.write(bytes(data))
    if restore_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)
    assert (after.st_mtime_ns == before.st_mtime_ns) == restore_mtime
    assert after.st_ctime_ns != before.st_ctime_ns
