"""``fedagent warm-start`` refuses bad flags, an unusable --model and an --out it could never write,
with one line naming the flag, before any training (test_warm_start.py tests the rest)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.trainers.common import warm_start as ws
from fedagent_flwr.trainers.common import warm_start_output as wso
from testkit.guess_conversations import CONVERSATIONS
from testkit.torch_state import deterministic_algorithms_restored


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "expert.jsonl"
    path.write_text("".join(json.dumps({"messages": m, "reward": 1.0}) + "\n" for m in CONVERSATIONS))
    return path


@pytest.fixture(autouse=True)
def _restore_deterministic_algorithms() -> Iterator[None]:
    """The command turns on torch's deterministic algorithms (process-wide); put them back."""
    yield from deterministic_algorithms_restored()


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records every call of the training loop (which then does nothing): bad input must stop before it."""
    calls: list[int] = []

    def train(*args: Any, **kwargs: Any) -> ws.TrainStats:
        calls.append(1)
        return ws.TrainStats(steps=1, epoch_losses=[0.0], first_step_loss=0.0, last_step_loss=0.0)

    monkeypatch.setattr(ws, "train", train)
    return calls


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The command's stderr, asserted to be one ``fedagent warm-start:`` line."""
    err = capsys.readouterr().err
    assert err.startswith("fedagent warm-start: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("below", ["ws", "sub/ws"])
def test_an_out_under_a_regular_file_is_refused_before_training(
        tiny_model_dir: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        no_training: list[int], below: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    out = afile / below
    assert ws.main(["--data", str(data), "--model", str(tiny_model_dir), "--out", str(out), "--device", "cpu"]) == 1
    assert one_line(capsys) == (f"fedagent warm-start: --out {out}: {afile} is a file, not a directory; "
                                "give a path inside a directory\n")
    assert no_training == [] and afile.read_text() == "keep me\n"


def test_the_scripts_out_check_refuses_an_out_under_a_regular_file(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    assert wso.main([str(tmp_path / "afile" / "ws")]) == 2
    assert "afile is a file, not a directory" in capsys.readouterr().err
    assert wso.main([str(tmp_path / "new" / "deeper" / "ws")]) == 0  # missing parents are made when saving


@pytest.mark.parametrize(("flag", "other"), [("--lr", "--max-grad-norm"), ("--max-grad-norm", "--lr")])
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_bad_lr_or_max_grad_norm_names_only_that_flag(flag: str, other: str, value: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        ws.parse_args(["--data", "d.jsonl", "--out", str(tmp_path / "warm"), flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert f"{flag} must be" in err and other not in err and err.endswith(f"got {float(value)}")


def test_a_min_reward_of_nan_is_refused_as_it_would_keep_every_line(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        ws.parse_args(["--data", "d.jsonl", "--out", str(tmp_path / "warm"), "--min-reward", "nan"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("--min-reward must be a number, got nan: it would keep "
                                                             "every line")
    kept = ws.parse_args(["--data", "d.jsonl", "--out", str(tmp_path / "warm"), "--min-reward", "0.5"])
    assert kept.min_reward == 0.5


def _without(tiny_model_dir: Path, tmp_path: Path, keep: tuple[str, ...]) -> Path:
    """A copy of the tiny model directory holding only the files named in ``keep``."""
    base = tmp_path / "base"
    base.mkdir()
    for name in keep:
        shutil.copy(tiny_model_dir / name, base / name)
    return base


@pytest.mark.parametrize(("keep", "error"), [
    ((), "holds no model (no config.json)"),  # was transformers' advice to install sentencepiece
    (("config.json",), "holds no tokenizer (none of tokenizer_config.json, "),  # was "no chat template"
    (("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"),
     "cannot load the model in"),  # no weights: was an OSError traceback
])
def test_a_model_directory_without_a_model_is_one_line_naming_model(
        tiny_model_dir: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        no_training: list[int], keep: tuple[str, ...], error: str) -> None:
    base = _without(tiny_model_dir, tmp_path, keep)
    assert ws.main(["--data", str(data), "--model", str(base), "--out", str(tmp_path / "warm"),
                    "--device", "cpu"]) == 1
    err = one_line(capsys)
    assert err.startswith("fedagent warm-start: --model") and error in err
    assert no_training == [] and not (tmp_path / "warm").exists()
