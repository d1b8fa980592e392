"""What verl's agent loop needs around it to run on CPU with a real model, for tests that drive
:class:`~fedagent_flwr.trainers.verl.agent_loop.EnvAgentLoop` without verl's rollout servers: a
``server_manager`` that generates with a Hugging Face model, the slice of verl's trainer config
the loop reads, and an agent-loop worker built without Ray over such a server."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch


class HFServer:
    """verl's ``server_manager`` contract (token in, token out) over a real HF model, greedy.

    It records each call's request id and sampling parameters (``calls``) and how many tokens each
    call returned (``generated``)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[dict[str, Any]] = []
        self.generated: list[int] = []  # tokens returned per call

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **_: Any) -> Any:
        """Greedily continue ``prompt_ids`` by at most ``sampling_params["max_tokens"]`` tokens;
        return the new tokens and their log-probabilities as verl's servers do."""
        self.calls.append({"request_id": request_id, **sampling_params})
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt_ids]), max_new_tokens=sampling_params["max_tokens"],
                                      do_sample=False, output_scores=True, return_dict_in_generate=True,
                                      pad_token_id=0)
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        logprobs = [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.scores, tokens)]
        self.generated.append(len(tokens))
        return SimpleNamespace(token_ids=tokens, log_probs=logprobs)


def loop_config(prompt_length: int, response_length: int) -> Any:
    """The part of verl's trainer config the agent loop reads: the rollout's prompt and response
    budgets (in tokens), log-probabilities on, and no extra chat-template arguments."""
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": prompt_length, "response_length": response_length,
                                          "calculate_log_probs": True}},
        "data": {"apply_chat_template_kwargs": {}},
    })


def agent_loop_worker(cls: type, model: Any, tokenizer: Any) -> Any:
    """``cls`` (a verl agent-loop worker class) without Ray, over an :class:`HFServer` of ``model``
    standing in for verl's vLLM servers (``llm_client``), with a GRPO config of ``rollout.n`` 2."""
    from omegaconf import OmegaConf

    from fedagent_flwr.trainers.verl.dataset import EnvEpisodeDataset

    worker = object.__new__(cls)
    worker.config = OmegaConf.merge(loop_config(prompt_length=1024, response_length=64), {
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2},
                              "rollout": {"n": 2, "log_prob_micro_batch_size_per_gpu": 2},
                              "ref": {"log_prob_micro_batch_size_per_gpu": 2}},
        "trainer": {"n_gpus_per_node": 1, "nnodes": 1}, "algorithm": {"adv_estimator": "grpo"}})
    worker.rollout_config = worker.config.actor_rollout_ref.rollout
    worker.llm_client = HFServer(model)
    worker.tokenizer = tokenizer
    worker.processor = None
    worker.hf_model_type = None
    worker.dataset_cls = EnvEpisodeDataset
    worker.tools = []
    worker.reward_loop_worker_handles = object()
    worker.distillation_enabled = False
    worker.mm_processor_kwargs = {}
    return worker
