"""Test-only crash points: let a crash test SIGKILL the ServerApp at a named point of a round.

The resume tests kill the ServerApp in windows far too short to hit from outside (between the
rename of a new global model and its record; inside the summary write that commits a round).
``$FEDAGENT_CRASH_FILE`` names a file that holds one point, e.g. ``aggregated@2``. The first
time the ServerApp reaches that point it deletes the file, so the re-run that follows goes
through, and kills its own process with SIGKILL, exactly as an external ``kill -9`` would: no
handler, no ``finally`` runs. Without the variable or without the file a crash point does
nothing; production runs never set it.

Points (``<name>@<round>``):

- ``aggregated@r``: round r's global model is renamed into place, its record not yet written.
- ``commit@r``: the summary that commits round r is fully written to its temporary name, not
  yet renamed over the old summary.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

CRASH_FILE_ENV = "FEDAGENT_CRASH_FILE"


def crash_point(name: str) -> None:
    """SIGKILL this process if ``$FEDAGENT_CRASH_FILE`` exists and names ``name`` (test-only)."""
    path = os.environ.get(CRASH_FILE_ENV)
    if not path:
        return
    trigger = Path(path)
    try:
        armed = trigger.read_text().strip() == name
    except OSError:  # no file: nothing armed
        return
    if armed:
        trigger.unlink(missing_ok=True)  # one shot: the re-run must get past this point
        os.kill(os.getpid(), signal.SIGKILL)
