"""Building a WebShop world must not let JAX take a GPU (docs/gpu.md §7).

bm25s probes JAX when it is imported, and JAX reserves 75% of a GPU's memory at its first op; on
the H200 the ClientApp processes, which count a partition's goals by building the world, took
30 and 105 GiB that way and no verl session could start. Each case runs in a fresh interpreter,
as a ClientApp process would, so that nothing imported earlier in the test session decides it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from testkit.webshop_data import DATA_DIR, needs_data

_COUNT_GOALS = """
import json, os, sys
from fedagent_flwr.envs.registry import get_env_class
n = get_env_class("WebShop").num_goals({"split": "train", "data_dir": sys.argv[1]})
print(json.dumps({"goals": n, "jax_platforms": os.environ.get("JAX_PLATFORMS"),
                  "bm25s_imported": "bm25s" in sys.modules,
                  "jax_saw": getattr(sys.modules.get("jax"), "PLATFORMS_AT_IMPORT", "jax never imported")}))
"""
# A stand-in for JAX (not installed here) that records the platform setting it found when bm25s
# imported it, which is when the real JAX would pick its device: set any later, it is too late.
_FAKE_JAX = {
    "jax/__init__.py": "import os\nPLATFORMS_AT_IMPORT = os.environ.get('JAX_PLATFORMS')\n",
    "jax/lax.py": ("import numpy as np\n"
                   "def top_k(x, k):\n    i = np.argsort(-np.asarray(x))[:k]\n    return np.asarray(x)[i], i\n"),
}


def _count_goals(env: dict[str, str], fake_jax: Path) -> dict[str, object]:
    for name, text in _FAKE_JAX.items():
        (fake_jax / name).parent.mkdir(parents=True, exist_ok=True)
        (fake_jax / name).write_text(text)
    env = {**env, "PYTHONPATH": os.pathsep.join([str(fake_jax), *filter(None, [env.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", _COUNT_GOALS, str(DATA_DIR)], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_data
def test_counting_goals_imports_bm25s_with_jax_on_the_cpu(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    seen = _count_goals(env, tmp_path)
    assert seen["goals"] > 0
    assert seen["bm25s_imported"] is True  # the path that probes JAX really ran
    assert seen["jax_saw"] == "cpu"  # what JAX found when it was imported, i.e. when it picks a device
    assert seen["jax_platforms"] == "cpu"


@needs_data
def test_a_platform_the_user_chose_is_kept(tmp_path: Path) -> None:
    seen = _count_goals({**os.environ, "JAX_PLATFORMS": "cuda"}, tmp_path)
    assert seen["jax_saw"] == "cuda" and seen["jax_platforms"] == "cuda"
