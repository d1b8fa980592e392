"""A client's LoRA adapter read as the full model it stands for: a *virtual full model*.

With federated LoRA (``model.lora.rank`` > 0) a client trains low-rank factors ``A`` (r x in) and
``B`` (out x r) on top of the round's global model ``W`` and uploads only peft's adapter files
(``adapter_model.safetensors``, ``adapter_config.json``). :class:`LoraAdapterReader` presents that
adapter to the aggregation as an ordinary :class:`~.reader.CheckpointReader` over the global
model's keys: a weight the adapter targets reads as ``W + s * B @ A`` (``s`` = ``lora_alpha / r``,
``lora_alpha / sqrt(r)`` with rsLoRA, peft's scaling), computed in fp32, every other key as ``W``.

Why a virtual full model rather than averaging the factors: every rule that reads readers (FedAvg,
FedProx, the server optimisers, a user's ``Strategy`` subclass) works unchanged, and FedAvg of
the virtual models is ``W + sum_i w_i s B_i A_i``, the exact weighted mean of the clients' full
updates. Averaging ``A`` and ``B`` separately (FedIT) gives ``(sum w_i B_i)(sum w_i A_i)``, which
is not the mean of the products. The new global model is a full model; the next round's clients
attach fresh adapters to it.

The base is the server's own global model of the round, its content hash checked against its
reference once per round (:func:`.open_ref.open_checkpoint`'s ``base_digests``); the adapter's files
are checked like any client checkpoint's. Memory per read: the target tensor in fp32 (the output
buffer itself when it is fp32) and the two factors.

An adapter means ``W + s B A`` only on the ``W`` it was trained on: the same factors on another
model (last round's global model, a resumed run's, another run's) read without complaint as some
other model. So the adapter file must record the content hash of the model it was trained on
(:data:`~.ref.ADAPTER_BASE_SHA256` in its safetensors metadata, which the adapter's own content hash
covers), and it is refused unless that is the content hash of the base it is opened on. The
reference trainer records it; an adapter without it (peft's ``save_pretrained`` alone, another
trainer) is refused too, naming the entry, since nothing else ties it to a model. Beside it the trainer
records the content-hash scheme it computed it with (:data:`~.ref.ADAPTER_BASE_HASH_VERSION`): a hash of
another scheme than this code's cannot be compared, and is refused saying so rather than as another
model (an adapter without the entry, written before it was recorded, is read as of this code's scheme).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedagent_flwr.checkpoint.content_hash import CONTENT_HASH_VERSION, hash_checkpoint_dir
from fedagent_flwr.checkpoint.hf_files import tied_weight_keys
from fedagent_flwr.checkpoint.reader import CheckpointReader, check_out_buffer, check_rows
from fedagent_flwr.checkpoint.receipts import FileStat
from fedagent_flwr.checkpoint.ref import (
    ADAPTER_BASE_HASH_VERSION,
    ADAPTER_BASE_SHA256,
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CheckpointError,
    CheckpointRef,
)
from fedagent_flwr.checkpoint.safetensors_file import MODEL_DTYPES, SafetensorsFile

__all__ = ["LoraAdapterReader", "LoraPair", "adapter_files", "adapter_scale"]

#: peft's key prefix for a PeftModel's wrapped model (``base_model.model.<the model's own key>``)
PEFT_PREFIX = "base_model.model."
_FACTORS = (".lora_A.weight", ".lora_B.weight")
# adapter_config.json settings that change what the factors mean; this reader supports their defaults only.
# peft 0.21's LoRA variants: aLoRA (alora_invocation_tokens) applies the update only from an invocation
# token on and Arrow (arrow_config) routes between adapters, so neither adapter is a fixed W + s B A;
# KaSA truncates the base weight, BD-LoRA's and QALoRA's factors mean another product, MonteCLoRA samples.
_UNSUPPORTED: dict[str, Any] = {
    "fan_in_fan_out": False, "use_dora": False, "bias": "none", "lora_bias": False, "modules_to_save": None,
    "rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None, "target_parameters": None,
    "trainable_token_indices": None, "alora_invocation_tokens": None, "arrow_config": None, "kasa_config": None,
    "use_bdlora": None, "use_qalora": False, "monteclora_config": None,
}
# init_lora_weights values that leave the base weight as it is (peft 0.21, tuners/lora/layer.py
# update_layer): True (Kaiming A, zero B), False (both random), "gaussian", "eva" (zero B, A set from
# activations later), "orthogonal" (B A = 0 by construction) and "mica" (zero A). The others rewrite the
# base weight in place when the adapter is made: pissa*, corda and olora subtract s B0 A0 from it, loftq
# quantises it, lora_ga subtracts its gradient-based start; the client's model is then
# W - s B0 A0 + s B A, not the W + s B A the server reads.
_SAFE_INITS: tuple[object, ...] = (True, False, "gaussian", "eva", "orthogonal", "mica")


def adapter_files(directory: Path) -> list[Path]:
    """The adapter's weight and settings files (CheckpointError naming the one that is missing)."""
    files = [directory / ADAPTER_WEIGHTS, directory / ADAPTER_CONFIG]
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{directory} holds no {path.name}: not a peft LoRA adapter")
    return files


def adapter_scale(settings: dict[str, Any], path: Path) -> float:
    """peft's scaling ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``) of an
    ``adapter_config.json`` (read from ``path``); CheckpointError for a setting this reader cannot honour."""
    if str(settings.get("peft_type", "")).upper() != "LORA":
        raise CheckpointError(f"{path}: peft_type is {settings.get('peft_type')!r}, not 'LORA'")
    rank, alpha = settings.get("r"), settings.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise CheckpointError(f"{path}: 'r' = {rank!r} is not a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise CheckpointError(f"{path}: 'lora_alpha' = {alpha!r} is not a positive number")
    init = settings.get("init_lora_weights", True)
    if not any(init is safe if isinstance(safe, bool) else init == safe for safe in _SAFE_INITS):
        raise CheckpointError(f"{path}: 'init_lora_weights' = {init!r} is not supported (only {list(_SAFE_INITS)}): "
                              "that initialisation rewrites the base weight when the adapter is made, so the "
                              "client's model is not W + (lora_alpha / r) B @ A over the global model W")
    for name, default in _UNSUPPORTED.items():
        value = settings.get(name)
        if not (value is None or value == default or (not value and not default)):  # [] for None, {} ...
            raise CheckpointError(f"{path}: '{name}' = {value!r} is not supported (only {default!r}): the "
                                  "server reads an adapter as W + (lora_alpha / r) B @ A on the targeted weights")
    return float(alpha) / (math.sqrt(rank) if settings.get("use_rslora") else rank)


@dataclass(frozen=True)
class LoraPair:
    """One targeted weight: the global model's key and the adapter file's keys of its two factors."""

    target: str  # "model.layers.0.self_attn.q_proj.weight"
    a_key: str  # "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    b_key: str


class LoraAdapterReader(CheckpointReader):
    """A peft LoRA adapter read as ``base`` plus its low-rank updates (see the module docstring).

    ``base`` (a reader of the global model the client started from, owned and closed by this reader)
    provides the keys, shapes and every untargeted tensor; ``base_ref`` is its reference, kept so
    the adapter can be opened again (:func:`.open_ref.open_checkpoint`'s ``base``) and recorded with
    the aggregate's sources. Every adapter key must pair
    with its partner factor and with a 2-d weight of the base of matching shape, which no other pair
    updates and which the base does not tie to another key, else CheckpointError naming the file and
    key; and the adapter must record the base's content hash as the model it was trained on.
    """

    def __init__(self, ref: CheckpointRef, directory: Path, base: CheckpointReader, base_ref: CheckpointRef) -> None:
        super().__init__(ref, directory)
        self.base = base
        self.base_ref = base_ref
        self._file = directory / ADAPTER_WEIGHTS
        config_path = directory / ADAPTER_CONFIG
        try:
            settings = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{config_path} is not readable JSON ({exc})") from None
        if not isinstance(settings, dict):
            raise CheckpointError(f"{config_path} does not hold a JSON object")
        self.scale = adapter_scale(settings, config_path)
        self.rank = int(settings["r"])
        self._handle = SafetensorsFile(self._file)
        try:
            self._pairs = self._pair_keys()
            self._check_base_hash(base_ref)
        except BaseException:
            self.close_adapter()
            raise
        self._base_keys = set(base.keys())

    def _check_base_hash(self, base_ref: CheckpointRef) -> None:
        """CheckpointError unless the adapter records the content hash of the base it is opened on (the
        module docstring): the base reference's hash (which opening with a hash check has found the base's
        files to have: :func:`.open_ref.open_checkpoint`), or the base directory's when it carries none."""
        metadata = self._handle.metadata()
        recorded = metadata.get(ADAPTER_BASE_SHA256)
        if not recorded:
            raise CheckpointError(f"{self._file} records no content hash of the model it was trained on (safetensors "
                                  f"metadata '{ADAPTER_BASE_SHA256}'): an adapter is read only on that model")
        scheme = metadata.get(ADAPTER_BASE_HASH_VERSION, CONTENT_HASH_VERSION)
        if scheme != CONTENT_HASH_VERSION:
            raise CheckpointError(f"{self._file} records the content hash of the model it was trained on as computed "
                                  f"by content hash {scheme}, and this fedagent-flwr computes {CONTENT_HASH_VERSION}: "
                                  "the two cannot be compared, so it is not read on any model (read it with the "
                                  "fedagent-flwr that wrote it)")
        actual = base_ref.sha256 or hash_checkpoint_dir(self.base.directory)
        if recorded != actual:
            raise CheckpointError(f"{self._file} was trained on the model with content hash {recorded}, and is read "
                                  f"on {self.base.directory}, whose content hash is {actual}: not the model it was "
                                  "trained on")

    def _pair_keys(self) -> dict[str, LoraPair]:
        """Map each targeted global key to its factors, checking names and shapes against the base."""
        shapes = {key: self._handle.shape(key) for key in self._handle.keys()}
        base_keys = set(self.base.keys())
        tied = tied_weight_keys(self.base.huggingface_dir())  # tied copy -> the key it is tied to
        partners = {**tied, **{kept: copy for copy, kept in tied.items()}}
        pairs: dict[str, LoraPair] = {}
        foreign = [key for key in shapes if not key.endswith(_FACTORS)]
        if foreign:
            raise CheckpointError(f"{self._file}: '{foreign[0]}' is not a LoRA factor (…lora_A.weight or "
                                  "…lora_B.weight); only LoRA factors can be read as an update of the global model")
        odd = [key for key in shapes if not (self._handle.dtype(key).is_floating_point
                                             and self._handle.dtype(key) in MODEL_DTYPES)]
        if odd:
            raise CheckpointError(f"{self._file}: factor '{odd[0]}' has dtype {self._handle.dtype(odd[0])}; a LoRA "
                                  "factor must be float64, float32, float16 or bfloat16")
        for key in shapes:
            factor = _FACTORS[0] if key.endswith(_FACTORS[0]) else _FACTORS[1]
            module = key[: -len(factor)]
            a_key, b_key = module + _FACTORS[0], module + _FACTORS[1]
            partner = b_key if factor == _FACTORS[0] else a_key
            if partner not in shapes:
                raise CheckpointError(f"{self._file}: '{key}' has no partner '{partner}' (an adapter holds both "
                                      "factors)")
            target = module.removeprefix(PEFT_PREFIX) + ".weight"
            if target in pairs:
                if pairs[target] != LoraPair(target, a_key, b_key):  # with and without peft's prefix, say
                    raise CheckpointError(f"{self._file}: '{key}' and '{pairs[target].a_key}' both update "
                                          f"'{target}': one pair of factors per weight")
                continue  # the partner of a pair already taken
            if target not in base_keys:
                raise CheckpointError(f"{self._file}: '{key}' updates '{target}', which the global model "
                                      f"{self.base.directory} does not hold (a tied or untargetable weight?)")
            if target in partners:  # the model re-ties them on load: an update of one alone is lost or spread
                raise CheckpointError(f"{self._file}: '{key}' updates '{target}', which the global model "
                                      f"{self.base.directory} ties to '{partners[target]}': an adapter of a tied "
                                      "weight is not supported")
            weight = self.base.shape(target)
            if len(weight) != 2:
                raise CheckpointError(f"{self._file}: '{key}' updates '{target}' {weight} of the global model, "
                                      "which is not a 2-d weight")
            want_a, want_b = (self.rank, weight[-1]), (weight[0], self.rank)
            if shapes[a_key] != want_a or shapes[b_key] != want_b:
                raise CheckpointError(
                    f"{self._file}: '{a_key}' {shapes[a_key]} and '{b_key}' {shapes[b_key]} do not fit "
                    f"'{target}' {weight} of the global model at rank {self.rank} (expected {want_a} and {want_b})")
            pairs[target] = LoraPair(target, a_key, b_key)
        if not pairs:
            raise CheckpointError(f"{self._file} holds no LoRA factors")
        return pairs

    @property
    def targets(self) -> list[str]:
        """The global model's keys this adapter updates, in the adapter file's order."""
        return list(self._pairs)

    def keys(self) -> list[str]:
        return self.base.keys()

    def _key_set(self) -> set[str]:
        return self._base_keys

    def shape(self, key: str) -> tuple[int, ...]:
        return self.base.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        """fp32 for a targeted weight (the sum is computed in fp32), the base's dtype otherwise."""
        return torch.float32 if key in self._pairs else self.base.dtype(key)

    def read_into(self, key: str, out: torch.Tensor) -> None:
        pair = self._pairs.get(key)
        before = self.base.bytes_read
        try:
            if pair is None:
                self.base.read_into(key, out)
                return
            self._require(key)
            check_out_buffer(self, key, self.base.shape(key), out)
            target = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
            self.base.read_into(key, target)
            target.addmm_(self._factor(pair.b_key), self._factor(pair.a_key), alpha=self.scale)
            if target is not out:
                out.copy_(target)
        finally:
            self.bytes_read += self.base.bytes_read - before

    def read_rows(self, key: str, start: int, stop: int, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Rows ``start:stop`` of ``key``: the base's rows plus those rows of the update."""
        pair = self._pairs.get(key)
        before = self.base.bytes_read
        try:
            if pair is None:
                return self.base.read_rows(key, start, stop, dtype)
            check_rows(self, key, self.base.shape(key), start, stop)
            rows = self.base.read_rows(key, start, stop, torch.float32)
            rows.addmm_(self._factor(pair.b_key, (start, stop)), self._factor(pair.a_key), alpha=self.scale)
            return rows if dtype in (None, torch.float32) else rows.to(dtype)
        finally:
            self.bytes_read += self.base.bytes_read - before

    def _factor(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One factor of the adapter file (only ``rows`` of it where given: B's rows are the update's),
        as fp32."""
        tensor = self._handle.get_tensor(key) if rows is None else self._handle.read_rows(key, *rows)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor.to(torch.float32)

    def huggingface_dir(self) -> Path | None:
        """The global model's: an adapter carries no model config of its own."""
        return self.base.huggingface_dir()

    def verify_content(self) -> None:
        """The adapter's files were checked at opening (hashed, or a store's receipt trusted): their stat is
        checked again (:meth:`~.reader.CheckpointReader.check_unchanged`); then the base's check, if it has
        one."""
        super().verify_content()
        self.base.verify_content()

    def describe(self) -> str:
        return f"LoRA adapter {self.directory} (over {self.base.directory})"

    def _held_stat(self, name: str) -> FileStat | str | None:
        """The adapter weights' stat through the descriptor they are read from (None for its config)."""
        return self._handle.held_stat() if name == ADAPTER_WEIGHTS else None

    def close_adapter(self) -> None:
        """Close the adapter file only (the base stays open)."""
        handle = getattr(self, "_handle", None)  # absent when the opening failed before it
        if handle is not None:
            handle.close()  # kept: a read now fails naming the closed file; its stat stays readable

    def close(self) -> None:
        self.close_adapter()
        self.base.close()
