"""End to end: `flwr run` on a real SuperLink in simulation mode, clients training the tiny model
with the reference trainer, the server averaging their real checkpoints every round."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedagent_flwr.seeding import select_clients
from testkit.flower_harness import SuperLink
from testkit.run_end import expected_end, ran_every_round
from testkit.simulation_runs import check_round_mean, client_state, run_job
from testkit.tensorboard_events import read_scalars
from testkit.webshop_data import DATA_DIR as WEBSHOP_DATA

pytestmark = pytest.mark.slow

# The client checkpoints stay: the tests recompute each round's mean from them.
COMMON = ("num_rounds=2 eval.num_episodes=2 trainer.max_new_tokens=8 trainer.lr=1e-3 "
          "storage.keep_client_checkpoints=true")
# The node's one long-lived reference trainer instead of a fresh one per job (a 2 x 2 run starts
# ~10, each ~4.5 s of CPU importing torch and transformers), for the tests that are not about how
# the trainer is started: test_simulation_persistent checks that it gives the subprocess mode's
# checkpoints bit for bit. Here the crashing-client test, the TinyGuess partition test and the verl
# test, elsewhere the fail-fast tests whose clients fail, the http-store crash case and the
# deployment's http-store run keep subprocess mode covered.
# Tests that never read the base model's score skip the round-0 evaluation (eval.before_train=false):
# in subprocess mode it costs one trainer start (~4.5 s of CPU) per evaluating node.
PERSISTENT = "trainer.mode=persistent"


def _check_update_stats(run_dir: Path, entry: dict, aggregate_event: dict) -> None:
    """The round's update statistics equal an independent float64 recomputation from the files:
    client checkpoints minus the model the round started from."""
    stats = entry["update_stats"]
    assert aggregate_event["update_stats"] == stats  # metrics.jsonl carries the same record
    start = load_file(str(Path(entry["started_from"]) / "model.safetensors"))
    keys = sorted(load_file(str(Path(entry["aggregated_actor"]) / "model.safetensors")))
    deltas = {}
    for c in stats["clients"]:
        state = client_state(run_dir / f"round_{entry['round']}" / f"client_{c}")
        deltas[c] = torch.cat([(state[k].double() - start[k].double()).flatten() for k in keys])
    weights = stats["weights"]
    mean = sum(w * deltas[c] for w, c in zip(weights, stats["clients"]))
    for i, c in enumerate(stats["clients"]):
        assert stats["client_update_norm"][i] == pytest.approx(deltas[c].norm().item(), rel=1e-6)
        for j, other in enumerate(stats["clients"]):
            expected = float(deltas[c] @ deltas[other] / (deltas[c].norm() * deltas[other].norm()))
            assert stats["cosine"][i][j] == pytest.approx(expected, abs=1e-6)
    assert stats["mean_update_norm"] == pytest.approx(mean.norm().item(), rel=1e-5)
    assert stats["num_params"] == sum(start[k].numel() for k in keys)


def _service_health(run_dir: Path, env: str, rounds: int = 2) -> dict[int, list[dict]]:
    """Each client's service /health per round, checked to serve ``env`` and that client."""
    found: dict[int, list[dict]] = {}
    for client in (0, 1):
        for r in range(1, rounds + 1):
            (health,) = json.loads((run_dir / f"round_{r}" / f"client_{client}" / "service_health.json").read_text())
            assert health["env"] == env and health["partition"]["client_id"] == client
            found.setdefault(client, []).append(health)
    return found


def test_fedprox_three_clients_two_rounds(superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path) -> None:
    mu = 0.05
    summary, run_dir, output = run_job(
        superlink, tmp_path,
        f"model.path={tiny_model_dir} clients.total=3 clients.per_round=2 strategy=fedprox "
        f"strategy.proximal_mu={mu} tracking=[tensorboard,jsonl] {COMMON} {PERSISTENT}",
        supernodes=3,
    )
    assert ran_every_round(summary), output[-4000:]
    # tracking=[tensorboard]: the validation curve, read back from the event files
    scalars = read_scalars(run_dir / "tensorboard")
    assert scalars["val/success_rate"] == [(p["round"], pytest.approx(p["success_rate"])) for p in summary["val_curve"]]
    assert [step for step, _ in scalars["aggregate/norm_ratio"]] == [1, 2]
    assert summary["strategy"] == "fedprox" and summary["mode"] == "federated"
    assert [p["round"] for p in summary["val_curve"]] == [0, 1, 2]
    assert all(p["n"] == 2 for p in summary["val_curve"])  # eval.num_episodes, split over clients
    previous = str(Path(tiny_model_dir).resolve())
    for entry in summary["rounds"]:
        r = entry["round"]
        assert entry["clients"] == select_clients(r, 3, 2, 42)
        assert entry["client_actor_ids"] == entry["clients"] and not entry["rejected"]
        assert entry["started_from"] == previous
        episodes = {}
        for c in entry["clients"]:
            job = json.loads((run_dir / f"round_{r}" / f"client_{c}" / "train_job.json").read_text())
            result = json.loads((run_dir / f"round_{r}" / f"client_{c}" / "train_result.json").read_text())
            assert job["model_path"] == previous  # the client started from the last aggregate
            assert job["proximal_mu"] == mu and result["metrics"]["proximal_mu"] == mu
            assert job["data_seed"] == 42 + 100 * r + c
            episodes[c] = float(result["num_episodes"])
        assert check_round_mean(run_dir, entry, episodes) < 1e-6
        previous = entry["aggregated_actor"]
    assert summary["final_model"] == previous
    assert (run_dir / "learning_curve.png").stat().st_size > 1000
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {e["event"] for e in events} == {"train", "aggregate", "evaluate"}
    for entry in summary["rounds"]:
        (aggregate,) = [e for e in events if e["event"] == "aggregate" and e["round"] == entry["round"]]
        _check_update_stats(run_dir, entry, aggregate)
    trains = [e for e in events if e["event"] == "train"]
    assert all(0.0 <= e["metrics"]["zero-variance-group-share"] <= 1.0 for e in trains)
    assert all(len(p["success_ci95"]) == 2 and p["success_ci95"][0] <= p["success_rate"] <= p["success_ci95"][1]
               for p in summary["val_curve"])
    # The user-facing audit command agrees: every round's aggregate matches its recorded sources.
    audit = subprocess.run([sys.executable, "-m", "fedagent_flwr.checkpoint.verify", str(run_dir)],
                           capture_output=True, text=True)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert audit.stdout.count(" ok") == 2


def test_custom_strategy_by_dotted_path_and_a_crashing_client(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    summary, run_dir, output = run_job(
        superlink, tmp_path,
        f"model.path={tiny_model_dir} strategy.class_path=testkit.strategies.ClientIdWeighted "
        f"strategy.name=client-id-weighted {COMMON} eval.before_train=false",
        supernodes=2,
    )
    # A round that lost a client trained on part of the federation: the run says so in its status
    # (degraded; outcome.py maps it to exit status 3, tests/test_outcome.py) and its warning, not
    # only in rounds[].rejected.
    assert expected_end(summary) == ("degraded", 3) and summary["status"] == "degraded", output[-4000:]
    assert summary["warning"].startswith(
        "round(s) [1] aggregated without client(s) [1] that they selected, so the final model was trained on "
        "part of the federation (round 1: client 1: "), summary["warning"]
    assert not summary.get("eval_failures")
    first, second = summary["rounds"]
    # Round 1: client 1's trainer crashed (unknown env); the round went on with client 0 alone.
    assert "1" in first["rejected"] and "exited with code" in first["rejected"]["1"]
    assert "NoSuchEnv" in first["rejected"]["1"]
    assert first["client_actor_ids"] == [0]
    assert check_round_mean(run_dir, first, {0: 1.0}) < 1e-6
    # Round 2: both clients, weighted 1:2 by the custom rule rather than by episode counts.
    assert second["client_actor_ids"] == [0, 1] and second["started_from"] == first["aggregated_actor"]
    assert check_round_mean(run_dir, second, {0: 1.0, 1: 2.0}) < 1e-6
    # Round 1's outputs were not touched by round 2.
    assert (Path(first["aggregated_actor"]) / "model.safetensors").exists()


def test_bad_config_stops_the_run_at_start(superlink: SuperLink, tmp_path: Path) -> None:
    proc = superlink.run(f"output_dir={tmp_path} num_roundz=3", supernodes=2, timeout=300)
    output = proc.stdout + proc.stderr
    assert "unknown config key 'num_roundz'" in output, output[-4000:]
    # a run-config file (Flower's --run-config FILE.toml) reaches the app: its typed key and its
    # overrides setting the same thing is refused before anything runs
    run_config = tmp_path / "run.toml"
    run_config.write_text(f'num-server-rounds = 3\noverrides = "output_dir={tmp_path} num_rounds=2"\n')
    proc = superlink.run(supernodes=2, timeout=300, run_config_file=run_config)
    output = proc.stdout + proc.stderr
    assert "'num-server-rounds' and overrides item 'num_rounds=2' both set 'num_rounds'" in output, output[-4000:]
    assert not list(tmp_path.glob("*/federated_summary.json"))


def test_each_client_serves_its_own_partition_and_nothing_outlives_the_run(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from fedagent_flwr.procs import pids_with_cmdline

    # Flower's typed run-config keys for the common settings, overrides for the rest
    proc = superlink.run(
        f"output_dir={tmp_path} run_name=job eval.num_episodes=2 trainer.max_new_tokens=8 "
        "partition.min_goals_per_client=5 eval.before_train=false",  # FedAgent's 100 > 10 secrets: all to both
        supernodes=2, extra_run_config=f"num-server-rounds=1 env='tinyguess_service' model-path='{tiny_model_dir}'",
    )
    output = proc.stdout + proc.stderr
    run_dir = tmp_path / "job"
    assert (run_dir / "federated_summary.json").exists(), output[-4000:]
    summary = json.loads((run_dir / "federated_summary.json").read_text())
    assert summary["total_rounds"] == 1 and summary["base_model"] == str(tiny_model_dir)
    assert ran_every_round(summary), output[-4000:]
    partitions = {}
    for client in (0, 1):
        (health,) = json.loads((run_dir / "round_1" / f"client_{client}" / "service_health.json").read_text())
        assert health["ready"] and health["env"] == "TinyGuess"
        assert health["partition"]["strategy"] == "uniform" and health["partition"]["client_id"] == client
        partitions[client] = health["partition"]["goal_indices"]
        job = json.loads((run_dir / "round_1" / f"client_{client}" / "train_job.json").read_text())
        assert job["env_spec"]["envs"][0]["name"] == "Service"  # the trainer played over HTTP
        logs = sorted(p.name for p in (run_dir / "services" / f"client_{client}").glob("*.log"))
        assert logs == ["train_0.json.log", "val_0.json.log"]  # a separate validation service
        assert not list((run_dir / "services" / f"client_{client}").glob("*.json"))  # stopped, forgotten
    assert partitions == {0: [0, 1, 2, 3, 4], 1: [5, 6, 7, 8, 9]}  # uniform over secrets 1..10
    assert "2 env service(s) and 0 persistent trainer(s) stopped" in output \
        or "4 env service(s) and 0 persistent trainer(s) stopped" in output
    assert pids_with_cmdline(str(run_dir / "services")) == []  # no service outlives the run




@pytest.mark.skipif(not (WEBSHOP_DATA / "items_shuffle_1000.json").exists(),
                    reason=f"WebShop data not found at {WEBSHOP_DATA}")
def test_webshop_two_clients_on_their_own_partitioned_services(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    summary, run_dir, output = run_job(
        superlink, tmp_path,
        f"model.path={tiny_model_dir} env=webshop env.data_dir={WEBSHOP_DATA} "
        "env.train.envs.0.n_envs=1 env.train.envs.0.max_turns=3 env.val.envs.0.max_turns=3 "
        "eval.num_episodes=2 trainer.max_new_tokens=8 trainer.max_model_len=2048 "
        f"partition.min_goals_per_client=10 {PERSISTENT}",
        supernodes=2,
    )
    assert ran_every_round(summary), output[-4000:]
    # WebShop scores every episode (task_score in [0, 1]): the validation curve carries its mean
    assert all(0.0 <= point["score_mean"] <= 1.0 for point in summary["val_curve"]), summary["val_curve"]
    assert [e["aggregated_actor"] is not None for e in summary["rounds"]] == [True, True]
    goals = {c: [h["partition"]["goal_indices"] for h in hs] for c, hs in _service_health(run_dir, "WebShop").items()}
    goals = {c: g[0] for c, g in goals.items() if g[0] == g[1]}  # same service, both rounds
    assert goals[0] and goals[1] and not set(goals[0]) & set(goals[1])  # disjoint uniform slices


@pytest.mark.skipif(not (WEBSHOP_DATA / "items_shuffle_1000.json").exists(),
                    reason=f"WebShop data not found at {WEBSHOP_DATA}")
def test_webshop_catalog_split_gives_each_client_its_own_catalogue(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    summary, run_dir, output = run_job(
        superlink, tmp_path,
        f"model.path={tiny_model_dir} env=webshop env.data_dir={WEBSHOP_DATA} partition=catalog_split "
        "num_rounds=1 env.train.envs.0.n_envs=1 env.train.envs.0.max_turns=2 env.val.envs.0.max_turns=2 "
        f"eval.num_episodes=2 trainer.max_new_tokens=8 trainer.max_model_len=2048 {PERSISTENT}",
        supernodes=2,
    )
    assert ran_every_round(summary), output[-4000:]
    described = {}
    for client in (0, 1):
        (health,) = json.loads((run_dir / "round_1" / f"client_{client}" / "service_health.json").read_text())
        assert health["variant"]["strategy"] == "catalog_split" and health["variant"]["client_id"] == client
        described[client] = health["info"]["variant"]
    assert described[0] != described[1]  # two different worlds, echoed by /health


def test_verl_backend_without_a_gpu_fails_every_client_alike_and_the_run_stops_with_verls_error(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """trainer=verl on a CPU machine: every verl job really starts (private Ray cluster, our
    dataset) and stops at verl's GPU check; the base model was evaluated (HF generation, which the
    verl backend uses) at round 0, each client's failure reaches the server as one line naming
    verl's error, and since every client failed the same way the run stops after round 1 with that
    line as its reason instead of running on without training."""
    summary, run_dir, output = run_job(
        superlink, tmp_path,
        f"model.path={tiny_model_dir} trainer=verl num_rounds=2 eval.num_episodes=1 trainer.max_new_tokens=8 "
        "trainer.ray_num_cpus=2 trainer.rollout_n=2",
        supernodes=2,
    )
    assert summary["status"] == "failed", output[-4000:]
    assert summary["error"].startswith("round 1: every client (2) failed the same way, so the run stops: client 0 "
                                       "round 1: verl trainer exited with code")
    assert "Total available GPUs 0" in summary["error"]
    (only,) = summary["rounds"]
    assert only["aggregated_actor"] is None and only["client_actor_ids"] == []
    for client in ("0", "1"):
        reason = only["rejected"][client]
        assert "verl_backend: error: verl exited with code 1" in reason and "Total available GPUs 0" in reason
        assert (run_dir / "round_1" / f"client_{client}" / "verl" / "verl.log").exists()
    assert [point["round"] for point in summary["val_curve"]] == [0]


def test_alfworld_two_clients_two_rounds_on_their_own_partitioned_services(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path, alfworld_data: Path
) -> None:
    """2 clients x 2 rounds on the real ALFWorld engine: each client's service runs under the
    ALFWorld service venv on its own uniform slice of the games built from the shared trial."""
    summary, run_dir, output = run_job(
        superlink, tmp_path,
        f"model.path={tiny_model_dir} env=alfworld env.data_dir={alfworld_data} "
        "env.train.envs.0.n_envs=1 env.train.envs.0.max_turns=2 env.val.envs.0.max_turns=2 "
        "env.service.pool_size=2 eval.num_episodes=2 trainer.max_new_tokens=8 trainer.max_model_len=4096 "
        f"partition.min_goals_per_client=3 {PERSISTENT}",
        supernodes=2,
    )
    assert ran_every_round(summary), output[-4000:]
    assert [e["aggregated_actor"] is not None for e in summary["rounds"]] == [True, True]
    healths = _service_health(run_dir, "ALFWorld")
    assert all(h["info"]["engine_workers"] == 2 and h["info"]["textworld"] == "1.7.0"
               for hs in healths.values() for h in hs)
    goals = {c: [h["partition"]["goal_indices"] for h in hs] for c, hs in healths.items()}
    goals = {c: g[0] for c, g in goals.items() if g[0] == g[1]}  # same service, both rounds
    assert goals == {0: [0, 1, 2], 1: [3, 4, 5]}  # uniform halves of the 6 train games
