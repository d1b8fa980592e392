"""WebShop data: product loading and normalisation, synthetic goals, the seed-42 shuffle, the split.

Behaviour follows ``shared/specs/webshop.md`` §1 and §2 (FedAgent's vendored engine, [FA-eng]):

* products are loaded from the raw catalogue list in file order, first occurrence of an ASIN wins,
  and every product gets the display fields the text pages use (``Title``, ``Price``, ``options``…);
* a product's *reward price* is fixed at load time: one listed price gives that price, two give
  ``uniform(p0, p1)`` drawn from a Mersenne-Twister stream seeded with 42;
* synthetic goals are made for every product that has an instruction, one per combination of its
  option values; the stream is re-seeded with 42 for the price-cap draws and the shuffle that follows.

The upstream engine uses Python's *global* ``random`` module; a private ``random.Random`` seeded the
same way produces the identical sequence (same generator, same method calls), so nothing here touches
global state and the goal list is the same in every process.

Data files are never part of the project: they are read from a directory given by config or by the
``FEDAGENT_WEBSHOP_DATA`` environment variable.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

DATA_ENV_VAR = "FEDAGENT_WEBSHOP_DATA"
PRODUCTS_FILE = "items_shuffle_1000.json"
ATTRIBUTES_FILE = "items_ins_v2_1000.json"
#: How a missing data directory is fixed; part of every "no data" message.
DOWNLOAD_HINT = "fetch the data with: python -m fedagent_flwr.envs.webshop.download {data_dir}"

#: The seed FedAgent's SimServer uses for the price draws, the price-cap draws and the shuffle.
GOAL_SEED = 42
#: Size of the validation split (goals[0:VAL_SIZE]); FedAgent's WEBSHOP_VAL_SIZE.
VAL_SIZE = 500
#: Price grid for the synthetic price caps: 10, 20, ..., 990.
PRICE_RANGE: tuple[int, ...] = tuple(range(10, 1000, 10))
#: Price cap used when fewer than two grid values lie above the product's price.
NO_PRICE_CAP = 1000000
DEFAULT_PRICE = 100.0

# Seller, brand and housekeeping keys that upstream deletes before building a product.
_DROP_KEYS = (
    "product_information", "brand", "brand_url", "list_price", "availability_status",
    "availability_quantity", "total_reviews", "total_answered_questions", "seller_id", "seller_name",
    "fulfilled_by_amazon", "fast_track_message", "aplus_present", "small_description_old",
)
_PRICE_JUNK_RE = re.compile(r"[^\d.]")


class WebShopDataError(ValueError):
    """Missing or unusable WebShop data (directory, files, or a split that cannot be made)."""


def resolve_data_dir(config_value: str | os.PathLike[str] | None = None) -> Path:
    """The data directory: ``config_value`` if given, else ``$FEDAGENT_WEBSHOP_DATA``.

    Raises :class:`WebShopDataError` naming both sources when neither is set or the directory lacks
    the catalogue, so a misconfigured run fails at start-up instead of mid-episode.
    """
    raw = config_value if config_value not in (None, "") else os.environ.get(DATA_ENV_VAR)
    if not raw:
        raise WebShopDataError(
            f"no WebShop data directory is set: set env.data_dir (or the environment variable {DATA_ENV_VAR}); "
            f"{DOWNLOAD_HINT.format(data_dir='DATA_DIR')}"
        )
    path = Path(raw).expanduser()
    for name in (PRODUCTS_FILE, ATTRIBUTES_FILE):
        if not (path / name).is_file():
            raise WebShopDataError(f"WebShop data directory {path} has no {name}; "
                                   f"{DOWNLOAD_HINT.format(data_dir=path)}")
    return path


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise WebShopDataError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise WebShopDataError(f"{path} is not valid JSON: {exc}") from None


def read_raw_products(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The raw catalogue (a JSON list of Amazon product records), in file order."""
    raw = _read_json(Path(path))
    if not isinstance(raw, list):
        raise WebShopDataError(f"{path} must hold a JSON list of products, got {type(raw).__name__}")
    return raw


def read_attributes(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The attribute/instruction file (``items_ins_v2_1000.json``): a JSON object keyed by ASIN."""
    raw = _read_json(Path(path))
    if not isinstance(raw, dict):
        raise WebShopDataError(f"{path} must hold a JSON object keyed by ASIN, got {type(raw).__name__}")
    return raw


def parse_pricing(pricing: Any) -> list[float]:
    """Listed prices of a raw ``pricing`` string ("$19.99$27.99" -> [19.99, 27.99]); at most two.

    An empty or missing string gives ``[100.0]`` (upstream's default). Pieces left empty after
    removing non-digits are skipped (upstream would crash on them; none occur in the data).
    """
    if not pricing:
        return [DEFAULT_PRICE]
    values: list[float] = []
    for piece in str(pricing).split("$")[1:]:
        cleaned = _PRICE_JUNK_RE.sub("", piece)
        if cleaned:
            values.append(float(cleaned))
    return values[:2] if values else [DEFAULT_PRICE]


def price_display(prices: Sequence[float]) -> str:
    """The ``Price`` display string: "$35.0" for one price, "$19.99 to $27.99" for two (float repr)."""
    if len(prices) == 1:
        return f"${prices[0]!r}"
    return f"${prices[0]!r} to ${prices[1]!r}"


def _normalise_options(raw_options: Any) -> dict[str, list[str]]:
    """``customization_options`` -> {lowercased group: [values]}; "/" becomes " | ", lowercased."""
    options: dict[str, list[str]] = {}
    if not isinstance(raw_options, Mapping):
        return options
    for group, entries in raw_options.items():
        if entries is None:
            continue
        values = []
        for entry in entries:
            value = entry.get("value", "") if isinstance(entry, Mapping) else entry
            values.append(str(value).strip().replace("/", " | ").lower())
        options[str(group).lower()] = values
    return options


def _acceptable_asin(asin: Any) -> TypeGuard[str]:
    # Upstream skips "nan" and ASINs over 10 characters; FedAgent also admits look-alike clones (LK_...).
    if not isinstance(asin, str) or asin == "nan":
        return False
    return len(asin) <= 10 or asin.startswith("LK_")


def build_product(raw: Mapping[str, Any], attributes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One normalised product (spec §1 steps 1, 3–6) without its reward price."""
    product = {k: v for k, v in raw.items() if k not in _DROP_KEYS}
    asin = product["asin"]
    product["Title"] = product.get("name")
    product["Description"] = product.get("full_description")
    bullets = product.get("small_description")
    product["BulletPoints"] = list(bullets) if isinstance(bullets, list) else [bullets]
    product["Reviews"] = []
    product["Rating"] = "N.A."
    images = product.get("images") or []
    product["MainImage"] = images[0] if images else None
    product["query"] = str(product.get("query") or "").lower().strip()
    prices = parse_pricing(product.get("pricing"))
    product["pricing"] = prices
    product["Price"] = price_display(prices)
    product["options"] = _normalise_options(product.get("customization_options"))
    info = attributes.get(asin) or {}
    product["Attributes"] = list(info["attributes"]) if "attributes" in info else ["DUMMY_ATTR"]
    product["instruction_text"] = info.get("instruction")
    product["instruction_attributes"] = info.get("instruction_attributes")
    return product


def load_products(
    raw_products: Iterable[Mapping[str, Any]],
    attributes: Mapping[str, Mapping[str, Any]],
    rng: random.Random,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Normalise the catalogue in file order; return (products, reward price by ASIN).

    ``rng`` supplies the ``uniform(p0, p1)`` draws for two-price products, in product order, so
    it must be the seed-42 stream of :func:`build_world` for FedAgent's numbers.
    """
    products: list[dict[str, Any]] = []
    seen: set[str] = set()
    for raw in raw_products:
        asin = raw.get("asin")
        if not _acceptable_asin(asin) or asin in seen:
            continue
        seen.add(asin)
        products.append(build_product(raw, attributes))
    prices: dict[str, float] = {}
    for product in products:
        listed = product["pricing"]
        prices[product["asin"]] = listed[0] if len(listed) == 1 else rng.uniform(listed[0], listed[1])
    return products, prices


def synthesize_goals(
    products: Sequence[Mapping[str, Any]], prices: Mapping[str, float], rng: random.Random
) -> list[dict[str, Any]]:
    """Synthetic goals (spec §2), in generation order (before the shuffle).

    One price-cap draw per instruction product, then one goal per combination of its option values
    (groups sorted by name; an empty group yields no goal for that product).
    """
    goals: list[dict[str, Any]] = []
    for product in products:
        if not product.get("instruction_text"):
            continue
        asin = product["asin"]
        cands = [p for p in PRICE_RANGE if p > prices[asin]][:4]
        if len(cands) >= 2:
            price_upper: float = max(rng.sample(cands, 2))
            price_text = f", and price lower than {price_upper:.2f} dollars"
        else:
            price_upper = NO_PRICE_CAP
            price_text = ""
        names = sorted(product["options"])
        for combo in itertools.product(*(product["options"][n] for n in names)):
            goal_options = dict(zip(names, combo))
            option_text = ", and ".join(f"{k}: {v}" for k, v in goal_options.items())
            option_text = " with " + option_text if option_text else ""
            goals.append({
                "asin": asin,
                "category": product.get("category"),
                "query": product.get("query"),
                "product_category": product.get("product_category"),
                "name": product.get("Title"),
                "attributes": product.get("instruction_attributes"),
                "price_upper": price_upper,
                "goal_options": goal_options,
                "instruction_text": product["instruction_text"] + option_text + price_text,
            })
    return goals


def goal_task_id(goal: Mapping[str, Any]) -> str:
    """FedAgent's hardness-label task id of a goal (spec §2 "Hardness-label task_id")."""
    options = goal.get("goal_options") or {}
    if options:
        key = str(sorted(options.items()))
    elif goal.get("instruction_text"):
        key = str(goal["instruction_text"])
    else:
        return str(goal["asin"])
    return f"{goal['asin']}_{abs(int(hashlib.md5(key.encode('utf-8')).hexdigest(), 16))}"


@dataclass
class WebShopWorld:
    """Everything an engine needs that is shared by all episodes: products, prices, shuffled goals."""

    products: list[dict[str, Any]]
    product_prices: dict[str, float]
    goals: list[dict[str, Any]]
    val_size: int
    by_asin: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_asin = {p["asin"]: p for p in self.products}

    @property
    def val_goals(self) -> list[dict[str, Any]]:
        """goals[0:val_size]."""
        return self.goals[: self.val_size]

    @property
    def train_goals(self) -> list[dict[str, Any]]:
        """goals[val_size:]."""
        return self.goals[self.val_size:]


def effective_val_size(num_goals: int, val_size: int = VAL_SIZE) -> int:
    """The validation-split size for a goal list of ``num_goals``.

    FedAgent's 500 when the list is long enough; for a small catalogue (fewer than 2×val_size goals)
    at most half of the goals, so that both splits are non-empty and every catalogue size works.
    """
    if val_size < 0:
        raise WebShopDataError(f"val_size must be >= 0, got {val_size}")
    if num_goals < 2:
        raise WebShopDataError(f"need at least 2 goals to make a train/validation split, got {num_goals}")
    return min(val_size, num_goals // 2)


def build_world(
    raw_products: Sequence[Mapping[str, Any]],
    attributes: Mapping[str, Mapping[str, Any]],
    *,
    extra_products: Sequence[Mapping[str, Any]] = (),
    num_goals: int | None = None,
    val_size: int = VAL_SIZE,
    shuffle_seed: int | None = None,
) -> WebShopWorld:
    """Products, reward prices and the shuffled goal list exactly as FedAgent's SimServer makes them.

    RNG sequence (spec §2): seed 42 -> price draws over the catalogue then ``extra_products``
    (look-alikes, which get ``DUMMY_ATTR`` and produce no goals) -> re-seed 42 -> price-cap draws ->
    shuffle; if ``shuffle_seed`` is neither None nor 42, goals[500:] are reshuffled with it.
    ``num_goals`` caps the list (FedAgent's WEBSHOP_NUM_GOALS); default all generated goals.
    """
    rng = random.Random(GOAL_SEED)
    products, prices = load_products(list(raw_products), attributes, rng)
    if extra_products:
        seen = {p["asin"] for p in products}
        extras = [p for p in extra_products if p.get("asin") not in seen]
        # Look-alikes carry no instruction ("instruction_text None for LK_ asins"), so no goals.
        more, more_prices = load_products(extras, {}, rng)
        for p in more:
            p["instruction_text"] = None
            p["instruction_attributes"] = None
        products += more
        prices.update(more_prices)
    goal_products = [p for p in products if not str(p["asin"]).startswith("LK_")]
    rng.seed(GOAL_SEED)
    goals = synthesize_goals(goal_products, prices, rng)
    rng.shuffle(goals)
    if shuffle_seed is not None and shuffle_seed != GOAL_SEED:
        head, tail = goals[:VAL_SIZE], goals[VAL_SIZE:]
        random.Random(shuffle_seed).shuffle(tail)
        goals = head + tail
    if num_goals is not None:
        if num_goals < 2:
            raise WebShopDataError(f"num_goals must be >= 2, got {num_goals}")
        goals = goals[:num_goals]
    return WebShopWorld(products, prices, goals, effective_val_size(len(goals), val_size))


def load_world(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    num_goals: int | None = None,
    val_size: int = VAL_SIZE,
    shuffle_seed: int | None = None,
    extra_product_files: Sequence[str | os.PathLike[str]] = (),
) -> WebShopWorld:
    """Read the catalogue and attribute file from ``data_dir`` (or the env var) and build the world."""
    path = resolve_data_dir(data_dir)
    raw = read_raw_products(path / PRODUCTS_FILE)
    attrs = read_attributes(path / ATTRIBUTES_FILE)
    extras: list[dict[str, Any]] = []
    for extra in extra_product_files:
        extras += read_raw_products(extra)
    return build_world(raw, attrs, extra_products=extras, num_goals=num_goals, val_size=val_size,
                       shuffle_seed=shuffle_seed)
