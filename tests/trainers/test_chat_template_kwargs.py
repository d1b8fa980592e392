"""``model.chat_template_kwargs``: one setting for the chat template's keyword arguments, with which
every renderer renders: the reference trainer's rollouts, the Hugging Face evaluator (validation of
both backends, per-client validation's job too) and verl (``data.apply_chat_template_kwargs``, which
verl's agent-loop base class hands to our agent loop).

Real components throughout: the tiny random model saved with a copy of the SmolLM2 tokenizer whose
chat template reads a keyword (``enable_thinking``, as Qwen3's does) and prints :data:`MARKER` first
when it is false; verl 0.9.1's own config and agent-loop base class. The played episodes are kept as
the real player returned them (``played`` below, ``played_batches`` for the evaluator).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from fedagent_flwr.checkpoint.ref import CheckpointRef
from fedagent_flwr.clientapp.job import EvalJob, TrainJob
from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.protocol import TrainInstruction
from fedagent_flwr.rollout.episode import Episode
from fedagent_flwr.schema import SettingError
from fedagent_flwr.trainers.common.checks import InputError
from fedagent_flwr.trainers.reference import train as reference
from fedagent_flwr.trainers.reference.config import GRPOConfig
from fedagent_flwr.trainers.verl import job as verl_job
from fedagent_flwr.trainers.verl.overrides import build_overrides, job_paths
from fedagent_flwr.trainers.verl.settings import VerlSettings
from testkit.reference_trainer import SPEC, TRAINER
from testkit.verl_agent_loop import HFServer
from testkit.verl_probe import compose_verl_config

MARKER = "NO-THINKING-MODE"
KWARGS = {"enable_thinking": False}
SEEDS = [3, 4]


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model with a chat template that reads ``enable_thinking``: SmolLM2's ChatML template,
    preceded by :data:`MARKER` when the keyword is given and false (prompts keep extending one another,
    so both rollout modes can play with it)."""
    from transformers import AutoTokenizer

    model_dir = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = (f"{{% if enable_thinking is defined and not enable_thinking %}}{MARKER}\n{{% endif %}}"
                               + tokenizer.chat_template)
    tokenizer.save_pretrained(str(model_dir))
    return model_dir


def _prompts(episodes: list[Episode]) -> list[list[int]]:
    """Every prompt the episodes were played from: the first prompt (concat) or each turn's (windowed)."""
    return [e.prompt_ids for e in episodes if e.prompt_ids] + [w.prompt_ids for e in episodes for w in e.windows]


def _marked(tokenizer: Any, prompts: list[list[int]]) -> list[bool]:
    return [tokenizer.decode(ids).startswith(MARKER) for ids in prompts]


def test_the_setting_reaches_the_jobs_from_the_run_config() -> None:
    for override in ("model.chat_template_kwargs={enable_thinking:false}",
                     "model.chat_template_kwargs.enable_thinking=false",
                     "+model.chat_template_kwargs.enable_thinking=false"):
        settings = load_settings(overrides=override)
        assert settings.run.model.chat_template_kwargs == KWARGS
        assert settings.trainer["chat_template_kwargs"] == KWARGS
    assert load_settings().trainer["chat_template_kwargs"] == {}  # the template's own defaults
    # the instruction carries the typed trainer settings, rebuilt on the client by the same validator
    settings = load_settings(overrides="trainer=verl model.chat_template_kwargs.enable_thinking=false")
    model = CheckpointRef(path="/run/global", kind="actor", format="fsdp-shards", world_size=1, sha256="0" * 64)
    sent = TrainInstruction(server_round=1, client_id=0, num_clients=2, data_seed=1, base_seed=1, algorithm="grpo",
                            local_steps=1, trainer=settings.trainer_settings, env_spec={"envs": []},
                            partition={"strategy": "none"}, service={"enabled": False}, global_model=model)
    assert TrainInstruction.from_record(sent.to_record()).trainer.chat_template_kwargs == KWARGS  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"'trainer\.chat_template_kwargs' is set from 'model\.chat_template_kwargs'"):
        load_settings(overrides="+trainer.chat_template_kwargs={enable_thinking:false}")


@pytest.mark.parametrize(("override", "message"), [
    ("model.chat_template_kwargs=false", "config key 'model.chat_template_kwargs' = 'false' is not a mapping"),
    ("model.chat_template_kwargs=[enable_thinking]", "config key 'model.chat_template_kwargs' = '[enable_thinking]' "
                                                     "is not a mapping"),
    ("model.chat_template_kwargs.options={depth:1}", "config key 'model.chat_template_kwargs.options' = {'depth': 1} "
                                                     "is not a JSON scalar or list of them"),
    ("model.chat_template_kwargs.tokenize=true", "config key 'model.chat_template_kwargs.tokenize' is an argument of "
                                                 "apply_chat_template that the agent loop sets itself"),
    ("model.chat_template_kwargs.budget=nan", "config key 'model.chat_template_kwargs.budget' = nan is not"),
    ("model.chat_template_kwargs.True=1", "config key 'model.chat_template_kwargs' has the key 'True', which verl's "
                                          "config would read as true"),
])
def test_a_bad_value_stops_the_run_at_config_load_naming_the_setting(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(overrides=override)
    assert str(refused.value).startswith(message)
    if "not a mapping" in message or "JSON scalar" in message:  # and says what to write instead
        assert str(refused.value).endswith("e.g. model.chat_template_kwargs={enable_thinking:false}")


def test_a_job_file_is_checked_by_the_same_rule() -> None:
    with pytest.raises(SettingError, match=r"model\.chat_template_kwargs' has the key '1x', not a keyword name"):
        VerlSettings.from_mapping({"chat_template_kwargs": {"1x": True}})
    with pytest.raises(InputError, match=r"model\.chat_template_kwargs\.x' = \{'y': 1\} is not a JSON scalar"):
        GRPOConfig.from_mapping({"chat_template_kwargs": {"x": {"y": 1}}})


@pytest.mark.parametrize("mode", ["concat", "windowed"])
def test_the_reference_trainers_rollouts_render_with_the_kwargs(
        mode: str, thinking_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    played: list[Episode] = []
    play = reference.play_episodes

    def recording(*args: Any, **kwargs: Any) -> list[Episode]:
        episodes = play(*args, **kwargs)
        played.extend(episodes)
        return episodes

    monkeypatch.setattr(reference, "play_episodes", recording)
    job = TrainJob(model_path=str(thinking_model_dir), output_dir=str(tmp_path / "out"), env_spec=SPEC, round=1,
                   client_id=1, num_clients=2, data_seed=143, local_steps=1, partition={"strategy": "none"},
                   trainer={**TRAINER, "rollout_mode": mode, "chat_template_kwargs": KWARGS})
    reference.train(job)
    prompts = _prompts(played)
    assert len(prompts) >= 4 and all(_marked(AutoTokenizer.from_pretrained(str(thinking_model_dir)), prompts))


def _evaluate(backend: str, model_dir: Path, out: Path, **trainer: Any) -> None:
    """One validation of ``model_dir`` on TinyGuess by ``backend``'s evaluator, as the ClientApp's job."""
    job = EvalJob(model_path=str(model_dir), output_dir=str(out), env_spec=SPEC, round=0, seeds=SEEDS,
                  trainer={"max_new_tokens": 8, **trainer})
    (verl_job.evaluate if backend == "verl" else reference.evaluate)(job)


@pytest.mark.parametrize("backend", ["reference", "verl"])
def test_validation_renders_with_the_kwargs(backend: str, thinking_model_dir: Path, tmp_path: Path,
                                            played_batches: list[list[Episode]]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(thinking_model_dir))
    _evaluate(backend, thinking_model_dir, tmp_path / "with", chat_template_kwargs=KWARGS)
    _evaluate(backend, thinking_model_dir, tmp_path / "without")
    with_kwargs, without = (_prompts(batch) for batch in played_batches)
    assert len(with_kwargs) == len(SEEDS) and all(_marked(tokenizer, with_kwargs))
    assert not any(_marked(tokenizer, without))  # the template's default: the keyword is what changed


def test_per_client_and_global_validation_jobs_carry_the_kwargs(tmp_path: Path) -> None:
    from fedagent_flwr.clientapp.app import validation_job

    settings = load_settings(overrides="model.chat_template_kwargs.enable_thinking=false")
    job = validation_job(settings.val_env_spec, {"enabled": False}, settings.trainer_settings, tmp_path, 0,
                         tmp_path / "model", tmp_path / "eval", 1, SEEDS)
    assert job.trainer["chat_template_kwargs"] == KWARGS
    assert GRPOConfig.from_mapping(job.trainer)[0].chat_template_kwargs == KWARGS  # what the evaluator reads


def test_verl_gets_them_as_data_apply_chat_template_kwargs_and_its_agent_loop_renders_with_them(
        thinking_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from fedagent_flwr.trainers.verl.agent_loop import EnvAgentLoop
    from fedagent_flwr.trainers.verl.dataset import EnvEpisodeDataset
    from fedagent_flwr.trainers.verl.overrides import hydra_value

    paths = job_paths(tmp_path / "verl", str(thinking_model_dir), "", "/tmp/fa-ray-test")

    def composed(trainer: dict[str, Any]) -> Any:
        overrides = build_overrides(algorithm="grpo", settings=VerlSettings.from_mapping(trainer)[0], paths=paths,
                                    batch_size=1, local_steps=1, seed=1, experiment_name="e")
        return overrides, compose_verl_config(overrides)

    stock, stock_cfg = composed({})
    assert not [o for o in stock if "chat_template" in o] and dict(stock_cfg.data.apply_chat_template_kwargs) == {}
    awkward = {"enable_thinking": False, "persona": "it's a \\ test'\\", "stop": ["true", 1, None, 2.5], "n": 3}
    overrides, cfg = composed({"chat_template_kwargs": awkward})
    written = [o for o in overrides if "chat_template" in o]
    assert written == [f"++data.apply_chat_template_kwargs={hydra_value(awkward)}"]
    assert OmegaConf.to_container(cfg.data.apply_chat_template_kwargs) == awkward  # Hydra read back every value

    # verl's AgentLoopBase takes data.apply_chat_template_kwargs; our loop renders every prompt with it
    _, cfg = composed({"chat_template_kwargs": KWARGS, "max_prompt_length": 512, "max_response_length": 96})
    tokenizer = AutoTokenizer.from_pretrained(str(thinking_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(thinking_model_dir), dtype=torch.float32).eval()
    loop = EnvAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=HFServer(model), tokenizer=tokenizer,
                        processor=None, dataset_cls=EnvEpisodeDataset, data_config=DictConfigWrap(cfg.data),
                        max_new_tokens=8)
    row = {"env_name": "TinyGuess", "env_config": {"lo": 1, "hi": 10}, "seed": 5, "max_turns": 2,
           "raw_prompt": [{"role": "user", "content": "x"}], "index": 0}
    output = asyncio.run(loop.run({"temperature": 0.0, "top_p": 1.0, "logprobs": True}, **row))
    assert tokenizer.decode(output.prompt_ids).startswith(MARKER)
    assert dict(loop.apply_chat_template_kwargs) == KWARGS


def test_the_warm_start_renders_its_examples_with_the_kwargs(thinking_model_dir: Path) -> None:
    """The supervised warm start trains on the prompts the run renders: with the kwargs its examples
    carry the template's marker, without them they do not."""
    from transformers import AutoTokenizer

    from fedagent_flwr.trainers.common import warm_start as ws
    from testkit.guess_conversations import CONVERSATIONS

    tokenizer = AutoTokenizer.from_pretrained(str(thinking_model_dir))
    conversations = list(enumerate(CONVERSATIONS, 1))
    args = ws.parse_args(["--data", "x.jsonl", "--out", "o", "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert args.chat_template_kwargs == KWARGS
    with_kwargs, _ = ws.build_examples(tokenizer, conversations, 4096, chat_template_kwargs=args.chat_template_kwargs)
    without, _ = ws.build_examples(tokenizer, conversations, 4096)
    assert all(MARKER in tokenizer.decode(e.input_ids) for e in with_kwargs)
    assert not any(MARKER in tokenizer.decode(e.input_ids) for e in without)


@pytest.mark.parametrize(("value", "message"), [
    ("{enable_thinking: false}", "not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"tokenize": true}', "model.chat_template_kwargs.tokenize"),
    ('{"Null": 1}', "would read as null"),
])
def test_the_warm_start_refuses_bad_kwargs_in_one_line(value: str, message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from fedagent_flwr.trainers.common import warm_start as ws

    with pytest.raises(SystemExit) as exited:
        ws.parse_args(["--data", "x.jsonl", "--out", "o", "--chat-template-kwargs", value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2 and "--chat-template-kwargs: " in err and message in err

