"""Federated LoRA in the reference trainer (``model.lora.rank`` > 0): a fresh adapter on the round's
global model, trained alone and saved alone.

Each client-round starts from the full global model (the server merges every round's updates into
it), attaches a new peft LoRA adapter to the attention projections (``model.lora.target_modules``),
trains only the adapter and writes peft's two adapter files as its checkpoint::

    <step_dir>/actor/
        adapter_model.safetensors   the factors, peft's key names (base_model.model.<module>.lora_A.weight);
                                    its metadata names the start model's content hash (fedagent.base_sha256)
        adapter_config.json         r, lora_alpha, target_modules, lora_dropout, ...

The server reads it as the global model plus ``(alpha / r) B @ A``
(:mod:`fedagent_flwr.checkpoint.lora_reader`), and only on the model whose content hash the adapter
records: the factors mean that update of that model alone. ``A`` starts as peft draws it (Kaiming-uniform),
from a generator of its own seeded by the run's seed, the round and the client (sha256, never
Python's salted ``hash()``); ``B`` starts at zero, so the adapted model starts as the global model.

peft's ``get_peft_model`` adds the adapter to the model object in place: the GRPO code goes on
training that same Hugging Face model (``model.base_model``, ``get_output_embeddings()``), whose
only trainable parameters are now the factors. :func:`fresh_adapter` takes the adapter out again
afterwards (peft's ``unload``: the original layers put back, nothing merged) and restores the
parameters' ``requires_grad``, so a persistent session trains the next round on its live model,
without a copy of it per round. It does so from a record of the model taken before the attach, also
when peft fails part-way (a target that is no linear layer is found after earlier ones were wrapped):
the session answers such a job as bad input and keeps serving, so the model must be as it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedagent_flwr.checkpoint.content_hash import CONTENT_HASH_VERSION
from fedagent_flwr.checkpoint.ref import ADAPTER_BASE_HASH_VERSION, ADAPTER_BASE_SHA256, ADAPTER_WEIGHTS
from fedagent_flwr.schema.lora import Lora
from fedagent_flwr.trainers.common.checks import InputError
from fedagent_flwr.trainers.common.seeds import derive_seed
from fedagent_flwr.trainers.reference.checkpoint import write_actor_dir

__all__ = ["ModelNotRestored", "adapter_seed", "attach_adapter", "fresh_adapter", "write_adapter_checkpoint"]


def adapter_seed(base_seed: int, server_round: int, client_id: int) -> int:
    """The seed of client ``client_id``'s fresh adapter in ``server_round`` (the run's seed, the round,
    the client: a new ``A`` every round, different between clients, the same in every rerun)."""
    return derive_seed("lora-init", base_seed, server_round, client_id)


def attach_adapter(model: Any, settings: Lora, seed: int) -> Any:
    """Attach a fresh LoRA adapter to ``model`` in place and return peft's wrapper of it.

    ``A`` is drawn from torch's CPU generator seeded with ``seed`` inside a forked CPU RNG state
    (peft builds and initialises the factors on the CPU), so the caller's random streams (sampling,
    dropout) are the same as without the adapter; ``B`` is zero. Only the CPU generator is seeded
    (not ``manual_seed``, which reseeds every CUDA device too): this trainer runs on the CPU, and
    touching the CUDA generators would start CUDA in every trainer process of a GPU node.
    A target that matches no module is an InputError naming ``model.lora.target_modules`` (the
    server checks the base model at start; a job file written by hand is checked here).
    """
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(task_type="CAUSAL_LM", r=settings.rank, lora_alpha=settings.alpha,
                        target_modules=list(settings.target_modules), lora_dropout=settings.dropout)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        try:
            return get_peft_model(model, config)
        except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise InputError(f"model.lora.target_modules = {list(settings.target_modules)}: {first}") from None


class ModelNotRestored(RuntimeError):
    """A model that :func:`fresh_adapter` could not put back as it found it: it must not serve another
    job. Not bad input, so a persistent session ends on it and a fresh trainer process replaces it
    (:mod:`fedagent_flwr.clientapp.trainer_server`)."""


def _signature(model: Any) -> list[tuple[object, ...]]:
    """What a job relies on in ``model``: each module (name, object, forward hooks), each parameter
    (name, object, ``requires_grad``)."""
    return ([(name, id(module), len(module._forward_hooks), len(module._forward_pre_hooks))
             for name, module in model.named_modules()]
            + [(name, id(param), param.requires_grad) for name, param in model.named_parameters()])


class _Restorer:
    """A record of ``model`` before an adapter is attached, and :meth:`restore` to go back to it."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.signature = _signature(model)
        # what peft changes: a target's slot in its parent (the wrapper in, the original inside it), the
        # flags (all frozen but the factors), the model's attributes (peft_config), config.pretraining_tp (1)
        self.children = [(module, dict(module._modules), dict(module._parameters)) for module in model.modules()]
        self.flags = [(param, param.requires_grad) for param in model.parameters()]
        self.attributes = set(vars(model))
        self.pretraining_tp = getattr(getattr(model, "config", None), "pretraining_tp", None)

    def restore(self) -> None:
        """Put every recorded slot, flag and attribute back (a no-op where peft's ``unload`` did already);
        ModelNotRestored if the model still differs from the record (a hook peft added, say)."""
        for module, children, params in self.children:
            for slots, saved in ((module._modules, children), (module._parameters, params)):
                if slots.keys() != saved.keys() or any(slots[k] is not v for k, v in saved.items()):
                    slots.clear()
                    slots.update(saved)
        for param, flag in self.flags:
            param.requires_grad_(flag)
        for name in set(vars(self.model)) - self.attributes:
            delattr(self.model, name)
        if self.pretraining_tp is not None:
            self.model.config.pretraining_tp = self.pretraining_tp
        if _signature(self.model) != self.signature:
            raise ModelNotRestored("the LoRA adapter could not be taken out of the live model cleanly (its modules, "
                                   "parameters or hooks differ from before it was attached): the model is not used "
                                   "again")


@contextmanager
def fresh_adapter(model: Any, settings: Lora, seed: int) -> Iterator[Any]:
    """:func:`attach_adapter` for the ``with`` block, then the adapter taken out of ``model`` again,
    unmerged (peft's ``unload``), and every parameter's ``requires_grad`` as it was: ``model`` is
    left as it was found, whatever the block raised (its weights untouched: only the factors train),
    and so is it when the attach itself fails part-way (the original layers put back from a record
    taken before it). ModelNotRestored (after the error that caused it, if any) where that fails."""
    restorer = _Restorer(model)
    try:
        peft_model = attach_adapter(model, settings, seed)
        try:
            yield peft_model
        finally:
            peft_model.unload()  # puts the original layers back (and drops peft's config from the model)
    finally:
        restorer.restore()


def write_adapter_checkpoint(peft_model: Any, step_dir: Path, base_sha256: str) -> Path:
    """Write ``step_dir/actor`` holding only the adapter (peft's files); return the actor dir.

    The factors go through peft's own ``get_peft_model_state_dict`` (its key names, the adapter's
    name dropped) and the settings through ``LoraConfig.save_pretrained``; peft's model card is
    not written (it is no part of the checkpoint). ``base_sha256``, the content hash of the model
    the adapter was trained on, goes into the factors' safetensors metadata
    (:data:`~fedagent_flwr.checkpoint.ref.ADAPTER_BASE_SHA256`, covered by the adapter's own content
    hash), with the content-hash scheme it was computed with (``ADAPTER_BASE_HASH_VERSION``): the server
    reads the adapter on that model only. Written as the full model's checkpoint is
    (:func:`~.checkpoint.write_actor_dir`).
    """
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    def fill(actor: Path) -> None:
        factors = {key: value.detach().to(torch.float32).contiguous()
                   for key, value in get_peft_model_state_dict(peft_model).items()}
        save_file(factors, str(actor / ADAPTER_WEIGHTS), metadata={
            "format": "pt", ADAPTER_BASE_SHA256: base_sha256, ADAPTER_BASE_HASH_VERSION: CONTENT_HASH_VERSION})
        peft_model.peft_config["default"].save_pretrained(str(actor))

    return write_actor_dir(step_dir, fill)
