"""WebShop's text-mode page state machine, in process (spec §3 and §4).

The engine renders each page directly as the list of text segments that upstream obtains by
stripping the rendered HTML, joined with " [SEP] ", and keeps the same clickables map, so
observations, admissible actions and rewards match WebShop's ``WebAgentTextEnv`` in text mode
without Flask, HTML or a browser simulator.

Pages: search -> results (10 per page) -> item -> description / features / reviews sub-pages,
and the done page after "Buy Now". ``search[...]`` works from every page; invalid actions leave
the state and observation unchanged.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from fedagent_flwr.envs.webshop.data import WebShopWorld
from fedagent_flwr.envs.webshop.reward import get_reward
from fedagent_flwr.envs.webshop.search import DEFAULT_TOP_K, Searcher

SEP = " [SEP] "
#: PRODUCT_WINDOW: products per results page.
PRODUCTS_PER_PAGE = 10

_ACTION_RE = re.compile(r"(.+)\[(.+)\]")

# Page kinds.
SEARCH, RESULTS, ITEM, DESCRIPTION, FEATURES, REVIEWS, DONE = (
    "search", "results", "item", "description", "features", "reviews", "done",
)
_SUB_PAGES = {"description": DESCRIPTION, "features": FEATURES, "reviews": REVIEWS}


def parse_action(action: str) -> tuple[str, str | None]:
    """Split ``name[arg]`` like upstream: ``re.match(r'(.+)\\[(.+)\\]')``, greedy, no end anchor.

    Without a match the whole string is the name and there is no argument.
    """
    match = _ACTION_RE.match(action)
    if match is None:
        return action, None
    return match.group(1), match.group(2)


def _text_segments(value: Any) -> list[str]:
    """Segments a data value contributes: none for "" or "\\n", else the stripped text.

    A whitespace-only value thus gives one empty segment, as upstream's HTML-to-text does.
    ``None`` renders as "None" (what the template engine prints).
    """
    text = "None" if value is None else str(value)
    if text in ("", "\n"):
        return []
    return [text.strip()]


def _html_safe_json(options: Mapping[str, str]) -> str:
    # Flask's tojson: sorted keys, ASCII, and <, >, &, ' escaped as \u00XX.
    text = json.dumps(dict(options), sort_keys=True, separators=(", ", ": "))
    return (text.replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026").replace("'", "\\u0027"))


@dataclass(frozen=True)
class EngineStep:
    """One engine step: the new observation, the purchase score (0 unless bought) and flags."""

    observation: str
    score: float
    done: bool
    valid: bool  # whether the action had an effect (False: unknown click, bad format, "search[]")
    reward_info: dict[str, Any] | None = None


class WebShopEngine:
    """One shopping session over a shared :class:`WebShopWorld` and search index.

    ``allowed_asins`` (a client's catalogue) hides every other product from search results;
    ``top_k`` is SEARCH_RETURN_N; ``rng`` (seeded 0) feeds the ``<r>`` random-search keyword only.
    """

    def __init__(
        self,
        world: WebShopWorld,
        search: Searcher,
        *,
        allowed_asins: Collection[str] | None = None,
        top_k: int = DEFAULT_TOP_K,
    ) -> None:
        self.world = world
        self.search_index = search
        self.allowed = None if allowed_asins is None else frozenset(allowed_asins)
        self.top_k = top_k
        self.rng = random.Random(0)
        self.goal: dict[str, Any] | None = None
        self._clear()

    # --- state -------------------------------------------------------------------------------

    def _clear(self) -> None:
        self.page = SEARCH
        self.keywords: list[str] | None = None
        self.page_num = 1
        self.results: list[str] = []
        self.asin: str | None = None
        self.options: dict[str, str] = {}
        self.last_score = 0.0
        self.bought: tuple[str, dict[str, str]] | None = None

    def reset(self, goal: Mapping[str, Any]) -> str:
        """Start a session for ``goal``; returns the search page's observation."""
        self.goal = dict(goal)
        self._clear()
        return self.observation()

    @property
    def instruction(self) -> str:
        if self.goal is None:
            raise RuntimeError("WebShopEngine has no goal; call reset first")
        return str(self.goal["instruction_text"])

    # --- search ------------------------------------------------------------------------------

    def _retrieve(self, keywords: list[str]) -> list[str] | None:
        """Ranked ASINs for the keywords (after the catalogue filter); None for the unsupported ``<a>``."""
        products = self.world.products
        first = keywords[0] if keywords else ""
        if first == "<r>":
            ranked = [p["asin"] for p in self.rng.sample(products, min(self.top_k, len(products)))]
        elif first == "<c>" and len(keywords) > 1:
            ranked = [p["asin"] for p in products if p.get("category") == keywords[1].strip()]
        elif first == "<q>":
            query = " ".join(keywords[1:]).strip()
            ranked = [p["asin"] for p in products if p.get("query") == query]
        elif first == "<a>":
            return None  # upstream crashes here; refused as an invalid action instead
        else:
            return self.search_index.search(" ".join(keywords), self.allowed, top_k=self.top_k)
        return ranked if self.allowed is None else [a for a in ranked if a in self.allowed]

    def _show_results(self, keywords: list[str], page_num: int) -> bool:
        results = self._retrieve(keywords)
        if results is None:
            return False
        self.keywords, self.page_num, self.results = keywords, page_num, results
        self.page, self.asin, self.options = RESULTS, None, {}
        return True

    # --- rendering ---------------------------------------------------------------------------

    def _page_products(self) -> list[dict[str, Any]]:
        start = (self.page_num - 1) * PRODUCTS_PER_PAGE
        return [self.world.by_asin[a] for a in self.results[start:start + PRODUCTS_PER_PAGE]]

    def _product(self) -> dict[str, Any]:
        assert self.asin is not None
        return self.world.by_asin[self.asin]

    def segments(self) -> list[str]:
        """The current page's text segments, in document order."""
        head = ["Instruction:", *_text_segments(self.instruction)]
        if self.page == SEARCH:
            return ["WebShop", *head, "Search"]
        if self.page == RESULTS:
            segs = [*head, "Back to Search", f"Page {self.page_num} (Total results: {len(self.results)})"]
            if self.page_num > 1:
                segs.append("< Prev")
            segs.append("Next >")
            for p in self._page_products():
                segs += [p["asin"], *_text_segments(p.get("Title")), *_text_segments(p.get("Price"))]
            return segs
        if self.page == DONE:
            return self._done_segments()
        product = self._product()
        segs = [*head, "Back to Search", "< Prev"]
        if self.page == ITEM:
            for group, values in product["options"].items():
                segs.append(group)
                segs += [v.strip() for v in values]
            segs += [*_text_segments(product.get("Title")), f"Price: {product.get('Price')}",
                     f"Rating: {product.get('Rating')}", "Description", "Features", "Reviews", "Buy Now"]
        elif self.page == DESCRIPTION:
            segs += _text_segments(product.get("Description"))
        elif self.page == FEATURES:
            # Each bullet is its own element, so an empty bullet still yields an (empty) segment.
            segs += ["None" if b is None else str(b).strip() for b in product.get("BulletPoints") or []]
        return segs  # REVIEWS: reviews are never loaded, so the page is just the header

    def _done_segments(self) -> list[str]:
        assert self.bought is not None
        asin, options = self.bought
        return [
            "Thank you for shopping with us!", "Your code:", "None", "(Paste it in your MTurk interface.)",
            "Purchased", "asin", asin, "options", _html_safe_json(options), "attrs", "None", "category", "None",
            "query", "None", "product category", "None", "Target", "asin", "options", "attrs", "price upper",
            "instuction text", "category", "product category", "query", "Goal", "None", "Reward",
            "Your score (min 0.0, max 1.0)", str(float(self.last_score)), "Reward Details", "None",
        ]

    def observation(self) -> str:
        """The text observation of the current page (segments joined with " [SEP] ")."""
        return SEP.join(self.segments())

    def clickables(self) -> dict[str, tuple[str, Any]]:
        """Clickable text -> (kind, payload), insertion-ordered like upstream's map.

        Buttons first, then product links, then option values; a repeated text keeps its first
        position but maps to the later element (so a value shared by two groups selects the later).
        """
        items: dict[str, tuple[str, Any]] = {}
        if self.page in (SEARCH, DONE):
            # After Buy Now FedAgent's engine auto-resets, so the done page reports the search page's actions.
            items["search"] = ("search", None)
        elif self.page == RESULTS:
            items["back to search"] = ("back", None)
            if self.page_num > 1:
                items["< prev"] = ("prev", None)
            items["next >"] = ("next", None)
            for p in self._page_products():
                items[str(p["asin"]).lower()] = ("asin", p["asin"])
        elif self.page == ITEM:
            for button in ("back to search", "< prev", "description", "features", "reviews", "buy now"):
                items[button] = ("button", button)
            for group, values in self._product()["options"].items():
                for value in values:
                    items[value] = ("option", (group, value))
        else:
            items["back to search"] = ("back", None)
            items["< prev"] = ("prev", None)
        return items

    def available_actions(self) -> dict[str, Any]:
        """``{"has_search_bar": bool, "clickables": [...]}`` as WebShop's get_available_actions."""
        return {"has_search_bar": self.page in (SEARCH, DONE), "clickables": list(self.clickables())}

    # --- transitions -------------------------------------------------------------------------

    def _invalid(self) -> EngineStep:
        return EngineStep(self.observation(), 0.0, False, False)

    def step(self, action: str) -> EngineStep:
        """Apply one action string (``search[...]`` or ``click[...]``); see spec §4."""
        if self.goal is None:
            raise RuntimeError("WebShopEngine.step called before reset")
        if self.page == DONE:
            raise RuntimeError("WebShopEngine.step called after the purchase; reset first")
        name, arg = parse_action(action)
        if arg is not None:
            arg = arg.lower()
        if name == "search" and arg:
            if not self._show_results(arg.split(" "), 1):
                return self._invalid()
            return EngineStep(self.observation(), 0.0, False, True)
        clickables = self.clickables()
        if name != "click" or arg is None or arg == "search" or arg not in clickables:
            return self._invalid()
        kind, payload = clickables[arg]
        if kind == "back":
            self._clear()
        elif self.page == RESULTS:
            if kind == "asin":
                self.page, self.asin = ITEM, str(payload).upper()
            else:
                assert self.keywords is not None
                self._show_results(self.keywords, self.page_num + (1 if kind == "next" else -1))
        elif self.page == ITEM:
            if kind == "option":
                group, value = payload
                self.options[group] = value
            elif payload == "back to search":
                self._clear()
            elif payload == "< prev":
                # Re-runs the stored search at the stored page and clears the chosen options (quirk).
                assert self.keywords is not None
                self._show_results(self.keywords, self.page_num)
            elif payload == "buy now":
                return self._buy()
            else:
                self.page = _SUB_PAGES[payload]
        elif kind == "prev":  # sub-page -> item page, options kept
            self.page = ITEM
        return EngineStep(self.observation(), 0.0, False, True)

    def _buy(self) -> EngineStep:
        assert self.goal is not None and self.asin is not None
        product = self._product()
        result = get_reward(product, self.goal, self.world.product_prices[self.asin], self.options)
        self.last_score = result.score
        self.bought = (self.asin, dict(self.options))
        self.page = DONE
        return EngineStep(self.observation(), result.score, True, True, result.info)
