"""Per-client validation (FedAgent's ``client_end_eval``): a client's own trained model on the
validation episodes, right after it trained.

It is the global evaluation's job run on another model: the ClientApp writes the same
:class:`~fedagent_flwr.clientapp.job.EvalJob` (validation spec, ``eval.seed``'s episodes, the
unperturbed validation service) and the trainer backend's own evaluator plays it. Only the model
differs, and it needs one step first: a trainer writes its checkpoint as verl FSDP rank files (or,
with ``model.lora``, an adapter), which the evaluator cannot load, so :func:`trained_model_dir` merges
them into a Hugging Face directory, as FedAgent merges each client's actor to ``round_r/client_c/hf`` before scoring it.
The merge is the aggregation's own code with a single source of weight 1 (an fp32 copy), with the
config, generation config and tokenizer of the model the client started from.

The result rides in the train reply as the evaluation reply's metrics behind
:data:`~fedagent_flwr.protocol.CLIENT_VAL_PREFIX`; the server records it apart from the training
metrics (``client_val`` events, ``client_val_curve``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.clientapp.job import EvalResult, TrainResult
from fedagent_flwr.protocol import CLIENT_VAL_PREFIX, EvalReply


def trained_model_dir(result: TrainResult, model_files: Path, out_dir: Path, start_model: Path | None = None) -> Path:
    """A Hugging Face directory of the trained actor in ``result``, for the evaluator.

    An ``hf-safetensors`` checkpoint is one already; FSDP rank files are merged into ``out_dir``
    (replaced if it exists: a retried round), and so is a LoRA adapter (``peft-lora``), onto
    ``start_model``, the global model it was trained on (the full model the server reads it as).
    ``model_files`` is the directory whose config and tokenizer files the merged model gets (the
    model the client started from).
    """
    if result.actor_format == "hf-safetensors":
        return Path(result.actor_dir)
    # Imported here: they import torch, which the ClientApp needs for this merge only.
    from fedagent_flwr.checkpoint import open_checkpoint, weighted_mean

    shutil.rmtree(out_dir, ignore_errors=True)
    lora = result.actor_format == "peft-lora"
    ref = CheckpointRef(path=str(Path(result.actor_dir).resolve()), kind="actor",
                        format="peft-lora" if lora else "fsdp-shards", world_size=int(result.world_size))
    base = CheckpointRef(path=str(start_model or model_files)) if lora else None
    with open_checkpoint(ref, check_hash=False, base=base) as reader:
        weighted_mean([(reader, 1.0)], out_dir, update_stats=False, model_files=model_files)
    return out_dir


def eval_reply(result: EvalResult) -> EvalReply:
    """The evaluation reply of a validation result (global or per-client alike)."""
    score, truncated = result.metrics.get("score_mean"), result.metrics.get("truncated_rate")
    return EvalReply(num_examples=int(result.num_episodes), success_rate=float(result.success_rate),
                     reward_mean=float(result.reward_mean), score_mean=None if score is None else float(score),
                     truncated_rate=None if truncated is None else float(truncated))


def client_val_metrics(result: EvalResult) -> dict[str, int | float]:
    """A train reply's per-client validation metrics (``client-val-num-examples``, ...)."""
    return eval_reply(result).metrics(CLIENT_VAL_PREFIX)
