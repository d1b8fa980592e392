"""Keys and values kept between an episode's turns, so a turn prefills only what is new.

A concat-mode turn's prompt is the previous turn's prompt, the tokens sampled for it and the
glue that wraps the next observation (:mod:`fedagent_flwr.rollout.episode`); a windowed turn's
prompt repeats the chat template's header and the task. Without a kept cache every turn prefills
its whole prompt again, which on a CPU costs about as much as decoding the turn. With one,
:class:`~fedagent_flwr.trainers.common.sampler.HFPolicy` reuses the longest common prefix of the
kept tokens and the new prompt and prefills only the rest.

The caches live for one batch of concurrent episodes (one ``play_episodes`` call, i.e. one
optimiser step's rollouts or one evaluation): the sampler's weights change between steps, so a
kept cache never outlives the weights that computed it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class RowCache:
    """The keys and values of ``tokens`` (one episode's last context, in order).

    ``layers[i]`` is layer ``i``'s ``(keys, values)``, each ``[kv_heads, len(tokens), head_dim]``.
    """

    tokens: list[int]
    layers: list[tuple[Any, Any]]


class PrefixCache:
    """The kept :class:`RowCache` of each live episode of one batch, by episode index."""

    def __init__(self) -> None:
        self.rows: dict[int, RowCache] = {}

    def get(self, key: int) -> RowCache | None:
        """The cache kept for episode ``key``, if any."""
        return self.rows.get(key)

    def put(self, key: int, row: RowCache) -> None:
        """Keep ``row`` for episode ``key`` (replacing its previous turn's)."""
        self.rows[key] = row

    def drop(self, key: int) -> None:
        """Episode ``key`` ended: free its cache."""
        self.rows.pop(key, None)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def plain_layers(cache: Any) -> list[Any] | None:
    """The layers of a Hugging Face cache when every one is a plain full-attention
    ``DynamicLayer`` (whose ``keys``/``values`` hold every position), else None: sliding-window,
    quantised or offloaded caches are not taken apart, and such a model prefills every turn."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    return list(layers)


def left_padded_past(kept: Sequence[RowCache | None], lengths: Sequence[int]) -> Any:
    """A ``DynamicCache`` of the first ``lengths[u]`` kept positions of each row, right-aligned
    (left padding, masked out by the caller's attention mask) to the longest of them."""
    import torch
    from transformers import DynamicCache

    width = max(lengths)
    template = next(k for k, n in zip(kept, lengths) if k is not None and n > 0)
    data = []
    for layer, (key0, value0) in enumerate(template.layers):
        keys = key0.new_zeros((len(kept), key0.shape[0], width, key0.shape[2]))
        values = value0.new_zeros((len(kept), value0.shape[0], width, value0.shape[2]))
        for row, (entry, n) in enumerate(zip(kept, lengths)):
            if entry is not None and n > 0:
                keys[row, :, width - n:] = entry.layers[layer][0][:, :n]
                values[row, :, width - n:] = entry.layers[layer][1][:, :n]
        data.append((keys, values))
    with torch.no_grad():
        return DynamicCache(ddp_cache_data=data)


def take_rows(layers: Sequence[Any], attention: Any, contexts: Sequence[list[int]]) -> list[RowCache]:
    """Each row's cache for ``contexts[row]``: its first ``len(context)`` unmasked positions.

    The positions a row holds are in order (left padding, kept prefix, prompt suffix, then one per
    decoding step); a row that stopped early was fed further tokens after its stop, which lie
    beyond its context and are dropped here.
    """
    rows = []
    for row, context in enumerate(contexts):
        positions = attention[row].nonzero().flatten()[:len(context)]
        rows.append(RowCache(list(context), [(layer.keys[row].index_select(1, positions),
                                              layer.values[row].index_select(1, positions)) for layer in layers]))
    return rows
