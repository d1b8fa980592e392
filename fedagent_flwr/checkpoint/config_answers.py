"""What transformers says about a model config, kept in the user cache across processes.

The ServerApp asks transformers two things about the configs it meets at its first aggregation:
a config as its config class reads it (``model_files.check_model_config``) and the weights its model
ties (``hf_files.tied_weight_keys``). Either imports transformers' model classes (its config
classes import them too, through their docstrings): ~3 s of CPU on round 1's critical path of every
run, for the same base model again and again. An answer is a function of the config file's bytes
and the transformers version only, so it is kept under that key in ``cache_dir()/config-answers``
and read by later processes. Not kept: configs with remote code (``auto_map``: the answer depends
on more files), answers that do not survive a JSON round trip unchanged, and anything when the
cache cannot be written (best effort: a missing entry only costs the next process that time). A
kept answer that does not have the shape of one is asked again (the callers check).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_log = logging.getLogger(__name__)

# Part of every key: raised whenever how an answer is computed or stored changes, so entries kept by
# an older version of this code are never read as this version's answers.
ANSWER_FORMAT = 1


def answer_file(question: str, config_bytes: bytes, raw: Any) -> Path | None:
    """Where transformers' answer to ``question`` about this config is kept; None when it cannot be
    kept (remote code, no transformers installed, no usable cache directory)."""
    # auto_map (remote code) and configuration_files (versioned config files beside config.json)
    # make transformers' answer depend on more than these bytes.
    if not isinstance(raw, dict) or "auto_map" in raw or "configuration_files" in raw:
        return None
    try:
        from importlib.metadata import version

        from fedagent_flwr.cache import cache_dir

        key = hashlib.sha256(f"{question}\nformat {ANSWER_FORMAT}\ntransformers {version('transformers')}\n".encode()
                             + config_bytes)
        return cache_dir() / "config-answers" / f"{question}-{key.hexdigest()}.json"
    except Exception as exc:  # PackageNotFoundError, an unwritable home
        _log.debug("no cache for config answers: %s", exc)
        return None


def read_answer(path: Path | None) -> Any | None:
    """The kept answer, or None when there is none (or it is unreadable: asked again)."""
    if path is None:
        return None
    try:
        return json.loads(path.read_text())["answer"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep_answer(path: Path | None, answer: Any) -> None:
    """Keep ``answer`` if it reads back from JSON exactly as it is (tuples, non-string keys and
    other types JSON changes are not kept: a read answer must equal a computed one)."""
    if path is None:
        return
    from fedagent_flwr.atomic import write_json_atomic

    try:
        if json.loads(json.dumps(answer)) != answer:
            return
        write_json_atomic(path, {"answer": answer})
    except (OSError, TypeError, ValueError) as exc:
        _log.debug("config answer not kept at %s: %s", path, exc)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' logging at error level while it is asked one of these questions (its warnings
    would only be noise in the run's log); the earlier level restored afterwards."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
