"""WebShop reward: the golden cases of shared/specs/webshop.md §9 (table 1–12, cases 13–17).

The spec computed them on 160 products rebuilt from the look-alike files (its §9 "Fixture"), so
these tests rebuild exactly that fixture from the shared data (:func:`testkit.webshop_data.golden_world`);
the real (partial) catalogue is checked to agree with it for the products both hold.
"""

from __future__ import annotations

from typing import Any

import pytest

from fedagent_flwr.envs.webshop.data import WebShopWorld, read_raw_products
from fedagent_flwr.envs.webshop.reward import (
    get_reward,
    match_options,
    normalize_color,
    service_reward,
    token_set_ratio,
)
from testkit.webshop_data import DATA_DIR, golden_world, needs_data, rebuild_golden_products


def make_goal(world: WebShopWorld, asin: str, goal_options: dict[str, str], price_upper: float,
              attributes: list[str] | None = None) -> dict[str, Any]:
    """A goal for ``asin`` as the spec gives it: name, category etc. taken from the product."""
    p = world.by_asin[asin]
    return {
        "asin": asin, "category": p["category"], "query": p["query"], "product_category": p["product_category"],
        "name": p["Title"], "attributes": attributes if attributes is not None else p["instruction_attributes"],
        "price_upper": price_upper, "goal_options": goal_options,
        "instruction_text": p["instruction_text"],
    }


@pytest.fixture(scope="module")
def world() -> WebShopWorld:
    return golden_world(with_lookalikes=True)


@pytest.fixture(scope="module")
def goal_a(world: WebShopWorld) -> dict[str, Any]:
    goal = make_goal(world, "B08ZRR3DZT", {"color": "red", "size": "x-small"}, 60.0)
    assert goal["query"] == "women's dresses"
    assert goal["attributes"] == ["polyester spandex", "daily wear"]
    return goal


@needs_data
def test_fixture_has_160_products_and_goal_a_options(world: WebShopWorld) -> None:
    assert len(rebuild_golden_products()) == 160
    options = world.by_asin["B08ZRR3DZT"]["options"]
    assert options == {
        "size": ["x-small", "small", "medium", "large", "x-large"],
        "color": ["black", "light blue", "pink", "plain black", "red", "white", "chocolate brown", "khaki"],
    }
    assert len([g for g in world.goals if g["asin"] == "B08ZRR3DZT"]) == 40


@needs_data
def test_fixture_agrees_with_real_catalogue() -> None:
    real = {r["asin"]: r for r in read_raw_products(DATA_DIR / "items_shuffle_1000.json")}
    shared = [p for p in rebuild_golden_products() if p["asin"] in real]
    assert len(shared) > 100
    for p in shared:
        r = real[p["asin"]]
        assert (p["name"], p["pricing"], p["small_description"]) == (r["name"], r["pricing"], r["small_description"])
        assert p["customization_options"] == r["customization_options"]


@needs_data
@pytest.mark.parametrize(
    ("asin", "options", "price", "expected"),
    [
        ("B08ZRR3DZT", {"size": "x-small", "color": "red"}, 25.0, 1.0),  # 1
        ("B08ZRR3DZT", {}, 25.0, 0.6),  # 2
        ("B08ZRR3DZT", {"size": "x-small", "color": "black"}, 25.0, 0.8),  # 3
        ("B08ZRR3DZT", {"size": "small", "color": "red"}, 25.0, 1.0),  # 4
        ("B08ZRR3DZT", {"size": "x-small", "color": "red"}, 75.0, 0.8),  # 5
        ("B08ZRR3DZT", {"size": "medium", "color": "plain black"}, 25.0, 0.6),  # 6
        ("B09N6WLYY1", {}, 21.0, 0.2),  # 7
        ("B09688C4XM", {}, 1847.0, 0.0),  # 8
        ("B07MGB73NJ", {"size": "medium", "color": "black"}, 20.0, 0.2),  # 9
        ("LK_PCOL_B08ZRR3DZT", {"size": "x-small", "color": "red"}, 9999.0, 0.6),  # 10
        ("LK_COLOR_B08ZRR3DZT", {"size": "x-small", "color": "red"}, None, 0.8),  # 11
        ("LK_SIZE_B08ZRR3DZT", {"size": "xx-small", "color": "red"}, None, 0.6),  # 12
    ],
)
def test_golden_table(world: WebShopWorld, goal_a: dict[str, Any], asin: str, options: dict[str, str],
                      price: float | None, expected: float) -> None:
    price = world.product_prices[asin] if price is None else price
    result = get_reward(world.by_asin[asin], goal_a, price, options)
    assert result.score == pytest.approx(expected, abs=1e-9)


@needs_data
def test_golden_table_type_factors(world: WebShopWorld, goal_a: dict[str, Any]) -> None:
    info7 = get_reward(world.by_asin["B09N6WLYY1"], goal_a, 21.0, {}).info
    assert (info7["r_type"], info7["title_score"]) == (1.0, pytest.approx(0.6))
    assert get_reward(world.by_asin["B09688C4XM"], goal_a, 1847.0, {}).info["r_type"] == 0.0
    info9 = get_reward(world.by_asin["B07MGB73NJ"], goal_a, 20.0, {"size": "medium", "color": "black"}).info
    assert (info9["r_type"], info9["title_score"]) == (0.5, pytest.approx(0.1))
    assert world.by_asin["LK_PCOL_B08ZRR3DZT"]["Attributes"] == ["DUMMY_ATTR"]


@needs_data
def test_case_13_black_medium_goal(world: WebShopWorld, goal_a: dict[str, Any]) -> None:
    goal = {**goal_a, "goal_options": {"color": "black", "size": "medium"}}
    p = world.by_asin["B08ZRR3DZT"]
    assert get_reward(p, goal, 25.0, {"color": "plain black", "size": "medium"}).score == pytest.approx(1.0)
    assert get_reward(p, goal, 25.0, {"color": "black", "size": "x-large"}).score == pytest.approx(0.8)


@needs_data
def test_case_14_goal_without_options(world: WebShopWorld, goal_a: dict[str, Any]) -> None:
    goal = {**goal_a, "goal_options": {}}
    p = world.by_asin["B08ZRR3DZT"]
    assert get_reward(p, goal, 25.0, {}).score == pytest.approx(1.0)
    assert get_reward(p, goal, 70.0, {"color": "red"}).score == pytest.approx(2 / 3, abs=1e-6)


@needs_data
def test_case_15_title_score_zero_overrides_query_match(world: WebShopWorld) -> None:
    goal = make_goal(world, "B08KYBVQ46", {"color": "orbit green", "size": "small"}, 40.0,
                     ["machine wash", "elastic waist"])
    other = world.by_asin["B08Q43LJKJ"]
    result = get_reward(other, goal, world.product_prices["B08Q43LJKJ"], {})
    assert result.score == 0.0 and result.info["title_score"] == 0.0
    assert other["query"] == goal["query"]
    target, price = world.by_asin["B08KYBVQ46"], world.product_prices["B08KYBVQ46"]
    assert get_reward(target, goal, price, {"color": "orbit green", "size": "small"}).score == pytest.approx(1.0)
    assert get_reward(target, goal, price, {"color": "victory crimson", "size": "small"}).score == pytest.approx(0.8)


@needs_data
def test_case_16_seven_attributes(world: WebShopWorld) -> None:
    goal = make_goal(world, "B09T756KQ5", {"color": "a-bk1", "size": "large"}, 30.0)
    assert len(goal["attributes"]) == 7
    wrong = get_reward(world.by_asin["B07JVVDJ6L"], goal, 20.0, {})
    assert wrong.score == pytest.approx(0.02)
    assert wrong.info["r_type"] == 0.1 and wrong.info["r_att"] == pytest.approx(1 / 7)
    right = get_reward(world.by_asin["B09T756KQ5"], goal, world.product_prices["B09T756KQ5"],
                       {"color": "a-bk2", "size": "large"})
    assert right.score == pytest.approx(0.9)


@pytest.mark.parametrize(
    ("purchased", "goal_options", "expected"),
    [
        (["standard"], {"size": "standard"}, 0),
        (["white | black"], {"color": "black"}, 1),
        (["navy blue"], {"color": "light blue"}, 1),
        (["x-small"], {"size": "x-large"}, 0),
        (["red"], {"color": "red", "size": "red"}, 2),
        (["café"], {"flavor": "café"}, 1),
    ],
)
def test_case_17_option_function(purchased: list[str], goal_options: dict[str, str], expected: int) -> None:
    assert match_options(purchased, list(goal_options.items())) == expected


def test_token_set_ratio_and_colour_rules() -> None:
    assert token_set_ratio("small", "size x small") == 100  # subset => 100
    assert token_set_ratio("12 ounce (pack of 1)", "12 ounce (pack of 2)") == 94
    assert token_set_ratio("", "x") == 0
    assert normalize_color("navy blue") == "blue"
    assert normalize_color(("color", "black")) == "black"
    assert normalize_color(("size", "x-small")) == ("size", "x-small")


def test_service_mapping() -> None:
    assert service_reward(1.0, True) == service_reward(1.0, True)
    won = service_reward(1.0, True)
    assert (won.reward, won.task_score, won.success) == (10.0, 1.0, True)
    partial = service_reward(0.8, True)
    assert (partial.reward, partial.task_score, partial.success) == (0.0, 0.8, False)
    assert service_reward(1.0, False).reward == 0.0
