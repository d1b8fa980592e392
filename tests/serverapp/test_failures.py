"""How a run ends when its clients fail: one reason for a GPU-memory shortage in any wording, a stop
after ``max_empty_rounds`` empty rounds in a row, and ``failed`` (not ``degraded``) for a run none of
whose rounds aggregated anything. The reasons are the real ones of two matrices that shared an H200
(four verl sessions, each asking vLLM for 30 % of the GPU at start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedagent_flwr.serverapp.failures import (
    GPU_MEMORY_HINT,
    HOST_MEMORY_HINT,
    OUT_OF_GPU_MEMORY,
    OUT_OF_HOST_MEMORY,
    EmptyRoundsError,
    RoundFailedError,
    is_gpu_memory_shortage,
    reason_key,
    round_reasons,
    stop_after_empty_rounds,
    stop_if_all_failed_alike,
)
from fedagent_flwr.serverapp.recorder import RunRecorder

SESSION = ("verl trainer failed: the persistent verl session could not start (starting verl's TaskRunner and "
           "workers (init_workers)): ")
# Our runner's wording of torch's out-of-memory error, when the session could not start.
RAN_OUT = ("client 0 round 2: " + SESSION + "ran out of GPU memory (CUDA out of memory) (OutOfMemoryError: CUDA "
           "out of memory. Tried to allocate 14.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which 14.31 MiB "
           "is free. Process 3162 has 30.15 GiB memory in use. Process 3163 has 105.39 GiB memory in use. Process "
           "9665 has 2.30 GiB memory in use. Including non-PyTorch memory, this pro) (log: the trainer server's log) "
           "(log: /tmp/outWS/runs/federated-s1/round_2/client_0/train.log)")
# torch's own words, from an evaluation job.
TORCH_OOM = ("client 1 eval round 2: verl trainer failed: OutOfMemoryError: CUDA out of memory. Tried to allocate "
             "20.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which 22.38 MiB is free. Process 3162 has 30.15 "
             "GiB memory in use. Process 3163 has 105.39 GiB memory in use.")
# vLLM's check at engine start, as the session now surfaces it from the server's log.
VLLM_FREE = ("client 1 round 2: " + SESSION + "ran out of GPU memory: vLLM could not start (Free memory on device "
             "cuda:0 (1.54/139.8 GiB) on startup is less than desired GPU memory utilization (0.3, 41.94 GiB)); run "
             "fewer sessions on the GPU at once or lower trainer.gpu_memory_utilization (RuntimeError: Engine core "
             "initialization failed. See root cause above. Failed core proc(s): {}) (log: the trainer server's log) "
             "(log: /tmp/outWS/runs/federated-s1/round_2/client_1/train.log)")
VLLM_RAW = ("ValueError: Free memory on device cuda:0 (1.54/139.8 GiB) on startup is less than desired GPU memory "
            "utilization (0.3, 41.94 GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
            "processes.")
# What the same client said before: vLLM's engine failure without its root cause.
ENGINE = ("client 1 round 2: " + SESSION + "RuntimeError: Engine core initialization failed. See root cause above. "
          "Failed core proc(s): {} (log: the trainer server's log) "
          "(log: /tmp/outWS/runs/federated-s1/round_2/client_1/train.log)")
NO_SUCH_ENV = "client 0 round 1: reference trainer exited with code 2: UnknownEnvError: unknown environment 'NoSuchEnv'"
# Ray killing a worker because the host's memory ran low: not the GPU's.
RAY_HOST_OOM = ("client 1 round 2: ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on "
                "memory. Memory on the node was 120.50GB / 126.00GB (0.956), which exceeds the memory usage threshold")
# What a GPU batch's client reported (2026-12-03, batch 12, shortened): Ray's memory monitor killing
# Flower's simulation actors, in words without the ``ray.exceptions.`` prefix.
RAY_NODE_OOM = ("OutOfMemoryError: 2 worker(s) were killed due to the node running low on memory. Memory on the "
                "node (IP: 192.0.2.2, ID: ca059e68) was 120.78GB used / 125.85GB limit (0.959746) OOM kill "
                "reason: Memory usage 128427753472B exceeded threshold of 128372506624B (95.0% of 135128952832B "
                "limit) Ray killed 2 worker(s) based on the killing policy")
# vLLM sizing its KV cache next to another process on the GPU.
VLLM_KV = ("client 0 round 2: verl trainer failed: ValueError: No available memory for the cache blocks. Try "
           "increasing `gpu_memory_utilization` when initializing the engine.")


def test_a_gpu_memory_shortage_is_one_reason_in_every_wording() -> None:
    assert {reason_key(r) for r in (RAN_OUT, TORCH_OOM, VLLM_FREE, VLLM_RAW, VLLM_KV)} == {OUT_OF_GPU_MEMORY}
    assert reason_key(RAY_HOST_OOM) != OUT_OF_GPU_MEMORY  # the host's memory: another cause, another fix
    # an engine failure that does not say why is not taken for a memory shortage, nor is another error
    assert reason_key(ENGINE) != OUT_OF_GPU_MEMORY and reason_key(NO_SUCH_ENV) != OUT_OF_GPU_MEMORY


def test_the_machines_memory_running_low_is_not_taken_for_the_gpus() -> None:
    from fedagent_flwr.trainers.verl.runner import known_cause

    assert reason_key(RAY_NODE_OOM) == reason_key(RAY_HOST_OOM) == OUT_OF_HOST_MEMORY
    assert not is_gpu_memory_shortage(RAY_NODE_OOM) and is_gpu_memory_shortage(TORCH_OOM)
    with pytest.raises(RoundFailedError) as stopped:
        stop_if_all_failed_alike("round 8", [0], {0: RAY_NODE_OOM})
    message = str(stopped.value)
    assert message.startswith("round 8: every client (1) was stopped because the machine ran low on memory, ")
    assert HOST_MEMORY_HINT in message and GPU_MEMORY_HINT not in message and "GPU memory" not in message
    # the trainer's own phrasing of the same log says the machine, and the server keeps it apart
    cause = known_cause(RAY_NODE_OOM)
    assert cause is not None and "RAM, not the GPU" in cause and "GPU memory" not in cause
    assert reason_key(f"client 0 round 8: {cause}") == OUT_OF_HOST_MEMORY
    assert known_cause(TORCH_OOM) == "ran out of GPU memory (CUDA out of memory)"
    # Ray's other wordings of the same kill: the raylet's summary and a worker's exit type
    for text in ("(raylet) 2 Workers (tasks / actors) killed due to memory pressure (OOM), 0 Workers crashed",
                 "ActorDiedError: The actor died unexpectedly. Worker exit type: NODE_OUT_OF_MEMORY"):
        assert reason_key(text) == OUT_OF_HOST_MEMORY and "RAM, not the GPU" in (known_cause(text) or "")
    assert HOST_MEMORY_HINT in round_reasons({"rejected": {"0": RAY_NODE_OOM}})
    assert GPU_MEMORY_HINT not in round_reasons({"rejected": {"0": RAY_NODE_OOM}})


def test_clients_short_of_gpu_memory_in_different_words_stop_the_run_at_once_saying_what_to_do() -> None:
    with pytest.raises(RoundFailedError) as stopped:
        stop_if_all_failed_alike("round 2", [0, 1], {0: RAN_OUT, 1: VLLM_FREE})
    message = str(stopped.value)
    assert message.startswith("round 2: every client (2) ran out of GPU memory, so the run stops; ")
    assert GPU_MEMORY_HINT in message and "trainer.gpu_memory_utilization" in message and RAN_OUT in message
    # one out of memory and one whose engine failed for an unknown reason: not alike, the run goes on
    stop_if_all_failed_alike("round 2", [0, 1], {0: RAN_OUT, 1: ENGINE})


def _round(server_round: int, aggregated: str | None, rejected: dict[int, str]) -> dict:
    return {"round": server_round, "aggregated_actor": aggregated, "rejected": {str(c): r for c, r in rejected.items()}}


def test_empty_rounds_in_a_row_stop_the_run_after_max_empty_rounds() -> None:
    different = {0: RAN_OUT, 1: NO_SUCH_ENV}
    rounds = [_round(1, None, different)]
    stop_after_empty_rounds(rounds, 2)  # one empty round: not yet
    rounds.append(_round(2, "/g2", {}))
    rounds.append(_round(3, None, different))
    stop_after_empty_rounds(rounds, 2)  # rounds 1 and 3 are empty, but not in a row
    rounds.append(_round(4, None, different))
    with pytest.raises(EmptyRoundsError) as stopped:
        stop_after_empty_rounds(rounds, 2)
    message = str(stopped.value)
    assert message.startswith("round(s) [3, 4] aggregated no client update, 2 in a row (max_empty_rounds=2), so the "
                              "run stops instead of training nothing; round 4: client 0: " + RAN_OUT)
    assert NO_SUCH_ENV in message and GPU_MEMORY_HINT in message
    stop_after_empty_rounds(rounds, 3)
    stop_after_empty_rounds(rounds, 0)  # 0: never


def _recorded(run_dir: Path, aggregated: list[str | None]) -> RunRecorder:
    recorder = RunRecorder(run_dir, {"run_id": 1, "base_model": "/m"})
    for server_round, actor in enumerate(aggregated, start=1):
        recorder.record_round(server_round=server_round, clients=[0, 1], started_from="/m",
                              client_actors={0: "/c0", 1: "/c1"} if actor else {},
                              aggregated=actor, rejected={} if actor else {0: RAN_OUT, 1: ENGINE}, client_metrics={})
    return recorder


def test_a_run_no_round_of_which_aggregated_anything_failed(tmp_path: Path) -> None:
    status, reason = _recorded(tmp_path / "none", [None, None, None, None]).outcome()
    assert status == "failed"
    assert reason.startswith("no round aggregated any client update (round(s) [1, 2, 3, 4]): the run trained "
                             "nothing and its final model is the one it started from "
                             f"(last round, 4: client 0: {RAN_OUT}; client 1: {ENGINE} ({GPU_MEMORY_HINT}))")
    # some empty rounds among rounds that trained: degraded, as before
    status, reason = _recorded(tmp_path / "some", [None, "/g2", None]).outcome()
    assert status == "degraded" and reason.startswith("round(s) [1, 3] aggregated no client checkpoint")
    assert _recorded(tmp_path / "all", ["/g1", "/g2"]).outcome() == ("completed", "")


def _partial(run_dir: Path, rounds: list[tuple[list[int], dict[int, str], dict[int, str]]]) -> RunRecorder:
    """A run whose every round aggregated something: (selected clients, their checkpoints, rejected)."""
    recorder = RunRecorder(run_dir, {"run_id": 1, "base_model": "/m"})
    for server_round, (clients, actors, rejected) in enumerate(rounds, start=1):
        recorder.record_round(server_round=server_round, clients=clients, started_from="/m", client_actors=actors,
                              aggregated=f"/g{server_round}", rejected=rejected, client_metrics={})
    return recorder


def test_a_round_that_lost_a_selected_client_makes_the_run_degraded(tmp_path: Path) -> None:
    """Batch 12's federated seed 4: client 1 was killed by the node's memory in round 9 and round 9
    aggregated client 0 alone; the run ended 'completed' (exit 0). It is now 'degraded' and says which
    rounds lost which clients, and why (the first such round)."""
    both, alone = {0: "/c0", 1: "/c1"}, {0: "/c0"}
    status, reason = _partial(tmp_path / "lost", [([0, 1], both, {}), ([0, 1], alone, {1: RAY_HOST_OOM}),
                                                   ([0, 1], both, {}), ([0, 1], alone, {1: "no reply within the "
                                                                                        "round timeout"})]).outcome()
    assert status == "degraded"
    assert reason == (
        "round(s) [2, 4] aggregated without client(s) [1] that they selected, so the final model was trained on "
        f"part of the federation (round 2: client 1: {RAY_HOST_OOM} ({HOST_MEMORY_HINT}))")
    # Clients the strategy did not select (fraction_train < 1) were never part of the round; an
    # error reply from a node no client is on (its own negative key) lost no selected client.
    status, reason = _partial(tmp_path / "sampled", [([1], {1: "/c1"}, {0: "not selected, yet recorded"}),
                                                     ([0], {0: "/c0"}, {-200: "error reply from unknown node"})]
                              ).outcome()
    assert (status, reason) == ("completed", "")
    # PPO: client 1's actor was averaged, its critic refused: the round lost a critic, not a client.
    status, reason = _partial(tmp_path / "critic", [([0, 1], both, {1: "critic checkpoint: bad shape"})]).outcome()
    assert (status, reason) == ("degraded", "round(s) [1] averaged the actors of client(s) [1] but not their critics "
                                            "(round 1: client 1: critic checkpoint: bad shape)")
    # An empty round and a partial one: both named, the empty one first.
    recorder = _recorded(tmp_path / "both", [None])
    recorder.record_round(server_round=2, clients=[0, 1], started_from="/m", client_actors={1: "/c1"},
                          aggregated="/g2", rejected={0: "no SuperNode serves this partition now"}, client_metrics={})
    status, reason = recorder.outcome()
    assert status == "degraded" and reason.startswith("round(s) [1] aggregated no client checkpoint")
    assert "; and round(s) [2] aggregated without client(s) [0] that they selected" in reason


def test_an_evaluation_that_lacks_a_client_makes_the_run_degraded(tmp_path: Path) -> None:
    """Each evaluating client plays its own slice of the validation episodes: a point that lost one
    is on other episodes than the rest of the curve, so the run says so in its status, not only in
    ``val_curve[].failed`` (before: 'completed'). An unknown node's failed reply lost no slice."""
    recorder = _recorded(tmp_path / "eval", ["/g1", "/g2"])
    recorder.record_eval(server_round=0, model="base", metrics={"success-rate": 0.1, "num-examples": 64})
    recorder.record_eval(server_round=1, model="/g1", metrics={"success-rate": 0.2, "num-examples": 64},
                         failed={-200: "error reply from unknown node 200: out of memory"})
    assert recorder.outcome() == ("completed", "")
    recorder.record_eval(server_round=2, model="/g2", metrics={"success-rate": 0.3, "num-examples": 32},
                         failed={1: RAY_HOST_OOM})
    status, reason = recorder.outcome()
    assert status == "degraded"
    assert reason == (
        "the evaluation of round(s) [2] lacks some clients' validation episodes, so those points are on other "
        f"episodes than the rest of the curve (round 2: client 1: {RAY_HOST_OOM} ({HOST_MEMORY_HINT}))")
