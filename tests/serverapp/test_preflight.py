"""Start-up checks without a simulation: every env spec is built with its config before round 0
(real environments, real data directories), and a bad value is named by its run-config key with
the fix. The same in real Flower simulations is in ``tests/e2e/test_fail_fast.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.serverapp.preflight import (
    base_model,
    check_env_specs,
    check_lora_targets,
    client_count_warnings,
    service_pool_warnings,
)
from testkit.webshop_data import DATA_DIR as WEBSHOP_DATA

WEBSHOP_DOWNLOAD = "python -m fedagent_flwr.envs.webshop.download"


def test_a_tinyguess_it_cannot_build_is_refused_naming_the_entry() -> None:
    settings = load_settings(overrides="env.train.envs.0.config.lo=20")  # composition accepts it
    with pytest.raises(ConfigError) as info:
        check_env_specs(settings, data_is_local=True)
    assert str(info.value) == "config key 'env.train.envs.0.config': TinyGuess config 'hi' (10) must be >= 'lo' (20)"
    with pytest.raises(ConfigError, match=r"'env.val.envs.0.config': TinyGuess config 'hi' \(10\)"):
        check_env_specs(load_settings(overrides="env.val.envs.0.config.lo=20"), data_is_local=False)
    assert check_env_specs(load_settings(), data_is_local=True) == []


@pytest.mark.parametrize("data_dir", ["/nonexistent", ""])
def test_missing_webshop_data_names_env_data_dir_and_the_download_command(
    data_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FEDAGENT_WEBSHOP_DATA", raising=False)
    settings = load_settings(overrides=f"env=webshop env.data_dir={data_dir}")
    with pytest.raises(ConfigError) as info:
        check_env_specs(settings, data_is_local=True)  # simulation: the clients share this machine
    message = str(info.value)
    assert message.startswith(f"config key 'env.data_dir' = {data_dir!r}: ")
    assert f"{WEBSHOP_DOWNLOAD} {data_dir or 'DATA_DIR'}" in message and "\n" not in message
    # Across machines the data may exist only on the clients: one warning, not a refusal.
    (warning,) = check_env_specs(settings, data_is_local=False)
    assert warning.startswith(message) and "every client needs it" in warning


@pytest.mark.skipif(not (WEBSHOP_DATA / "items_shuffle_1000.json").exists(),
                    reason=f"no WebShop data at {WEBSHOP_DATA}")
def test_webshop_with_its_data_passes_and_bad_values_are_named() -> None:
    assert check_env_specs(load_settings(overrides=f"env=webshop env.data_dir={WEBSHOP_DATA}"),
                           data_is_local=True) == []
    bad = load_settings(overrides=f"env=webshop env.data_dir={WEBSHOP_DATA} "
                                  "+env.val.envs.0.config.observation_format=html")
    with pytest.raises(ConfigError, match=r"^config key 'env.val.envs.0.config.observation_format' = 'html': "):
        check_env_specs(bad, data_is_local=True)


def test_missing_alfworld_data_names_env_data_dir_and_the_download_command(tmp_path: Path) -> None:
    settings = load_settings(overrides=f"env=alfworld env.data_dir={tmp_path / 'none'}")
    with pytest.raises(ConfigError) as info:
        check_env_specs(settings, data_is_local=True)
    assert str(info.value).startswith(f"config key 'env.data_dir' = '{tmp_path / 'none'}': ALFWorld data root ")
    assert f"python -m fedagent_flwr.envs.alfworld.download {tmp_path / 'none'}" in str(info.value)


def test_a_base_model_directory_without_a_model_is_named_as_model_path(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert base_model(tiny_model_dir, str(tiny_model_dir)).sha256
    with pytest.raises(ConfigError, match=r"^config key 'model.path' = '/x': .* is not a Hugging Face model directory"):
        base_model(tmp_path, "/x")


def test_a_verl_step_larger_than_the_service_pool_is_warned_about_naming_the_key() -> None:
    # verl's agent loop starts a step's episodes at once: past the pool they queue for a slot, and
    # one that waits past the service's create timeout fails the job. The reference trainer would
    # stall instead and is refused by the config check (tests/test_config.py).
    settings = load_settings(overrides="env=tinyguess_service trainer=verl trainer.rollout_n=4")
    (warning,) = service_pool_warnings(settings)
    n_envs = settings.train_env_spec["envs"][0]["n_envs"]
    assert warning.startswith(f"config key 'env.service.pool_size' = 4: a verl step plays {4 * n_envs} episodes "
                              "of env.train.envs.0 at once")
    assert f"set env.service.pool_size={4 * n_envs}" in warning and "300 s" in warning
    roomy = load_settings(overrides=f"env=tinyguess_service trainer=verl trainer.rollout_n=4 "
                                    f"env.service.pool_size={4 * n_envs}")
    assert service_pool_warnings(roomy) == []
    assert service_pool_warnings(load_settings(overrides="trainer=verl trainer.rollout_n=4")) == []  # no services


@pytest.mark.parametrize(("targets", "message"), [
    ("[q_proj,qproj]", "config key 'model.lora.target_modules' entry 'qproj' matches no module of the base model "),
    ("[lm_head]", "config key 'model.lora.target_modules' entry 'lm_head' matches lm_head, whose weight the base "
                  "model ties to model.embed_tokens.weight"),
    ("[embed_tokens]", "config key 'model.lora.target_modules' entry 'embed_tokens' matches model.embed_tokens "
                       "(Embedding): federated LoRA adapts linear layers only"),
])
def test_lora_targets_the_adapters_could_not_use_are_refused_at_start(tiny_model_dir: Path, targets: str,
                                                                       message: str) -> None:
    settings = load_settings(overrides=f"model.lora.rank=4 model.lora.target_modules={targets}")
    with pytest.raises(ConfigError) as info:
        check_lora_targets(settings, tiny_model_dir)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    # the default targets (the attention projections) and the MLP's fit the tiny Qwen2 model; rank 0 checks nothing
    check_lora_targets(load_settings(overrides="model.lora.rank=4"), tiny_model_dir)
    check_lora_targets(load_settings(overrides="model.lora.rank=4 model.lora.target_modules=[gate_proj,down_proj]"),
                       tiny_model_dir)
    check_lora_targets(load_settings(overrides=f"model.lora.target_modules={targets}"), tiny_model_dir)


def test_lora_without_peft_installed_is_refused_at_start_naming_the_extra(tiny_model_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError, as without the package
    with pytest.raises(ConfigError, match=r"config key 'model.lora.rank' = 4 needs peft, .*fedagent-flwr\[lora\]"):
        check_lora_targets(load_settings(overrides="model.lora.rank=4"), tiny_model_dir)


def test_client_counts_that_run_otherwise_than_written_are_warned_about() -> None:
    (warning,) = client_count_warnings(load_settings(overrides="clients.per_round=5"))
    assert warning == ("config key 'clients.per_round' = 5 is more than clients.total = 2: every round trains all 2 "
                       "clients")
    assert client_count_warnings(load_settings(overrides="clients.total=4 clients.per_round=4")) == []
    (many,) = client_count_warnings(load_settings(overrides="clients.total=101 clients.per_round=2"))
    assert many.startswith("with more than 100 clients FedAgent's data seed rule")
