"""The ``fedagent`` console script: every command reaches its module's own ``main``."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedagent_flwr import cli

REPO = Path(__file__).resolve().parents[1]


def test_the_console_script_is_declared_and_every_command_has_a_main() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fedagent"] == "fedagent_flwr.cli:main"
    for name, (module, summary) in cli.COMMANDS.items():
        assert callable(importlib.import_module(module).main), name
        assert summary and name in cli.usage()


def test_unknown_command_is_refused_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["verfiy"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'verfiy'" in err and "verify" in err
    assert cli.main([]) == 2 and cli.main(["--help"]) == 0


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_commands_usage_names_a_way_to_run_it(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``fedagent NAME --help`` prints a usage line naming the command as it was run, ``fedagent
    NAME``: never a bare ``fedagent`` (which would run no command), nor the module path."""
    program = sys.argv[0]
    with pytest.raises(SystemExit) as done:
        cli.main([name, "--help"])
    assert done.value.code == 0 and sys.argv[0] == program  # put back, also after the command's exit
    usage = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("usage:"))
    assert usage.startswith(f"usage: fedagent {name} "), usage


def test_a_module_run_by_itself_names_itself() -> None:
    proc = subprocess.run([sys.executable, "-m", "fedagent_flwr.outcome", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m fedagent_flwr.outcome "), proc.stdout


def test_installed_script_builds_the_smoke_model(tmp_path: Path) -> None:
    """The installed ``fedagent`` (next to this interpreter) runs a command end to end."""
    script = Path(sys.executable).parent / "fedagent"
    if not script.exists():
        if os.environ.get("CI"):  # CI installs the package fresh: a missing script is a packaging bug
            pytest.fail(f"{script} is not installed")
        pytest.skip(f"{script} is not installed: reinstall the package (pip install -e .)")
    done = subprocess.run([str(script), "tiny-model", str(tmp_path / "tiny"), "--seed", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "tiny"))
    assert model.config.num_hidden_layers == 2
    assert AutoTokenizer.from_pretrained(str(tmp_path / "tiny")).eos_token == "<|im_end|>"


def test_the_smoke_model_replaces_only_a_smoke_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Written again over a tiny model it replaces it; a directory holding anything else (a real
    model, whose weight shards transformers' save would delete) is refused, nothing touched."""
    from fedagent_flwr.models import tiny

    assert tiny.main([str(tmp_path / "tiny"), "--seed", "1"]) == 0
    assert tiny.main([str(tmp_path / "tiny"), "--seed", "2"]) == 0
    real = tmp_path / "Qwen2.5-7B"
    real.mkdir()
    files = {"config.json": '{"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28}',
             "model-00001-of-00004.safetensors": "weights"}
    for name, text in files.items():
        (real / name).write_text(text)
    capsys.readouterr()
    assert tiny.main([str(real)]) == 2
    assert f"tiny-model: {real} exists and is not an empty directory or a tiny model" in capsys.readouterr().err
    assert {p.name: p.read_text() for p in real.iterdir()} == files
