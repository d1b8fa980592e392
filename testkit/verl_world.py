"""One federated round of verl clients at FSDP world sizes 2 and 1, on CPU, in two gloo processes.

:func:`run` spawns two processes that go through the code a verl client and the server run, with
verl's own FSDP engine on CPU (:mod:`testkit.verl_cpu`):

1. **client 1 at world size 1** (the second process, a gloo group of its own): verl's
   ``ActorRolloutRefWorker`` (the persistent trainer's subclass) builds its actor from the job's
   composed verl config, takes one real optimiser step with the FedProx hook armed by the job's
   ``sitecustomize`` (a marker per rank), and verl's ``FSDPCheckpointManager`` saves
   ``model_world_size_1_rank_0.pt`` where a verl job leaves it;
2. **client 0 at world size 2** (both processes, one gloo group): the same with
   ``trainer.n_gpus_per_node=2``: ``model_world_size_2_rank_{0,1}.pt``, a marker from each rank;
3. **the server** (first process): ``FedAvgFSDP`` aggregates both replies and records the round,
   then ``python -m fedagent_flwr.checkpoint.verify``'s ``main`` audits the run;
4. **persistent reload on 2 ranks**: client 0's actor, still alive as in a persistent session,
   takes the round's global model through ``fedagent_reload`` (``FSDPEngine.initialize()``); each
   rank reports how far its own shard of every tensor is from the global model, then takes one
   more optimiser step so the FedProx hook reports itself again.

Each process writes ``rank<R>.json`` with what it saw; oracles of the clients' full weights
(gathered by torch's FULL_STATE_DICT, not by our reader) go to ``oracle/``. The test asserts.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import runpy
import time
from pathlib import Path
from typing import Any

import torch

CLIENT_EPISODES = {0: 3.0, 1: 5.0}  # the replies' num-examples: the aggregation weights
LR = 0.01  # large enough that a client's update is far above the 1e-6 audit tolerance
MU = 0.1  # FedProx
SEED = 7


def _phase_env(rank: int, world_size: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # verl's Worker reads them; the group is file-based


def _join(init_file: Path, rank: int, world_size: int) -> None:
    import torch.distributed as dist

    _phase_env(rank, world_size)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)


def _leave() -> None:
    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


_CONFIGS: dict[int, Any] = {}  # verl's composed config per world size (Hydra composition is slow)


def _config(root: Path, model_path: str, world_size: int) -> Any:
    """verl's config for a client at ``world_size``, composed from the job's own overrides (once:
    Hydra composition is slow, and every actor here starts from ``model_path``)."""
    from fedagent_flwr.trainers.verl.overrides import build_overrides, job_paths
    from fedagent_flwr.trainers.verl.persistent import compose_verl_config
    from fedagent_flwr.trainers.verl.settings import VerlSettings

    if world_size not in _CONFIGS:
        settings = VerlSettings(n_gpus_per_node=world_size, lr=LR)
        paths = job_paths(root / "job" / "verl", model_path, "", str(root / "ray"))
        overrides = build_overrides(algorithm="grpo", settings=settings, paths=paths, batch_size=2, local_steps=1,
                                    seed=SEED, experiment_name="ws2")
        _CONFIGS[world_size] = compose_verl_config(overrides)
    return copy.deepcopy(_CONFIGS[world_size])  # init_model edits its config


def _actor(root: Path, model_path: str, world_size: int) -> Any:
    """verl's actor worker (the persistent trainer's class, role ``actor``), built as verl builds it."""
    from fedagent_flwr.trainers.verl.persistent_workers import ReloadableActorRolloutRefWorker

    worker = ReloadableActorRolloutRefWorker(_config(root, model_path, world_size).actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


def _step(worker: Any, seed: int) -> float:
    """One real optimiser step of the actor engine on a seeded batch of this rank (next-token loss)."""
    engine = worker.actor.engine
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, engine.model_config.hf_config.vocab_size, (2, 12), generator=generator)
    engine.module.train()
    engine.optimizer_zero_grad()
    logits = engine.module(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))
    loss.backward()
    engine.optimizer_step()  # wrapped by the client-rule hook (FedProx) armed in this process
    return float(loss)


def _save(worker: Any, actor_dir: Path, oracle: Path) -> None:
    """verl's checkpoint manager writes the rank files; torch's FULL_STATE_DICT gathers the oracle."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    engine = worker.actor.engine
    engine.checkpoint_manager.save_checkpoint(local_path=str(actor_dir), hdfs_path=None, global_step=1,
                                              max_ckpt_to_keep=None)
    with FSDP.state_dict_type(engine.module, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
        full = engine.module.state_dict()
    if dist.get_rank() == 0:
        oracle.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().clone().float() for k, v in full.items()}, oracle)
    dist.barrier()


def _markers(marker_dir: Path, clear: bool) -> list[dict[str, Any]]:
    from fedagent_flwr.trainers.verl import engine_hooks

    found = engine_hooks.read_markers(str(marker_dir))
    if clear:
        for path in marker_dir.glob("actor-*.json"):
            path.unlink()
    return found


def _shard_errors(worker: Any, global_dir: Path) -> dict[str, Any]:
    """Max |this rank's shard - the global model's matching block| over every tensor."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    expected = load_file(str(global_dir / "model.safetensors"))
    engine = worker.actor.engine
    with FSDP.state_dict_type(engine.module, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
        state = engine.module.state_dict()
    worst, placements, missing = 0.0, set(), []
    for key, value in state.items():
        source = key if key in expected else "model.embed_tokens.weight" if key == "lm_head.weight" else None
        if source is None:
            missing.append(key)
            continue
        assert isinstance(value, DTensor), f"{key} is {type(value).__name__}, not a DTensor"
        placements.add(str(value.placements))
        (placement,) = value.placements
        assert isinstance(placement, Shard)
        block = torch.chunk(expected[source], world, dim=placement.dim)[rank]
        local = value.to_local()
        assert local.shape == block.shape, f"{key}: rank {rank} holds {tuple(local.shape)}, not {tuple(block.shape)}"
        worst = max(worst, float((local.double() - block.double()).abs().max()) if local.numel() else 0.0)
    return {"max_abs_error": worst, "keys": len(state), "missing": missing, "placements": sorted(placements)}


def _server(root: Path, base: Path, actor_dirs: dict[int, Path]) -> dict[str, Any]:
    """What the ServerApp does with the two replies: aggregate, record, then the audit command."""
    from flwr.app import Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedagent_flwr.checkpoint import CheckpointRef
    from fedagent_flwr.checkpoint.verify import main as verify
    from fedagent_flwr.protocol import TrainReply
    from fedagent_flwr.serverapp.recorder import RunRecorder
    from fedagent_flwr.serverapp.strategy import FedAvgFSDP
    from testkit.round_harness import connect, train_round

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    run_root = root / "run"
    initial = CheckpointRef.for_directory(base)
    recorder = RunRecorder(run_root, {"base_model": str(base), "env_kind": "test", "mode": "federated",
                                      "strategy": "fedavg"})
    strategy = FedAvgFSDP(run_root=str(run_root), initial_model=initial, num_clients=2, clients_per_round=2)
    connect(strategy, recorder, [0, 1])
    refs = {c: CheckpointRef.for_directory(d) for c, d in actor_dirs.items()}
    replies = []
    for client, ref in refs.items():
        instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="train")
        metrics = {"num-examples": CLIENT_EPISODES[client], "reward-mean": 0.5, "success-rate": 0.25}
        replies.append(Message(TrainReply(client_id=client, actor=ref, metrics=metrics).to_record(),
                               reply_to=instruction))
    started = time.monotonic()
    entry = train_round(strategy, 1, replies)
    aggregate_s = time.monotonic() - started
    started = time.monotonic()
    verify_rc = verify([str(run_root)])
    return {"entry": entry, "world_sizes": {c: r.world_size for c, r in refs.items()},
            "global": strategy.global_model.path, "verify_rc": verify_rc,
            "aggregate_s": round(aggregate_s, 2), "verify_s": round(time.monotonic() - started, 2)}


def rank_main(rank: int, root_text: str, base_text: str, job_env: dict[str, str]) -> None:
    """The program of process ``rank`` (0 or 1); see the module docstring for its steps."""
    started = time.monotonic()
    torch.set_num_threads(1)
    os.environ.update(job_env)
    # What a verl worker's interpreter does at start: the job's sitecustomize arms the hooks.
    from fedagent_flwr.trainers.verl.engine_hooks import SITE_DIR

    runpy.run_path(str(Path(SITE_DIR) / "sitecustomize.py"))
    from testkit import verl_cpu

    verl_cpu.install()
    root, base = Path(root_text), Path(base_text)
    marker_dir = Path(job_env["FEDAGENT_CLIENT_RULE_MARKERS"])
    slot = {c: root / "run" / "round_1" / f"client_{c}" / "checkpoints" / "global_step_1" / "actor" for c in (0, 1)}
    report: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "phase_s": {}}

    def lap(name: str) -> None:
        report["phase_s"][name] = round(time.monotonic() - started, 1)

    lap("imports")

    # 1. client 1 at world size 1, on the second process (a group of its own)
    if rank == 1:
        _join(root / "init_b", 0, 1)
        worker = _actor(root, str(base), 1)
        report["client1_loss"] = _step(worker, SEED + 10)
        _save(worker, slot[1], root / "oracle" / "client1.pt")
        report["client1_markers"] = _markers(marker_dir, clear=True)
        del worker
        _leave()
    else:  # meanwhile the first process prepares client 0's config and loads what the server needs
        _config(root, str(base), 2)
        import fedagent_flwr.serverapp.strategy  # noqa: F401
    lap("1 client 1")

    # 2. client 0 at world size 2; the actor stays alive, as a persistent session's does
    _join(root / "init_a", rank, 2)
    worker = _actor(root, str(base), 2)
    report["client0_loss"] = _step(worker, SEED + rank)
    _save(worker, slot[0], root / "oracle" / "client0.pt")
    report["client0_markers"] = _markers(marker_dir, clear=False)
    lap("2 client 0")

    # 3. the server aggregates the two clients and audits the round
    torch.distributed.barrier()  # both ranks have read the markers: the next round's are new
    if rank == 0:
        _markers(marker_dir, clear=True)  # the session clears them before each round (job.prepare_train)
        report["server"] = _server(root, base, slot)
    torch.distributed.barrier()
    lap("3 server")

    # 4. the round's global model into the live world-size-2 actor (the next round's start)
    global_dir = root / "run" / "round_1" / "global"  # where FedAvgFSDP writes round 1's model
    report["before_reload"] = _shard_errors(worker, global_dir)
    report["reload"] = worker.fedagent_reload(str(global_dir), SEED + 1)
    report["after_reload"] = _shard_errors(worker, global_dir)
    lap("4 reloaded")
    _step(worker, SEED + 20 + rank)
    torch.distributed.barrier()
    report["reload_markers"] = _markers(marker_dir, clear=False)
    del worker
    _leave()
    report["seconds"] = round(time.monotonic() - started, 1)
    report["cpu_s"] = round(time.process_time(), 1)
    (root / f"rank{rank}.json").write_text(json.dumps(report, indent=1, default=str))


# A hang guard, not a bound on speed: two ranks stuck in a collective are killed and fail the test
# here, instead of holding the suite until its own timeout.
HANG_GUARD_S = 600


def run(root: Path, base: Path, job_env: dict[str, str]) -> list[dict[str, Any]]:
    """Spawn the two processes and return their reports (rank order)."""
    return spawn_ranks(rank_main, (str(root), str(base), job_env), root)


def spawn_ranks(main: Any, args: tuple[Any, ...], root: Path) -> list[dict[str, Any]]:
    """Run ``main(rank, *args)`` in two spawned processes; return their ``root/rank<R>.json`` reports."""
    import torch.multiprocessing as mp

    root.mkdir(parents=True, exist_ok=True)
    ranks = mp.start_processes(main, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + HANG_GUARD_S
    while not ranks.join(timeout=5.0):  # raises if a rank failed
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            raise TimeoutError(f"the two ranks did not finish within {HANG_GUARD_S} s (a hung collective?)")
    return [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)]
