"""ShardedTensor without a process group, for reading old FSDP1 rank files (:mod:`.shard_file`).

ShardedTensor.__setstate__ insists on an initialised process group with the saving rank's
rank and world size, which a server never has. The weights-only unpickler lets a pickled name
be mapped to another class, so the ShardedTensor machinery is mapped to inert records that
just keep their state. Nothing else becomes loadable: only these names are added
(:data:`SHARDED_TENSOR_GLOBALS`, for ``torch.serialization.safe_globals``).
"""

from __future__ import annotations

from typing import Any

import torch

from fedagent_flwr.checkpoint.ref import CheckpointError


class _Record:
    """Keeps whatever state the pickle gives it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (dict state, slot state) with no dict part
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


class _ProcessGroupState(_Record):
    pass


class ShardedTensorStub(torch.Tensor):
    """Stands in for ShardedTensor; ``st_state`` = (local_shards, metadata, pg, spec, rrefs)."""

    ProcessGroupState = _ProcessGroupState
    st_state: tuple[Any, ...] = ()

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub is narrower than its dispatch protocol
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise CheckpointError("a ShardedTensor placeholder cannot be used as a tensor")

    def __setstate__(self, state: Any) -> None:
        self.st_state = tuple(state)


def _restricted_getattr(obj: Any, name: str) -> Any:
    # ShardedTensor pickles its nested ProcessGroupState class as getattr(ShardedTensor, ...);
    # that is the only attribute lookup a rank file may perform.
    if obj is ShardedTensorStub and name == "ProcessGroupState":
        return _ProcessGroupState
    raise CheckpointError(f"rank file asks for attribute {name!r} of {obj!r}")


def _identity(value: Any) -> Any:
    return value


def _record_type(name: str) -> type:
    return type(name, (_Record,), {})


_ST = "torch.distributed._shard."
SHARDED_TENSOR_GLOBALS: list[Any] = [
    (ShardedTensorStub, _ST + "sharded_tensor.api.ShardedTensor"),
    (_ProcessGroupState, _ST + "sharded_tensor.api.ShardedTensor.ProcessGroupState"),
    (_record_type("Shard"), _ST + "sharded_tensor.shard.Shard"),
    (_record_type("ShardMetadata"), _ST + "metadata.ShardMetadata"),
    (_record_type("ShardedTensorMetadata"), _ST + "sharded_tensor.metadata.ShardedTensorMetadata"),
    (_record_type("TensorProperties"), _ST + "sharded_tensor.metadata.TensorProperties"),
    (_identity, _ST + "sharded_tensor.metadata.MEM_FORMAT_ENCODING"),
    (_record_type("ChunkShardingSpec"), _ST + "sharding_spec.chunk_sharding_spec.ChunkShardingSpec"),
    (_record_type("EnumerableShardingSpec"), _ST + "sharding_spec.api.EnumerableShardingSpec"),
    (_record_type("RemoteDevice"), "torch.distributed.remote_device._remote_device"),
    (_restricted_getattr, "builtins.getattr"),
    (_restricted_getattr, "__builtin__.getattr"),
]
