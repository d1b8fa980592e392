"""Apply an environment-level variant (:mod:`fedagent_flwr.hetero.env_level`) to a WebShop config.

A client's service receives a small variant *request* (strategy, client, knobs).
:func:`variant_env_config` resolves it against the world the config loads and returns the env
config that realises it, using WebShop's existing config keys:

* ``catalog_split``: ``catalog`` (the client's ASINs; search drops every other product, ranks not
  refilled) and ``goal_indices`` (the client's slice of the train pool);
* ``bm25_field_subset`` / ``bm25_reweight``: ``bm25_in_memory`` = {fields, k1, b};
* ``lookalike``: ``extra_product_files`` = [``<lookalike_dir>/lookalike_<name>.json``] (decoys are
  appended after the catalogue, produce no goals, and put search on the in-memory default BM25);
* ``rank_wrapper``: ``rank_wrapper`` = {type, seed, ...} over the in-memory default BM25
  (:class:`RankWrapperSearch`, one per env instance, its RNG advancing on every search call).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from fedagent_flwr.envs.base import EnvConfigError
from fedagent_flwr.envs.webshop.search import Searcher
from fedagent_flwr.hetero.env_level import (
    CATALOG_SPLIT,
    LOOKALIKE,
    RANK_PARTIAL_P,
    RANK_SHUFFLE_K,
    RANK_WRAPPER,
    RANK_WRAPPER_POOL,
    EnvVariant,
    resolve_variant,
    unshuffled_goal_asins,
)
from fedagent_flwr.hetero.uniform import PartitionError

#: Sub-directory of the WebShop data directory holding ``lookalike_<name>.json`` files.
LOOKALIKE_SUBDIR = "lookalike"


class RankWrapperSearch:
    """FedAgent's rank wrappers (spec §8 V5) around a base searcher with ``asins`` and ``search``.

    * ``bm25_default``: the base ranking;
    * ``bm25_shuffle``: the base top ``max(shuffle_k, K)`` shuffled with the wrapper's RNG, cut to K;
    * ``bm25_invert``: the base top-K reversed;
    * ``bm25_partial``: with probability ``p`` (one ``rng.random()`` per search), ``rng.sample`` of
      min(K, N) of all indexed ASINs in load order; otherwise the base top-K.

    The RNG (``random.Random(seed)``) lives as long as the wrapper and advances on every search,
    re-searches by paging included, as in FedAgent. The catalogue filter applies afterwards.
    """

    def __init__(self, base: Any, *, type: str, seed: int, shuffle_k: int = RANK_SHUFFLE_K,
                 p: float = RANK_PARTIAL_P) -> None:
        if type not in RANK_WRAPPER_POOL:
            raise EnvConfigError(f"unknown rank wrapper {type!r} (known: {', '.join(RANK_WRAPPER_POOL)})")
        self.base, self.type, self.seed = base, type, int(seed)
        self.shuffle_k, self.p = int(shuffle_k), float(p)
        self.rng = random.Random(self.seed)
        self.top_k = base.top_k
        self.asins = base.asins

    def search(self, query: str, allowed: Collection[str] | None = None, top_k: int | None = None) -> list[str]:
        k = self.top_k if top_k is None else top_k
        if self.type == "bm25_shuffle":
            ranked = list(self.base.search(query, None, top_k=max(self.shuffle_k, k)))
            self.rng.shuffle(ranked)
            ranked = ranked[:k]
        elif self.type == "bm25_invert":
            ranked = list(self.base.search(query, None, top_k=k))[::-1]
        elif self.type == "bm25_partial" and self.rng.random() < self.p:
            ranked = self.rng.sample(list(self.asins), min(k, len(self.asins)))
        else:  # bm25_default, or bm25_partial's other branch
            ranked = list(self.base.search(query, None, top_k=k))
        return ranked if allowed is None else [a for a in ranked if a in allowed]


def rank_wrapper_search(base: Searcher, spec: Mapping[str, Any]) -> RankWrapperSearch:
    """A :class:`RankWrapperSearch` from a ``rank_wrapper`` config ({type, seed, shuffle_k?, p?})."""
    if not isinstance(spec, Mapping) or "type" not in spec or set(spec) - {"type", "seed", "shuffle_k", "p"}:
        raise EnvConfigError(
            f"WebShop config 'rank_wrapper' must be a mapping with type/seed[/shuffle_k/p], got {spec!r}"
        )
    try:
        return RankWrapperSearch(base, type=str(spec["type"]), seed=int(spec.get("seed", 42)),
                                 shuffle_k=int(spec.get("shuffle_k", RANK_SHUFFLE_K)),
                                 p=float(spec.get("p", RANK_PARTIAL_P)))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, EnvConfigError):
            raise
        raise EnvConfigError(f"WebShop config 'rank_wrapper' has a bad value: {spec!r}") from None


def lookalike_file(config: Mapping[str, Any], request: Mapping[str, Any], name: str) -> Path:
    """``<lookalike_dir>/lookalike_<name>.json``; ``lookalike_dir`` defaults to ``<data_dir>/lookalike``."""
    from fedagent_flwr.envs.webshop.data import WebShopDataError, resolve_data_dir

    folder = request.get("lookalike_dir")
    if not folder:
        try:
            folder = resolve_data_dir(config.get("data_dir")) / LOOKALIKE_SUBDIR
        except WebShopDataError as exc:
            raise EnvConfigError(str(exc)) from None
    path = Path(folder) / f"lookalike_{name}.json"
    if not path.is_file():
        raise EnvConfigError(
            f"lookalike variant {name!r} needs {path}, which does not exist (FedAgent's v_price file is not in the "
            "shared data; set 'lookalike_pool' to the files you have, "
            "e.g. [\"v_color\", \"v_size\", \"v_price_color\"])"
        )
    return path


def variant_env_config(config: Mapping[str, Any], request: Mapping[str, Any]) -> tuple[dict[str, Any], EnvVariant]:
    """(env config realising ``request`` for this client, the resolved :class:`EnvVariant`).

    Raises :class:`EnvConfigError` for a bad request or a config that already sets what the
    variant would set (``catalog``/``goal_indices``, ``bm25_in_memory``, ``extra_product_files``,
    ``rank_wrapper``).
    """
    from fedagent_flwr.envs.webshop.env import shared_world

    try:
        strategy = str(request.get("strategy", ""))
        if strategy == CATALOG_SPLIT:
            if config.get("split", "train") != "train":
                raise EnvConfigError("the catalog_split variant slices the train pool; use it on train services only")
            world, _ = shared_world(config)
            catalogue = [p["asin"] for p in world.products if not str(p["asin"]).startswith("LK_")]
            pool_asins = [g["asin"] for g in world.train_goals]
            unshuffled = unshuffled_goal_asins(world.products)[world.val_size:]
            variant = resolve_variant(request, all_asins=catalogue, pool_goal_asins=pool_asins,
                                      unshuffled_pool_goal_asins=unshuffled)
        else:
            variant = resolve_variant(request)
    except PartitionError as exc:
        raise EnvConfigError(f"WebShop env variant: {exc}") from None
    out = dict(config)

    def put(key: str, value: Any) -> None:
        if out.get(key) is not None:
            raise EnvConfigError(f"WebShop config sets {key!r}, which the {variant.strategy} variant also sets")
        out[key] = value

    if variant.catalog is not None:
        put("catalog", sorted(variant.catalog))
    if variant.goal_indices is not None:
        put("goal_indices", list(variant.goal_indices))
    if variant.bm25 is not None:
        put("bm25_in_memory", {"fields": list(variant.bm25["fields"]), "k1": variant.bm25["k1"],
                               "b": variant.bm25["b"]})
    if variant.strategy == LOOKALIKE:
        assert variant.lookalike is not None
        put("extra_product_files", [str(lookalike_file(config, request, variant.lookalike))])
    if variant.strategy == RANK_WRAPPER:
        assert variant.rank_wrapper is not None
        put("rank_wrapper", dict(variant.rank_wrapper))
    return out, variant
