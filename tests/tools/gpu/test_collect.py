"""``tools/gpu/collect.sh`` packs under a temporary name and renames: a session's wait calls re-pack
the same archive, and one cut off mid-pack must leave the last complete archive, not a truncated one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from testkit.gpu_tools import GPU_TOOLS, collected

#: this interpreter's folder first, so the script's python3 is the test's
PATH = f"{Path(sys.executable).parent}:{os.environ['PATH']}"


def _run(out: Path | str, archive: Path | str, path: str = PATH,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``OUT=out collect.sh archive`` with ``path`` as PATH, from ``cwd``."""
    return subprocess.run(["bash", str(GPU_TOOLS / "collect.sh"), str(archive)], cwd=cwd,
                          env={**os.environ, "OUT": str(out), "PATH": path}, capture_output=True, text=True,
                          timeout=300)


def test_a_failed_pack_keeps_the_previous_archive_and_leaves_no_partial_file(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = out / "runs" / "federated-s9"
    run.mkdir(parents=True)
    (run / "federated_summary.json").write_text('{"status": "completed"}\n')
    (out / "session.log").write_text("round 1 of 5\n")
    work = tmp_path / "work"
    work.mkdir()
    results = collected(out, work)  # a first, complete archive at work/r.tgz
    assert (results / "federated-s9" / "federated_summary.json").read_text() == '{"status": "completed"}\n'
    before = (work / "r.tgz").read_bytes()

    # the next pack dies part-way: this tar writes some bytes to its output, then fails, as a tar
    # killed by the call's time limit or a full disk would
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "tar").write_text('#!/bin/bash\nwhile [ $# -gt 0 ]; do [ "$1" = czf ] && { printf partial > "$2"; '
                              'exit 1; }; shift; done\nexit 1\n')
    (fake / "tar").chmod(0o755)
    (out / "session.log").write_text("round 2 of 5\n")
    failed = _run(out, work / "r.tgz", f"{fake}:{PATH}")
    assert failed.returncode == 1 and "any previous archive is kept" in failed.stderr
    assert (work / "r.tgz").read_bytes() == before
    assert sorted(p.name for p in work.iterdir()) == ["r.tgz", "unpacked"]

    # a TERM mid-pack (the call's time limit): the script stops, and its partial file goes with it;
    # one left by a call killed outright (SIGKILL, no trap) is removed by the next pack
    (fake / "tar").write_text('#!/bin/bash\nwhile [ $# -gt 0 ]; do [ "$1" = czf ] && { printf partial > "$2"; '
                              'kill -TERM $PPID; exit 1; }; shift; done\nexit 1\n')
    stopped = _run(out, work / "r.tgz", f"{fake}:{PATH}")
    assert stopped.returncode == 143, stopped.stderr
    assert (work / "r.tgz").read_bytes() == before
    assert sorted(p.name for p in work.iterdir()) == ["r.tgz", "unpacked"]
    (work / ".r.tgz.partial.12345").write_bytes(b"left by a killed call")

    # and a pack that succeeds replaces it
    packed = _run(out, work / "r.tgz")
    assert packed.returncode == 0, packed.stderr
    with tarfile.open(work / "r.tgz") as archive:
        log = archive.extractfile("results/session.log.tail")
        assert log is not None and log.read() == b"round 2 of 5\n"
    assert sorted(p.name for p in work.iterdir()) == ["r.tgz", "unpacked"]

    # a relative OUT and ARCHIVE are the caller's
    here = _run("out", "work/here.tgz", cwd=tmp_path)
    assert here.returncode == 0, here.stderr
    with tarfile.open(work / "here.tgz") as archive:
        assert "results/federated-s9/federated_summary.json" in archive.getnames()


def _posix_mv(folder: Path) -> str:
    """A PATH whose ``mv`` has only the options POSIX (and BSD, macOS) mv has: ``-T`` (GNU's "treat the
    target as a file") is refused as BSD mv refuses it; otherwise the real mv, which without ``-T``
    moves a file INTO a target that is a directory, as every mv does."""
    real = shutil.which("mv")
    assert real is not None
    folder.mkdir()
    (folder / "mv").write_text(
        "#!/bin/bash\nfor arg in \"$@\"; do case $arg in\n"
        "  --) break ;;\n"
        "  --*) echo \"mv: illegal option -- ${arg#--}\" >&2; exit 64 ;;\n"
        "  -*T*) echo 'mv: illegal option -- T' >&2; exit 64 ;;\n"
        "  -*) ;;\n"
        "  *) break ;;\n"
        f"esac; done\nexec {real} \"$@\"\n")
    (folder / "mv").chmod(0o755)
    return f"{folder}:{PATH}"


def test_packs_with_a_posix_mv_and_refuses_a_directory_as_the_archive(tmp_path: Path) -> None:
    """collect.sh renames its archive into place with the options every mv has (it used GNU's ``-T``,
    so with BSD's or macOS's mv no archive was ever packed). What ``-T`` guarded against, a directory
    at ARCHIVE that a plain mv would move the archive INTO, reporting success, is refused before
    packing, with any mv, leaving the directory as it was."""
    out = tmp_path / "out"
    (out / "runs" / "federated-s9").mkdir(parents=True)
    (out / "runs" / "federated-s9" / "federated_summary.json").write_text('{"status": "completed"}\n')
    path = _posix_mv(tmp_path / "bin")

    packed = _run(out, tmp_path / "r.tgz", path)
    assert packed.returncode == 0, packed.stderr
    with tarfile.open(tmp_path / "r.tgz") as archive:
        assert "results/federated-s9/federated_summary.json" in archive.getnames()

    taken = tmp_path / "taken"
    taken.mkdir()
    link = tmp_path / "link"
    link.symlink_to(taken)
    for archive_path, mv_path in ((taken, path), (taken, PATH), (link, path)):
        refused = _run(out, archive_path, mv_path)
        assert refused.returncode == 1
        assert refused.stderr == (f"collect.sh: {archive_path} is a directory: name a file for the archive; "
                                  "nothing packed\n")
        assert list(taken.iterdir()) == [] and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "link", "out", "r.tgz", "taken"]
