"""The WebShop expert policy and ``fedagent webshop-expert``, on the real env, data and SmolLM2 tokenizer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedagent_flwr import cli
from fedagent_flwr.envs.projection import project_action
from fedagent_flwr.envs.webshop import expert as expert_module
from fedagent_flwr.envs.webshop import expert_cli
from fedagent_flwr.envs.webshop.env import WebShopEnv
from fedagent_flwr.envs.webshop.expert import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_PROMPT_LENGTH,
    DEFAULT_MAX_RESPONSE_LENGTH,
    DEFAULT_MAX_TURNS,
    DEFAULT_SEARCH_RETURN_N,
    EpisodeSettings,
    ExpertInputError,
    ExpertMove,
    ExpertSummary,
    WebShopExpert,
    expert_env_config,
    play_expert_episode,
    search_query,
)
from fedagent_flwr.envs.webshop.prompts import CONCAT_SYSTEM_PROMPT
from testkit.webshop_data import DATA_DIR, needs_data

REPO = Path(__file__).resolve().parents[3]
# Room for a whole purchase: with the recipe's 2,560-token response budget most concat episodes
# stop as truncated before "buy now" (measured; docs/results.md §4), which is not what these tests check.
ROOMY = EpisodeSettings(max_response_length=8192)


def _play(tokenizer: Any, seeds: range, settings: EpisodeSettings = ROOMY) -> list[tuple[Any, dict[str, Any], Any]]:
    env = WebShopEnv(expert_env_config(DATA_DIR))
    out = []
    for seed in seeds:
        episode, record = asyncio.run(play_expert_episode(env, seed, tokenizer, settings))
        out.append((episode, record, env.engine.bought))
    return out


def test_search_query_drops_the_lead_and_price_and_optionally_the_options() -> None:
    instruction = ("Find me women's dresses with polyester spandex for daily wear with color: red, and size: x-small, "
                   "and price lower than 60.00 dollars")
    assert search_query(instruction) == (
        "women's dresses with polyester spandex for daily wear with color: red, and size: x-small")
    assert search_query(instruction, {"color": "red", "size": "x-small"}) == (
        "women's dresses with polyester spandex for daily wear")
    assert search_query("Find me a [big] box") == "a big box"


def test_defaults_are_the_webshop_recipes() -> None:
    recipe = yaml.safe_load((REPO / "conf" / "recipe" / "webshop_verl.yaml").read_text())
    env_defaults = yaml.safe_load((REPO / "conf" / "env" / "webshop.yaml").read_text())
    assert recipe["env"]["train"]["envs"][0]["max_turns"] == DEFAULT_MAX_TURNS
    assert recipe["trainer"]["max_new_tokens"] == DEFAULT_MAX_NEW_TOKENS
    assert recipe["trainer"]["max_prompt_length"] == DEFAULT_MAX_PROMPT_LENGTH
    assert recipe["trainer"]["max_response_length"] == DEFAULT_MAX_RESPONSE_LENGTH
    assert env_defaults["search_return_n"] == DEFAULT_SEARCH_RETURN_N
    windowed = yaml.safe_load((REPO / "conf" / "recipe" / "webshop_windowed_verl.yaml").read_text())["trainer"]
    settings = EpisodeSettings(mode="windowed")
    assert (settings.max_prompt_length, settings.max_response_length) == (
        windowed["max_prompt_length"], windowed["max_response_length"])
    assert (EpisodeSettings().max_prompt_length, EpisodeSettings().max_response_length) == (
        DEFAULT_MAX_PROMPT_LENGTH, DEFAULT_MAX_RESPONSE_LENGTH)


@needs_data
def test_expert_replies_are_valid_and_it_buys_the_target(smollm2_tokenizer: Any) -> None:
    played = _play(smollm2_tokenizer, range(20))
    eos = smollm2_tokenizer.eos_token_id
    for episode, record, bought in played:
        assert record["split"] == "train" and record["goal_index"] >= 500  # a training goal
        messages = record["messages"]
        assert messages[0] == {"role": "system", "content": CONCAT_SYSTEM_PROMPT}
        assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * episode.num_turns
        for message, turn in zip(messages[2::2], episode.turns):
            action, valid = project_action(message["content"])
            assert valid and turn.info["is_action_valid"] == 1 and turn.info["action_applied"], message
            assert turn.ended_with_eos and turn.info["action"] == action
        assert record["valid_replies"] == episode.num_turns
        # Where the first results page lists the target, the expert buys exactly it.
        first_page = episode.turns[0].info["available_actions"]["clickables"]
        if record["asin"].lower() in first_page:
            assert bought is not None and bought[0] == record["asin"]
        sampled = [i for i, m in zip(episode.response_ids, episode.response_mask) if m]
        assert sampled.count(eos) == episode.num_turns  # one EOS per reply, at its end
    successes = sum(record["success"] for _, record, _ in played)
    assert successes >= 16, [(r["seed"], r["task_score"]) for _, r, _ in played]  # 19/20 measured
    assert all(r["reward"] == (10.0 if r["success"] else 0.0) for _, r, _ in played)


@needs_data
def test_windowed_mode_alternates_user_and_assistant(smollm2_tokenizer: Any) -> None:
    (episode, record, _), = _play(smollm2_tokenizer, range(1, 2), EpisodeSettings(mode="windowed"))
    assert record["mode"] == "windowed" and episode.windows and not episode.truncated
    assert [m["role"] for m in record["messages"]] == ["user", "assistant"] * episode.num_turns
    assert all(project_action(m["content"])[1] for m in record["messages"][1::2])


def test_a_windowed_episode_is_written_one_turn_a_line_as_warm_start_reads_it(
        smollm2_tokenizer: Any, tmp_path: Path) -> None:
    """Each windowed turn is a prompt of its own: the SFT file holds one line per turn (the window
    and its reply), which tokenizes as the windowed rollout's own prompt and reply."""
    from fedagent_flwr.rollout import tokenize_conversation

    settings = EpisodeSettings(mode="windowed")
    out = tmp_path / "w.jsonl"
    expert_module.write_expert_file(out, expert_env_config(DATA_DIR), smollm2_tokenizer, [1], settings)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    (episode, record, _), = _play(smollm2_tokenizer, range(1, 2), settings)
    assert len(lines) == episode.num_turns > 1 and [line["turn"] for line in lines] == list(range(episode.num_turns))
    assert [line["messages"] for line in lines] == [record["messages"][2 * k:2 * k + 2] for k in range(len(lines))]
    assert all(line["seed"] == 1 and line["mode"] == "windowed" for line in lines)
    for line, window in zip(lines, episode.windows):
        prompt, response, mask = tokenize_conversation(smollm2_tokenizer, line["messages"])
        assert prompt == list(window.prompt_ids) and response == list(window.response_ids) and all(mask)


def test_long_replies_are_shortened_within_max_new_tokens(smollm2_tokenizer: Any) -> None:
    expert = WebShopExpert(None, smollm2_tokenizer, max_turns=6)  # type: ignore[arg-type]  # env unused by _fit
    move = ExpertMove("I am on the search page, so I search for the product the task describes.",
                      "search[" + " ".join(f"word{i}" for i in range(40)) + "]")
    short, ids = expert._fit(move, 40)
    assert len(ids) <= 40 and ids[-1] == smollm2_tokenizer.eos_token_id
    text = smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert text == short.reply() and project_action(text)[1]
    assert move.action.startswith(short.action[:-1]) and short.action != move.action


@needs_data
def test_validation_goals_are_refused(smollm2_tokenizer: Any) -> None:
    with pytest.raises(ExpertInputError, match="held out"):
        expert_env_config(DATA_DIR, "val")
    env = WebShopEnv({"data_dir": str(DATA_DIR), "split": "val"})
    with pytest.raises(ExpertInputError):
        asyncio.run(play_expert_episode(env, 0, smollm2_tokenizer, ROOMY))
    assert env.goal_index is None  # refused before any val goal was reset


def _cli(*args: str) -> int:
    return cli.main(["webshop-expert", *args])


@needs_data
def test_command_writes_the_file_atomically(tiny_model_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "data" / "expert.jsonl"
    assert _cli("--data-dir", str(DATA_DIR), "--model", str(tiny_model_dir), "--episodes", "3",
                "--first-seed", "5", "--max-response-length", "8192", "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert "episode 3/3 seed 7" in printed and "wrote" in printed and "episodes 3, success rate" in printed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["seed"] for r in records] == [5, 6, 7] and [r["goal_index"] for r in records] == [505, 506, 507]
    assert all(r["env"] == "webshop" and r["split"] == "train" and r["messages"][0]["role"] == "system"
               for r in records)
    assert sorted(p.name for p in out.parent.iterdir()) == ["expert.jsonl"]

    # A run that fails part-way leaves the previous file as it was and no temporary file.
    out.write_text("old\n")
    real = expert_module.play_expert_episode
    calls = []

    async def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("stop here")
        return await real(*args, **kwargs)

    monkeypatch.setattr(expert_module, "play_expert_episode", failing)
    with pytest.raises(RuntimeError, match="stop here"):
        _cli("--data-dir", str(DATA_DIR), "--model", str(tiny_model_dir), "--episodes", "3", "--out", str(out))
    assert out.read_text() == "old\n" and sorted(p.name for p in out.parent.iterdir()) == ["expert.jsonl"]


@needs_data
@pytest.mark.parametrize(("args", "message"), [
    (["--split", "val"], "split must be 'train'"),
    (["--split", "test"], "split must be 'train'"),
    (["--episodes", "0"], "--episodes must be >= 1"),
    (["--first-seed", "-1"], "--first-seed must be >= 0"),
    (["--max-turns", "0"], "--max-turns must be >= 1"),
    (["--model", "./no-such-model"], "is not a directory"),
    (["--max-new-tokens", "12"], "--max-new-tokens must be >= "),  # below any reply: refused before playing
])
def test_command_refuses_bad_input(args: list[str], message: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.jsonl"
    if "--max-new-tokens" in args:
        # The floor is counted with the command's tokenizer; on a fresh machine the first use of the
        # bundled model converts it and says so on stderr, which is not this command's error output.
        _tokenizer_of_the_command()
        capsys.readouterr()
    assert _cli("--data-dir", str(DATA_DIR), "--out", str(out), *args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedagent webshop-expert: error:") and message in err and "\n" not in err
    assert not out.exists()


def test_command_refuses_missing_data_and_a_directory_as_out(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.jsonl")) == 2
    err = capsys.readouterr().err.strip()
    assert "error:" in err and "items_shuffle_1000.json" in err and "\n" not in err
    assert _cli("--data-dir", str(tmp_path), "--out", str(tmp_path)) == 2
    assert "is a directory" in capsys.readouterr().err


@needs_data
@pytest.mark.parametrize("below", ["x.jsonl", "sub/x.jsonl"])
def test_command_refuses_an_out_under_a_regular_file(below: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    out = afile / below
    assert _cli("--data-dir", str(DATA_DIR), "--out", str(out), "--episodes", "1", "--quiet") == 2
    assert capsys.readouterr().err == (f"fedagent webshop-expert: error: --out {out}: {afile} is a file, "
                                       "not a directory; give a path inside a directory\n")
    assert afile.read_text() == "keep me\n"


@pytest.mark.parametrize(("option", "value", "least"), [
    ("--max-new-tokens", "0", 1), ("--max-new-tokens", "-5", 1), ("--max-turns", "-1", 1),
    ("--search-return-n", "0", 1), ("--max-prompt-length", "-1", 0), ("--max-response-length", "-1", 0),
    ("--history-length", "-1", 0),
])
def test_a_numeric_option_below_its_least_is_named_before_any_work(
        option: str, value: str, least: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each numeric option below its least value is one line naming the option as typed (before: the
    setting's name, ``max_new_tokens must be >= 1``), exit 2; checked before the data directory (none
    here) and before any model is loaded."""
    out = tmp_path / "x.jsonl"
    assert _cli("--data-dir", str(tmp_path / "nowhere"), "--out", str(out), option, value) == 2
    assert capsys.readouterr().err == f"fedagent webshop-expert: error: {option} must be >= {least}, got {value}\n"
    assert list(tmp_path.iterdir()) == []


@needs_data
def test_a_model_folder_without_a_tokenizer_says_so(tiny_model_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``--model EMPTYDIR`` (before: transformers' advice to install sentencepiece) says the folder holds
    no model and what to give instead; a folder with only a model's config.json (before: "the tokenizer
    has no chat template") says it holds no tokenizer; exit 2, no file written."""
    tokenizer_files = "tokenizer_config.json, tokenizer.json, tokenizer.model, vocab.json, vocab.txt"
    out = tmp_path / "x.jsonl"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _cli("--data-dir", str(DATA_DIR), "--out", str(out), "--model", str(empty)) == 2
    assert capsys.readouterr().err == (
        f"fedagent webshop-expert: error: --model {empty}: {empty} holds no model (no config.json, and none of "
        f"{tokenizer_files}); give a Hugging Face model directory (as save_pretrained writes it) or leave "
        "--model empty for the bundled SmolLM2-135M-Instruct\n")
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    assert _cli("--data-dir", str(DATA_DIR), "--out", str(out), "--model", str(config_only)) == 2
    assert capsys.readouterr().err == (
        f"fedagent webshop-expert: error: --model {config_only}: {config_only} holds no tokenizer (none of "
        f"{tokenizer_files}); save the model's tokenizer into it (tokenizer.save_pretrained)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config-only", "empty"]


@needs_data
def test_a_tokenizer_folder_without_config_json_still_serves(smollm2_tokenizer_dir: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Only the tokenizer is loaded, so a folder of its files alone passes the --model check: the run
    gets as far as the --max-new-tokens floor, which is counted with that tokenizer."""
    assert not (smollm2_tokenizer_dir / "config.json").exists()
    assert _cli("--data-dir", str(DATA_DIR), "--out", str(tmp_path / "x.jsonl"), "--model",
                str(smollm2_tokenizer_dir), "--max-new-tokens", "12") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("fedagent webshop-expert: error: --max-new-tokens must be >= "), err


@pytest.mark.parametrize(("given", "env", "message"), [
    (None, None, "no WebShop data directory: pass --data-dir DIR (or set FEDAGENT_WEBSHOP_DATA); "
                 "fetch the data with: fedagent download-webshop DIR"),
    ("nowhere", None, "--data-dir {dir} has no items_shuffle_1000.json; "
                      "fetch the data with: fedagent download-webshop {dir}"),
    (None, "nowhere", "$FEDAGENT_WEBSHOP_DATA {dir} has no items_shuffle_1000.json; "
                      "fetch the data with: fedagent download-webshop {dir}"),
])
def test_missing_data_points_to_the_commands_flag_and_download_command(
        given: str | None, env: str | None, message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    where = tmp_path / "nowhere"
    if env is None:
        monkeypatch.delenv("FEDAGENT_WEBSHOP_DATA", raising=False)
    else:
        monkeypatch.setenv("FEDAGENT_WEBSHOP_DATA", str(where))
    flags = ["--data-dir", str(where)] if given else []
    assert _cli(*flags, "--out", str(tmp_path / "x.jsonl")) == 2
    assert capsys.readouterr().err == f"fedagent webshop-expert: error: {message.format(dir=where)}\n"


@needs_data
def test_a_max_new_tokens_too_small_for_a_goal_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Above the up-front floor (the goal-independent replies fit) but below what a goal's product
    click needs: the episode that cannot fit stops the run with one line naming the reply and the
    option to raise, exit 2, no traceback and no file."""
    out = tmp_path / "x.jsonl"
    tokenizer_floor = WebShopExpert.min_new_tokens(_tokenizer_of_the_command())
    assert _cli("--data-dir", str(DATA_DIR), "--out", str(out), "--episodes", "3", "--quiet",
                "--max-new-tokens", str(tokenizer_floor)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("fedagent webshop-expert: error: the expert's reply 'click[")
    assert err.endswith(f"more than max_new_tokens={tokenizer_floor}: raise --max-new-tokens")
    assert list(tmp_path.iterdir()) == []


def _tokenizer_of_the_command() -> Any:
    """The tokenizer ``--model ''`` loads (the bundled SmolLM2's)."""
    return expert_cli._load_tokenizer("")


def test_the_floor_is_the_longest_goal_independent_reply(smollm2_tokenizer: Any) -> None:
    """min_new_tokens is exactly what the longest fixed-text reply needs, and that reply fits it."""
    expert = WebShopExpert(None, smollm2_tokenizer, max_turns=6)  # type: ignore[arg-type]  # env unused by _fit
    floor = WebShopExpert.min_new_tokens(smollm2_tokenizer)
    needs = [len(expert._fit(ExpertMove("a long reason " * 20, action), floor)[1])
             for action in expert_module.FIXED_ACTIONS]
    assert max(needs) == floor
    with pytest.raises(expert_module.ReplyTooLongError, match="raise --max-new-tokens"):
        expert._fit(ExpertMove("a long reason " * 20, "click[back to search]"), floor - 1)


def test_the_summary_counts_turns_once_one_reply_a_turn() -> None:
    summary = ExpertSummary()
    for turns, valid in ((3, 3), (5, 4)):
        summary.add({"success": True, "task_score": 1.0, "num_turns": turns, "valid_replies": valid,
                     "truncated": False})
    assert summary.turns == 8 and not hasattr(summary, "replies")
    assert "mean turns 4.00, format-valid replies 7/8," in summary.line()


def _replayed(tokenizer: Any, replies: list[str]) -> Any:
    """A ``generate`` that answers turn k with ``replies[k]`` (tokenised, then the EOS), as the expert did."""
    answers = iter(replies)

    async def generate(prompt_ids: list[int], sampling: Any) -> list[int]:
        return [*tokenizer.encode(next(answers), add_special_tokens=False), tokenizer.eos_token_id]

    return generate


@needs_data
def test_windowed_expert_windows_are_the_ones_a_webshop_service_serves(tmp_path: Path, smollm2_tokenizer: Any) -> None:
    """The warm start trains on windows the expert rendered in process (it reads the engine); the
    windowed RL run renders them on the client from a WebShop service's replies
    (``ServiceTextEnv.window_prompt``). Replaying the expert's replies through a real service process,
    at the windowed recipe's limits, gives the same windows token for token and the same return, on
    goals of both clients' halves: a warm-started model is shown, in RL, what it was trained on."""
    from fedagent_flwr.envs.service.client import ServiceTextEnv
    from fedagent_flwr.envs.service.launch import ServiceLaunch
    from fedagent_flwr.envs.service.manager import EnvServiceManager
    from fedagent_flwr.rollout.episode import SamplingParams
    from fedagent_flwr.rollout.windowed import run_windowed_episode

    settings = EpisodeSettings("windowed", max_turns=15, max_new_tokens=512, max_prompt_length=4096,
                               max_response_length=512, history_length=2)  # conf/recipe/webshop_windowed_verl.yaml
    env = WebShopEnv(expert_env_config(DATA_DIR, max_turns=settings.max_turns))
    launch = ServiceLaunch(env="WebShop", config={"data_dir": str(DATA_DIR), "split": "train"}, pool_size=1)
    with EnvServiceManager(launch, tmp_path / "svc.json", stop_grace_s=5.0) as manager:
        url = manager.ensure_running()
        for seed in (0, 3205, 5608):  # training goals 500, 3705 and 6108: client 0's and client 1's halves
            episode, record = asyncio.run(play_expert_episode(env, seed, smollm2_tokenizer, settings))
            replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
            served = asyncio.run(run_windowed_episode(
                ServiceTextEnv({"url": url, "env": "WebShop"}), seed, smollm2_tokenizer,
                _replayed(smollm2_tokenizer, replies),
                SamplingParams(settings.max_new_tokens, temperature=0.0), settings.max_turns,
                settings.max_prompt_length + settings.max_response_length, history_length=settings.history_length,
                max_prompt_len=settings.max_prompt_length))
            assert len(replies) == episode.num_turns >= 3 and not episode.truncated, seed
            assert served.messages == episode.messages, seed
            assert [w.prompt_ids for w in served.windows] == [w.prompt_ids for w in episode.windows], seed
            assert (served.reward, served.success, served.num_turns) == (episode.reward, episode.success,
                                                                          episode.num_turns), seed


@needs_data
@pytest.mark.parametrize("mode", ["concat", "windowed"])
def test_the_expert_plays_under_the_prompt_budget_as_verls_loop_does(mode: str, smollm2_tokenizer: Any) -> None:
    # A prompt budget below the first prompt, with a response budget so large that their sum fits it:
    # verl's agent loop would not play this episode, so neither does the expert (no turn, truncated).
    tight = EpisodeSettings(mode=mode, max_prompt_length=64, max_response_length=8192)
    (episode, record, bought), = _play(smollm2_tokenizer, range(1), tight)
    assert (episode.num_turns, episode.truncated, record["success"], bought) == (0, True, False, None)
    roomy = EpisodeSettings(mode=mode, max_prompt_length=4096, max_response_length=8192)
    (played, _, _), = _play(smollm2_tokenizer, range(1), roomy)
    assert played.num_turns > 0 and not played.truncated  # the same episode with room for its prompts
