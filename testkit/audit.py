"""The checkpoint audit (``python -m fedagent_flwr.checkpoint.verify RUN_DIR``) run inside the test
process.

The end-to-end tests audit every run they check. As a subprocess each audit paid for a fresh
interpreter importing torch (9.6 s of CPU, 77 s of wall time for a 2-round run's audit on the
shared 2-core machine at load 13); in the test process torch is already imported. The command's
``main`` is called with the same argument and its output captured, so the tests read the same exit
status and lines.
``tests/e2e/test_simulation.py`` still runs the command itself, as a user would.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
from pathlib import Path

from fedagent_flwr.checkpoint.verify import main as verify_main


def audit_run(run_dir: Path) -> subprocess.CompletedProcess[str]:
    """The audit of ``run_dir``: its exit status, stdout and stderr, as ``subprocess.run`` gives them."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        returncode = verify_main([str(run_dir)])
    return subprocess.CompletedProcess(["python", "-m", "fedagent_flwr.checkpoint.verify", str(run_dir)],
                                       returncode, stdout.getvalue(), stderr.getvalue())
