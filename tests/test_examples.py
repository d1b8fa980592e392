"""Every example of docs/extending.md, run the way the guide says (CPU).

* in a real Flower simulation (1 round, 2 clients, the tiny model): the in-process environment,
  trained with the median strategy and the client rule; the service-backed environment with the
  round-robin partition, whose ``/health`` echoes it;
* the median strategy on real FSDP checkpoints of 4 clients (where a median is not a mean),
  checked against numpy's median of the clients' files;
* the client rule's arithmetic, and the same rule inside verl's real FSDP engine;
* the verl advantage estimator: the overrides the example trainer option generates pass verl's
  validation, and a fresh process with the job's environment registers the estimator (without
  importing it itself) and verl's ``compute_advantage`` returns what numpy computes;
* the guide quotes the overrides these tests run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fedagent_flwr.checkpoint import CheckpointRef, open_checkpoint
from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.envs.base import BaseTextEnv
from fedagent_flwr.envs.registry import register_env
from fedagent_flwr.hetero import PartitionError, partition_goals
from fedagent_flwr.trainers.common.client_rule import ClientRuleError, load_client_rule
from testkit.audit import audit_run
from testkit.ckpt_factory import Suite
from testkit.flower_harness import REPO, SuperLink
from testkit.run_end import ran_every_round
from testkit.verl_probe import ENGINE, compose_verl_config

GUIDE = REPO / "docs" / "extending.md"
SEARCHPATH = "hydra.searchpath=[pkg://examples.conf]"
# The overrides the guide quotes, one per extension point (checked by the last test).
ENV_OVERRIDES = f"{SEARCHPATH} env=unscramble"
STRATEGY_OVERRIDES = "strategy.class_path=examples.median_strategy.CoordinateMedian strategy.name=median"
RULE_OVERRIDES = ("trainer.client_rule=examples.client_rule.ProximalFreeze "
                  "trainer.client_rule_args={mu:0.1,freeze:embed_tokens}")
SERVICE_OVERRIDES = f"{SEARCHPATH} env=glossary_service"
PARTITION_OVERRIDES = f"{SEARCHPATH} partition=round_robin"
VERL_OVERRIDES = f"{SEARCHPATH} trainer=verl_median_baseline"
ENV_CHECK = "python -m fedagent_flwr.envs.check examples.unscramble_env.Unscramble"
SERVICE_CHECK = "python -m fedagent_flwr.envs.check examples.glossary_env.Glossary --service"
# What CI adds to keep a run short: one round, two validation episodes, short replies.
CI = "num_rounds=1 eval.num_episodes=2 trainer.max_new_tokens=8 trainer.lr=1e-3"
ROUND_ROBIN = "examples.partition_round_robin.round_robin"


# --------------------------------------------------------------------------------------------
# Real Flower simulations
# --------------------------------------------------------------------------------------------


def _run(superlink: SuperLink, tmp_path: Path, overrides: str) -> tuple[dict, Path]:
    proc = superlink.run(f"output_dir={tmp_path} run_name=job {overrides}", supernodes=2)
    output = proc.stdout + proc.stderr
    summary_path = tmp_path / "job" / "federated_summary.json"
    assert summary_path.exists(), output[-4000:]
    summary = json.loads(summary_path.read_text())
    assert ran_every_round(summary), output[-4000:]
    return summary, tmp_path / "job"


def _actor_state(client_dir: Path) -> dict[str, torch.Tensor]:
    result = json.loads((client_dir / "train_result.json").read_text())
    return torch.load(Path(result["actor_dir"]) / "model_world_size_1_rank_0.pt", map_location="cpu",
                      weights_only=True)


@pytest.mark.slow
def test_in_process_env_trains_a_round_with_the_median_strategy_and_the_client_rule(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    summary, run_dir = _run(
        superlink, tmp_path,
        f"model.path={tiny_model_dir} {ENV_OVERRIDES} {STRATEGY_OVERRIDES} {RULE_OVERRIDES} {CI} "
        "storage.keep_client_checkpoints=true",  # the test reads the client checkpoints after the run
    )
    (entry,) = summary["rounds"]
    assert entry["client_actor_ids"] == [0, 1] and not entry["rejected"]
    assert summary["strategy"] == "median" and [p["round"] for p in summary["val_curve"]] == [0, 1]
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    states = {}
    for client in (0, 1):
        client_dir = run_dir / "round_1" / f"client_{client}"
        job = json.loads((client_dir / "train_job.json").read_text())
        result = json.loads((client_dir / "train_result.json").read_text())
        # The environment: named by its dotted path, played in the trainer (2 instances x rollout_n 2).
        assert job["env_spec"]["envs"][0]["name"] == "examples.unscramble_env.Unscramble"
        assert result["num_episodes"] == 4
        # The client rule: it ran, and the frozen embeddings never left the global weights.
        assert job["trainer"]["client_rule"] == "examples.client_rule.ProximalFreeze"
        assert "client_rule_value" in result["metrics"]
        states[client] = _actor_state(client_dir)
        assert torch.equal(states[client]["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
        assert not torch.equal(states[client]["model.norm.weight"], base["model.norm.weight"])  # it trained
    # The strategy: the written global model is numpy's median of the two clients' files.
    global_dir = Path(entry["aggregated_actor"])
    aggregate = load_file(str(global_dir / "model.safetensors"))
    assert set(aggregate) == set(states[0]) - {"lm_head.weight"}  # the tiny model ties the head
    for key, tensor in aggregate.items():
        expected = np.median(np.stack([states[0][key].numpy(), states[1][key].numpy()]), axis=0)
        assert np.abs(tensor.numpy().astype(np.float64) - expected).max() < 1e-6, key
    with safe_open(str(global_dir / "model.safetensors"), framework="pt") as handle:
        assert handle.metadata()["fedagent.aggregation"] == "coordinate_median"
    audit = audit_run(run_dir)
    assert audit.returncode == 1 and "written by the rule 'coordinate_median'" in audit.stdout


@pytest.mark.slow
def test_service_env_serves_each_client_its_round_robin_partition(
    superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from examples.partition_round_robin import round_robin

    # Persistent trainers (one per node, not one per job): the env runs in the service, and the
    # trainer, which only plays the built-in Service env against it, is not what is checked here.
    summary, run_dir = _run(superlink, tmp_path, f"model.path={tiny_model_dir} {SERVICE_OVERRIDES} "
                            f"{PARTITION_OVERRIDES} {CI} trainer.mode=persistent")
    (entry,) = summary["rounds"]
    assert entry["client_actor_ids"] == [0, 1] and entry["aggregated_actor"]
    knobs = {"strategy": ROUND_ROBIN, "min_goals_per_client": 4}
    for client in (0, 1):
        client_dir = run_dir / "round_1" / f"client_{client}"
        (health,) = json.loads((client_dir / "service_health.json").read_text())
        assert health["ready"] and health["env"] == "Glossary"
        assert health["partition"]["strategy"] == ROUND_ROBIN and health["partition"]["client_id"] == client
        goals = round_robin(client, 2, 12, knobs, 42)
        assert health["partition"]["goal_indices"] == goals
        # service_setup loaded the glossary once and restricted the pool to the client's goals.
        assert health["info"]["glossary_entries"] == 12 and health["info"]["num_goals"] == len(goals)
        job = json.loads((client_dir / "train_job.json").read_text())
        assert job["env_spec"]["envs"][0]["name"] == "Service"  # the trainer played over HTTP
        assert job["env_spec"]["envs"][0]["config"]["env"] == "Glossary"
        logs = sorted(p.name for p in (run_dir / "services" / f"client_{client}").glob("*.log"))
        assert logs == ["train_0.json.log", "val_0.json.log"]  # validation had a service of its own


# --------------------------------------------------------------------------------------------
# The guide's checks of an environment
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [ENV_CHECK, SERVICE_CHECK])
def test_env_check_command_passes_the_examples(command: str) -> None:
    args = command.split()[1:]
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 failed" in run.stdout and "FAIL" not in run.stdout
    if "--service" in command:
        assert '"env": "Glossary"' in run.stdout  # the /health of the real service


@register_env("CoinFlip")
class CoinFlip(BaseTextEnv):
    """Non-deterministic on purpose: every instance draws its own observation."""

    async def system_prompt(self) -> str:
        return "Flip."

    async def reset(self, seed: int) -> tuple[str, dict]:
        return f"coin {os.urandom(4).hex()}", {}

    async def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        return "done", 0.0, True, {"success": False}


def test_env_check_reports_a_nondeterministic_reset() -> None:
    from fedagent_flwr.envs.check import check_env

    results = dict(check_env("tests.test_examples.CoinFlip", {"max_turns": 1}, seeds=[0]))
    assert "differ" in results["seed 0: deterministic"]


# --------------------------------------------------------------------------------------------
# Partition: deterministic across processes, the floor kept, faulty strategies named
# --------------------------------------------------------------------------------------------


def test_round_robin_partition_is_deterministic_across_processes_and_keeps_the_floor() -> None:
    knobs = {"min_goals_per_client": 5}
    here = [partition_goals(ROUND_ROBIN, c, 3, 12, knobs, base_seed=7) for c in range(3)]
    assert all(len(goals) == 5 for goals in here)  # 4 dealt + 1 from the floor
    assert sorted(set().union(*here)) == list(range(12))  # every goal is dealt to someone
    code = (f"import json; from fedagent_flwr.hetero import partition_goals; "
            f"print(json.dumps([partition_goals({ROUND_ROBIN!r}, c, 3, 12, {knobs!r}, base_seed=7) "
            "for c in range(3)]))")
    for hash_seed in ("1", "2"):  # Python's salted hash() would differ between these
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                               env={**os.environ, "PYTHONHASHSEED": hash_seed}, check=True)
        assert json.loads(other.stdout) == here
    assert partition_goals(ROUND_ROBIN, 0, 3, 12, knobs, base_seed=8) != here[0]  # the seed matters


def too_few(client_id: int, num_clients: int, num_goals: int, knobs: dict, base_seed: int,
            goal_info: object = None) -> list[int]:
    """A faulty partition strategy (used by dotted path below): ignores the floor."""
    return [client_id]


def unsorted(client_id: int, num_clients: int, num_goals: int, knobs: dict, base_seed: int,
             goal_info: object = None) -> list[int]:
    """A faulty partition strategy: indices out of order."""
    return [3, 1]


def test_faulty_partition_strategies_are_named() -> None:
    with pytest.raises(PartitionError, match=r"tests\.test_examples\.too_few.*fewer than the floor of 2"):
        partition_goals("tests.test_examples.too_few", 0, 2, 10, {"min_goals_per_client": 2})
    with pytest.raises(PartitionError, match="sorted, distinct"):
        partition_goals("tests.test_examples.unsorted", 0, 2, 10, {})
    with pytest.raises(ConfigError, match=r"partition\.strategy.*no attribute 'missing'"):
        load_settings("config", "partition.strategy=examples.partition_round_robin.missing")


# --------------------------------------------------------------------------------------------
# Aggregation rule: the median of 4 real FSDP checkpoints (world sizes 1 and 2)
# --------------------------------------------------------------------------------------------


def test_median_strategy_matches_numpys_median_of_the_client_files(suite: Suite, tmp_path: Path) -> None:
    from examples.median_strategy import CoordinateMedian

    names = ["qwen_a", "qwen_b", "qwen_plain", "qwen_c"]
    readers = [open_checkpoint(CheckpointRef.for_directory(suite.ckpt(n), fmt="fsdp-shards"), root=suite.root)
               for n in names]
    strategy = object.__new__(CoordinateMedian)  # aggregate_checkpoints needs no run state...
    strategy.model_files = suite.ckpt("qwen_a") / "huggingface"  # ...but the model files of the base model
    try:
        report = strategy.aggregate_checkpoints(1, [(r, 1.0) for r in readers], tmp_path / "global", None)
    finally:
        for reader in readers:
            reader.close()
    written = load_file(str(tmp_path / "global" / "model.safetensors"))
    states = [suite.expected(n) for n in names]
    assert set(written) == set(states[0]) and report.num_tensors == len(written)
    differs_from_mean = False
    for key, tensor in written.items():
        stacked = np.stack([s[key].double().numpy() for s in states])
        assert np.abs(tensor.double().numpy() - np.median(stacked, axis=0)).max() < 1e-6, key
        differs_from_mean |= bool(np.abs(tensor.double().numpy() - stacked.mean(axis=0)).max() > 1e-4)
    assert differs_from_mean  # four clients: the median is not the mean


# --------------------------------------------------------------------------------------------
# Client rule: arithmetic, config errors, and the rule inside verl's FSDP engine
# --------------------------------------------------------------------------------------------


def test_client_rule_freezes_matching_tensors_and_adds_the_proximal_gradient_to_the_rest() -> None:
    rule = load_client_rule({"client_rule": "examples.client_rule.ProximalFreeze",
                             "client_rule_args": {"mu": 0.5, "freeze": "bias"}})
    assert rule is not None
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    start = {n: p.detach().clone() for n, p in layer.named_parameters()}
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        layer(torch.randn(5, 4)).pow(2).sum().backward()
        plain = layer.weight.grad.clone()
        drift = layer.weight.detach() - start["weight"]
        value = rule.apply(layer.named_parameters())
        torch.testing.assert_close(layer.weight.grad, plain + 0.5 * drift)
        assert torch.count_nonzero(layer.bias.grad) == 0
        assert value == pytest.approx(float(drift.pow(2).sum()), rel=1e-5)
        optimizer.step()
    assert torch.equal(layer.bias.detach(), start["bias"])
    with pytest.raises(ClientRuleError, match="mu must be a number >= 0"):
        load_client_rule({"client_rule": "examples.client_rule.ProximalFreeze", "client_rule_args": {"mu": -1}})
    with pytest.raises(ConfigError, match=r"trainer\.client_rule 'examples\.client_rule\.Nope'"):
        load_settings("config", "trainer.client_rule=examples.client_rule.Nope")


_RULE_PROBE = ENGINE + r"""
e = engine(impl.FSDPEngineWithLMHead)
w0, b0 = e.module.weight.detach().clone(), e.module.bias.detach().clone()
e.module.weight.grad = torch.ones_like(w0); e.module.bias.grad = torch.ones_like(b0)
e.optimizer_step()                                   # w1 = w0 - 1 (no drift yet)
w1 = e.module.weight.detach().clone()
e.module.weight.grad = torch.ones_like(w0); e.module.bias.grad = torch.ones_like(b0)
e.optimizer_step()                                   # w2 = w1 - (1 + (0.25 + 0.5) (w1 - w0))
expected = w1 - (1 + 0.75 * (w1 - w0))
print(json.dumps({"wrapped": list(impl.FSDPEngine._fedagent_wrapped),
                  "weight_error": float((e.module.weight - expected).abs().max()),
                  "bias_unchanged": bool(torch.equal(e.module.bias.detach(), b0)),
                  "rule_imported_by": "examples.client_rule" in sys.modules}))
"""


def test_client_rule_runs_in_verls_fsdp_engine_next_to_fedprox(tmp_path: Path) -> None:
    from fedagent_flwr.trainers.common.client_rule import job_rule_specs
    from fedagent_flwr.trainers.common.fedprox import FEDPROX_RULE
    from fedagent_flwr.trainers.verl import engine_hooks
    from fedagent_flwr.trainers.verl.job import job_environment

    rule = {"client_rule": "examples.client_rule.ProximalFreeze", "client_rule_args": {"mu": 0.5, "freeze": "bias"}}
    env = job_environment(dict(os.environ), rules=job_rule_specs(0.25, rule), marker_dir=str(tmp_path / "rule"))
    probe = subprocess.run([sys.executable, "-c", _RULE_PROBE], env=env, capture_output=True, text=True,
                           timeout=600, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr[-2000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["wrapped"] == ["client_rule"]  # one wrapper runs the job's rules
    assert result["weight_error"] < 1e-6 and result["bias_unchanged"] and result["rule_imported_by"]
    (marker,) = engine_hooks.read_markers(str(tmp_path / "rule"))
    # FedProx's rule runs first, then the user's (which freezes the bias, proximal term included).
    assert marker["rules"] == [FEDPROX_RULE, "examples.client_rule.ProximalFreeze"]
    assert marker["rule_args"][0] == {"mu": 0.25} and marker["engine"] == "FSDPEngineWithLMHead"
    assert "[client_rule] hook active" in probe.stdout


# --------------------------------------------------------------------------------------------
# verl advantage estimator
# --------------------------------------------------------------------------------------------


def test_verl_estimator_option_generates_overrides_that_pass_verls_validation(tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from fedagent_flwr.trainers.verl.overrides import build_overrides, job_paths
    from fedagent_flwr.trainers.verl.settings import VerlSettings

    run = load_settings("config", VERL_OVERRIDES)
    settings, _ = VerlSettings.from_mapping({k: v for k, v in run.trainer.items() if k not in ("backend", "timeout_s")})
    assert settings.plugin_modules == ["examples.verl_advantage"]
    overrides = build_overrides(algorithm="grpo", settings=settings,
                                paths=job_paths(tmp_path / "verl", str(tiny_model_dir), "", "/tmp/fa-ray-test"),
                                batch_size=2, local_steps=1, seed=142, experiment_name="round1_client0")
    cfg = compose_verl_config(overrides)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert cfg.algorithm.adv_estimator == "group_median_baseline" and not need_critic(cfg)


_ESTIMATOR_PROBE = r"""
import json, sys
import numpy as np, torch
assert "examples.verl_advantage" not in sys.modules
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage   # what verl's TaskRunner runs
rewards = torch.zeros(8, 5)
rewards[:, -1] = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5])
mask = torch.ones(8, 5)
mask[1, 3:] = 0
data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                           non_tensors={"uid": np.array(list("aaabbbbb"), dtype=object)})
out = compute_advantage(data, adv_estimator=sys.argv[1])
print(json.dumps({"advantages": out.batch["advantages"].tolist(),
                  "imported_by_hook": "examples.verl_advantage" in sys.modules}))
"""


def test_verl_estimator_is_registered_in_a_fresh_job_process_and_verl_computes_with_it(tmp_path: Path) -> None:
    from fedagent_flwr.trainers.verl.job import job_environment

    env = job_environment(dict(os.environ), plugin_modules=["examples.verl_advantage"])
    probe = subprocess.run([sys.executable, "-c", _ESTIMATOR_PROBE, "group_median_baseline"], env=env,
                           capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr[-2000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["imported_by_hook"]
    scores = np.array([1.0, 0, 0, 0, 1, 1, 0, 0.5])
    groups = [slice(0, 3), slice(3, 8)]
    baseline = np.concatenate([np.full(g.stop - g.start, np.median(scores[g])) for g in groups])
    mask = np.ones((8, 5))
    mask[1, 3:] = 0
    assert np.allclose(np.array(result["advantages"]), (scores - baseline)[:, None] * mask)
    # Without the plugin module the job's processes do not know the name.
    plain = job_environment(dict(os.environ))
    unknown = subprocess.run([sys.executable, "-c", _ESTIMATOR_PROBE, "group_median_baseline"], env=plain,
                             capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert unknown.returncode != 0 and "Unknown advantage estimator" in unknown.stderr


# --------------------------------------------------------------------------------------------
# A strategy that changes the client rule's arguments per round
# --------------------------------------------------------------------------------------------

# The guide's expression (section 5), quoted verbatim; "{...}" stands for the new arguments.
RULE_ARGS_PER_ROUND = ("dataclasses.replace(instruction, trainer=dataclasses.replace(instruction.trainer, "
                       "client_rule_args={...}))")


def test_guide_expression_changes_the_rule_arguments_that_reach_the_client(tmp_path: Path) -> None:
    """Run as quoted on a real strategy's instruction, the expression yields an instruction whose
    trainer settings, after the message round trip, carry the new arguments and nothing else new."""
    import dataclasses

    from flwr.app import ConfigRecord

    from fedagent_flwr.protocol import TrainInstruction
    from fedagent_flwr.serverapp.app import build_strategy

    assert RULE_ARGS_PER_ROUND in GUIDE.read_text()
    settings = load_settings("config", RULE_OVERRIDES)
    base = CheckpointRef(path=str(tmp_path / "base"), kind="actor", format="hf-safetensors", world_size=1,
                         sha256="0" * 64)
    instruction = build_strategy(settings, tmp_path / "run", base).train_instruction(2, 0, ConfigRecord({}))
    new_args = {"mu": 0.05, "freeze": "embed_tokens"}
    changed = eval(RULE_ARGS_PER_ROUND.replace("{...}", repr(new_args)),  # the guide's own text
                   {"dataclasses": dataclasses, "instruction": instruction})
    received = TrainInstruction.from_record(changed.to_record())
    assert received.trainer.client_rule_args == new_args
    assert received.trainer == dataclasses.replace(instruction.trainer, client_rule_args=new_args)
    assert received.trainer.client_rule == "examples.client_rule.ProximalFreeze" and received.server_round == 2


# --------------------------------------------------------------------------------------------
# The guide
# --------------------------------------------------------------------------------------------


def test_guide_quotes_the_commands_these_tests_run() -> None:
    guide = GUIDE.read_text()
    for command in (ENV_OVERRIDES, STRATEGY_OVERRIDES, RULE_OVERRIDES, SERVICE_OVERRIDES, PARTITION_OVERRIDES,
                    VERL_OVERRIDES, ENV_CHECK, SERVICE_CHECK, "python -m pytest -q tests/test_examples.py"):
        assert command in guide, command
    assert "docs/extending.md" in (REPO / "README.md").read_text()
