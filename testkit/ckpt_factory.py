"""Real checkpoints for the checkpoint tests (no mocks).

FSDP checkpoints are written the way verl writes them: worker processes join a gloo process
group on CPU, build a tiny seeded ``transformers`` model, ``fully_shard`` it (FSDP2) and each rank
saves ``model.state_dict()`` (DTensors) to ``model_world_size_W_rank_R.pt``; rank 0 adds
``fsdp_config.json`` and ``huggingface/`` (config, generation config, a real tokenizer). The full
unsharded state dict is saved next to each checkpoint as ``<name>.expected.pt`` (outside the
checkpoint directory, so it is not hashed or read by the code under test).

Everything is built once per test session (see :func:`build_suite`) by one ``spawn`` launch of
two processes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

TINY_CONFIG: dict[str, Any] = {
    # Odd sizes on purpose: with 2 ranks vocab 257 and intermediate 99 give uneven blocks.
    "vocab_size": 257,
    "hidden_size": 64,
    "intermediate_size": 99,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


@dataclass(frozen=True)
class ModelSpec:
    """One tiny model: architecture, seed, tied embeddings, size tweaks."""

    name: str
    arch: str  # "qwen2" | "llama"
    seed: int
    tie: bool = False
    overrides: tuple[tuple[str, Any], ...] = ()


W1_SPECS = (
    ModelSpec("qwen_a", "qwen2", seed=1),
    ModelSpec("llama_tied_a", "llama", seed=11, tie=True),
)
W1_PLAIN_SPEC = ModelSpec("qwen_plain", "qwen2", seed=4)  # unsharded: plain tensors, world size 1
W2_SPECS = (
    ModelSpec("qwen_b", "qwen2", seed=2),
    ModelSpec("qwen_c", "qwen2", seed=3),
    ModelSpec("llama_tied_b", "llama", seed=12, tie=True),
)


def make_config(spec: ModelSpec) -> Any:
    """The transformers config of a spec."""
    from transformers import LlamaConfig, Qwen2Config

    values = dict(TINY_CONFIG, tie_word_embeddings=spec.tie, **dict(spec.overrides))
    cls = Qwen2Config if spec.arch == "qwen2" else LlamaConfig
    return cls(**values)


def make_model(spec: ModelSpec, dtype: torch.dtype = torch.float32) -> Any:
    """A seeded tiny causal LM (identical on every rank for the same spec)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(make_config(spec))
    # Random init leaves norms at 1.0; perturb every tensor so averages are informative.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.to(dtype)


def save_tokenizer(directory: Path) -> None:
    """A small but real fast tokenizer (word level), so tokenizer copying can be checked."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, "</s>": 2}
    for word in ("go", "north", "south", "take", "key", "open", "door", "look"):
        vocab[word] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>"
    )
    tokenizer.save_pretrained(str(directory))


def save_hf_extras(model: Any, directory: Path) -> None:
    """config.json, generation_config.json and tokenizer files, as verl's rank 0 writes them."""
    from transformers import GenerationConfig

    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(directory))
    GenerationConfig(max_new_tokens=8, do_sample=False).save_pretrained(str(directory))
    save_tokenizer(directory)


# ---------------------------------------------------------------------------------------------
# FSDP workers (run in spawned processes)


def _save_fsdp(spec: ModelSpec, root: Path, rank: int, world_size: int, mesh: Any, dtensor: bool = True) -> None:
    """Write one checkpoint the way verl's FSDP checkpoint manager lays it out."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = make_model(spec)
    ckpt = root / spec.name
    if rank == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(expected, root / f"{spec.name}.expected.pt")
        save_hf_extras(model, ckpt / "huggingface")
        (ckpt / "fsdp_config.json").write_text(
            json.dumps({"FSDP_version": 2, "world_size": world_size})
        )
    if dtensor:
        # Same wrapping as verl: every decoder layer, then the root module.
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if world_size > 1:
        dist.barrier()
    torch.save(model.state_dict(), ckpt / f"model_world_size_{world_size}_rank_{rank}.pt")


def _fsdp_worker(rank: int, init_file: str, out_root: str) -> None:
    """Rank ``rank`` of a 2-process gloo group: writes every FSDP checkpoint of the suite.

    World-size-1 checkpoints are sharded over a one-rank mesh on rank 0 (what verl does with a
    single GPU), so one launch of two processes covers both world sizes.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        root = Path(out_root)
        solo = dist.new_group([0])  # every rank must take part in creating a group
        if rank == 0:
            solo_mesh = DeviceMesh.from_group(solo, "cpu")
            for spec in W1_SPECS:
                _save_fsdp(spec, root, 0, 1, solo_mesh)
            _save_fsdp(W1_PLAIN_SPEC, root, 0, 1, None, dtensor=False)
        mesh = init_device_mesh("cpu", (2,))
        for spec in W2_SPECS:
            _save_fsdp(spec, root, rank, 2, mesh)
        _write_edge_cases(rank, 2, root)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _save_rank(
    root: Path, name: str, expected: dict[str, torch.Tensor], state: dict[str, Any], rank: int, world_size: int
) -> None:
    import torch.distributed as dist

    directory = root / name
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(expected, root / f"{name}.expected.pt")
    dist.barrier()
    torch.save(state, directory / f"model_world_size_{world_size}_rank_{rank}.pt")


def _write_edge_cases(rank: int, world_size: int, root: Path) -> None:
    """Layouts beyond plain FSDP2: empty blocks, Shard(1), Replicate, HSDP, ShardedTensor."""
    import torch.distributed as dist
    import torch.distributed._shard.sharded_tensor as sharded_tensor
    from torch import nn
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(5)
    module = nn.Module()
    module.tiny = nn.Parameter(torch.randn(1, 3))  # rank 1 holds an empty block
    module.odd = nn.Parameter(torch.randn(5, 2))  # blocks of 3 and 2 rows
    module.register_buffer("steps", torch.arange(4, dtype=torch.int64))
    columns, replicated = torch.randn(3, 5), torch.randn(4)
    expected = {k: v.detach().clone() for k, v in module.state_dict().items()}
    expected.update(columns=columns, replicated=replicated)
    fully_shard(module)
    mesh = init_device_mesh("cpu", (world_size,))
    state = dict(module.state_dict())
    state["columns"] = distribute_tensor(columns, mesh, [Shard(1)])  # blocks of 3 and 2 columns
    state["replicated"] = distribute_tensor(replicated, mesh, [Replicate()])
    _save_rank(root, "odd_shapes", expected, state, rank, world_size)

    # HSDP meshes ("ddp", "fsdp"): Replicate on the first dimension, Shard(0) on the second.
    for mesh_shape in ((2, 1), (1, 2)):
        hsdp = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("ddp", "fsdp"))
        torch.manual_seed(7)
        linear = nn.Linear(5, 3)
        expected = {k: v.detach().clone() for k, v in linear.state_dict().items()}
        fully_shard(linear, mesh=hsdp)
        name = f"hsdp_{mesh_shape[0]}x{mesh_shape[1]}"
        _save_rank(root, name, expected, linear.state_dict(), rank, world_size)

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world_size)])
    torch.manual_seed(100 + rank)  # different data per rank, as real shards would be
    st = sharded_tensor.rand(spec, 7, 3)
    full = torch.empty(7, 3) if rank == 0 else None
    st.gather(dst=0, out=full)
    st_dir = root / "sharded_tensor"
    if rank == 0:
        st_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"weight": full}, root / "sharded_tensor.expected.pt")
    dist.barrier()
    torch.save({"weight": st}, st_dir / f"model_world_size_{world_size}_rank_{rank}.pt")


def write_fsdp_checkpoints(out_root: Path) -> None:
    """Launch the two gloo workers (spawn) and wait for them."""
    import torch.multiprocessing as mp

    out_root.mkdir(parents=True, exist_ok=True)
    init_file = out_root / ".gloo_init"
    init_file.unlink(missing_ok=True)
    mp.start_processes(
        _fsdp_worker, args=(str(init_file), str(out_root)), nprocs=2, join=True, start_method="spawn"
    )
    init_file.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# HF safetensors sources


def write_hf_checkpoint(
    spec: ModelSpec, directory: Path, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None
) -> dict[str, torch.Tensor]:
    """``save_pretrained`` a tiny model (optionally in several files); return its state dict."""
    model = make_model(spec, dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    save_hf_extras(model, directory)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# Session suite


@dataclass
class Suite:
    """Paths of the checkpoints built for a test session."""

    root: Path

    def ckpt(self, name: str) -> Path:
        return self.root / name

    def expected(self, name: str) -> dict[str, torch.Tensor]:
        return torch.load(self.root / f"{name}.expected.pt", weights_only=True)

    def copy(self, name: str, target: Path) -> Path:
        """A private copy to damage in a test."""
        destination = target / name
        shutil.copytree(self.root / name, destination)
        return destination


_SUITE: Suite | None = None


def build_suite(tmp_path_factory: pytest.TempPathFactory) -> Suite:
    """Build (once per process) every FSDP checkpoint the tests use (the ``suite`` fixture of
    ``tests/conftest.py``)."""
    global _SUITE
    if _SUITE is None:
        root = tmp_path_factory.mktemp("fsdp_checkpoints")
        write_fsdp_checkpoints(root)
        _SUITE = Suite(root)
    return _SUITE


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64 (0 for empty tensors)."""
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


def same_size_impostor(original: Path, target: Path) -> None:
    """Write at ``target`` (same file name) a valid plain rank file of other values and exactly
    ``original``'s size: another file that no size check can tell apart."""
    state = torch.load(original, weights_only=True)  # the saved OrderedDict, its metadata included
    for value in state.values():
        if value.is_floating_point():
            value.add_(1)
    torch.save(state, target)
    assert target.stat().st_size == original.stat().st_size
    assert target.read_bytes() != original.read_bytes()
