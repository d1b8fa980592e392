"""``trainer.request_fingerprints`` on CPU with real verl 0.9.1 agent-loop code: the setting (off by
default) reaches the agent-loop YAML; with it on, every server call of a seeded rollout, concat or
windowed, appends one line beside the episode log (its vLLM seed, env seed, row, turn, verl step,
place in the GRPO group and digests of its prompt, tokens and log-probs); with it off nothing is
written and the rollouts are otherwise unchanged; a retried client-round starts a fresh file; the
digests tell apart what two runs must not confuse; and tools/gpu/fingerprints.py joins two runs'
files and refuses bad input. The stand-in server is a greedy HF model, so nothing here says that
vLLM reproduces a request: that is what the tool is for, on two GPU runs' files."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from fedagent_flwr.clientapp.job import TrainJob
from fedagent_flwr.config import load_settings
from fedagent_flwr.schema import SettingError
from fedagent_flwr.trainers.verl.job import prepare_train
from fedagent_flwr.trainers.verl.request_seeds import request_seed, seed_base
from fedagent_flwr.trainers.verl.settings import VerlSettings
from testkit.gpu_tools import collected, gpu_tool
from testkit.verl_agent_loop import HFServer, agent_loop_worker

AGENT = "fedagent_env_fingerprint_test"
ROW = {"env_name": "TinyGuess", "env_config": {"lo": 1, "hi": 10}, "seed": 3, "max_turns": 3,
       "raw_prompt": [{"role": "user", "content": "x"}], "index": 0}
SPEC = {"envs": [{"name": "TinyGuess", "n_envs": 2, "max_turns": 3, "config": {"lo": 1, "hi": 10}}]}
TIMING = ("started", "seconds", "pid")


class PromptRecordingServer(HFServer):
    """:class:`HFServer` that also keeps each call's prompt token ids (``prompts``)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.prompts: list[list[int]] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> Any:
        self.prompts.append(list(prompt_ids))
        return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)


def _job(model: Path, out: Path, **trainer: Any) -> TrainJob:
    return TrainJob(model_path=str(model), output_dir=str(out), env_spec=SPEC, round=1, client_id=0, num_clients=2,
                    data_seed=7, local_steps=1, partition={"strategy": "none"}, trainer={"rollout_n": 2, **trainer})


def _rollouts(model: Any, tokenizer: Any, episode_log: Path, on: bool, monkeypatch: pytest.MonkeyPatch,
              worker_cls: type | None = None, step: int = 1) -> PromptRecordingServer:
    """One GRPO group of ``ROW`` (rollout_n 0 and 1 at ``step``) through ``worker_cls`` (default: the
    seeded concat worker), logging episodes to ``episode_log``; the server it called."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    from fedagent_flwr.trainers.verl.request_seeds import SeededAgentLoopWorker

    monkeypatch.setitem(_agent_loop_registry, AGENT, {
        "_target_": "fedagent_flwr.trainers.verl.agent_loop.EnvAgentLoop", "max_new_tokens": 8,
        "invalid_action_penalty": 0.1, "episode_log": str(episode_log), "history_length": 2,
        "request_fingerprints": on})
    worker = agent_loop_worker(worker_cls or SeededAgentLoopWorker, model, tokenizer)
    worker.llm_client = PromptRecordingServer(model)
    for n in (0, 1):
        trajectory = {"step": step, "sample_index": 0, "rollout_n": n, "validate": False}
        asyncio.run(worker._run_agent_loop({"temperature": 1.0, "top_p": 1.0}, trajectory, agent_name=AGENT,
                                           trace=False, **ROW))
    return worker.llm_client


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_setting_is_a_verl_bool_off_by_default_and_reaches_the_agent_loop_yaml(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    assert VerlSettings.from_mapping({})[0].request_fingerprints is False
    assert load_settings(overrides="trainer=verl").trainer["request_fingerprints"] is False
    with pytest.raises(SettingError, match=r"'trainer\.request_fingerprints' must be bool"):
        VerlSettings.from_mapping({"request_fingerprints": 1})
    for on in (False, True):
        prep = prepare_train(_job(tiny_model_dir, tmp_path / f"out{on}", request_fingerprints=on))
        (loop,) = yaml.safe_load(Path(prep.paths.agent_loop_file).read_text())
        assert loop["request_fingerprints"] is on


def test_a_retried_round_starts_a_fresh_fingerprint_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    from fedagent_flwr.trainers.verl.dataset import FINGERPRINT_FILE

    stale = tmp_path / "out" / "verl" / FINGERPRINT_FILE
    stale.parent.mkdir(parents=True)
    stale.write_text('{"seed": 1}\n')
    prep = prepare_train(_job(tiny_model_dir, tmp_path / "out", request_fingerprints=True))
    assert not stale.exists() and prep.episode_log.parent == stale.parent


def _model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def test_every_request_of_a_seeded_rollout_is_fingerprinted_deterministically(
        tiny_model_dir: Path, smollm2_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each server call of a seeded concat rollout leaves one line that names it (seed, env seed, row,
    turn, step, place in the group) and digests what it sent and got. The server is greedy HF, so
    the second run's equal lines show only that a line is a deterministic function of the request
    and its answer (no clock, process or id leaks into it beyond the timing fields), not that any
    server reproduces its answers."""
    from fedagent_flwr.trainers.verl.agent_loop import FINGERPRINT_FILE, logprob_digest, token_digest

    model = _model(tiny_model_dir)
    runs = []
    for run in ("a", "b"):
        episode_log = tmp_path / run / "verl" / "episodes.jsonl"
        episode_log.parent.mkdir(parents=True)
        server = _rollouts(model, smollm2_tokenizer, episode_log, True, monkeypatch)
        prints = _lines(episode_log.parent / FINGERPRINT_FILE)
        # one line per server call, in call order (one rollout after the other here), each naming its call
        assert len(prints) == len(server.calls) >= 4 and len(_lines(episode_log)) == 2
        assert [p["seed"] for p in prints] == [c["seed"] for c in server.calls]
        assert [p["prompt_sha256"] for p in prints] == [token_digest(ids) for ids in server.prompts]
        assert [p["prompt_len"] for p in prints] == [len(ids) for ids in server.prompts]
        assert [p["output_len"] for p in prints] == server.generated
        assert all(p["env_seed"] == ROW["seed"] and p["index"] == 0 and p["logprobs_len"] == p["output_len"]
                   for p in prints)
        turns = [p["turn"] for p in prints]
        first_of_second = turns.index(0, 1)  # where rollout_n 1 starts
        for n, chunk in enumerate((prints[:first_of_second], prints[first_of_second:])):
            assert [p["turn"] for p in chunk] == list(range(len(chunk)))
            assert [p["seed"] for p in chunk] == [request_seed(seed_base(3, 1, 0, n, False), t)
                                                  for t in range(len(chunk))]
            assert all(p["step"] == 1 and p["rollout_n"] == n for p in chunk)  # from the seeded worker
        # the two rollouts of the group share their first prompt, not their seeds
        assert prints[0]["prompt_sha256"] == prints[first_of_second]["prompt_sha256"]
        assert prints[0]["seed"] != prints[first_of_second]["seed"]
        assert prints[0]["logprobs_sha256"] != logprob_digest([])
        assert all(p["logprob_sum"] < 0 for p in prints)  # log-probs of the returned tokens, summed
        runs.append([{k: v for k, v in p.items() if k not in TIMING} for p in prints])
    assert runs[0] == runs[1]  # the same requests and answers: the same lines (a deterministic digest)


@pytest.mark.parametrize("windowed", [False, True], ids=["concat", "windowed"])
def test_off_writes_nothing_and_the_rollouts_are_the_same_as_with_it_on(
        windowed: bool, tiny_model_dir: Path, smollm2_tokenizer: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The setting only observes: on or off, the agent loop sends the server the same prompts with
    the same sampling parameters (seed included) and logs the same episodes; off, no file."""
    from fedagent_flwr.trainers.verl.agent_loop import FINGERPRINT_FILE
    from fedagent_flwr.trainers.verl.request_seeds import SeededAgentLoopWorker
    from fedagent_flwr.trainers.verl.windowed import SeededWindowedAgentLoopWorker

    model = _model(tiny_model_dir)
    seen = {}
    for on in (True, False):
        episode_log = tmp_path / str(on) / "verl" / "episodes.jsonl"
        episode_log.parent.mkdir(parents=True)
        server = _rollouts(model, smollm2_tokenizer, episode_log, on, monkeypatch,
                           SeededWindowedAgentLoopWorker if windowed else SeededAgentLoopWorker)
        assert (episode_log.parent / FINGERPRINT_FILE).exists() is on
        calls = [{k: v for k, v in call.items() if k != "request_id"} for call in server.calls]  # ids are fresh
        seen[on] = (episode_log.read_text().splitlines(), calls, server.prompts)
    assert len(seen[True][1]) >= 4 and all(call["seed"] is not None for call in seen[True][1])
    assert seen[False] == seen[True]


def test_windowed_rollouts_are_fingerprinted_per_turn_with_their_step(
        tiny_model_dir: Path, smollm2_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windowed mode (``run_windowed``, a fresh prompt per turn) through the seeded windowed worker:
    one line per server call, with the turn's own prompt, seed, the trajectory's step and place."""
    from fedagent_flwr.trainers.verl.agent_loop import FINGERPRINT_FILE, token_digest
    from fedagent_flwr.trainers.verl.windowed import SeededWindowedAgentLoopWorker

    episode_log = tmp_path / "verl" / "episodes.jsonl"
    episode_log.parent.mkdir(parents=True)
    server = _rollouts(_model(tiny_model_dir), smollm2_tokenizer, episode_log, True, monkeypatch,
                       SeededWindowedAgentLoopWorker, step=3)
    prints = _lines(episode_log.parent / FINGERPRINT_FILE)
    episodes = _lines(episode_log)
    assert len(episodes) == 2 and [e["samples"] for e in episodes] == [ROW["max_turns"]] * 2  # every turn played
    assert len(prints) == len(server.calls) == 2 * ROW["max_turns"]
    assert [p["prompt_sha256"] for p in prints] == [token_digest(ids) for ids in server.prompts]
    assert [p["seed"] for p in prints] == [c["seed"] for c in server.calls]
    for n in (0, 1):
        chunk = prints[n * ROW["max_turns"]:(n + 1) * ROW["max_turns"]]
        assert [p["turn"] for p in chunk] == list(range(ROW["max_turns"]))
        assert [p["seed"] for p in chunk] == [request_seed(seed_base(3, 3, 0, n, False), t)
                                              for t in range(ROW["max_turns"])]
        assert all(p["step"] == 3 and p["rollout_n"] == n and p["env_seed"] == 3 and p["index"] == 0 for p in chunk)
        assert len({p["prompt_sha256"] for p in chunk}) == ROW["max_turns"]  # a new window each turn


def test_without_the_seeded_worker_step_place_and_seed_are_none(
        tiny_model_dir: Path, smollm2_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's own worker (``trainer.request_seeds`` off) adds no step or place columns and no seed:
    the lines say None rather than guess; a row without an env seed is recorded, not a TypeError."""
    from types import SimpleNamespace

    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from fedagent_flwr.rollout.episode import SamplingParams
    from fedagent_flwr.trainers.verl.agent_loop import FINGERPRINT_FILE, ServerGenerate

    episode_log = tmp_path / "verl" / "episodes.jsonl"
    episode_log.parent.mkdir(parents=True)
    server = _rollouts(_model(tiny_model_dir), smollm2_tokenizer, episode_log, True, monkeypatch, AgentLoopWorker)
    prints = _lines(episode_log.parent / FINGERPRINT_FILE)
    assert len(prints) == len(server.calls) >= 2 and all("seed" not in call for call in server.calls)
    assert all(p["step"] is None and p["rollout_n"] is None and p["seed"] is None and p["env_seed"] == 3
               for p in prints)

    class OneToken:
        async def generate(self, request_id: str, **_: Any) -> Any:
            return SimpleNamespace(token_ids=[7], log_probs=[-0.5])

    bare = tmp_path / "bare.jsonl"
    generate = ServerGenerate(OneToken(), {}, None, fingerprint_log=str(bare),
                              fingerprint_row={"seed": None, "index": None})
    assert asyncio.run(generate([1, 2], SamplingParams(4))) == [7]
    (line,) = _lines(bare)
    assert line["env_seed"] is None and line["index"] is None and line["step"] is None and line["turn"] == 0


def test_the_digests_tell_apart_what_two_runs_must_not_confuse() -> None:
    from fedagent_flwr.trainers.verl.agent_loop import logprob_digest, token_digest

    assert token_digest([1, 2]) == token_digest((1, 2))
    assert len({token_digest(ids) for ids in ([1, 2], [2, 1], [1, 2, 0], [1], [], [2**40])}) == 6
    value = -1.25
    assert logprob_digest([value]) == logprob_digest([-1.25])
    assert logprob_digest([value]) != logprob_digest([math.nextafter(value, 0.0)])  # one ulp apart
    assert logprob_digest([value, -0.5]) != logprob_digest([-0.5, value])


def test_collect_keeps_every_client_rounds_fingerprints(tmp_path: Path) -> None:
    """tools/gpu/collect.sh packs ``round_<r>/client_<c>/verl/request_fingerprints.jsonl`` as
    ``results/<run>/fingerprints/round_<r>-client_<c>.jsonl`` (the device machine keeps nothing)."""

    from fedagent_flwr.trainers.verl.agent_loop import FINGERPRINT_FILE

    out = tmp_path / "out"
    written = {}
    for round_, client in ((1, 0), (2, 1)):
        path = out / "runs" / "local-s5" / f"round_{round_}" / f"client_{client}" / "verl" / FINGERPRINT_FILE
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"seed": round_ * 10 + client}) + "\n")
        written[f"round_{round_}-client_{client}.jsonl"] = path.read_text()
    kept = collected(out, tmp_path) / "local-s5" / "fingerprints"
    assert {p.name: p.read_text() for p in kept.iterdir()} == written


def _fingerprints_module():  # noqa: ANN202 - tools/gpu/fingerprints.py
    return gpu_tool("fingerprints")


def _line(seed: int | None, started: float, prompt: list[int], tokens: list[int], logprobs: list[float], *,
          env_seed: int = 5, turn: int = 0, step: int | None = 1, rollout_n: int | None = 0,
          seconds: float = 0.1) -> str:
    """A fingerprint line as the agent loop's own :func:`request_fingerprint` writes it."""
    from types import SimpleNamespace

    from fedagent_flwr.trainers.verl.agent_loop import request_fingerprint

    output = SimpleNamespace(token_ids=tokens, log_probs=logprobs, extra_fields={"num_cached_tokens": 16})
    return json.dumps(request_fingerprint(env_seed=env_seed, index=0, turn=turn, seed=seed, step=step,
                                          rollout_n=rollout_n, prompt_ids=prompt, output=output, started=started,
                                          seconds=seconds))


def test_two_runs_files_join_on_seed_and_name_the_first_request_of_each_kind(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """tools/gpu/fingerprints.py on files the agent loop's own ``request_fingerprint`` writes: requests
    that agree, differ only in a log-prob's last bit, in a token, or in the prompt are told apart,
    the first of each kind in run A's start order, with its step; a request of one run only is
    counted; a file whose requests carry no seed is refused."""
    tool = _fingerprints_module()
    line = _line

    lp = [-0.5, -1.25]
    nudged = [-0.5, math.nextafter(-1.25, 0.0)]
    a_lines = [line(1, 1.0, [1, 2], [3, 4], lp), line(2, 2.0, [1, 2], [3, 4], lp), line(3, 3.0, [1, 2], [3, 4], lp),
               line(4, 4.0, [1, 2, 9], [3, 4], lp), line(5, 5.0, [1, 2], [3, 4], lp), line(6, 6.0, [1], [2], lp)]
    b_lines = [line(1, 9.0, [1, 2], [3, 4], lp), line(2, 1.0, [1, 2], [3, 4], nudged), line(3, 2.0, [1, 2], [3, 5], lp),
               line(4, 3.0, [1, 2, 8], [3, 4], lp), line(5, 4.0, [1, 2], [3, 5], lp)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(a_lines) + "\n")
    b.write_text("\n".join(b_lines) + "\n")
    assert tool.main([str(a), str(b)]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["joined"] == 5 and result["only_a"] == 1 and result["only_b"] == 0
    assert result["counts"] == {"same": 1, "logprobs": 1, "tokens": 2, "prompt": 1}
    assert {kind: first["seed"] for kind, first in result["first"].items()} == {
        "same": 1, "logprobs": 2, "tokens": 3, "prompt": 4}  # A's start order, not B's or the file's
    assert result["first"]["tokens"]["cached_tokens"] == [16, 16] and result["first"]["tokens"]["started_rank"] == 2
    assert result["first"]["logprobs"]["logprob_sum"] == [-1.75, math.fsum(nudged)]
    assert result["first"]["tokens"]["step"] == 1 and result["first"]["tokens"]["rollout_n"] == 0
    assert result["counts_by_step"] == {"1": result["counts"]}
    assert tool.main([str(a), str(a)]) == 0
    capsys.readouterr()
    unseeded = tmp_path / "u.jsonl"
    unseeded.write_text(line(None, 1.0, [1], [2], lp) + "\n")
    assert tool.main([str(a), str(unseeded)]) == 2
    assert "without a seed (was trainer.request_seeds on?)" in capsys.readouterr().err


def test_the_read_out_counts_per_step_and_joins_on_seed_env_seed_index_and_turn(
        tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Differences after step 1 are expected (the weights differ after the first update), so the
    counts are split by step and each class's first request names its step; two requests that share
    only a seed are two requests, the same (seed, env seed, index, turn) twice is refused."""
    tool = _fingerprints_module()
    lp = [-0.5]
    a_lines = [_line(1, 1.0, [1], [2], lp), _line(1, 2.0, [1], [2], lp, env_seed=6),  # same seed, other env seed
               _line(1, 3.0, [1], [2], lp, turn=1), _line(9, 4.0, [1], [2], lp, step=2, rollout_n=1),
               _line(8, 5.0, [1], [2], lp, step=2)]
    b_lines = [_line(1, 1.0, [1], [2], lp), _line(1, 2.0, [1], [3], lp, env_seed=6),
               _line(1, 3.0, [1], [2], lp, turn=1), _line(9, 4.0, [1], [3], lp, step=2, rollout_n=1),
               _line(8, 5.0, [1, 1], [2], lp, step=2)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(a_lines) + "\n")
    b.write_text("\n".join(b_lines) + "\n")
    assert tool.main([str(a), str(b)]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["joined"] == 5 and result["only_a"] == result["only_b"] == 0
    assert result["counts"] == {"same": 2, "logprobs": 0, "tokens": 2, "prompt": 1}
    assert result["counts_by_step"] == {"1": {"same": 2, "logprobs": 0, "tokens": 1, "prompt": 0},
                                        "2": {"same": 0, "logprobs": 0, "tokens": 1, "prompt": 1}}
    first = result["first"]
    assert (first["tokens"]["seed"], first["tokens"]["env_seed"], first["tokens"]["step"]) == (1, 6, 1)
    assert (first["prompt"]["seed"], first["prompt"]["step"], first["prompt"]["rollout_n"]) == (8, 2, 0)
    unstepped = tmp_path / "u.jsonl"
    unstepped.write_text(_line(1, 1.0, [1], [2], lp, step=None, rollout_n=None) + "\n")
    assert tool.main([str(unstepped), str(unstepped)]) == 0
    assert json.loads(capsys.readouterr().out)["counts_by_step"] == {"none": {"same": 1, "logprobs": 0, "tokens": 0,
                                                                               "prompt": 0}}
    repeated = tmp_path / "r.jsonl"
    repeated.write_text(a_lines[0] + "\n" + a_lines[1] + "\n" + _line(1, 7.0, [4], [5], lp) + "\n")
    assert tool.main([str(a), str(repeated)]) == 2
    assert capsys.readouterr().err == (f"fingerprints: {repeated}:3: request {{'seed': 1, 'env_seed': 5, 'index': 0, "
                                       "'turn': 0} repeats, so requests cannot be joined\n")


def test_the_read_out_splits_by_turn_and_gives_how_crowded_each_class_of_request_ran(
        tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Turn 0's prompts come from the data and env alone, so the counts are split by turn too; and
    for each step, turn and class, the median number of the same run's same-step requests that
    overlapped a request in time, in A and in B (requests of another step never count), and the
    median output length in A and in B (the in-flight count's confound: longer requests overlap more).
    Every class has its own crowding in each run, and "same" holds two requests, so its medians are the
    mean of the middle two."""
    tool = _fingerprints_module()

    def lp(n: int) -> list[float]:
        return [-0.5] * n

    nudged = [-0.5, math.nextafter(-0.5, 0.0)]
    # run A, step 1 (start-end s): seed 1 0-1, seed 5 0.2-0.4, seed 2 0.5-1.5, seed 4 (turn 1) 1-2,
    # seed 3 alone 4-5. Overlaps: seed 1 with 5 and 2 (2), seed 2 with 1 and 4 (2), seed 5 with 1,
    # seed 4 with 2 (1 each), seed 3 none. Seed 9, at step 2, overlaps them all and counts for no one.
    a_lines = [_line(1, 0.0, [1], [2], lp(1), seconds=1.0), _line(2, 0.5, [1], [2, 6], lp(2), seconds=1.0),
               _line(3, 4.0, [1], [2], lp(1), seconds=1.0), _line(4, 1.0, [1, 2], [3], lp(1), turn=1, seconds=1.0),
               _line(5, 0.2, [1], [2, 2, 2, 2], lp(4), seconds=0.2),
               _line(9, 0.0, [1], [2], lp(1), step=2, seconds=9.0)]
    # run B: seeds 1-4 overlap one another (3 each), seed 5 runs alone after them; seed 2 other
    # log-probs, seed 3 other (and more) tokens
    b_lines = [_line(1, 0.0, [1], [2], lp(1), seconds=5.0), _line(2, 0.1, [1], [2, 6], nudged, seconds=5.0),
               _line(3, 0.2, [1], [5, 5, 5], lp(3), seconds=5.0),
               _line(4, 0.3, [1, 2], [3], lp(1), turn=1, seconds=5.0),
               _line(5, 6.0, [1], [2, 2, 2, 2], lp(4), seconds=1.0),
               _line(9, 0.0, [1], [2], lp(1), step=2, seconds=9.0)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(a_lines) + "\n")
    b.write_text("\n".join(b_lines) + "\n")
    assert tool.main([str(a), str(b)]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["counts_by_step_turn"] == {
        "1": {"0": {"same": 2, "logprobs": 1, "tokens": 1, "prompt": 0},
              "1": {"same": 1, "logprobs": 0, "tokens": 0, "prompt": 0}},
        "2": {"0": {"same": 1, "logprobs": 0, "tokens": 0, "prompt": 0}}}
    # "same" at step 1, turn 0: seeds 1 and 5, in-flight 2 and 1 in A, 3 and 0 in B
    assert result["in_flight_by_step_turn"] == {
        "1": {"0": {"same": [1.5, 1.5], "logprobs": [2.0, 3.0], "tokens": [0.0, 3.0]}, "1": {"same": [1.0, 3.0]}},
        "2": {"0": {"same": [0.0, 0.0]}}}
    assert result["output_len_by_step_turn"] == {
        "1": {"0": {"same": [2.5, 2.5], "logprobs": [2.0, 2.0], "tokens": [1.0, 3.0]}, "1": {"same": [1.0, 1.0]}},
        "2": {"0": {"same": [1.0, 1.0]}}}
    records = tool.load(a)
    assert sorted(tool.in_flight(records).values()) == [0, 0, 1, 1, 2, 2]
    assert tool._median([]) is None and tool._median([4, 1, 3]) == 3.0 and tool._median([4, 1, 3, 2]) == 2.5


@pytest.mark.parametrize("key", ["prompt_sha256", "output_sha256", "logprobs_sha256", "seed", "env_seed", "index",
                                 "turn"])
def test_a_line_missing_a_key_it_needs_is_bad_input(key: str, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Exit 2 (bad input) with one line naming the file, line and key, not a KeyError's exit 1
    (which reads as "the runs differ")."""
    tool = _fingerprints_module()
    good = tmp_path / "good.jsonl"
    good.write_text(_line(1, 1.0, [1], [2], [-0.5]) + "\n")
    record = json.loads(_line(2, 2.0, [1], [2], [-0.5]))
    del record[key]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_line(1, 1.0, [1], [2], [-0.5]) + "\n" + json.dumps(record) + "\n")
    assert tool.main([str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fingerprints: {bad}:2: missing {key} ") and err.count("\n") == 1


def test_a_line_that_is_not_a_json_object_is_bad_input_named_by_file_and_line(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    tool = _fingerprints_module()
    good = tmp_path / "good.jsonl"
    good.write_text(_line(1, 1.0, [1], [2], [-0.5]) + "\n")
    cut = tmp_path / "cut.jsonl"
    cut.write_text(_line(1, 1.0, [1], [2], [-0.5]) + "\n\n" + _line(2, 2.0, [1], [2], [-0.5])[:40] + "\n")
    assert tool.main([str(good), str(cut)]) == 2
    assert capsys.readouterr().err.startswith(f"fingerprints: {cut}:3: not JSON (")
    listed = tmp_path / "list.jsonl"
    listed.write_text("[1, 2]\n")
    assert tool.main([str(listed), str(good)]) == 2
    assert capsys.readouterr().err == f"fingerprints: {listed}:1: not a JSON object\n"
    odd = tmp_path / "odd.jsonl"
    record = json.loads(_line(1, 1.0, [1], [2], [-0.5]))
    odd.write_text(json.dumps({**record, "turn": [0]}) + "\n")  # a list: not a join key (nor hashable)
    assert tool.main([str(good), str(odd)]) == 2
    assert capsys.readouterr().err.startswith(f"fingerprints: {odd}:1: {{'seed': 1, 'env_seed': 5, 'index': 0, "
                                              "'turn': [0]} are not all integers")
