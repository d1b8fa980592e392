"""The warm start's loss: summed fp32 cross-entropy of the reply tokens, with logits only where it needs them.

Why: a causal LM's forward pass computes the output head at every position, ``[batch, width, vocab]``.
For SmolLM2-135M (vocab 49,152) at batch 8 x 4,608 tokens that is 1.8 G logits: 3.6 GB in bf16, 7.2 GB
once upcast to fp32, and as much again for the log-softmax and each of their gradients — tens of GB,
while the windowed WebShop data label only ~5% of the positions (the replies; measured on an H100,
docs/gpu.md §7). So :func:`reply_loss` runs the model's body (transformers' ``model.base_model``, the
decoder with its final norm), gathers the hidden states at the positions that predict a labelled token
(position ``t`` predicts token ``t + 1``), and applies the output head (``get_output_embeddings()``)
to those rows only. The loss is the same sum of ``-log p(token | tokens before it)`` as the full
computation, up to floating-point rounding (tests/trainers/test_warm_start_memory.py compares the loss and
every parameter's gradient).

That holds only where the causal LM's logits *are* ``head(body(x).last_hidden_state)``. Some
architectures do more between the two (Gemma-2's logit soft-capping, Cohere's logit scale, Granite's
logit scaling), so :func:`head_matches_full_logits` checks it on the model itself once, on a short
input, and the command falls back to :func:`full_logits_reply_loss` (the computation this module
replaces, logits everywhere) where it does not hold.
"""

from __future__ import annotations

from typing import Any

IGNORE = -100  # torch's cross-entropy ignore_index: positions without a label


def _autocast(device: Any) -> Any:
    """bf16 autocast on CUDA, nothing elsewhere (the CPU trains in fp32)."""
    import torch

    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def body_and_head(model: Any) -> tuple[Any, Any] | None:
    """``(body, head)`` of a transformers causal LM — ``model.base_model`` (the decoder stack with its
    final norm, returning ``last_hidden_state``) and ``model.get_output_embeddings()`` — or None when the
    model has no separate body (``base_model`` is the model itself) or no output head."""
    body = getattr(model, "base_model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if body is None or body is model or head is None:
        return None
    return body, head


def full_logits_reply_loss(model: Any, ids: Any, attention: Any, labels: Any) -> tuple[Any, int]:
    """Summed cross-entropy of the labelled (reply) tokens, each predicted from the position before
    it, and their count, from the logits of every position (the fallback; see the module docstring).
    bf16 autocast on CUDA, fp32 elsewhere; the loss itself in fp32."""
    import torch

    with _autocast(ids.device):
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), target.reshape(-1),
        ignore_index=IGNORE, reduction="sum")
    return loss, int((target != IGNORE).sum())


def reply_only_loss(body: Any, head: Any, ids: Any, attention: Any, labels: Any) -> tuple[Any, int]:
    """The loss of :func:`full_logits_reply_loss`, with the output head applied only at the positions
    that predict a labelled token: ``[n_reply, vocab]`` logits instead of ``[batch, width, vocab]``."""
    import torch

    target = labels[:, 1:]
    predicts = target != IGNORE  # position t (of the first width-1) predicts token t+1
    with _autocast(ids.device):
        hidden = body(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
        logits = head(hidden[:, :-1][predicts])
    loss = torch.nn.functional.cross_entropy(logits.float(), target[predicts], reduction="sum")
    return loss, int(predicts.sum())


def reply_loss(model: Any, ids: Any, attention: Any, labels: Any, reply_only: bool = True) -> tuple[Any, int]:
    """Summed fp32 cross-entropy of the labelled (reply) tokens and their count: with the output head
    at those positions only (:func:`reply_only_loss`) when ``reply_only`` and the model has a body and
    a head, else from every position's logits (:func:`full_logits_reply_loss`)."""
    parts = body_and_head(model) if reply_only else None
    if parts is None:
        return full_logits_reply_loss(model, ids, attention, labels)
    return reply_only_loss(*parts, ids, attention, labels)


def head_matches_full_logits(model: Any, ids: Any, tolerance: float = 1e-3) -> bool:
    """Whether ``head(body(ids))`` gives the model's own logits on ``ids`` (one row, a few dozen tokens
    are enough), checked in fp32 without gradients; False when the model has no body and head.

    A model that changes the logits after its head (soft-capping, scaling) fails this and is trained
    with full logits instead: the reply-only loss would otherwise be another loss, silently.
    """
    import torch

    parts = body_and_head(model)
    if parts is None:
        return False
    body, head = parts
    was_training = model.training
    model.eval()  # no dropout: both passes must see the same network
    try:
        with torch.no_grad():
            full = model(input_ids=ids, use_cache=False).logits.float()
            split = head(body(input_ids=ids, use_cache=False).last_hidden_state).float()
    finally:
        model.train(was_training)
    return bool(torch.allclose(full, split, rtol=tolerance, atol=tolerance))
