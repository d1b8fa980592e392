"""tools/gpu/vllm_repro.py compare: the counts docs/results.md quotes, from the committed probe outputs.

The probe itself needs the GPU node's vLLM; its comparison runs anywhere, on the token ids it wrote.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.gpu_tools import gpu_tool

REPO = Path(__file__).resolve().parents[3]
PROBES = REPO / "docs" / "gpu-runs" / "2026-12-04" / "vllm-repro"
TOOL = REPO / "tools" / "gpu" / "vllm_repro.py"


def _compare(*files: Path) -> list[str]:
    done = subprocess.run([sys.executable, str(TOOL), "compare", *map(str, files)],
                          capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def test_compare_prints_the_committed_probes_counts() -> None:
    lines = _compare(PROBES / "bi0.json", PROBES / "bi1a.json", PROBES / "bi1b.json")
    assert lines == [
        "bi0 (VLLM_BATCH_INVARIANT='0'): one batch twice: 128/128 requests identical; "
        "one batch vs reversed in 16s: 128/128 requests identical",
        "bi1a (VLLM_BATCH_INVARIANT='1'): one batch twice: 128/128 requests identical; "
        "one batch vs reversed in 16s: 97/128 requests identical",
        "bi1b (VLLM_BATCH_INVARIANT='1'): one batch twice: 128/128 requests identical; "
        "one batch vs reversed in 16s: 97/128 requests identical",
        "bi0 vs bi1a, one batch each: 56/128 requests identical",
        "bi0 vs bi1b, one batch each: 54/128 requests identical",
        "bi1a vs bi1b, one batch each: 117/128 requests identical",
    ]


def test_compare_counts_a_request_that_differs_in_one_token(tmp_path: Path) -> None:
    record = json.loads((PROBES / "bi0.json").read_text())
    assert record["requests"] == 128 and all(len(run) == 128 for run in record["runs"].values())
    changed = json.loads(json.dumps(record))
    changed["label"] = "edited"
    changed["runs"]["one-batch"][5][-1] += 1  # the last token of one request
    changed["runs"]["reversed-16s"][7][0] += 1  # the first token of another
    (tmp_path / "edited.json").write_text(json.dumps(changed))
    lines = _compare(PROBES / "bi0.json", tmp_path / "edited.json")
    assert lines[1] == ("edited (VLLM_BATCH_INVARIANT='0'): one batch twice: 127/128 requests identical; "
                        "one batch vs reversed in 16s: 126/128 requests identical")
    assert lines[2] == "bi0 vs edited, one batch each: 127/128 requests identical"


def test_compare_refuses_runs_of_different_lengths(tmp_path: Path) -> None:
    """A run with a request missing is bad input (exit 2, one line naming both lengths), not a count
    over the requests both runs happen to reach (zip would stop at the shorter one)."""
    record = json.loads((PROBES / "bi0.json").read_text())
    short = json.loads(json.dumps(record))
    short["label"] = "short"
    del short["runs"]["one-batch"][-1]  # 127 requests in one run, 128 in the others
    (tmp_path / "short.json").write_text(json.dumps(short))
    done = subprocess.run([sys.executable, str(TOOL), "compare", str(tmp_path / "short.json")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "vllm_repro: runs of 127 and 128 requests cannot be compared request by request"
    with pytest.raises(ValueError, match="runs of 128 and 127 requests"):
        gpu_tool("vllm_repro")._same(record["runs"]["one-batch"], short["runs"]["one-batch"])
