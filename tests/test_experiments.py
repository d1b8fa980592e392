"""FedAgent's paper presets (conf/experiment/paper_*, conf/trainer/verl_ppo) and the matrix command.

Every preset composes, passes the run's checks and yields verl overrides that verl's own config
validation accepts (as tests/test_recipes.py does for conf/recipe/); the entries of
``python -m fedagent_flwr.experiments`` compose to the settings the command prints (every run on
the first backbone, and the other backbones' runs differ from those only in model.path), and the
``flwr run`` line it prints carries exactly those overrides.
"""

from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr import experiments
from fedagent_flwr.clientapp.backend import CLIENTAPP_TRAINER_KEYS
from fedagent_flwr.config import RunSettings, conf_dir, load_settings, parse_overrides
from fedagent_flwr.trainers.common.client_rule import RULE_KEYS
from fedagent_flwr.trainers.verl.overrides import build_overrides, job_paths
from fedagent_flwr.trainers.verl.settings import VerlSettings
from testkit.flower_harness import REPO
from testkit.verl_probe import compose_verl_config

PRESETS = sorted(p.stem for p in (conf_dir() / "experiment").glob("paper_*.yaml"))
LEAVES = [f"paper_{env}_{algorithm}" for env in experiments.ENVS for algorithm in experiments.ALGORITHMS]
LABELS_DIR = REPO.parent / "shared" / "data" / "hardness"
MATRIX = experiments.paper_matrix()
WITH_EPOCHS = experiments.config_has_epochs()


def _verl_config(settings: RunSettings, model_dir: Path, tmp_path: Path) -> Any:
    """verl's composed and validated config for one client job of ``settings`` (no GPU needed; PPO's
    critic check reads the model's config, hence a real model directory)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    verl_settings, unknown = VerlSettings.from_mapping(
        {k: v for k, v in settings.trainer.items() if k not in CLIENTAPP_TRAINER_KEYS and k not in RULE_KEYS})
    assert not unknown
    batch = sum(int(e["n_envs"]) for e in settings.train_env_spec["envs"])
    paths = job_paths(tmp_path / "verl", str(model_dir), "", "/tmp/fa-ray-test")
    overrides = build_overrides(algorithm=settings.run.algorithm, settings=verl_settings, paths=paths, batch_size=batch,
                                local_steps=settings.run.train.local_steps, seed=1, experiment_name="round1_client0")
    cfg = compose_verl_config(overrides)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert cfg.data.train_batch_size == batch
    return cfg


def test_there_is_a_preset_per_environment_and_algorithm() -> None:
    assert set(LEAVES) | {"paper_protocol"} == set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_and_passes_verls_validation(preset: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = load_settings("config", f"experiment={preset}")
    assert (settings.mode, settings.run.clients.total, settings.clients_per_round, settings.run.num_rounds,
            settings.run.seed) == (
        "federated", experiments.TOTAL, experiments.PER_ROUND, experiments.ROUNDS, experiments.SEED)
    assert settings.partition == {"strategy": "uniform", "min_goals_per_client": experiments.MIN_GOALS}
    assert settings.trainer["n_gpus_per_node"] == experiments.GPUS_PER_CLIENT
    cfg = _verl_config(settings, tiny_model_dir, tmp_path)
    if preset == "paper_protocol":
        return
    env, algorithm = preset.removeprefix("paper_").split("_")
    assert (settings.run.env.name, settings.run.algorithm) == (env, algorithm)
    n_envs, rollout_n = experiments.STEP_SHAPE[algorithm]
    rollout = cfg.actor_rollout_ref.rollout
    assert (cfg.data.train_batch_size, rollout.n) == (n_envs, rollout_n)
    # FedAgent's 64-row mini-batches: GRPO 8 prompts x 8 rollouts, PPO 64 prompts x 1, the critic's too
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n == 64
    assert cfg.algorithm.adv_estimator == {"grpo": "grpo", "ppo": "gae"}[algorithm]
    if algorithm == "ppo":
        assert cfg.critic.ppo_mini_batch_size * rollout.n == 64
    # validation: every held-out goal (WebShop) or valid_seen game (ALFWorld) once
    assert settings.run.eval.num_episodes == settings.val_env_spec["envs"][0]["n_envs"] == {"webshop": 500,
                                                                                       "alfworld": 140}[env]


def test_ppo_preset_is_fedagents_ppo(tiny_model_dir: Path, tmp_path: Path) -> None:
    """trainer=verl_ppo alone: PPO with one rollout per instance; 64 instances give 64-row mini-batches."""
    settings = load_settings("config", "trainer=verl_ppo env.train.envs.0.n_envs=64")
    assert (settings.run.algorithm, settings.trainer_backend, settings.trainer["rollout_n"]) == ("ppo", "verl", 1)
    cfg = _verl_config(settings, tiny_model_dir, tmp_path)
    assert cfg.algorithm.adv_estimator == "gae" and cfg.actor_rollout_ref.rollout.n == 1
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == cfg.critic.ppo_mini_batch_size == 64
    # the PPO leaves restate verl_ppo's group settings (the GRPO preset's would win otherwise): keep them equal
    for env in experiments.ENVS:
        leaf = load_settings("config", f"experiment=paper_{env}_ppo")
        assert {k: leaf.trainer[k] for k in ("rollout_n", "ppo_mini_batch_size")} == {
            k: settings.trainer[k] for k in ("rollout_n", "ppo_mini_batch_size")}


def test_matrix_is_fedagents_176_runs() -> None:
    assert len(MATRIX) == 176 and len({e.name for e in MATRIX}) == 176
    counts = {family: sum(e.family == family for e in MATRIX) for family in experiments.FAMILIES}
    assert counts == {"uniform": 112, "env_heterogeneity": 16, "task_heterogeneity": 24, "decentralized": 24}
    assert {e.model for e in MATRIX if e.family != "uniform"} == {experiments.BACKBONES[0]}
    assert {e.env for e in MATRIX if e.family == "env_heterogeneity"} == {"webshop"}
    # the name states FedAgent's N, M, T, E and goals per client; the entry must agree
    for e in MATRIX:
        assert f"total-{e.total}_cl-per-rd-{e.per_round}_rd-{e.rounds}_ep-per-cl-{e.epochs}_min-goals-per-cl-" \
               f"{e.min_goals}_p-" in e.name


def _composed(settings: RunSettings) -> dict[str, Any]:
    """The settings an entry promises, read back from the composed run."""
    train = settings.train_env_spec["envs"]
    search = {e["config"].get("search_return_n") for e in train + settings.val_env_spec["envs"]}
    assert len(search) == 1  # training and validation search alike, as FedAgent's services
    return {
        "env": settings.run.env.name, "algorithm": settings.run.algorithm, "mode": settings.mode,
        "model": settings.run.model.path, "clients_total": settings.run.clients.total,
        "clients_per_round": settings.clients_per_round, "rounds": settings.run.num_rounds,
        "epochs": settings.raw["train"]["epochs"] if WITH_EPOCHS else None,
        "min_goals_per_client": settings.partition["min_goals_per_client"], "seed": settings.run.seed,
        "local_client_id": settings.run.experiment.local_client_id, "partition": settings.partition["strategy"],
        "search_return_n": search.pop(), "envs_per_step": sum(e["n_envs"] for e in train),
        "rollout_n": settings.trainer["rollout_n"],
    }


def _twin(entry: experiments.Entry) -> experiments.Entry:
    """The same run on the heterogeneity backbone (the uniform table repeats on four backbones)."""
    return next(e for e in MATRIX if e.model == experiments.BACKBONES[0]
                and e.name.split("/", 2)[2] == entry.name.split("/", 2)[2])


# Composing takes about half a second, so every run on the first backbone composes (92 of 176),
# and so does one run per other backbone; the other backbones' runs must then be their twin's
# overrides plus model.path, which test_other_backbones_only_change_the_model checks.
COMPOSED = [e for e in MATRIX if e.model == experiments.BACKBONES[0]] + [
    next(e for e in MATRIX if e.model == model) for model in experiments.BACKBONES[1:]]


def test_other_backbones_only_change_the_model() -> None:
    others = [e for e in MATRIX if e.model != experiments.BACKBONES[0]]
    assert len(others) == 3 * 28
    for entry in others:
        mine = entry.overrides(with_epochs=WITH_EPOCHS)
        assert f"model.path={entry.model}" in mine
        assert [o for o in mine if not o.startswith("model.path=")] == _twin(entry).overrides(with_epochs=WITH_EPOCHS)


@pytest.mark.skipif(not LABELS_DIR.is_dir(), reason=f"hardness labels not found at {LABELS_DIR}")
@pytest.mark.parametrize("entry", COMPOSED, ids=lambda e: e.name)
def test_entry_composes_to_its_printed_settings(entry: experiments.Entry) -> None:
    overrides = entry.overrides(with_epochs=WITH_EPOCHS, labels_dir=str(LABELS_DIR))
    settings = load_settings("config", overrides)
    promised = entry.settings(with_epochs=WITH_EPOCHS)
    knobs = promised.pop("knobs")
    assert promised.pop("epochs_applied") == WITH_EPOCHS
    if not WITH_EPOCHS:
        promised["epochs"] = None  # FedAgent's E, printed but not applied by this build
    assert _composed(settings) == promised
    assert {k: settings.partition[k] for k in knobs} == knobs
    if entry.partition == "hardness":
        assert Path(settings.partition["trajectories_file"]).is_file()


def _run_config_overrides(flwr_run: str) -> list[str]:
    """The overrides a printed flwr run line hands to the ServerApp (shell, then TOML, then shlex)."""
    argv = shlex.split(flwr_run)
    assert argv[:4] == ["flwr", "run", ".", "--stream"]
    run_config = tomllib.loads(argv[argv.index("--run-config") + 1])
    return parse_overrides(run_config["overrides"])


def test_command_prints_json_with_runnable_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert experiments.main(["--json", "--family", "task_heterogeneity", "--env", "webshop",
                             "--data-dir", "/data/web shop", "--labels-dir", "/labels dir"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["entries"]
    assert len(rows) == 12 and {r["settings"]["algorithm"] for r in rows} == {"grpo", "ppo"}
    for row in rows:
        assert _run_config_overrides(row["flwr_run"]) == row["overrides"]
        assert "env.data_dir=/data/web shop" in row["overrides"]
        federation = shlex.split(row["flwr_run"])[-1]
        assert federation == f"num-supernodes=100 client-resources-num-gpus={experiments.GPUS_PER_CLIENT}"
    hardness = [r for r in rows if r["settings"]["partition"] == "hardness"]
    assert len(hardness) == 4 and all(
        "partition.trajectories_file=/labels dir/qwen2.5-1.5b_webshop_trajectories.json" in r["overrides"]
        for r in hardness)
    assert any("windowed" in note for note in out["not_reproduced"])


def test_command_prints_text_with_key_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert experiments.main(["--family", "env_heterogeneity", "--algorithm", "ppo"]) == 0
    text = capsys.readouterr().out
    assert "5 runs: env_heterogeneity 5" in text
    assert "env_heterogeneity/catalog_split_ppo/fed_webshop_ppo_total-100_cl-per-rd-2_rd-70_ep-per-cl-3_" \
           "min-goals-per-cl-100_p-catalog_split_div-1.0_keep-0.7" in text
    assert "N=100 M=2 T=70 E=3 goals=100 seed=42 G=1 envs/step=64 partition=catalog_split env_div=1.0 " \
           "keep_ratio=0.7 search_return_n=200" in text
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("flwr run")]
    assert len(lines) == 5 and all("env.search_return_n=200" in _run_config_overrides(line) for line in lines)


def test_command_refuses_a_path_it_cannot_quote(capsys: pytest.CaptureFixture[str]) -> None:
    assert experiments.main(["--data-dir", 'a"b']) == 2
    assert "--data-dir" in capsys.readouterr().err
