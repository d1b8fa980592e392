"""The multi-turn episode runner ("concat mode"): one training sample per episode.

Shared by the verl agent loop and the CPU reference trainer, so both train on exactly the same
token layout:

* ``prompt_ids`` = chat template of ``[system: env.system_prompt(), user: reset observation]``
  with the generation prompt;
* ``response_ids`` = every turn's sampled tokens, **exactly as sampled** (mask 1), each followed,
  unless the episode ends there, by the template glue that closes the assistant turn and wraps
  the next observation as a user turn (mask 0).

The glue is derived from the chat template *as text*: the conversation is rendered before and
after adding the assistant reply and the observation, and only the new suffix is tokenised. The
sampled tokens are never re-tokenised, so the policy is trained on the very tokens it produced.
That relies on the template only ever extending its previous output; a template that rewrites
earlier turns is refused with :class:`ChatTemplateError` naming the tokenizer.

No silent truncation: a turn starts only if its prompt plus ``max_new_tokens`` fits in
``max_model_len``; otherwise the episode stops with ``truncated=True``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedagent_flwr.envs.base import BaseTextEnv


class ChatTemplateError(ValueError):
    """A chat template whose output for a longer conversation does not extend the shorter one."""


class ConversationError(ValueError):
    """A recorded conversation that cannot be laid out as an episode (see :func:`tokenize_conversation`)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one turn is sampled: at most ``max_new_tokens`` tokens at ``temperature`` / ``top_p``.

    ``temperature <= 0`` means greedy decoding.
    """

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


#: ``generate(prompt_ids, sampling)`` -> ids of the new tokens only (a final EOS included, as
#: vLLM and ``model.generate`` return it), at most ``sampling.max_new_tokens`` of them.
GenerateFn = Callable[[list[int], SamplingParams], Awaitable[list[int]]]


async def generate_turn(generate: GenerateFn, prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
    """One turn's new token ids from ``generate``; ValueError if it broke its bound (``max_new_tokens``)."""
    new_ids = [int(i) for i in await generate(list(prompt_ids), sampling)]
    if len(new_ids) > sampling.max_new_tokens:
        raise ValueError(f"generate returned {len(new_ids)} tokens for max_new_tokens={sampling.max_new_tokens}")
    return new_ids


def stop_token_ids(tokenizer: Any, eos_token_ids: Iterable[int] | None) -> set[int]:
    """The ids that end a turn: ``eos_token_ids``, by default the tokenizer's EOS (left out if it has none)."""
    stop_ids = set(eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id])
    stop_ids.discard(None)
    return stop_ids


def model_stop_ids(tokenizer: Any, generation_eos: int | Iterable[int] | None) -> tuple[int, ...]:
    """The ids a sampler ends a reply at, sorted: the generation config's ``eos_token_id`` (one id or
    a list; None when the model has none) and the tokenizer's EOS.

    Both samplers stop at this set: Hugging Face's ``generate`` and :class:`HFPolicy` at the
    generation config's ids, and vLLM, which adds the generation config's ids to every request's stop
    ids. Qwen2.5-Instruct lists two (``<|im_end|>`` and ``<|endoftext|>``), so a runner told only the
    tokenizer's EOS would record a reply ended with the second as cut short.
    """
    stop: set[int] = set()
    for source in (generation_eos, tokenizer.eos_token_id):
        if isinstance(source, int):
            stop.add(source)
        elif source is not None:
            stop.update(int(s) for s in source)
    return tuple(sorted(stop))


def stop_texts(tokenizer: Any, stop_ids: Iterable[int]) -> list[str]:
    """The text of each stop id, in id order (the order :func:`_reply_stop_id` tries them)."""
    return [tokenizer.decode([i], skip_special_tokens=False) for i in sorted(stop_ids)]


def leading_stop(closing: str, eos_texts: Sequence[str]) -> int | None:
    """Index of the first (non-empty) text of ``eos_texts`` that starts ``closing``, else None:
    which stop id :func:`tokenize_conversation` appends to a recorded reply (the one the template
    closes turns with, so that :meth:`ChatRenderer.glue` then strips exactly that text, as it does
    for a sampled reply that ended with it)."""
    for index, text in enumerate(eos_texts):
        if text and closing.startswith(text):
            return index
    return None


def require_chat_template(tokenizer: Any, where: str) -> None:
    """ChatTemplateError unless ``tokenizer`` has a chat template (``where`` names it in the message).

    Checked up front by the commands that render conversations (``fedagent webshop-expert``,
    ``fedagent warm-start``), so a template-less tokenizer fails with one line, not mid-run.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(f"the tokenizer in {where} has no chat template")


def windowed_turns(messages: Sequence[Mapping[str, str]]) -> list[tuple[Mapping[str, str], Mapping[str, str]]]:
    """The ``(window, reply)`` pairs of a windowed episode's transcript (user, assistant, user, ...).

    Each windowed turn is a prompt of its own (one user message, the window) and its reply, so a
    windowed transcript becomes one training sample per pair. ConversationError when the messages
    do not alternate user and assistant, starting with a user message.
    """
    pairs = list(zip(messages[0::2], messages[1::2]))
    if len(messages) % 2 or any(user.get("role") != "user" or reply.get("role") != "assistant"
                                for user, reply in pairs):
        raise ConversationError("a windowed transcript must alternate user and assistant messages, user first")
    return pairs


@dataclass
class TurnRecord:
    """What happened in one turn (kept for logs and debugging; not used for training)."""

    action: str
    observation: str
    reward: float
    done: bool
    info: dict[str, Any]
    num_tokens: int
    ended_with_eos: bool


@dataclass
class WindowSample:
    """One turn of a windowed episode as its own training sample.

    ``prompt_ids`` = the chat template of the turn's single user message (the windowed prompt) with
    the generation prompt; ``response_ids`` = the tokens sampled for it, all trained (mask 1).
    ``invalid`` marks a turn whose action the environment flagged invalid (``is_action_valid``).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    invalid: bool = False


@dataclass
class Episode:
    """One finished episode as a training sample plus its transcript.

    Concat mode: ``messages`` is the conversation that ``prompt_ids + response_ids`` encode (the
    last observation is in ``turns`` only, since no tokens follow it) and ``windows`` is empty.
    Windowed mode (:mod:`fedagent_flwr.rollout.windowed`): the samples are the ``windows``, one per
    turn; ``prompt_ids``/``response_ids``/``response_mask`` stay empty and ``messages`` is the
    transcript (each turn's windowed prompt and reply).
    """

    seed: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    reward: float
    success: bool
    num_turns: int
    truncated: bool
    messages: list[dict[str, str]]
    turns: list[TurnRecord] = field(default_factory=list)
    windows: list[WindowSample] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        """Training samples the episode gives: one per played turn in windowed mode (which leaves
        ``prompt_ids`` empty), the whole episode in concat mode."""
        return len(self.windows) if not self.prompt_ids else 1

    @property
    def trained_tokens(self) -> int:
        """Tokens the policy is trained on (mask 1) over all of the episode's samples."""
        return sum(self.response_mask) + sum(sum(w.response_mask) for w in self.windows)


def _tokenizer_name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template and derives turn glue."""

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any] | None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(template_kwargs or {})

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
        )

    def encode(self, text: str) -> list[int]:
        # The rendered template already holds every special token; adding BOS/EOS here would
        # differ from apply_chat_template(tokenize=True).
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        """The first prompt of an episode (``messages`` with the generation prompt), as text and ids."""
        text = self.render(messages, add_generation_prompt=True)
        return text, self.encode(text)

    def _extends(self, shorter: str, longer: str, step: str) -> str:
        if not longer.startswith(shorter):
            raise ChatTemplateError(
                f"the chat template of tokenizer {_tokenizer_name(self.tokenizer)!r} does not only "
                f"extend its previous output when {step}; multi-turn masks cannot be built from it"
            )
        return longer[len(shorter):]

    def closing(self, prompt_text: str, history: list[dict[str, str]], reply: str) -> tuple[str, str]:
        """The rendered ``history`` (ending with the assistant ``reply``) and the template's text that
        closes the reply (e.g. ChatML's ``<|im_end|>\\n``); ``prompt_text`` is the rendered history
        before the reply, with the generation prompt."""
        with_reply = self.render(history, add_generation_prompt=False)
        reply_part = self._extends(prompt_text, with_reply, "adding the assistant reply")
        if not reply_part.startswith(reply):
            raise ChatTemplateError(
                f"the chat template of tokenizer {_tokenizer_name(self.tokenizer)!r} does not render "
                "the assistant reply verbatim; multi-turn masks cannot be built from it"
            )
        return with_reply, reply_part[len(reply):]

    def glue(
        self,
        prompt_text: str,
        history: list[dict[str, str]],
        reply: str,
        observation: str,
        sampled_stop: str | None,
    ) -> tuple[str, str]:
        """Text between the sampled reply and the next generation, and the next prompt's text.

        ``history`` ends with the assistant ``reply``; ``prompt_text`` is the rendered history
        before that reply, with the generation prompt; ``sampled_stop`` is the text of the stop id
        that ended the reply (None when it was cut at ``max_new_tokens``).
        """
        with_reply, closing = self.closing(prompt_text, history, reply)
        if sampled_stop and closing.startswith(sampled_stop):
            # The sampled stop already closed the turn when the template closes turns with that very
            # token; any other stop (Qwen2.5 stops on <|endoftext|> as well as on its closing
            # <|im_end|>) is followed by the template's whole closing.
            closing = closing[len(sampled_stop):]
        next_prompt = self.render(
            [*history, {"role": "user", "content": observation}], add_generation_prompt=True
        )
        wrapped = self._extends(with_reply, next_prompt, "adding the next observation")
        return closing + wrapped, next_prompt


async def run_episode(
    env: BaseTextEnv,
    seed: int,
    tokenizer: Any,
    generate: GenerateFn,
    sampling: SamplingParams,
    max_turns: int,
    max_model_len: int,
    *,
    eos_token_ids: Iterable[int] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_response_len: int | None = None,
    max_prompt_len: int | None = None,
) -> Episode:
    """Play one episode of ``env`` (reset with ``seed``) with the policy behind ``generate``.

    ``eos_token_ids`` are the ids that end a turn (default: the tokenizer's EOS). The environment
    is closed when the episode ends, also on error, so pooled sessions always go back.
    ``max_response_len`` additionally bounds the tokens after the prompt (verl pads responses to
    a fixed ``response_length``): a turn that might not fit is not started (``truncated``).
    ``max_prompt_len`` bounds the first prompt (verl's ``prompt_length``): a longer one plays no
    turn (``truncated``, ``prompt_ids`` kept; :mod:`fedagent_flwr.rollout.bounds`).
    """
    response_budget = max_model_len if max_response_len is None else max_response_len
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    stop_ids = stop_token_ids(tokenizer, eos_token_ids)
    renderer = ChatRenderer(tokenizer, chat_template_kwargs)
    try:
        system = await env.system_prompt()
        observation, _ = await env.reset(seed)
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": observation},
        ]
        prompt_text, prompt_ids = renderer.prompt(messages)
        context = list(prompt_ids)
        response_ids: list[int] = []
        response_mask: list[int] = []
        turns: list[TurnRecord] = []
        reward, success = 0.0, False
        truncated = max_prompt_len is not None and len(prompt_ids) > max_prompt_len  # no turn is played

        while not truncated and len(turns) < max_turns:
            if (len(context) + sampling.max_new_tokens > max_model_len
                    or len(response_ids) + sampling.max_new_tokens > response_budget):
                truncated = True
                break
            new_ids = await generate_turn(generate, context, sampling)
            ended_with_eos = bool(new_ids) and new_ids[-1] in stop_ids
            sampled_stop = tokenizer.decode([new_ids[-1]], skip_special_tokens=False) if ended_with_eos else None
            response_ids += new_ids
            response_mask += [1] * len(new_ids)
            context += new_ids
            reply = tokenizer.decode(new_ids, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})

            observation, step_reward, done, info = await env.step(reply)
            reward += float(step_reward)
            success = success or bool(info.get("success", False))
            turns.append(
                TurnRecord(reply, observation, float(step_reward), bool(done), dict(info),
                           len(new_ids), ended_with_eos)
            )
            if done or len(turns) >= max_turns:
                break  # nothing follows the last reply, so no observation tokens are added

            glue_text, next_prompt = renderer.glue(
                prompt_text, messages, reply, observation, sampled_stop
            )
            glue_ids = renderer.encode(glue_text)
            if (len(context) + len(glue_ids) + sampling.max_new_tokens > max_model_len
                    or len(response_ids) + len(glue_ids) + sampling.max_new_tokens > response_budget):
                truncated = True
                break
            messages.append({"role": "user", "content": observation})
            prompt_text = next_prompt
            response_ids += glue_ids
            response_mask += [0] * len(glue_ids)
            context += glue_ids

        return Episode(
            seed=seed,
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=response_mask,
            reward=reward,
            success=success,
            num_turns=len(turns),
            truncated=truncated,
            messages=messages,
            turns=turns,
        )
    finally:
        await env.close()


def _reply_stop_id(closing: str, stop_ids: set[int], eos_texts: list[str], tokenizer: Any) -> int | None:
    """The stop id a policy ends a reply with, given the template's ``closing`` text after the reply.

    The first stop id (in id order, :func:`leading_stop`) whose text starts the
    closing; when none does, the tokenizer's EOS if it is a stop id, else the smallest stop id;
    None when there are no stop ids at all.
    """
    index = leading_stop(closing, eos_texts)
    if index is not None:
        return sorted(stop_ids)[index]
    if tokenizer.eos_token_id in stop_ids:
        return int(tokenizer.eos_token_id)
    return min(stop_ids) if stop_ids else None


def _check_layout(messages: list[dict[str, str]]) -> int:
    """Index of the first assistant message; ConversationError unless the messages before it end
    with a user message and, from it on, assistant and user messages alternate."""
    roles = [message.get("role") for message in messages]
    if "assistant" not in roles:
        raise ConversationError("the conversation has no assistant message")
    first = roles.index("assistant")
    if first == 0 or roles[first - 1] != "user":
        raise ConversationError("the first assistant message must follow a user message")
    for index in range(first, len(roles)):
        expected = "assistant" if (index - first) % 2 == 0 else "user"
        if roles[index] != expected:
            raise ConversationError(
                f"message {index} has role {roles[index]!r}, expected {expected!r}: after the first "
                "reply, assistant and user messages must alternate"
            )
    return first


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    eos_token_ids: Iterable[int] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, response_ids, response_mask)`` of a recorded conversation, laid out exactly as
    :func:`run_episode` lays out the episode that produced it, so that supervised training (the warm
    start) and RL train on one token layout.

    The messages before the first assistant message (system + first observation) are the prompt,
    with the generation prompt. Each reply is its text's tokens followed by the stop id that ends
    it (:func:`_reply_stop_id`; for ChatML the ``<|im_end|>`` that closes the turn), mask 1, so the
    model learns to stop; each later user message adds the template glue (mask 0), built by the
    same :meth:`ChatRenderer.glue` the runner uses. A conversation that ends with a user message
    (an episode truncated before its next turn) ends with that message's glue.

    Round trip: for an episode whose replies each ended with the stop id the template closes turns
    with (what a chat policy emits; a reply ended by another stop id, e.g. Qwen2.5's <|endoftext|>,
    is recorded as text only, so it comes back ended by the template's),
    ``tokenize_conversation(episode.messages)`` equals the episode's ids and mask. It cannot when
    a reply's sampled ids are not the tokenizer's own encoding of its decoded text (a
    non-canonical split, special tokens that ``skip_special_tokens`` dropped, a text that
    decoding's cleanup changed), or when a reply was cut at ``max_new_tokens`` without a stop id
    (the runner then trains no stop id and its glue keeps the template's closing).
    """
    first = _check_layout(messages)
    stop_ids = stop_token_ids(tokenizer, eos_token_ids)
    eos_texts = stop_texts(tokenizer, stop_ids)
    renderer = ChatRenderer(tokenizer, chat_template_kwargs)
    history = [dict(message) for message in messages[:first]]
    prompt_text, prompt_ids = renderer.prompt(history)
    response_ids: list[int] = []
    response_mask: list[int] = []
    for index in range(first, len(messages), 2):
        reply = messages[index]["content"]
        history.append({"role": "assistant", "content": reply})
        stop_id = _reply_stop_id(renderer.closing(prompt_text, history, reply)[1], stop_ids, eos_texts, tokenizer)
        reply_ids = renderer.encode(reply) + ([] if stop_id is None else [stop_id])
        response_ids += reply_ids
        response_mask += [1] * len(reply_ids)
        if index + 1 == len(messages):
            break
        observation = messages[index + 1]["content"]
        glue_text, prompt_text = renderer.glue(
            prompt_text, history, reply, observation,
            None if stop_id is None else tokenizer.decode([stop_id], skip_special_tokens=False),
        )
        glue_ids = renderer.encode(glue_text)
        history.append({"role": "user", "content": observation})
        response_ids += glue_ids
        response_mask += [0] * len(glue_ids)
    return prompt_ids, response_ids, response_mask
