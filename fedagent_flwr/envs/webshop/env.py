"""``WebShopEnv``: the in-process WebShop text environment, registered as "WebShop".

One instance runs one episode at a time over a world (products, reward prices, the seed-42 goal list)
and a search index that are built once per process and shared by every instance with the same data
config. The env speaks FedAgent's protocol: the model's reply is projected to an action
(``<action>…</action>``), the engine applies it, and the step reward is FedAgent's service mapping
(10 iff the purchase scores exactly 1.0; the raw score is ``info["task_score"]``) unless the config
asks for the graded one (``reward: score``).

Config keys (all optional except the data location):

* ``data_dir``: directory with ``items_shuffle_1000.json`` and ``items_ins_v2_1000.json``
  (default: ``$FEDAGENT_WEBSHOP_DATA``);
* ``split``: "train" (goals[val_size:], default) or "val" (goals[:val_size]);
* ``goal_indices``: a partition of the split's pool (indices into it); a seed then picks
  ``goal_indices[random.Random(seed).randrange(len)]`` as FedAgent's partitioned services do;
  without it the goal is ``seed % pool size`` (FedAgent's ``500 + seed % 6410`` for train);
* ``max_turns`` (15, the paper's cap), ``search_return_n`` (50), ``val_size`` (500),
  ``goal_limit`` (FedAgent's WEBSHOP_NUM_GOALS; default all generated goals), ``shuffle_seed``,
  ``catalog`` (allowed ASINs for search results), ``extra_product_files`` (look-alike files),
  ``observation_format`` ("raw", FedAgent 0.8's default, or "baseline", the 0.3.1 quoted form),
  ``search_seed`` (seeds the ``<r>`` random-search keyword, combined with the episode seed),
  ``bm25_in_memory`` ({fields, k1, b}: FedAgent's in-memory BM25Okapi backend instead of the
  Lucene-style one; also chosen, with FedAgent's default fields, when extra products are given),
  ``rank_wrapper`` ({type, seed, shuffle_k, p}: FedAgent's V5 re-ranking over the in-memory BM25,
  one RNG per env instance; see :mod:`fedagent_flwr.envs.webshop.variants`),
  ``reward`` ("success", FedAgent's 10-iff-score-1.0 mapping, default; or "score", 10 × the raw
  purchase score, an explicit departure from FedAgent that gives GRPO groups of near-miss purchases
  a signal; ``info["success"]``/``info["won"]`` stay FedAgent's win either way).

Environment-level heterogeneity (``catalog_split``, ``bm25_field_subset``, ``bm25_reweight``,
``lookalike``, ``rank_wrapper``) reaches a service as a small ``variant`` request, which
:meth:`WebShopEnv.service_setup` resolves into the keys above
(:func:`fedagent_flwr.envs.webshop.variants.variant_env_config`).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from fedagent_flwr.envs.base import (
    BaseTextEnv,
    EnvConfigError,
    EnvDataError,
    configured_goal_indices,
    optional_config_int,
    pool_index_for_seed,
    restricted_goal_config,
)
from fedagent_flwr.envs.registry import register_env
from fedagent_flwr.envs.webshop.data import VAL_SIZE, WebShopDataError, WebShopWorld, load_world, resolve_data_dir
from fedagent_flwr.envs.webshop.engine import WebShopEngine
from fedagent_flwr.envs.webshop.prompts import (
    CONCAT_SYSTEM_PROMPT,
    baseline_observation,
    concat_user_turn,
    project_action,
    render_window,
    task_from_observation,
)
from fedagent_flwr.envs.webshop.reward import REWARD_MODES, service_reward
from fedagent_flwr.envs.webshop.search import (
    DEFAULT_TOP_K,
    IN_MEMORY_FIELDS,
    BM25Search,
    InMemoryBM25,
    Searcher,
)
from fedagent_flwr.envs.window import Window

DEFAULT_MAX_TURNS = 15
_SPLITS = ("train", "val")
_OBS_FORMATS = ("raw", "baseline")

_CACHE_LOCK = threading.Lock()
_WORLDS: dict[tuple[Any, ...], WebShopWorld] = {}
_SEARCHERS: dict[tuple[Any, ...], Searcher] = {}


def _int(config: Mapping[str, Any], key: str, default: int | None, minimum: int) -> int | None:
    return optional_config_int(config, key, default, minimum, "WebShop")


def _world_key(config: Mapping[str, Any]) -> tuple[Any, ...]:
    try:
        data_dir = str(resolve_data_dir(config.get("data_dir")).resolve())
    except WebShopDataError as exc:
        raise EnvDataError(str(exc), key="data_dir") from None
    extras = config.get("extra_product_files") or ()
    if isinstance(extras, str):
        extras = (extras,)
    return (
        data_dir,
        _int(config, "goal_limit", None, 2),
        _int(config, "val_size", VAL_SIZE, 0),
        _int(config, "shuffle_seed", None, 0),
        tuple(str(e) for e in extras),
    )


def _search_key(config: Mapping[str, Any]) -> tuple[Any, ...]:
    """("lucene",) or ("in_memory", fields, k1, b): the backend a config asks for.

    As in FedAgent, an explicit ``bm25_in_memory`` config ({fields, k1, b}) or extra (look-alike)
    products select the in-memory BM25Okapi backend; otherwise the Lucene-style bm25s index is used.
    """
    spec = config.get("bm25_in_memory")
    if spec is None and not config.get("extra_product_files") and not config.get("rank_wrapper"):
        return ("lucene",)
    spec = spec or {}
    if not isinstance(spec, Mapping) or set(spec) - {"fields", "k1", "b"}:
        raise EnvConfigError(f"WebShop config 'bm25_in_memory' must be a mapping with fields/k1/b, got {spec!r}")
    fields = spec.get("fields", IN_MEMORY_FIELDS)
    if isinstance(fields, str) or not isinstance(fields, Sequence) or not fields:
        raise EnvConfigError(f"WebShop config 'bm25_in_memory.fields' must be a non-empty list, got {fields!r}")
    try:
        k1, b = float(spec.get("k1", 1.2)), float(spec.get("b", 0.75))
    except (TypeError, ValueError):
        raise EnvConfigError(f"WebShop config 'bm25_in_memory' k1/b must be numbers, got {spec!r}") from None
    return ("in_memory", tuple(str(f) for f in fields), k1, b)


def shared_world(config: Mapping[str, Any]) -> tuple[WebShopWorld, Searcher]:
    """The (world, search backend) for ``config``, built once per process and cached.

    Building the world once and single-threaded also keeps the goal list identical for every env,
    which FedAgent's thread-parallel pool start-up did not guarantee.
    """
    key = _world_key(config)
    search_key = _search_key(config)
    with _CACHE_LOCK:
        world = _WORLDS.get(key)
        if world is None:
            data_dir, goal_limit, val_size, shuffle_seed, extras = key
            try:
                world = load_world(data_dir, num_goals=goal_limit, val_size=val_size,
                                   shuffle_seed=shuffle_seed, extra_product_files=extras)
            except WebShopDataError as exc:
                raise EnvConfigError(str(exc)) from None
            _WORLDS[key] = world
        searcher = _SEARCHERS.get(key + search_key)
        if searcher is None:
            if search_key[0] == "lucene":
                searcher = BM25Search(world.products)
            else:
                _, fields, k1, b = search_key
                searcher = InMemoryBM25(world.products, fields=fields, k1=k1, b=b)
            _SEARCHERS[key + search_key] = searcher
        return world, searcher


def _split(config: Mapping[str, Any]) -> str:
    split = config.get("split", "train")
    if split not in _SPLITS:
        raise EnvConfigError(f"WebShop config 'split' must be one of {_SPLITS}, got {split!r}")
    return split


def _split_bounds(config: Mapping[str, Any]) -> tuple[int, int]:
    """(offset, size) of the split's pool inside the shuffled goal list."""
    world = _WORLDS.get(_world_key(config)) or shared_world(config)[0]
    if _split(config) == "val":
        return 0, world.val_size
    return world.val_size, len(world.goals) - world.val_size


def _goal_indices(config: Mapping[str, Any], pool_size: int) -> list[int] | None:
    return configured_goal_indices("WebShop", config, pool_size)


@register_env("WebShop")
class WebShopEnv(BaseTextEnv):
    """WebShop shopping episodes in process (search with bm25s, reward as FedAgent's service)."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self._check_fields(self.config)
        self.split = _split(self.config)
        self.max_turns = _int(self.config, "max_turns", DEFAULT_MAX_TURNS, 1)
        self.top_k = _int(self.config, "search_return_n", DEFAULT_TOP_K, 1)
        self.search_seed = _int(self.config, "search_seed", 0, 0)
        self.observation_format = self.config.get("observation_format", "raw")
        self.reward_mode: str = self.config.get("reward", "success")
        catalog = self.config.get("catalog")
        self.world, self.search_index = shared_world(self.config)
        if self.config.get("rank_wrapper") is not None:
            from fedagent_flwr.envs.webshop.variants import rank_wrapper_search

            # Per instance: the wrapper's RNG is the env instance's, as in FedAgent.
            self.search_index = rank_wrapper_search(self.search_index, self.config["rank_wrapper"])
        self.offset, self.pool_size = _split_bounds(self.config)
        self.goal_indices = _goal_indices(self.config, self.pool_size)
        self.engine = WebShopEngine(
            self.world, self.search_index, allowed_asins=None if catalog is None else set(catalog),
            top_k=self.top_k,  # type: ignore[arg-type]  # None only if the config says null
        )
        self.goal_index: int | None = None
        self._turn = 0
        self._done = True

    @staticmethod
    def _check_fields(config: Mapping[str, Any]) -> None:
        """The config values that need no data loaded: split, integers, formats, reward mode, search backend."""
        _split(config)
        _int(config, "max_turns", DEFAULT_MAX_TURNS, 1)
        _int(config, "search_return_n", DEFAULT_TOP_K, 1)
        _int(config, "search_seed", 0, 0)
        observation_format = config.get("observation_format", "raw")
        if observation_format not in _OBS_FORMATS:
            raise EnvConfigError(
                f"WebShop config 'observation_format' must be one of {_OBS_FORMATS}, got {observation_format!r}",
                key="observation_format",
            )
        reward_mode = config.get("reward", "success")
        if reward_mode not in REWARD_MODES:
            raise EnvConfigError(
                f"WebShop config 'reward' must be one of {REWARD_MODES}, got {reward_mode!r}", key="reward")
        catalog = config.get("catalog")
        if catalog is not None and (isinstance(catalog, str) or not isinstance(catalog, Sequence)):
            raise EnvConfigError(f"WebShop config 'catalog' must be a list of ASINs, got {catalog!r}", key="catalog")
        _search_key(config)

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> None:
        """Every value that needs no catalogue loaded, and that the data directory holds the
        catalogue files: loading and indexing the catalogue itself is each service's work."""
        cls._check_fields(config)
        _world_key(config)

    # --- goal pool ---------------------------------------------------------------------------

    @classmethod
    def num_goals(cls, config: Mapping[str, Any]) -> int | None:
        """Pool size: ``len(goal_indices)`` if given, else the split's goal count."""
        _, size = _split_bounds(config)
        indices = _goal_indices(config, size)
        return len(indices) if indices is not None else size

    @classmethod
    def goal_info(cls, config: Mapping[str, Any]) -> list[Any]:
        """Metadata (category, task id, hardness label, ASIN) of each pool goal, for the
        partitions that need it (preference, hardness)."""
        from fedagent_flwr.envs.webshop.goal_info import goal_info_for_config

        return goal_info_for_config(config)

    @classmethod
    def restrict_goals(cls, config: Mapping[str, Any], goal_indices: Sequence[int]) -> dict[str, Any]:
        """Copy of ``config`` limited to the given pool indices (composes with an existing restriction)."""
        pool = cls.num_goals(config) or 0
        _, size = _split_bounds(config)
        return restricted_goal_config("WebShop", config, goal_indices, pool, _goal_indices(config, size))

    @classmethod
    def service_setup(
        cls, config: Mapping[str, Any], partition: Mapping[str, Any], variant: Mapping[str, Any]
    ) -> Any:
        """The service pool for a client: ``partition`` (``goal_indices``) and ``variant`` applied.

        Without a variant this is the generic setup (goals restricted by the partition, one
        instance built up front so config errors surface before the port is bound). With one, the
        request is resolved by :func:`~fedagent_flwr.envs.webshop.variants.variant_env_config`;
        ``/health`` info then carries its short description under ``"variant"``.
        """
        from fedagent_flwr.envs.service.app import ServiceEnvSetup
        from fedagent_flwr.envs.webshop.variants import variant_env_config

        effective = dict(config)
        resolved = None
        if variant:
            effective, resolved = variant_env_config(effective, variant)
        goal_indices = (partition or {}).get("goal_indices")
        if goal_indices is not None:
            if resolved is not None and resolved.goal_indices is not None:
                raise EnvConfigError(
                    f"the {resolved.strategy} variant chooses the goals itself; the partition must not set goal_indices"
                )
            effective = cls.restrict_goals(effective, list(goal_indices))
        probe = cls(effective)
        catalog = effective.get("catalog")
        info: dict[str, Any] = {
            "num_goals": cls.num_goals(effective),
            "catalog_size": len(set(catalog)) if catalog is not None else len(probe.world.products),
        }
        if resolved is not None:
            info["variant"] = resolved.describe()

        def factory(_slot: int) -> WebShopEnv:
            return cls(effective)

        return ServiceEnvSetup(factory=factory, info=info)

    def goal_index_for_seed(self, seed: int) -> int:
        """Absolute index into the shuffled goal list that an episode with ``seed`` uses."""
        return self.offset + pool_index_for_seed(seed, self.goal_indices, self.pool_size)

    # --- episode -----------------------------------------------------------------------------

    def _format(self, observation: str) -> str:
        return baseline_observation(observation) if self.observation_format == "baseline" else observation

    async def system_prompt(self) -> str:
        return CONCAT_SYSTEM_PROMPT

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        seed = int(seed)
        self.goal_index = self.goal_index_for_seed(seed)
        goal = self.world.goals[self.goal_index]
        # A private stream per episode for the "<r>" keyword: deterministic, independent of other envs.
        self.engine.rng = random.Random(self.search_seed * 1_000_003 + seed)  # type: ignore[operator]  # as top_k
        raw = self.engine.reset(goal)
        self._turn, self._done = 0, False
        available = self.engine.available_actions()
        self.task = task_from_observation(raw)
        shown = self._format(raw)
        text = concat_user_turn(shown, available, task=self.task)
        # "task" and "observation" (as shown to the model) feed the windowed prompt (render_window).
        return text, {"goal_index": self.goal_index, "asin": goal["asin"], "available_actions": available,
                      "raw_observation": raw, "observation": shown, "task": self.task, "turns": 0}

    async def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._done or self.goal_index is None:
            raise RuntimeError("WebShopEnv.step called without an active episode; call reset first")
        self._turn += 1
        action, valid = project_action(action_text)
        result = self.engine.step(action)
        mapped = service_reward(result.score, result.done, self.reward_mode)
        self._done = result.done or self._turn >= self.max_turns  # type: ignore[operator]  # as top_k
        available = self.engine.available_actions()
        info: dict[str, Any] = {
            "success": mapped.success,
            "won": mapped.success,
            "task_score": mapped.task_score,
            "is_action_valid": int(valid),
            "action": action,
            "action_applied": result.valid,
            "available_actions": available,
            "raw_observation": result.observation,
            "observation": self._format(result.observation),
            "turns": self._turn,
        }
        if result.reward_info is not None:
            info["reward_info"] = result.reward_info
        return concat_user_turn(info["observation"], available), mapped.reward, self._done, info

    @classmethod
    def render_window(cls, window: Window) -> str:
        """FedAgent's windowed WebShop prompt (:func:`~fedagent_flwr.envs.webshop.prompts.render_window`)."""
        return render_window(window)
