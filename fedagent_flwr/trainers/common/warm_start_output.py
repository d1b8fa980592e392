"""Where ``fedagent warm-start`` writes its model: the output directory's check and its crash-safe
replacement.

Its own module because it is its own concern and needs no torch: ``tools/gpu/webshop_warm_start.sh``
asks :func:`check_out_dir` (``python -m fedagent_flwr.trainers.common.warm_start_output OUT_DIR``)
before minutes of expert episodes, so a folder it may not replace is refused before any work.

``--force`` replaces only an earlier warm start's output: the directory is replaced whole, so a
folder of other things (``--out ~/models``, a folder of run records that merely holds a copy of a
``warm_start.json``) must never qualify. An earlier output is recognised by what :func:`save_output`
writes: the record, the model's ``config.json`` and its safetensors weights.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from fedagent_flwr.atomic import fsync_dir, fsync_file, parent_problem, temporary_dir, write_json_atomic

__all__ = ["RECORD_FILE", "WarmStartError", "check_out_dir", "check_out_parent", "is_earlier_output", "save_output"]

RECORD_FILE = "warm_start.json"


class WarmStartError(ValueError):
    """Bad input or output for the warm start; the message is the one line the command prints."""


def is_earlier_output(out: Path) -> bool:
    """Whether ``out`` holds what :func:`save_output` writes: the record, ``config.json`` and weights."""
    return ((out / RECORD_FILE).is_file() and (out / "config.json").is_file()
            and any(out.glob("*.safetensors")))


def check_out_parent(out: Path) -> None:
    """WarmStartError unless ``out``'s parent exists as a writable directory or can be made in one:
    :func:`save_output` makes it only once training is over, which a failure then would cost."""
    if problem := parent_problem(out):
        raise WarmStartError(f"--out {out}: {problem}")


def check_out_dir(out: Path, force: bool) -> None:
    """WarmStartError if ``out``'s parent cannot hold it (:func:`check_out_parent`), if ``out`` is a
    file, or a non-empty directory unless ``force`` is set and it is an earlier warm start's output
    (:func:`is_earlier_output`)."""
    check_out_parent(out)
    if out.exists() and not out.is_dir():
        raise WarmStartError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (force and is_earlier_output(out)):
        raise WarmStartError(f"--out {out} exists and is not empty; " + (
            f"it is not an earlier warm start's output (a model with its {RECORD_FILE}), the only kind "
            "--force replaces: name a new directory" if force else "pass --force to replace it"))


def save_output(model: Any, tokenizer: Any, record: dict[str, Any], out: Path) -> None:
    """Write model, tokenizer and ``warm_start.json`` to a temporary directory beside ``out``, fsync
    its files and itself, then rename it to ``out`` and fsync the parent, so that a renamed ``out``
    is never missing bytes after a crash. An existing ``out`` is moved aside first (two renames: a
    directory cannot replace a non-empty one) and removed only once the new one is in place; if
    that last rename fails it is moved back, and a crash between the two leaves it under
    ``.<name>.old-*``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = temporary_dir(out.parent, f".{out.name}.tmp-")
    aside: Path | None = None
    try:
        model.save_pretrained(str(staged))
        tokenizer.save_pretrained(str(staged))
        write_json_atomic(staged / RECORD_FILE, record)
        for path in sorted(staged.rglob("*"), reverse=True):  # files before the directories holding them
            (fsync_dir if path.is_dir() else fsync_file)(path)
        fsync_dir(staged)
        if out.exists():
            aside = temporary_dir(out.parent, f".{out.name}.old-")
            os.replace(out, aside / out.name)
        try:
            os.replace(staged, out)
        except BaseException:
            if aside is not None:  # put the previous output back; if even that fails, leave it aside
                previous, aside = aside, None
                os.replace(previous / out.name, out)
                shutil.rmtree(previous, ignore_errors=True)
            raise
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m fedagent_flwr.trainers.common.warm_start_output OUT_DIR``: exit 0 if a forced warm
    start may write ``OUT_DIR``, else 2 with one line saying why."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fedagent_flwr.trainers.common.warm_start_output OUT_DIR", file=sys.stderr)
        return 2
    try:
        check_out_dir(Path(args[0]), force=True)
    except WarmStartError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
