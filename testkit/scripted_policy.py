"""A scripted policy for the episode runners: fixed reply texts, each ended by EOS as a chat model ends
its turns (shared by the rollout tests of ``run_episode`` and ``tokenize_conversation``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fedagent_flwr.rollout import SamplingParams


def scripted_policy(tokenizer: Any, replies: list[str]) -> tuple[Any, list[list[int]]]:
    """A ``GenerateFn`` that answers with ``replies`` in order, and the list of the ids it returned."""
    sent: list[list[int]] = []
    texts: Iterator[str] = iter(replies)

    async def generate(prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
        ids = tokenizer.encode(next(texts), add_special_tokens=False) + [tokenizer.eos_token_id]
        sent.append(ids)
        return ids

    return generate, sent
