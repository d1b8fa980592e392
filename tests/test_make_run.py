"""What `make run` hands to `flwr run`: the default job with the persistent reference trainer.

The Makefile's command line is read with `make -n` (nothing runs), its `--run-config` values are
parsed by Flower's own parser and composed by the real Hydra config, so a quoting slip in the
Makefile, or a key the config no longer accepts, fails here rather than in a user's first run.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.common.config import parse_config_args

from fedagent_flwr.config import load_settings
from fedagent_flwr.run_config import hydra_arguments
from testkit.app_config import declared_run_config

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _flwr_run_arguments(*make_args: str) -> list[str]:
    """The arguments `make run` passes to `flwr run` (after `run . --stream`), from `make -n`."""
    venv = Path(sys.executable).parent.parent  # `make -n` only prints `install`'s steps
    printed = subprocess.run(
        ["make", "-s", "-n", "-C", str(REPO), "run", f"VENV={venv}", *make_args],
        capture_output=True, text=True, check=True,
    ).stdout
    lines = [line for line in printed.replace("\\\n", " ").splitlines() if "flwr run . --stream" in line]
    assert len(lines) == 1, printed
    words = shlex.split(lines[0].split(";")[0])  # the outcome wrapper's command line
    return words[words.index("--stream") + 1:]


def _run_config(arguments: list[str]) -> dict[str, object]:
    """What the ServerApp's run config holds for these `flwr run` arguments."""
    values = [arguments[i + 1] for i, word in enumerate(arguments) if word == "--run-config"]
    return {**declared_run_config(), **parse_config_args(values)}


def test_make_run_uses_the_persistent_reference_trainer() -> None:
    arguments = _flwr_run_arguments()
    settings = load_settings(*hydra_arguments(_run_config(arguments)))
    assert settings.trainer_backend == "reference"
    assert settings.trainer["mode"] == "persistent"
    # The job itself is the default one: nothing but the trainer's mode is set.
    default = load_settings("config", [])
    assert settings.run.num_rounds == default.run.num_rounds == 2
    assert settings.run.clients.total == default.run.clients.total == 2
    assert settings.val_env_spec == default.val_env_spec
    assert {k: v for k, v in settings.trainer.items() if k != "mode"} == {
        k: v for k, v in default.trainer.items() if k != "mode"}


def test_make_run_args_merge_with_it_and_an_empty_run_config_drops_it() -> None:
    merged = _run_config(_flwr_run_arguments("ARGS=--run-config \"num-server-rounds=3 strategy='fedprox'\""))
    settings = load_settings(*hydra_arguments(merged))
    assert settings.trainer["mode"] == "persistent" and settings.run.num_rounds == 3
    assert _flwr_run_arguments("RUN_CONFIG=") == []
    assert load_settings(*hydra_arguments(_run_config([]))).trainer["mode"] == "subprocess"
