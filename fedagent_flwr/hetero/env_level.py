"""Environment-level heterogeneity for WebShop: which *world* each federated client shops in.

FedAgent's environment-level arms (reference/fedagent.md §4.2, specs/webshop.md §8) leave the goal
list alone (except ``catalog_split``, which also slices the goals) and change what the client's
search engine shows:

* ``catalog_split`` (V1): a goal slice plus a per-client catalogue - the slice's target ASINs and a
  ``keep_ratio`` share of the other products, chosen by ``e = (1 - env_div)*u + env_div*v`` with
  ``u`` shared by all clients and ``v`` private to the client (``env_div`` 0: identical catalogues,
  1: independent ones). Search results outside the catalogue are dropped (ranks not refilled).
* ``bm25_field_subset`` (V2): the in-memory BM25Okapi over one of N field subsets.
* ``bm25_reweight`` (V3): the in-memory BM25Okapi with one of N (k1, b) pairs.
* ``lookalike`` (V4): one of N files of decoy products (clones of catalogue products with another
  colour/size/price) appended to the catalogue.
* ``rank_wrapper`` (V5): one of N re-rankings of the in-memory BM25 results (identity, shuffle,
  inversion, random results half of the time).

Everything here is a pure function of (client id, client count, knobs, base seed, world data).
Random draws use numpy's legacy ``RandomState`` seeded with FedAgent's integer formulas
(``base_seed``, ``base_seed + 1000*client_id``, ``base_seed + client_id``), so with
``base_seed = 42`` the choices are FedAgent's, in every process (never Python's salted ``hash()``).

A client's service is launched with a small *request* (:func:`variant_request`: strategy, client,
knobs); the service resolves it against its world with :func:`resolve_variant` into an
:class:`EnvVariant`, whose :meth:`EnvVariant.describe` is the short JSON summary ``/health`` shows
(catalogues as a count and a SHA-256 of the sorted ASINs).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedagent_flwr.hetero.common import DEFAULT_SEED, check_args, fedagent_slice, knob, knob_int
from fedagent_flwr.hetero.uniform import DEFAULT_MIN_GOALS, PartitionError
from fedagent_flwr.schema.run import Partition

CATALOG_SPLIT = "catalog_split"
BM25_FIELD_SUBSET = "bm25_field_subset"
BM25_REWEIGHT = "bm25_reweight"
LOOKALIKE = "lookalike"
RANK_WRAPPER = "rank_wrapper"
#: The environment-level strategy names (FedAgent's ``PARTITION_STRATEGY`` values).
ENV_LEVEL_STRATEGIES: tuple[str, ...] = (CATALOG_SPLIT, BM25_FIELD_SUBSET, BM25_REWEIGHT, LOOKALIKE, RANK_WRAPPER)
#: Strategies that pick one entry of a fixed pool per client.
POOL_STRATEGIES: tuple[str, ...] = (BM25_FIELD_SUBSET, BM25_REWEIGHT, LOOKALIKE, RANK_WRAPPER)

#: FedAgent's ``DEFAULTS``: catalog_split divergence and distractor density (the schema fields' defaults).
DEFAULT_ENV_DIV: float = Partition.env_div  # type: ignore[assignment]
DEFAULT_KEEP_RATIO: float = Partition.keep_ratio  # type: ignore[assignment]
#: Pool size per strategy when ``variant_n`` is 0 or absent (FedAgent's function defaults).
DEFAULT_VARIANT_N: dict[str, int] = {BM25_FIELD_SUBSET: 4, BM25_REWEIGHT: 4, LOOKALIKE: 2, RANK_WRAPPER: 4}

#: The in-memory index's full field list F (``description``/``features`` are no product keys: spec §5 quirk).
FULL_FIELDS: tuple[str, ...] = ("name", "Title", "description", "features", "BulletPoints")
DEFAULT_K1 = 1.2
DEFAULT_B = 0.75

#: V2 pool, in order: (name, fields); all with k1 = 1.2, b = 0.75.
FIELD_SUBSET_POOL: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("full", FULL_FIELDS),
    ("name", ("name", "Title")),
    ("desc", ("description",)),
    ("bullets", ("BulletPoints",)),
    ("features", ("features",)),
    ("name_bullets", ("name", "Title", "BulletPoints")),
    ("desc_features", ("description", "features")),
    ("no_name", ("description", "features", "BulletPoints")),
)
#: V3 pool, in order: (name, k1, b); all over the full field list.
REWEIGHT_POOL: tuple[tuple[str, float, float], ...] = (
    ("full", 1.2, 0.75),
    ("full_b=0.0", 1.2, 0.0),
    ("full_k1=0.3", 0.3, 0.75),
    ("full_k1=5.0", 5.0, 0.75),
    ("full_k1=0.1", 0.1, 0.75),
    ("full_b=1.0", 1.2, 1.0),
    ("full_k1=2.0_b=0.5", 2.0, 0.5),
    ("full_k1=0.3_b=0.0", 0.3, 0.0),
)
#: V4 pool, in order: file ``lookalike_{name}.json``. ``v_price`` is not in the shared data.
LOOKALIKE_POOL: tuple[str, ...] = ("v_price", "v_color", "v_size", "v_price_color")
#: V5 pool, in order.
RANK_WRAPPER_POOL: tuple[str, ...] = ("bm25_default", "bm25_shuffle", "bm25_invert", "bm25_partial")
RANK_SHUFFLE_K = 50
RANK_PARTIAL_P = 0.5

_POOL_SIZES = {BM25_FIELD_SUBSET: len(FIELD_SUBSET_POOL), BM25_REWEIGHT: len(REWEIGHT_POOL),
               LOOKALIKE: len(LOOKALIKE_POOL), RANK_WRAPPER: len(RANK_WRAPPER_POOL)}
_REQUEST_KEYS = {
    CATALOG_SPLIT: ("env_div", "keep_ratio", "min_goals_per_client", "holdout_file", "catalog_targets"),
    BM25_FIELD_SUBSET: ("variant_n",),
    BM25_REWEIGHT: ("variant_n",),
    LOOKALIKE: ("variant_n", "lookalike_dir", "lookalike_pool"),
    RANK_WRAPPER: ("variant_n",),
}


def asin_set_digest(asins: Collection[str]) -> str:
    """SHA-256 (hex) of the sorted ASINs joined by newlines: a catalogue's fingerprint for ``/health``."""
    return hashlib.sha256("\n".join(sorted(asins)).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class EnvVariant:
    """A client's resolved world. Only the fields of its ``strategy`` are set.

    ``goal_indices`` are indices into the train pool (the env's ``goal_indices`` config);
    ``catalog`` the ASINs search may show; ``bm25`` the in-memory index ({fields, k1, b});
    ``lookalike`` the decoy file's pool name (``v_color``...); ``rank_wrapper`` the wrapper
    ({type, seed, shuffle_k, p}).
    """

    strategy: str
    client_id: int
    num_clients: int
    base_seed: int
    name: str
    index: int | None = None
    goal_indices: tuple[int, ...] | None = None
    catalog: frozenset[str] | None = None
    bm25: Mapping[str, Any] | None = None
    lookalike: str | None = None
    rank_wrapper: Mapping[str, Any] | None = None
    stats: Mapping[str, Any] | None = None

    def describe(self) -> dict[str, Any]:
        """Short JSON-serialisable summary (for ``/health``): large sets as count + SHA-256."""
        out: dict[str, Any] = {"strategy": self.strategy, "client_id": self.client_id,
                               "num_clients": self.num_clients, "base_seed": self.base_seed, "name": self.name}
        if self.index is not None:
            out["index"] = self.index
        if self.goal_indices is not None:
            g = self.goal_indices
            out["goals"] = {"count": len(g), "first": g[0] if g else None, "last": g[-1] if g else None,
                            "sha256": hashlib.sha256(json.dumps(list(g)).encode()).hexdigest()}
        if self.catalog is not None:
            out["catalog"] = {"size": len(self.catalog), "sha256": asin_set_digest(self.catalog)}
        if self.bm25 is not None:
            out["bm25"] = {"fields": list(self.bm25["fields"]), "k1": self.bm25["k1"], "b": self.bm25["b"]}
        if self.lookalike is not None:
            out["lookalike"] = self.lookalike
        if self.rank_wrapper is not None:
            out["rank_wrapper"] = dict(self.rank_wrapper)
        if self.stats:
            out["stats"] = dict(self.stats)
        return out


# --- pool choice (V2-V5) ------------------------------------------------------------------------


def effective_variant_n(strategy: str, variant_n: int | None) -> int:
    """``variant_n`` or the strategy's default when 0/None; must fit the pool."""
    n = DEFAULT_VARIANT_N[strategy] if not variant_n else int(variant_n)
    if not 1 <= n <= _POOL_SIZES[strategy]:
        raise PartitionError(f"variant_n for {strategy} must be in [1, {_POOL_SIZES[strategy]}], got {variant_n!r}")
    return n


def choose_variant_index(client_id: int, variant_n: int, base_seed: int = DEFAULT_SEED) -> int:
    """FedAgent's assignment: ``RandomState(base_seed + client_id).randint(variant_n)``."""
    if variant_n < 1:
        raise PartitionError(f"variant_n must be >= 1, got {variant_n}")
    return int(np.random.RandomState(int(base_seed) + int(client_id)).randint(variant_n))


def pool_variant(strategy: str, client_id: int, num_clients: int, variant_n: int | None = None,
                 base_seed: int = DEFAULT_SEED) -> EnvVariant:
    """The V2-V5 variant of a client: ``pool[:N][choose_variant_index(...)]``, resolved to parameters."""
    if strategy not in POOL_STRATEGIES:
        raise PartitionError(f"{strategy!r} is not a pool strategy ({', '.join(POOL_STRATEGIES)})")
    check_args(client_id, num_clients, 1)
    n = effective_variant_n(strategy, variant_n)
    i = choose_variant_index(client_id, n, base_seed)
    common: dict[str, Any] = {"strategy": strategy, "client_id": client_id, "num_clients": num_clients,
                              "base_seed": int(base_seed), "index": i}
    if strategy == BM25_FIELD_SUBSET:
        name, fields = FIELD_SUBSET_POOL[i]
        return EnvVariant(name=name, bm25={"fields": fields, "k1": DEFAULT_K1, "b": DEFAULT_B}, **common)
    if strategy == BM25_REWEIGHT:
        name, k1, b = REWEIGHT_POOL[i]
        return EnvVariant(name=name, bm25={"fields": FULL_FIELDS, "k1": k1, "b": b}, **common)
    if strategy == LOOKALIKE:
        name = LOOKALIKE_POOL[i]
        return EnvVariant(name=name, lookalike=name, **common)
    name = RANK_WRAPPER_POOL[i]
    wrapper: dict[str, Any] = {"type": name, "seed": int(base_seed) + int(client_id)}
    if name == "bm25_shuffle":
        wrapper["shuffle_k"] = RANK_SHUFFLE_K
    elif name == "bm25_partial":
        wrapper["p"] = RANK_PARTIAL_P
    return EnvVariant(name=name, rank_wrapper=wrapper, **common)


# --- catalog_split (V1) -------------------------------------------------------------------------


def unshuffled_goal_asins(products: Sequence[Mapping[str, Any]]) -> list[str]:
    """FedAgent's ``goal_asins`` (spec §8 V1 step 1): the goals' ASINs in *generation* order.

    For each product (load order; look-alike ``LK_`` clones skipped) with a truthy instruction, its
    ASIN repeated once per option combination: the product of the value counts of its non-empty
    option groups (1 without options).
    """
    out: list[str] = []
    for p in products:
        asin = str(p["asin"])
        if asin.startswith("LK_") or not p.get("instruction_text"):
            continue
        n = 1
        for values in (p.get("options") or {}).values():
            if values:
                n *= len(values)
        out += [asin] * n
    return out


def catalog_distractors(
    all_asins: Collection[str], targets: Collection[str], holdout: Collection[str] = ()
) -> list[str]:
    """sorted(all − targets − holdout); a holdout ASIN among the targets is an error."""
    clash = set(holdout) & set(targets)
    if clash:
        raise PartitionError(f"holdout ASINs are goal targets of this client: {sorted(clash)[:5]}")
    return sorted(set(all_asins) - set(targets) - set(holdout))


def keep_distractors(all_asins: Collection[str], distractors: Sequence[str], client_id: int, env_div: float,
                     keep_ratio: float, base_seed: int = DEFAULT_SEED) -> list[str]:
    """The kept distractors: the ``round(keep_ratio * D)`` smallest ``e = (1-env_div)*u + env_div*v``.

    ``u`` = ``RandomState(base_seed).random()`` and ``v`` = ``RandomState(base_seed + 1000*client_id)
    .random()``, one draw per ASIN of ``sorted(all_asins)`` in order (so a value belongs to its ASIN
    whatever the distractor set); ``np.argsort`` with its default kind, as FedAgent. Returned sorted.
    """
    ordered = sorted(set(all_asins))
    pos = {a: i for i, a in enumerate(ordered)}
    u = np.random.RandomState(int(base_seed)).random_sample(len(ordered))
    v = np.random.RandomState(int(base_seed) + 1000 * int(client_id)).random_sample(len(ordered))
    idx = np.array([pos[a] for a in distractors], dtype=np.int64)
    e = (1.0 - env_div) * u[idx] + env_div * v[idx]
    n_keep = int(round(keep_ratio * len(distractors)))
    order = np.argsort(e)[:n_keep]
    return sorted(distractors[i] for i in order)


def catalog_split(
    client_id: int,
    num_clients: int,
    all_asins: Collection[str],
    pool_goal_asins: Sequence[str],
    *,
    env_div: float = DEFAULT_ENV_DIV,
    keep_ratio: float = DEFAULT_KEEP_RATIO,
    min_goals_per_client: int = DEFAULT_MIN_GOALS,
    base_seed: int = DEFAULT_SEED,
    holdout: Collection[str] = (),
    target_asins: Sequence[str] | None = None,
) -> EnvVariant:
    """FedAgent's catalog split (spec §8 V1) for one client.

    ``all_asins``: the catalogue (unique ASINs, no look-alikes). ``pool_goal_asins[i]``: the ASIN of
    train-pool goal ``i``. Goal slice = :func:`~fedagent_flwr.hetero.common.fedagent_slice` of the
    pool; targets = the ASINs of ``target_asins`` (default ``pool_goal_asins``) at the slice's
    indices; catalogue = targets ∪ :func:`keep_distractors` over ``sorted(all − targets − holdout)``.
    """
    check_args(client_id, num_clients, max(len(pool_goal_asins), 1))
    if not 0.0 <= env_div <= 1.0 or not 0.0 <= keep_ratio <= 1.0:
        raise PartitionError(f"env_div and keep_ratio must be in [0, 1], got {env_div!r}, {keep_ratio!r}")
    goals = fedagent_slice(client_id, num_clients, len(pool_goal_asins), min_goals_per_client)
    source = pool_goal_asins if target_asins is None else target_asins
    targets = {str(source[i]) for i in goals if i < len(source)}
    distractors = catalog_distractors(all_asins, targets, holdout)
    kept = keep_distractors(all_asins, distractors, client_id, env_div, keep_ratio, base_seed)
    catalog = frozenset(targets) | frozenset(kept)
    return EnvVariant(
        strategy=CATALOG_SPLIT, client_id=client_id, num_clients=num_clients, base_seed=int(base_seed),
        name=f"env_div={env_div:g},keep_ratio={keep_ratio:g}", goal_indices=tuple(goals), catalog=catalog,
        stats={"targets": len(targets), "distractors": len(distractors), "kept": len(kept),
               "holdout": len(set(holdout)), "env_div": env_div, "keep_ratio": keep_ratio},
    )


def read_holdout(path: str | Path) -> list[str]:
    """ASINs of a holdout file ``{"asins": [...]}`` (FedAgent's HOLDOUT_FILE)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise PartitionError(f"cannot read holdout file {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("asins"), list):
        raise PartitionError(f"holdout file {path} must hold a JSON object with an 'asins' list")
    return [str(a) for a in data["asins"]]


# --- requests: what a client's service is launched with -----------------------------------------


def variant_request(strategy: str, client_id: int, num_clients: int, knobs: Mapping[str, Any] | None = None,
                    base_seed: int = DEFAULT_SEED) -> dict[str, Any] | None:
    """The ``variant`` dict for a client's service launch (None for a non-env-level strategy).

    Small and JSON-serialisable: strategy, client id, client count, base seed and the strategy's
    knobs present in ``knobs`` (others ignored). Validated here, so a bad knob fails at start.
    """
    key = (strategy or "").strip().lower()
    if key not in ENV_LEVEL_STRATEGIES:
        return None
    check_args(client_id, num_clients, 1)
    knobs = dict(knobs or {})
    request: dict[str, Any] = {"strategy": key, "client_id": int(client_id), "num_clients": int(num_clients),
                               "base_seed": int(base_seed)}
    for name in _REQUEST_KEYS[key]:
        if knobs.get(name) is not None:
            request[name] = knobs[name]
    _check_request(request)
    return request


def _check_request(request: Mapping[str, Any]) -> tuple[str, int, int, int]:
    strategy = str(request.get("strategy", ""))
    if strategy not in ENV_LEVEL_STRATEGIES:
        raise PartitionError(f"unknown env-level strategy {strategy!r} (known: {', '.join(ENV_LEVEL_STRATEGIES)})")
    unknown = set(request) - {"strategy", "client_id", "num_clients", "base_seed", *_REQUEST_KEYS[strategy]}
    if unknown:
        raise PartitionError(f"unknown keys for {strategy}: {sorted(unknown)}")
    num_clients = knob_int(request, "num_clients", 1, 1)
    client_id = knob_int(request, "client_id", 0, 0)
    base_seed = knob_int(request, "base_seed", 42, 0)
    check_args(client_id, num_clients, 1)
    if strategy == CATALOG_SPLIT:
        for name in ("env_div", "keep_ratio", "min_goals_per_client", "catalog_targets"):
            knob(request, name)
    else:
        effective_variant_n(strategy, knob(request, "variant_n"))
        pool = request.get("lookalike_pool")
        if pool is not None and (isinstance(pool, str) or not isinstance(pool, Sequence) or not pool
                                 or not all(isinstance(p, str) and p for p in pool)):
            raise PartitionError(f"lookalike_pool must be a non-empty list of names, got {pool!r}")
    return strategy, client_id, num_clients, base_seed


def resolve_variant(
    request: Mapping[str, Any],
    *,
    all_asins: Collection[str] = (),
    pool_goal_asins: Sequence[str] = (),
    unshuffled_pool_goal_asins: Sequence[str] | None = None,
) -> EnvVariant:
    """Resolve a :func:`variant_request` dict against the world's data.

    ``all_asins`` and ``pool_goal_asins`` (train-pool goal ASINs, served order) are needed by
    ``catalog_split`` only; ``unshuffled_pool_goal_asins`` only with ``catalog_targets:
    "unshuffled"`` (FedAgent's goal_asins[val_size:], see :func:`unshuffled_goal_asins`).
    ``lookalike`` with a custom ``lookalike_pool`` picks from that list instead of FedAgent's.
    """
    strategy, client_id, num_clients, base_seed = _check_request(request)
    if strategy == CATALOG_SPLIT:
        holdout = read_holdout(request["holdout_file"]) if request.get("holdout_file") else []
        targets = None
        if knob(request, "catalog_targets") == "unshuffled":
            if unshuffled_pool_goal_asins is None:
                raise PartitionError("catalog_targets 'unshuffled' needs the unshuffled goal ASINs")
            targets = unshuffled_pool_goal_asins
        return catalog_split(
            client_id, num_clients, all_asins, pool_goal_asins,
            env_div=knob(request, "env_div"), keep_ratio=knob(request, "keep_ratio"),
            min_goals_per_client=knob(request, "min_goals_per_client"),
            base_seed=base_seed, holdout=holdout, target_asins=targets,
        )
    variant_n = knob(request, "variant_n")
    if strategy == LOOKALIKE and request.get("lookalike_pool") is not None:
        pool = [str(p) for p in request["lookalike_pool"]]
        n = min(len(pool), int(variant_n) or DEFAULT_VARIANT_N[LOOKALIKE])
        i = choose_variant_index(client_id, n, base_seed)
        return EnvVariant(strategy=strategy, client_id=client_id, num_clients=num_clients, base_seed=base_seed,
                          name=pool[i], index=i, lookalike=pool[i])
    return pool_variant(strategy, client_id, num_clients, variant_n, base_seed)
