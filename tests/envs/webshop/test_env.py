"""WebShop pages, actions, search and the ``WebShopEnv`` (spec §3–5, §7, §9 cases 2 and 19–22)."""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import pytest

from fedagent_flwr.envs.registry import get_env_class, make_env
from fedagent_flwr.envs.webshop.data import WebShopWorld
from fedagent_flwr.envs.webshop.engine import WebShopEngine, parse_action
from fedagent_flwr.envs.webshop.env import WebShopEnv
from fedagent_flwr.envs.webshop.prompts import (
    admissible_actions_text,
    baseline_observation,
    project_action,
    windowed_prompt,
)
from fedagent_flwr.envs.webshop.search import (
    IN_MEMORY_FIELDS,
    BM25Search,
    InMemoryBM25,
    analyze,
    in_memory_document_text,
)
from testkit.webshop_data import DATA_DIR, golden_world, needs_data

TITLE_A = "SheIn Women's Sexy One Shoulder Sleeveless Cutout Mini Club Pencil Bodycon Dress"
A_VALUES = ["x-small", "small", "medium", "large", "x-large", "black", "light blue", "pink", "plain black",
            "red", "white", "chocolate brown", "khaki"]


@pytest.fixture(scope="module")
def world() -> WebShopWorld:
    return golden_world()


@pytest.fixture(scope="module")
def index(world: WebShopWorld) -> BM25Search:
    return BM25Search(world.products)


@pytest.fixture()
def engine(world: WebShopWorld, index: BM25Search) -> WebShopEngine:
    eng = WebShopEngine(world, index)
    goal = next(g for g in world.goals
                if g["asin"] == "B08ZRR3DZT" and g["goal_options"] == {"color": "red", "size": "x-small"})
    eng.reset(goal)
    return eng


def _to_item_a(engine: WebShopEngine) -> None:
    assert engine.step("search[women's dresses polyester spandex]").valid
    assert "b08zrr3dzt" in engine.available_actions()["clickables"]
    assert engine.step("click[b08zrr3dzt]").valid


@needs_data
def test_case_19_reset_observation(engine: WebShopEngine) -> None:
    instruction = engine.instruction
    assert instruction in {
        "Find me women's dresses with polyester spandex for daily wear with color: red, and size: x-small, "
        f"and price lower than {x} dollars" for x in ("40.00", "50.00", "60.00")
    }
    assert engine.observation() == f"WebShop [SEP] Instruction: [SEP] {instruction} [SEP] Search"
    assert engine.available_actions() == {"has_search_bar": True, "clickables": ["search"]}


@needs_data
def test_case_20_item_page_and_sub_pages(engine: WebShopEngine) -> None:
    _to_item_a(engine)
    i = engine.instruction
    assert engine.observation() == (
        f"Instruction: [SEP] {i} [SEP] Back to Search [SEP] < Prev [SEP] size [SEP] x-small [SEP] small [SEP] "
        "medium [SEP] large [SEP] x-large [SEP] color [SEP] black [SEP] light blue [SEP] pink [SEP] plain black "
        f"[SEP] red [SEP] white [SEP] chocolate brown [SEP] khaki [SEP] {TITLE_A} [SEP] Price: $19.99 to $27.99 "
        "[SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now"
    )
    assert engine.available_actions() == {
        "has_search_bar": False,
        "clickables": ["back to search", "< prev", "description", "features", "reviews", "buy now", *A_VALUES],
    }
    item_obs = engine.observation()
    assert engine.step("click[red]").observation == item_obs  # selection is not shown
    engine.step("click[description]")
    assert engine.observation() == f"Instruction: [SEP] {i} [SEP] Back to Search [SEP] < Prev"
    assert engine.available_actions()["clickables"] == ["back to search", "< prev"]
    engine.step("click[< prev]")
    assert engine.observation() == item_obs and engine.options == {"color": "red"}  # options kept
    engine.step("click[features]")
    segments = engine.observation().split(" [SEP] ")
    assert segments[:4] == ["Instruction:", i, "Back to Search", "< Prev"] and len(segments) == 4 + 7
    engine.step("click[< prev]")
    engine.step("click[reviews]")
    assert engine.observation() == f"Instruction: [SEP] {i} [SEP] Back to Search [SEP] < Prev"


@needs_data
def test_results_page_shape(engine: WebShopEngine) -> None:
    engine.step("search[women's dresses polyester spandex]")
    segs = engine.observation().split(" [SEP] ")
    total = len(engine.results)
    assert segs[:5] == [
        "Instruction:", engine.instruction, "Back to Search", f"Page 1 (Total results: {total})", "Next >"]
    shown = engine.results[:10]
    assert segs[5:] == [
        x for a in shown for x in (a, engine.world.by_asin[a]["Title"], engine.world.by_asin[a]["Price"])]
    assert engine.available_actions() == {
        "has_search_bar": False, "clickables": ["back to search", "next >", *[a.lower() for a in shown]]}


@needs_data
def test_case_22_paging_past_the_end(world: WebShopWorld, index: BM25Search) -> None:
    eng = WebShopEngine(world, index, top_k=50)
    eng.reset(world.goals[0])
    eng.step("search[women]")
    assert len(eng.results) == 50  # a common word: the top-K cut applies
    for _ in range(5):
        eng.step("click[next >]")
    assert eng.observation().endswith("[SEP] Page 6 (Total results: 50) [SEP] < Prev [SEP] Next >")
    assert eng.available_actions()["clickables"] == ["back to search", "< prev", "next >"]


@needs_data
def test_case_21_invalid_actions_are_no_ops(engine: WebShopEngine) -> None:
    _to_item_a(engine)
    before = engine.observation()
    for action in ("click[nonexistent]", "buy now", "search[]", "click[search]"):
        step = engine.step(action)
        assert (step.observation, step.score, step.done, step.valid) == (before, 0.0, False, False)


@needs_data
def test_case_2_prev_clears_options_then_buy(engine: WebShopEngine) -> None:
    _to_item_a(engine)
    engine.step("click[red]")
    engine.step("click[x-small]")
    assert engine.options == {"color": "red", "size": "x-small"}
    engine.step("click[< prev]")
    assert engine.page == "results" and engine.options == {}
    engine.step("click[b08zrr3dzt]")
    step = engine.step("click[buy now]")
    assert step.done and step.score == pytest.approx(0.6)
    segs = step.observation.split(" [SEP] ")
    assert segs[:9] == ["Thank you for shopping with us!", "Your code:", "None", "(Paste it in your MTurk interface.)",
                        "Purchased", "asin", "B08ZRR3DZT", "options", "{}"]
    assert segs[-3:] == [str(step.score), "Reward Details", "None"] and "instuction text" in segs
    assert engine.available_actions() == {"has_search_bar": True, "clickables": ["search"]}


@needs_data
def test_right_purchase_scores_one_and_done_page_options(engine: WebShopEngine) -> None:
    _to_item_a(engine)
    engine.step("click[x-small]")
    engine.step("click[red]")
    step = engine.step("click[buy now]")
    assert step.score == 1.0 and step.done
    assert '{"color": "red", "size": "x-small"}' in step.observation.split(" [SEP] ")


@needs_data
def test_back_to_search_and_search_from_any_page(engine: WebShopEngine) -> None:
    _to_item_a(engine)
    engine.step("click[red]")
    assert engine.step("search[pencil dress]").valid and engine.page == "results" and engine.options == {}
    engine.step("click[back to search]")
    assert engine.observation() == f"WebShop [SEP] Instruction: [SEP] {engine.instruction} [SEP] Search"
    assert engine.keywords is None


def test_parse_action_matches_upstream_regex() -> None:
    assert parse_action("search[red dress]") == ("search", "red dress")
    assert parse_action("click[< prev]") == ("click", "< prev")
    assert parse_action("search[]") == ("search[]", None)
    assert parse_action("click[a[b]]") == ("click[a", "b]")  # greedy, as upstream's (.+)\[(.+)\]


@needs_data
def test_search_sanity(world: WebShopWorld, index: BM25Search) -> None:
    assert index.search("women's dresses polyester spandex")[0] == "B08ZRR3DZT"
    assert index.search("zzzzqqq") == [] and index.search("the and of") == []
    full = index.search("dress", top_k=200)
    allowed = set(full[::2])
    assert index.search("dress", allowed=allowed, top_k=200) == [a for a in full if a in allowed]
    assert len(index.search("women", top_k=7)) == 7
    scores = index.scores("dress")
    ranked = index.search("dress", top_k=200)
    assert all(scores[index.asins.index(a)] > 0 for a in ranked)
    ordered = [(-scores[index.asins.index(a)], index.asins.index(a)) for a in ranked]
    assert ordered == sorted(ordered)  # (-score, load order)
    assert analyze("Women's X-Small 3.5mm dresses, the") == ["women", "x", "small", "3.5mm", "dress"]


@needs_data
def test_catalogue_filter_hides_products(world: WebShopWorld, index: BM25Search) -> None:
    eng = WebShopEngine(world, index, allowed_asins={"B09N6WLYY1"})
    eng.reset(world.goals[0])
    eng.step("search[women's dresses polyester spandex]")
    assert eng.results == ["B09N6WLYY1"]
    assert eng.step("click[b08zrr3dzt]").valid is False


def test_projection_and_prompts() -> None:
    assert project_action("<think>ok</think><action> Click[Buy Now] </action>") == ("click[buy now]", True)
    assert project_action("no tags, just Click[buy now]") == (" just click[buy now]", False)  # last 20 chars
    assert project_action("<action>search[x]</action>") == ("search[x]", False)  # no think tags
    assert project_action("<think>好</think><action>search[x]</action>") == ("search[x]", False)
    assert project_action("<think></think></action>x<action>") == ("", True)
    available = {"has_search_bar": True, "clickables": ["search"]}
    assert admissible_actions_text(available) == "'search[<your query>]',\n'click[search]',"
    assert baseline_observation("WebShop [SEP] Instruction: [SEP] find x [SEP] Search") == "'Search'"
    first = windowed_prompt("find x", "obs0", available, (), 2)
    assert first.startswith("\nYou are an expert") and first.endswith("\n") and "Prior to this step" not in first
    later = windowed_prompt("find x", "obs3", available, [("o1", "a1"), ("o2", "a2"), ("o3", "a3")], 2)
    assert "already taken 3 step(s)" in later and "[Observation 2: 'o2', Action 2: 'a2']" in later
    assert "Observation 1:" not in later and "You are now at step 4" in later


# --- the BaseTextEnv ---------------------------------------------------------------------------


def _cfg(**extra: Any) -> dict[str, Any]:
    return {"data_dir": str(DATA_DIR), **extra}


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


@needs_data
def test_env_registered_and_goal_pool() -> None:
    cls = get_env_class("webshop")
    assert cls is WebShopEnv and cls.env_name == "WebShop"
    env = make_env("WebShop", _cfg())
    train = WebShopEnv.num_goals(_cfg())
    assert train == len(env.world.goals) - 500 and WebShopEnv.num_goals(_cfg(split="val")) == 500
    restricted = WebShopEnv.restrict_goals(_cfg(), [5, 7, 9])
    assert restricted["goal_indices"] == [5, 7, 9] and WebShopEnv.num_goals(restricted) == 3
    again = WebShopEnv.restrict_goals(restricted, [2, 0])
    assert again["goal_indices"] == [9, 5]
    with pytest.raises(ValueError):
        WebShopEnv.restrict_goals(_cfg(), [train])
    with pytest.raises(ValueError):
        WebShopEnv(_cfg(split="test"))


@needs_data
def test_env_seed_to_goal_mapping() -> None:
    env = WebShopEnv(_cfg())
    n_train = len(env.world.goals) - 500
    assert env.goal_index_for_seed(3) == 500 + 3 and env.goal_index_for_seed(n_train + 3) == 503
    val = WebShopEnv(_cfg(split="val"))
    assert val.goal_index_for_seed(499) == 499 and val.goal_index_for_seed(500) == 0
    part = WebShopEnv(WebShopEnv.restrict_goals(_cfg(), [10, 20, 30]))
    for seed in (0, 1, 12345):
        assert part.goal_index_for_seed(seed) == 500 + [10, 20, 30][random.Random(seed).randrange(3)]


@needs_data
def test_env_episode_buy_target_wins() -> None:
    async def episode() -> tuple[Any, ...]:
        env = WebShopEnv(_cfg(max_turns=15))
        obs, info = await env.reset(11)
        goal = env.world.goals[info["goal_index"]]
        assert obs.startswith(
            f"Your task is to: {goal['instruction_text']}.\nYour current observation is: WebShop [SEP]")
        assert obs.endswith("[\n'search[<your query>]',\n'click[search]',\n].")
        assert await env.system_prompt() == (
            "You are an expert autonomous agent operating in the WebShop e-commerce environment. Each turn, "
            "first reason step-by-step about the current situation inside <think> </think> tags, then choose "
            "exactly one admissible action and present it inside <action> </action> tags.")
        # Search the target's own title (brackets would confuse the action syntax), then its options.
        title = re.sub(r"[\[\]]", " ", env.world.by_asin[goal["asin"]]["Title"])
        _, _, _, i = await env.step(f"<think>.</think><action>search[{title}]</action>")
        assert goal["asin"].lower() in i["available_actions"]["clickables"]
        o, r, d, i = await env.step(f"<think>.</think><action>click[{goal['asin'].lower()}]</action>")
        assert (r, d, i["is_action_valid"], i["action_applied"]) == (0.0, False, 1, True)
        assert o.startswith("Your current observation is: Instruction: [SEP]")
        for value in goal["goal_options"].values():
            await env.step(f"<think>.</think><action>click[{value}]</action>")
        return await env.step("<think>.</think><action>click[buy now]</action>")

    obs, reward, done, info = _run(episode())
    assert done and info["task_score"] == 1.0 and reward == 10.0 and info["success"] is True
    assert "Thank you for shopping with us!" in obs


@needs_data
def test_env_turn_cap_and_invalid_format() -> None:
    async def episode() -> list[Any]:
        env = WebShopEnv(_cfg(max_turns=2, observation_format="baseline"))
        obs, _ = await env.reset(0)
        assert "Your current observation is: 'Search'." in obs
        first = await env.step("I will just click[buy now]")
        second = await env.step("<think>x</think><action>click[nothing]</action>")
        with pytest.raises(RuntimeError):
            await env.step("again")
        return [first, second]

    (o1, r1, d1, i1), (o2, r2, d2, i2) = _run(episode())
    assert (r1, d1, i1["is_action_valid"], i1["success"]) == (0.0, False, 0, False)
    assert (r2, d2, i2["is_action_valid"], i2["action_applied"]) == (0.0, True, 1, False)


@needs_data
def test_env_reset_is_deterministic() -> None:
    a, b = WebShopEnv(_cfg()), WebShopEnv(_cfg())
    assert _run(a.reset(42)) == _run(b.reset(42))


def test_in_memory_bm25_toy_check() -> None:
    # Spec §5: BM25Okapi(k1=1.2, b=0.75) on the toy corpus; idf(dress) = idf(for) floored to 0.25 x avg idf.
    corpus = ["red dress for women", "blue dress for men", "red shoes for women", "green hat for kids", "dress"]
    index = InMemoryBM25([{"asin": str(i), "name": d} for i, d in enumerate(corpus)], fields=["name"])
    assert index.scores("red dress for") == pytest.approx([0.585668, 0.271851, 0.449743, 0.135926, 0.204910], abs=1e-6)
    assert index.idf["dress"] == pytest.approx(0.145738, abs=1e-6) and index.idf["for"] == index.idf["dress"]
    assert index.search("red dress for") == ["0", "2", "1", "4", "3"]
    assert index.search("zzz", top_k=3) == ["0", "1", "2"]  # every document scores: always min(K, N)
    assert index.search("   ") == []


@needs_data
def test_in_memory_backend_document_quirk_and_env_selection(world: WebShopWorld) -> None:
    p = world.by_asin["B08ZRR3DZT"]
    # description/features are not product keys: the default indexes name twice plus the bullets.
    assert in_memory_document_text(p, IN_MEMORY_FIELDS) == " ".join([p["name"], p["Title"], *p["BulletPoints"]]).strip()
    assert in_memory_document_text(p, ["description"]) == p["name"]
    env = WebShopEnv(_cfg(bm25_in_memory={"fields": ["name", "Title"], "k1": 1.2, "b": 0.75}, search_return_n=50))
    assert isinstance(env.search_index, InMemoryBM25)
    _run(env.reset(0))
    env.engine.step("search[pencil bodycon dress]")
    assert len(env.engine.results) == 50
    assert env.engine.observation().split(" [SEP] ")[3] == "Page 1 (Total results: 50)"
    assert isinstance(WebShopEnv(_cfg()).search_index, BM25Search)


def test_shared_option_value_selects_later_group_and_done_json_escapes() -> None:
    from fedagent_flwr.envs.webshop.data import build_world

    raw = [{"asin": "B000000001", "name": "Tom & Jerry mug", "full_description": "  ", "small_description": ["", " b "],
            "pricing": "$5.00", "query": "mugs", "category": "garden", "product_category": "a › b",
            "customization_options": {"Size": [{"value": "Red"}, {"value": "S/M"}], "Color": [{"value": "Red"}]}}]
    ins = {"B000000001": {"attributes": ["mug"], "instruction": "Find a mug", "instruction_attributes": ["mug"]}}
    world = build_world(raw, ins)
    eng = WebShopEngine(world, BM25Search(world.products))
    eng.reset(world.goals[0])
    eng.step("search[mug]")
    eng.step("click[b000000001]")
    assert eng.available_actions()["clickables"][6:] == ["red", "s | m"]
    assert ("size [SEP] red [SEP] s | m [SEP] color [SEP] red [SEP] Tom & Jerry mug [SEP] Price: $5.0"
            in eng.observation())
    eng.step("click[red]")
    assert eng.options == {"color": "red"}  # the later group wins
    eng.step("click[description]")
    assert eng.observation().endswith("< Prev [SEP] ")  # whitespace-only text -> one empty segment
    eng.step("click[< prev]")
    eng.step("click[features]")
    assert eng.observation().endswith("< Prev [SEP]  [SEP] b")  # an empty bullet still gives a segment
    eng.step("click[< prev]")
    eng.options["size"] = "<a & 'b'>"
    segs = eng.step("click[buy now]").observation.split(" [SEP] ")
    assert segs[8] == '{"color": "red", "size": "\\u003ca \\u0026 \\u0027b\\u0027\\u003e"}'
