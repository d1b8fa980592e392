"""The token bounds an episode is played under, one object for every caller of the episode runners.

verl's agent loop plays under two budgets, ``data.max_prompt_length`` (P, the backend's
``trainer.max_prompt_length``) and ``data.max_response_length`` (R), in a context of P + R; the CPU
reference trainer under one, ``trainer.max_model_len``. :class:`TokenBounds` carries either, and
:meth:`TokenBounds.prompt_response` is the one place that derives verl's, used by the agent loop that
trains and by the verl backend's settings that the Hugging Face evaluator validates with: validation
plays the episodes training would play, cut where training cuts them.

What each bound does in each runner (no prompt is ever truncated; a turn that would not fit is not
started and the episode ends ``truncated``):

* ``max_model_len``: a turn's prompt plus ``max_new_tokens`` must fit (both modes).
* ``max_prompt_len``: concat mode, the first prompt (system prompt + reset observation) must fit;
  windowed mode, every turn's window prompt.
* ``max_response_len``: concat mode, everything after the first prompt (replies and observations)
  must fit with the next turn's ``max_new_tokens``; windowed mode, a turn samples at most this many
  tokens (its response is its reply alone), as verl's windowed loop caps ``max_new_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenBounds:
    """An episode's token budgets: the context, and optionally the prompt and the response (None: no
    bound of its own beyond ``max_model_len``)."""

    max_model_len: int
    max_prompt_len: int | None = None
    max_response_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_prompt_len", "max_response_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def prompt_response(cls, prompt_len: int, response_len: int) -> TokenBounds:
        """verl's bounds: a prompt of at most ``prompt_len`` tokens and a response of at most
        ``response_len``, in a context of their sum (verl pads every row to that shape)."""
        return cls(prompt_len + response_len, prompt_len, response_len)
