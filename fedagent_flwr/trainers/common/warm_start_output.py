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

import sys
from pathlib import Path
from typing import Any

from fedagent_flwr.atomic import parent_problem, replace_dir, write_json_atomic

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
    """Write model, tokenizer and ``warm_start.json`` to ``out`` through
    :func:`~fedagent_flwr.atomic.replace_dir`, so that a renamed ``out`` is never missing bytes after a
    crash and an earlier output is kept until the new one is in place."""
    def write(staged: Path) -> None:
        model.save_pretrained(str(staged))
        tokenizer.save_pretrained(str(staged))
        write_json_atomic(staged / RECORD_FILE, record)

    replace_dir(out, write)


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
