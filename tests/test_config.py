"""Run configuration: Hydra composition from the Flower run config, strict validation, modes."""

from __future__ import annotations

import pytest

from fedagent_flwr.config import ConfigError, conf_dir, load_settings
from fedagent_flwr.seeding import data_seed, select_clients


def test_defaults_describe_the_two_client_federated_job() -> None:
    settings = load_settings()
    assert (settings.mode, settings.run.clients.total, settings.clients_per_round, settings.run.num_rounds) == (
        "federated", 2, 2, 2)
    assert settings.run.strategy.class_path.endswith("FedAvgFSDP")
    assert settings.train_env_spec["envs"][0]["name"] == "TinyGuess"
    assert settings.trainer_backend == "reference"


def test_modes_come_from_config_alone() -> None:
    assert load_settings(overrides="experiment=centralized").mode == "centralized"
    local = load_settings(overrides="experiment=local clients.total=4 experiment.local_client_id=3")
    assert (local.mode, local.run.experiment.local_client_id, local.run.clients.total) == ("local", 3, 4)
    prox = load_settings(overrides="strategy=fedprox strategy.proximal_mu=0.5")
    assert prox.run.strategy.class_path.endswith("FedProxFSDP") and prox.run.strategy.proximal_mu == 0.5


def test_per_round_larger_than_total_means_all_clients() -> None:
    assert load_settings(overrides="clients.per_round=5").clients_per_round == 2


def test_null_deselects_the_optional_recipe() -> None:
    # Hydra raises a bare ValueError on group=null; for the recipe it means "no preset" (recipe=none)
    preset = load_settings(overrides="recipe=tinyguess_verl")
    assert preset.run.num_rounds != load_settings().run.num_rounds
    default = load_settings().run
    assert load_settings(overrides="recipe=null").run == load_settings(overrides="recipe=none").run == default
    assert load_settings(overrides="recipe=tinyguess_verl recipe=null").run == load_settings().run
    # the last selection of a group wins (Hydra's rule), null included: no preset dropped in silence
    assert load_settings(overrides="recipe=null recipe=tinyguess_verl").run == preset.run
    assert load_settings(overrides="recipe=tinyguess_verl recipe=null recipe=tinyguess_verl").run == preset.run


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("foo=1", "unknown config key 'foo'"),
        ("model.pathh=x", "unknown config key 'model.pathh' (from override 'model.pathh=x'); did you mean "
                          "'model.path'?"),
        ("num_roundz=3", "unknown config key 'num_roundz' (from override 'num_roundz=3'); did you mean 'num_rounds'?"),
        ("trainer=verl trainer.rollout_m=4", "unknown config key 'trainer.rollout_m' (from override "
                                            "'trainer.rollout_m=4'); did you mean 'trainer.rollout_n'?"),
        ("num_rounds=abc", "config key 'num_rounds' must be int"),
        ("num_rounds=0", "config key 'num_rounds' = 0 is invalid"),
        ("clients.per_round=0", "config key 'clients.per_round'"),
        ("trainer.lr=-1", "config key 'trainer.lr'"),
        ("trainer.top_p=2", "config key 'trainer.top_p'"),
        ("trainer.stall_timeout_s=-1", "config key 'trainer.stall_timeout_s'"),
        ("trainer=verl trainer.stall_timeout_s=-1", "config key 'trainer.stall_timeout_s'"),
        ("strategy=nope", "config group 'strategy' has no option 'nope' (available: fedadagrad fedadam fedavg fedavgm "
                           "fedprox fedyogi)"),
        ("strategy=fedprxo", "config group 'strategy' has no option 'fedprxo' (available: fedadagrad fedadam fedavg "
                             "fedavgm fedprox fedyogi); did you mean 'fedprox'?"),
        # the recipe was an optional group, whose missing option Hydra skipped: the default job ran
        ("recipe=tinyguess_verll", "config group 'recipe' has no option 'tinyguess_verll' (available: none "
                                   "tinyguess_verl webshop_verl webshop_windowed_verl); did you mean "
                                   "'tinyguess_verl'?"),
        ("+recipe=nope", "config group 'recipe' has no option 'nope' (available: none tinyguess_verl"),
        ("env=null", "config group 'env' needs one of its options, not null (options in "),
        ("recipe=[nope]", "config group 'recipe' takes one option, not ['nope'] (options in "),
        ("strategy=[fedavg,fedprox]", "config group 'strategy' takes one option, not ['fedavg', 'fedprox']"),
        ("recipe=true", "config group 'recipe' has no option 'true' (options in "),
        ("strategy=1.5", "config group 'strategy' has no option '1.5' (options in "),
        ("recipe=''", "; recipe=none selects none"),
        ("recipe=tinyguess_verl recipe=nope", "config group 'recipe' has no option 'nope'"),  # each one is checked
        ("strategy.weights=[1,0]", "config key 'strategy.weights'"),
        ("strategy.weights=[1,2,3]", "has 3 entries but clients.total is 2"),
        ("strategy.proximal_mu=-0.1", "config key 'strategy.proximal_mu'"),
        ("experiment.local_client_id=5", "config key 'experiment.local_client_id'"),
        ("experiment=centralized clients.total=2", "experiment 'centralized' does not match"),
        ("algorithm=ppo", "needs the verl backend"),
        ("algorithm=dqn", "config key 'algorithm'"),
        ("partition.strategy=random", "config key 'partition.strategy'"),
        ("env.train.envs.0.n_envs=0", "config key 'env.train'"),
        ("env.train.envs.0.name=Nope", "config key 'env.train'"),
        ("model.lora.rank=-1", "config key 'model.lora.rank' = -1 is invalid"),
        ("model.lora.alpha=0", "config key 'model.lora.alpha' = 0 is invalid"),
        ("model.lora.dropout=1", "config key 'model.lora.dropout' = 1.0 is invalid"),
        ("model.lora.rank=8 model.lora.target_modules=[]", "config key 'model.lora.target_modules' is empty"),
        ("model.lora.target_modules=['q proj']", "config key 'model.lora.target_modules' entry 0 = 'q proj'"),
        ("model.lora.rankk=8", "unknown config key 'model.lora.rankk'"),
        ("trainer.lora.rank=8", "config key 'trainer.lora' is set from 'model.lora'; set model.lora instead"),
        ("model.lora.rank=8 trainer=verl", "config key 'model.lora.rank' = 8: model.lora is supported by the reference "
                                           "trainer; verl LoRA is not wired yet"),
        ("model.lora.rank=8 trainer.mode=persistent trainer.optimizer_state=keep",
         "config key 'trainer.optimizer_state' = 'keep' does not go with model.lora.rank = 8"),
        ("num_rounds", "is not of the form key=value"),
        ("overrides='unbalanced", "cannot be parsed"),
    ],
)
def test_bad_config_names_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(overrides=override)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_client_selection_follows_fedagent_rule() -> None:
    import random

    for r in (1, 2, 7):
        expected = sorted(random.Random(42 + r - 1).sample(range(10), 3))
        assert select_clients(r, 10, 3, 42) == expected
    assert select_clients(3, 4, 4, 42) == [0, 1, 2, 3]
    assert select_clients(3, 4, 2, 42, local_client_id=1) == [1]
    assert data_seed(42, 2, 3) == 42 + 200 + 3


def test_partition_strategies_and_knobs_are_checked() -> None:
    assert load_settings(overrides="env=webshop partition=coverage partition.size_std=0.5").partition["size_std"] == 0.5
    for override, message in [
        ("partition=preference", "needs goal metadata, which environment TinyGuess does not provide"),
        ("env=webshop partition=preference partition.omega=1.5", "config key 'partition.omega'"),
        ("env=webshop partition=hardness", "config key 'partition.trajectories_file'"),
        # a misspelt knob of a built-in strategy would silently leave the default in force
        ("env=webshop partition=coverage +partition.sizestd=16",
         "config key 'partition.sizestd' is not a knob of the built-in partition strategies: did you mean 'size_std'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_settings(overrides=override)
    # every key a built-in strategy reads is declared, so none of them is refused, and a declared knob
    # that the chosen group's file leaves out is set without Hydra's '+'
    lookalike = load_settings(overrides="env=webshop partition=lookalike partition.lookalike_pool=[v_color] "
                                        "partition.lookalike_dir=/x").partition
    assert (lookalike["lookalike_pool"], lookalike["lookalike_dir"]) == (["v_color"], "/x")
    scenes = load_settings(overrides="env=alfworld partition=env_disjoint partition.holdout_scenes=[FloorPlan1]")
    assert scenes.partition["holdout_scenes"] == ["FloorPlan1"]
    assert load_settings(overrides="env=webshop partition=coverage partition.omega=0.3").partition["omega"] == 0.3
    # a partition function of one's own reads keys of its own: they pass, unchecked
    custom = load_settings(
        overrides="partition.strategy=examples.partition_round_robin.round_robin +partition.stride=3")
    assert custom.partition["stride"] == 3


def test_partition_defaults_are_fedagents_and_knobs_are_checked() -> None:
    assert load_settings().partition == {"strategy": "uniform", "min_goals_per_client": 100}
    env_disjoint = load_settings(overrides="env=alfworld partition=env_disjoint").partition
    assert (env_disjoint["env_div"], env_disjoint["fallback"], env_disjoint["unit"]) == (0.7, "skip", "game")
    for override, message in [
        ("env=alfworld partition=env_disjoint partition.fallback=rooms", "config key 'partition.fallback'"),
        ("env=alfworld partition=env_disjoint partition.unit=room", "config key 'partition.unit'"),
        ("env=webshop partition=coverage partition.min_goals_per_client=600", "must be <= 500 for coverage"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_settings(overrides=override)


def test_environment_level_arms_need_a_served_env() -> None:
    assert load_settings(overrides="env=webshop partition=catalog_split").partition["env_div"] == 0.7
    assert load_settings(overrides="env=webshop partition=lookalike").partition["strategy"] == "lookalike"
    with pytest.raises(ConfigError, match="set env.service.enabled=true"):
        load_settings(overrides="partition=catalog_split")
    with pytest.raises(ConfigError, match="environment TinyGuess does not support"):
        load_settings(overrides="env=tinyguess_service partition=rank_wrapper")
    with pytest.raises(ConfigError, match="config key 'partition.env_div'"):
        load_settings(overrides="env=webshop partition=catalog_split partition.env_div=3")


@pytest.mark.parametrize("group", sorted(p.stem for p in (conf_dir() / "env").glob("*.yaml")))
def test_every_env_group_composes_and_validates(group: str) -> None:
    """Each shipped env group is a complete, valid config (a key one group lacks stops its runs)."""
    import yaml

    settings = load_settings(overrides=f"env={group}")
    declared = yaml.safe_load((conf_dir() / "env" / f"{group}.yaml").read_text())
    assert settings.run.env.name == declared.get("name", settings.run.env.name) and settings.run.env.name


@pytest.mark.parametrize("group", sorted(p.stem for p in (conf_dir() / "trainer").glob("*.yaml")))
def test_every_trainer_group_composes_and_validates(group: str) -> None:
    settings = load_settings(overrides=f"trainer={group}")
    # a group is named for its backend, or is a preset of one (verl_ppo: FedAgent's PPO on verl)
    assert group == settings.trainer_backend or group.startswith(f"{settings.trainer_backend}_")


def test_service_pool_must_hold_what_the_reference_trainer_plays_at_once() -> None:
    # It samples a step's episodes in lockstep: an episode waiting for a pool slot would stall the rest.
    with pytest.raises(ConfigError, match=r"'env.service.pool_size' = 4 .* 8 episodes .* set env.service.pool_size=8"):
        load_settings(overrides="env=tinyguess_service trainer.rollout_n=4")
    # validation plays in waves of the pool (tests/trainers/test_eval_waves.py): 8 episodes on 4 slots pass
    assert load_settings(overrides="env=tinyguess_service clients.total=1 clients.per_round=1 experiment=centralized")
    assert load_settings(overrides="env=tinyguess_service env.service.pool_size=8 trainer.rollout_n=4")


def test_a_declared_strategy_kwarg_is_set_with_or_without_a_plus() -> None:
    # strategy.kwargs is an open mapping (a custom Strategy's own arguments need "+"), but the keys
    # the ServerApp reads itself are settings: both forms set them, and an unknown key says how.
    for override in ("strategy.kwargs.discovery_timeout=5", "+strategy.kwargs.discovery_timeout=5"):
        assert load_settings(overrides=override).run.strategy.kwargs.discovery_timeout == 5.0
    with pytest.raises(ConfigError,
                       match=r"unknown config key 'strategy.kwargs.foo': .* with '\+strategy.kwargs.foo=\.\.\.'"):
        load_settings(overrides="strategy.kwargs.foo=1")
    assert load_settings(overrides="+strategy.kwargs.foo=1").raw["strategy"]["kwargs"] == {"foo": 1}


def test_lora_settings_travel_to_every_job_as_the_model_group_sets_them() -> None:
    settings = load_settings(overrides="model.lora.rank=8 model.lora.alpha=32 "
                                       "model.lora.target_modules=[q_proj,v_proj]")
    lora = {"rank": 8, "alpha": 32, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}
    assert settings.trainer["lora"] == lora  # what a job file carries
    from fedagent_flwr.trainers.reference.config import GRPOConfig

    cfg, _ = GRPOConfig.from_mapping(settings.trainer)
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules) == (8, 32, ["q_proj", "v_proj"])
    # off by default, with the Llama-style attention projections as the targets
    default = load_settings().trainer["lora"]
    assert default == {"rank": 0, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                       "dropout": 0.0}
    # a verl job file written by hand with an adapter is refused by the job's own check, in the same words
    from fedagent_flwr.schema import SettingError
    from fedagent_flwr.trainers.verl.settings import VerlSettings

    with pytest.raises(SettingError, match="model.lora is supported by the reference trainer; verl LoRA is not wired"):
        VerlSettings.from_mapping({"lora": lora})
