"""tools/gpu/batch24_session.sh on CPU: valid bash that refuses to start without its settings, and
the two runs it launches compose, as ``arms.py launch`` builds them from its own ``--extra``, to
batch 24's declared plan (docs/results.md §4) before any GPU is touched."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from fedagent_flwr.config import load_settings
from testkit.gpu_tools import gpu_tool

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tools" / "gpu" / "batch24_session.sh"
WEBSHOP_DATA = REPO.parent / "shared" / "data" / "webshop"


def test_the_script_is_valid_bash_and_names_a_missing_setting(tmp_path: Path) -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    env = {"PATH": "/usr/bin:/bin"}
    no_out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env)
    assert no_out.returncode != 0 and "set OUT" in no_out.stderr
    no_seed = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                             env={**env, "OUT": str(tmp_path)})
    assert no_seed.returncode != 0 and "set SEED" in no_seed.stderr
    # a relative OUT is the caller's, not the repository root's the script changes to (bash -x shows it resolved)
    relative = subprocess.run(["bash", "-x", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                              env={**env, "OUT": "back"}, cwd=tmp_path)
    assert relative.returncode != 0 and f"OUT={tmp_path}/back" in relative.stderr
    assert list(tmp_path.iterdir()) == []  # refused before anything started or was written


@pytest.mark.skipif(not (WEBSHOP_DATA / "items_shuffle_1000.json").exists(),
                    reason=f"WebShop data not found at {WEBSHOP_DATA}")
def test_the_launched_runs_are_the_declared_ones(tiny_model_dir: Path) -> None:
    text = SCRIPT.read_text()
    (launch,) = re.findall(r"arms\.py launch (.*?)--extra \"(.*?)\"", text, flags=re.DOTALL)
    options, extra = launch
    assert "--recipe webshop_windowed_verl" in options and "--arms federated local" in options
    assert '--seeds "$SEED"' in options
    # the warm start trains with the session's seed, as seeds 4 and 5 did (warm_start-s4/-s5 json: seed 4, 5)
    assert "SEED=$SEED timeout -k 10 420 bash tools/gpu/webshop_warm_start.sh /tmp/ws-warm" in text
    runs_dir = REPO / "docs" / "gpu-runs" / "2026-12-06" / "webshop-fed-vs-local"
    for seed, card in ((4, "h100"), (5, "h200")):
        assert json.loads((runs_dir / f"warm_start-s{seed}-{card}.json").read_text())["seed"] == seed
    # The node's paths, here: the shared WebShop data and a real model directory for the warm start's.
    assert "model.path=/tmp/ws-warm" in extra and "env.data_dir=$PWD/.gpu-data/webshop" in extra
    extra = extra.replace("$PWD/.gpu-data/webshop", str(WEBSHOP_DATA)).replace("/tmp/ws-warm", str(tiny_model_dir))
    runs = gpu_tool("arms").plan("webshop_windowed_verl", [6], ["federated", "local"], extra, 39500)
    experiments = {}
    for run in runs:
        settings = load_settings("config", run["overrides"])
        assert settings.run.num_rounds == 5 and settings.trainer["lr"] == pytest.approx(1e-5), run["name"]
        assert settings.raw["model"]["path"] == str(tiny_model_dir) and settings.raw["seed"] == 6
        experiments[run["arm"]] = (settings.raw["experiment"]["name"], run["sessions"])
    # local: client 0 of the same 2-client partition trains alone (one verl session)
    assert experiments == {"federated": ("federated", 2), "local": ("local", 1)}
