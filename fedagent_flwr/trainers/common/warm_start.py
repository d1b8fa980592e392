"""``fedagent warm-start``: supervised fine-tuning (SFT) of a causal LM on recorded conversations.

Why: a small base model that never writes the environment's reply format (SmolLM2-135M on WebShop,
docs/gpu-runs/2026-12-02/webshop-diagnosis.md) gives federated RL no signal at all; a short
supervised pass on valid expert trajectories first teaches it the format. The result is a plain
Hugging Face model directory, used as a run's base model (``model.path``).

What: each JSONL line ``{"messages": [...], "reward": float?}`` is laid out by
:func:`~fedagent_flwr.rollout.episode.tokenize_conversation`, i.e. exactly as the concat rollout
lays out the episode, and the loss is the cross-entropy of the reply tokens only (mask 1; the
prompt and the template glue around observations carry label -100), with the output head applied at
those positions only (:mod:`~fedagent_flwr.trainers.common.reply_loss`: the full logits of a batch of
8 x 4,608 tokens took tens of GB of an H100). GPU memory: ``--gradient-checkpointing`` recomputes the
layers' activations in the backward pass; ``--max-gpu-memory-fraction`` caps the process, so beside
other GPU work it stops with its own out-of-memory line instead of starving them. Plain torch: AdamW at a
constant learning rate, gradient clipping, a shuffle drawn from ``torch.Generator`` seeded with
``--seed``, bf16 autocast on CUDA and fp32 on the CPU (the weights stay fp32). Conversations
longer than ``--max-len`` tokens are dropped (never truncated: a cut reply would teach the model
to stop mid-action) and counted.

Reproducibility: ``--seed`` seeds Python, NumPy and torch (every CUDA device too) and asks torch for
deterministic kernels (:func:`~fedagent_flwr.trainers.common.seeds.seed_everything`, warn-only). On
the CPU the same data, seed and versions give bit-identical weights (tested). On CUDA the batch
order and the data are the same, but bit-identical weights are not promised: cuBLAS is
deterministic only with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``) set before the process
starts, kernels without a deterministic version only warn, and another GPU model, driver, CUDA or
torch version may pick other kernels (bf16 autocast makes such differences visible). ``--attention
auto`` lets torch pick cuDNN's attention on an H100, whose backward is not deterministic (two warm
starts from one data file: last step loss 0.0122 and 0.0164); ``math`` pins the deterministic one.

The output directory is written under a temporary name, fsynced and renamed into place (``--force``
replaces only an earlier one, holding ``warm_start.json``, :data:`RECORD_FILE`), weights in fp32 unless
``--save-dtype bfloat16`` (half the bytes, each rounded once). The record: the data's sha256 as read,
examples used and dropped, epochs, steps, losses, seed, saved dtype, base model, logits, checkpointing,
memory cap and peak GPU memory, so a run whose base model it is records where that model came from.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fedagent_flwr.cli import program
from fedagent_flwr.rollout.episode import (
    ChatTemplateError,
    ConversationError,
    require_chat_template,
    tokenize_conversation,
    windowed_turns,
)
from fedagent_flwr.schema.trainer import chat_template_kwargs_from_json
from fedagent_flwr.trainers.common.gpu_memory_cap import apply_memory_cap, out_of_memory_message
from fedagent_flwr.trainers.common.reply_loss import IGNORE, head_matches_full_logits, reply_loss
from fedagent_flwr.trainers.common.warm_start_output import RECORD_FILE as RECORD_FILE  # re-exported
from fedagent_flwr.trainers.common.warm_start_output import WarmStartError, check_out_dir, save_output

#: ``--save-dtype`` choices: the weights train in fp32 either way; bfloat16 halves the saved model
#: (SmolLM2-135M: ~538 MB in fp32, ~269 MB in bf16) at the price of rounding every weight once.
SAVE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Example:
    """One conversation as a training sample: the token ids and their labels (``IGNORE`` except on
    reply tokens, where the label is the token itself; the loss shifts them by one)."""

    line: int
    input_ids: list[int]
    labels: list[int]


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation settings of one warm start."""

    epochs: int = 3
    lr: float = 1e-5
    batch_size: int = 4
    seed: int = 0
    max_grad_norm: float = 1.0
    log_every: int = 10
    #: the output head only at the positions that predict a reply token (reply_loss.py says why)
    reply_only_logits: bool = True
    #: transformers' non-reentrant activation checkpointing: the decoder layers' activations are
    #: recomputed in the backward pass instead of kept (less memory, one more forward's compute)
    gradient_checkpointing: bool = False


@dataclass
class TrainStats:
    """What a training pass did: steps, the mean reply-token loss of each epoch, of the first and
    last step."""

    steps: int = 0
    epoch_losses: list[float] = field(default_factory=list)
    first_step_loss: float = math.nan
    last_step_loss: float = math.nan


def read_conversations(
    path: Path, min_reward: float | None = None
) -> tuple[list[tuple[int, list[dict[str, str]]]], str]:
    """``(line number, messages)`` of every conversation in the JSONL file ``path``, in file order,
    and the sha256 of the bytes they were parsed from (hashed as read, so the record names exactly
    the data trained on, even if the file is replaced while training runs).

    Blank lines are skipped. With ``min_reward`` only lines whose ``reward`` is at least that are
    kept, and a line without a finite numeric reward is refused. A windowed episode written whole
    on one line (``"mode": "windowed"`` with more than one reply: older expert files) is refused,
    since read as one conversation it is not what the windowed rollout trains on. WarmStartError
    names ``file:line``.
    """
    if path.is_dir():
        raise WarmStartError(f"data file {path} is a directory; give the JSONL file")
    if not path.is_file():
        raise WarmStartError(f"data file {path} does not exist")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise WarmStartError(f"data file {path} cannot be read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise WarmStartError(f"{path}:{line}: not UTF-8 (byte {data[exc.start]:#04x}); "
                             "the file must be UTF-8 JSON lines") from None
    kept: list[tuple[int, list[dict[str, str]]]] = []
    # split on "\n" only: str.splitlines() would also break at U+2028 and the like, which JSON
    # written with ensure_ascii=False (the expert's) holds unescaped inside strings
    for number, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise WarmStartError(f"{where}: not JSON ({exc.msg})") from None
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise WarmStartError(f"{where}: no 'messages' list of {{'role': str, 'content': str}} objects")
        if record.get("mode") == "windowed":
            check_windowed_line(messages, where)
        if min_reward is not None:
            reward = record.get("reward")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise WarmStartError(f"{where}: --min-reward is set but the line's 'reward' is "
                                     f"{'missing' if reward is None else repr(reward)}, not a finite number")
            if reward < min_reward:
                continue
        kept.append((number, [{"role": m["role"], "content": m["content"]} for m in messages]))
    return kept, hashlib.sha256(data).hexdigest()


def check_windowed_line(messages: list[dict[str, str]], where: str) -> None:
    """WarmStartError unless a ``"mode": "windowed"`` line is one windowed turn (its window and reply).

    A whole windowed episode on one line would otherwise pass as a concat conversation and teach
    a layout the windowed rollout never shows the model.
    """
    try:
        turns = len(windowed_turns(messages))
    except ConversationError as exc:
        raise WarmStartError(f"{where}: {exc}") from None
    if turns > 1:
        raise WarmStartError(
            f"{where}: a windowed episode of {turns} turns written whole on one line; re-write the file with "
            "the current `fedagent webshop-expert`, which writes a windowed episode one turn a line")


def make_example(line: int, prompt_ids: list[int], response_ids: list[int], response_mask: list[int]) -> Example:
    """The training sample of one laid-out conversation: labels only where the mask is 1."""
    labels = [IGNORE] * len(prompt_ids) + [t if m else IGNORE for t, m in zip(response_ids, response_mask)]
    return Example(line, prompt_ids + response_ids, labels)


def build_examples(
    tokenizer: Any, conversations: Sequence[tuple[int, list[dict[str, str]]]], max_len: int, source: str = "data",
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[Example], int]:
    """The examples of ``conversations`` and how many were dropped for being longer than ``max_len``,
    rendered with ``chat_template_kwargs`` (the run's ``model.chat_template_kwargs``: the RL run's prompts).

    WarmStartError (naming ``source:line``) for a conversation without a reply, with a layout the
    rollout never produces, or that the chat template refuses to render (transformers' ValueError,
    e.g. no template, or jinja's TemplateError, e.g. the template's ``raise_exception``).
    """
    from jinja2 import TemplateError

    examples: list[Example] = []
    dropped = 0
    for line, messages in conversations:
        try:
            example = make_example(line, *tokenize_conversation(tokenizer, messages,
                                                                chat_template_kwargs=chat_template_kwargs))
        except (ValueError, TemplateError) as exc:  # ConversationError, ChatTemplateError, the template's own
            raise WarmStartError(f"{source}:{line}: {exc}") from None
        if len(example.input_ids) > max_len:
            dropped += 1
        else:
            examples.append(example)
    return examples, dropped


def collate(batch: Sequence[Example], pad_id: int, device: Any) -> tuple[Any, Any, Any]:
    """Right-padded ``(input_ids, attention_mask, labels)`` tensors of ``batch`` on ``device``."""
    import torch

    width = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    for row, example in enumerate(batch):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        attention[row, :n] = 1
        labels[row, :n] = torch.tensor(example.labels)
    return ids.to(device), attention.to(device), labels.to(device)


def shuffled_batches(examples: Sequence[Example], batch_size: int, generator: Any) -> Iterator[list[Example]]:
    """One epoch's batches in an order drawn from ``generator`` (a seeded ``torch.Generator``)."""
    import torch

    order = torch.randperm(len(examples), generator=generator).tolist()
    for start in range(0, len(order), batch_size):
        yield [examples[i] for i in order[start:start + batch_size]]


def train(model: Any, examples: Sequence[Example], config: TrainConfig, pad_id: int, device: Any,
          log: Any = print) -> TrainStats:
    """Fine-tune ``model`` in place on ``examples``; ``log`` gets a progress line every
    ``config.log_every`` steps (step, loss, tokens/s) and after the last."""
    import torch

    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    total_steps = config.epochs * math.ceil(len(examples) / config.batch_size)
    stats = TrainStats()
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    window_tokens, window_start = 0, time.monotonic()
    for epoch in range(1, config.epochs + 1):
        epoch_loss, epoch_tokens = 0.0, 0
        for batch in shuffled_batches(examples, config.batch_size, generator):
            ids, attention, labels = collate(batch, pad_id, device)
            loss_sum, n = reply_loss(model, ids, attention, labels, config.reply_only_logits)
            loss = loss_sum / max(n, 1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            stats.steps += 1
            value = float(loss.detach())
            if stats.steps == 1:
                stats.first_step_loss = value
            stats.last_step_loss = value
            epoch_loss, epoch_tokens = epoch_loss + float(loss_sum.detach()), epoch_tokens + n
            window_tokens += int(attention.sum())
            if stats.steps % config.log_every == 0 or stats.steps == total_steps:
                elapsed = max(time.monotonic() - window_start, 1e-9)
                log(f"step {stats.steps}/{total_steps} epoch {epoch}: loss {value:.4f}, "
                    f"{window_tokens / elapsed:.0f} tokens/s")
                window_tokens, window_start = 0, time.monotonic()
        stats.epoch_losses.append(epoch_loss / max(epoch_tokens, 1))
    if config.gradient_checkpointing:
        model.gradient_checkpointing_disable()  # leave the model as it came
    return stats


ATTENTION_KERNELS = {"auto": None, "math": "MATH", "efficient": "EFFICIENT_ATTENTION"}  # --attention: SDPBackend


def attention_kernels(choice: str) -> AbstractContextManager[Any]:
    """The context in which SDPA uses only ``choice``'s kernel (``auto``: torch chooses)."""
    backend = ATTENTION_KERNELS[choice]
    if backend is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, backend))


#: files of which a tokenizer directory holds at least one (save_pretrained writes tokenizer_config.json)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_model_dir(base: Path, given: str) -> None:
    """WarmStartError naming ``--model`` unless ``base`` holds a model's ``config.json`` and a tokenizer.

    Why: from a directory without them transformers does not say so; an empty one ends in advice to
    install sentencepiece, one with only ``config.json`` in "the tokenizer has no chat template".
    """
    what = f"--model {given or base}"
    if not (base / "config.json").is_file():
        raise WarmStartError(f"{what}: {base} holds no model (no config.json); give a Hugging Face model "
                             "directory (as save_pretrained writes it) or leave --model empty for the bundled model")
    if not any((base / name).is_file() for name in TOKENIZER_FILES):
        raise WarmStartError(f"{what}: {base} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                             "save the model's tokenizer into it (tokenizer.save_pretrained)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line of ``fedagent warm-start``."""
    parser = argparse.ArgumentParser(
        prog=program("python -m fedagent_flwr.trainers.common.warm_start"),
        description="Supervised warm start: fine-tune a causal LM on recorded conversations (loss on the "
                    "replies only, laid out as the concat rollout lays out episodes).")
    parser.add_argument("--data", type=Path, required=True, help="JSONL file, one {'messages': [...]} per line")
    parser.add_argument("--model", default="", help="base model dir or hub id ('' = the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, required=True, help="output model directory")
    parser.add_argument("--force", action="store_true",
                        help="replace an earlier warm start's --out (a model with its warm_start.json)")
    parser.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--max-len", type=int, default=4096, help="drop conversations longer than this (tokens)")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--min-reward", type=float, default=None, help="keep lines whose 'reward' is at least this")
    parser.add_argument("--max-grad-norm", type=float, default=TrainConfig.max_grad_norm)
    parser.add_argument("--log-every", type=int, default=TrainConfig.log_every, help="steps between progress lines")
    parser.add_argument("--save-dtype", choices=SAVE_DTYPES, default="float32",
                        help="dtype of the saved weights (the weights and optimiser train in fp32 either way, "
                             "the forward pass under bf16 autocast on CUDA): float32 (default, as the bundled "
                             "base model and the run's aggregates) or bfloat16 (half the size, rounded once)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute the decoder layers' activations in the backward pass instead of keeping "
                             "them (transformers' non-reentrant checkpointing): less GPU memory, ~1/3 more compute")
    parser.add_argument("--max-gpu-memory-fraction", type=float, default=None, metavar="F",
                        help="cap this process at fraction F (0 < F <= 1) of the GPU's memory "
                             "(torch.cuda.set_per_process_memory_fraction), so that beside other GPU work it stops "
                             "with its own out-of-memory error instead of starving its neighbours; CUDA only")
    parser.add_argument("--attention", choices=tuple(ATTENTION_KERNELS), default="auto",
                        help="SDPA kernels to train with: auto (torch's pick; on CUDA maybe cuDNN's, whose backward "
                             "is not deterministic), math (reference, deterministic) or efficient (CUDA; not so)")
    parser.add_argument("--chat-template-kwargs", default="{}", metavar="JSON", help="the run's "
                        "model.chat_template_kwargs (e.g. '{\"enable_thinking\": false}'): render as the run does")
    args = parser.parse_args(argv)
    try:
        args.chat_template_kwargs = chat_template_kwargs_from_json(args.chat_template_kwargs)
    except ValueError as exc:
        parser.error(f"--chat-template-kwargs: {exc}")
    fraction = args.max_gpu_memory_fraction
    if fraction is not None and not 0 < fraction <= 1:
        parser.error("--max-gpu-memory-fraction must be in (0, 1]")
    for name in ("epochs", "batch_size", "max_len", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    # one line per flag, naming only the one that is wrong (NaN fails "> 0" too)
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    if not args.max_grad_norm > 0:  # inf is allowed: no clipping
        parser.error(f"--max-grad-norm must be > 0, got {args.max_grad_norm}")
    if args.min_reward is not None and math.isnan(args.min_reward):  # every comparison with NaN is false
        parser.error("--min-reward must be a number, got nan: it would keep every line")
    return args


def warm_start(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    """Run the warm start that ``args`` (:func:`parse_args`) describe; return the written record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedagent_flwr.models.smollm2 import ModelResolutionError, resolve_model_path
    from fedagent_flwr.trainers.common.precision import torch_device
    from fedagent_flwr.trainers.common.seeds import seed_everything

    check_out_dir(args.out, args.force)
    conversations, data_sha256 = read_conversations(args.data, args.min_reward)
    try:
        base = resolve_model_path(args.model)
    except ModelResolutionError as exc:
        raise WarmStartError(str(exc)) from None
    check_model_dir(base, args.model)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise WarmStartError("--device cuda but torch sees no CUDA device")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(base))
        require_chat_template(tokenizer, str(base))
    except (OSError, ValueError) as exc:  # ChatTemplateError is a ValueError
        # transformers' messages run over several lines: the command prints one
        raise WarmStartError(f"--model: no usable tokenizer in {base}: {' '.join(str(exc).split())}"
                             if not isinstance(exc, ChatTemplateError) else str(exc)) from None
    examples, dropped = build_examples(tokenizer, conversations, args.max_len, str(args.data),
                                       args.chat_template_kwargs)
    if dropped:
        log(f"dropped {dropped} of {len(conversations)} conversations longer than --max-len {args.max_len} tokens")
    if not examples:
        raise WarmStartError(f"{args.data}: no conversation left to train on "
                             f"({len(conversations)} after --min-reward, {dropped} too long)")
    seed_everything(args.seed)
    device = torch_device(args.device)
    if args.attention == "efficient" and device.type != "cuda":
        raise WarmStartError("--attention efficient needs a CUDA device; use math (or auto) on the CPU")
    try:
        cap = apply_memory_cap(args.max_gpu_memory_fraction, device)
    except ValueError as exc:
        raise WarmStartError(str(exc)) from None
    try:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).to(device)
    except OSError as exc:  # e.g. a directory with config and tokenizer but no weights
        raise WarmStartError(f"--model: cannot load the model in {base}: {' '.join(str(exc).split())}") from None
    if args.gradient_checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        raise WarmStartError(f"--gradient-checkpointing: {type(model).__name__} does not support it")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # the reply-only loss is the model's own only where its logits are head(body(x)): checked on the model
    probe = torch.tensor([examples[0].input_ids[:64]], device=device)
    reply_only = head_matches_full_logits(model, probe)
    if not reply_only:
        log("warm start: this model's logits are not its output head applied to its body's hidden states; "
            "computing the logits of every position (more memory)")
    config = TrainConfig(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                         max_grad_norm=args.max_grad_norm, log_every=args.log_every, reply_only_logits=reply_only,
                         gradient_checkpointing=args.gradient_checkpointing)
    reply_tokens = sum(len(e.labels) - e.labels.count(IGNORE) for e in examples)
    log(f"warm start: {len(examples)} conversations, {reply_tokens} reply tokens, base {base}, device {device}")
    started = time.monotonic()
    try:
        with attention_kernels(args.attention):
            stats = train(model, examples, config, int(pad_id), device, log)
    except torch.OutOfMemoryError:
        raise WarmStartError(out_of_memory_message(device, cap, config.gradient_checkpointing)) from None
    peak = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
    record = {
        "data": str(args.data.resolve()),
        "data_sha256": data_sha256,
        "base_model": str(base),
        "min_reward": args.min_reward,
        "max_len": args.max_len,
        "examples_used": len(examples),
        "examples_dropped_too_long": dropped,
        "reply_tokens": reply_tokens,
        "device": str(device),
        "seconds": round(time.monotonic() - started, 1),
        **{k: v for k, v in asdict(config).items() if k != "log_every"},
        "steps": stats.steps,
        "loss_first_epoch": stats.epoch_losses[0],
        "loss_last_epoch": stats.epoch_losses[-1],
        "loss_first_step": stats.first_step_loss,
        "loss_last_step": stats.last_step_loss,
        "save_dtype": args.save_dtype,
        "attention": args.attention,
        "chat_template_kwargs": args.chat_template_kwargs,
        "max_gpu_memory_fraction": args.max_gpu_memory_fraction,
        "peak_gpu_memory_gib": peak,
    }
    try:
        save_output(model.to(device="cpu", dtype=getattr(torch, args.save_dtype)), tokenizer, record, args.out)
    except OSError as exc:  # a full disk, a quota: say so in one line, and that an earlier output is kept
        raise WarmStartError(f"--out {args.out}: saving the trained model failed ({exc.strerror or exc}); the "
                             "training is lost and anything at --out is as it was: free space or name another "
                             "--out, then run again") from None
    if peak is not None:
        log(f"peak GPU memory allocated by the warm start: {peak} GiB"
            + (f" (cap {cap / 2**30:.1f} GiB)" if cap is not None else ""))
    log(f"saved {args.out} (step loss {stats.first_step_loss:.4f} -> {stats.last_step_loss:.4f} over "
        f"{stats.steps} steps; epoch loss {stats.epoch_losses[0]:.4f} -> {stats.epoch_losses[-1]:.4f})")
    return record


def main(argv: Sequence[str] | None = None) -> int:
    """``fedagent warm-start``: exit 0 on success, 1 with one error line on bad input."""
    args = parse_args(argv)
    try:
        warm_start(args)
    except WarmStartError as exc:
        print(f"fedagent warm-start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
