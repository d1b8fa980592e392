"""tools/gpu/run_ws2.sh (issue 19) on CPU: the run it starts is accepted by the ServerApp's checks
and by verl's own config validation at the world sizes it asks for, before any GPU is touched."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from fedagent_flwr.clientapp.backend import CLIENTAPP_TRAINER_KEYS
from fedagent_flwr.config import load_settings
from fedagent_flwr.per_client import trainer_for_client
from fedagent_flwr.trainers.verl.overrides import build_overrides, job_paths
from fedagent_flwr.trainers.verl.settings import VerlSettings
from testkit.verl_probe import compose_verl_config

SCRIPT = Path(__file__).resolve().parents[3] / "tools" / "gpu" / "run_ws2.sh"


def _overrides(mode: str) -> str:
    """The Hydra overrides the script gives run_federated.sh for ``mode`` (its own two lines)."""
    lines = re.findall(r'^\s*overrides="(.*)"$', SCRIPT.read_text(), flags=re.MULTILINE)
    assert len(lines) == 2, lines
    text = lines[0] + " " + lines[1].replace("$overrides", "")
    return " ".join(shlex.split(text.replace("$mode", mode).replace("$EXTRA", "")))


def test_the_script_is_valid_bash_and_refuses_a_host_without_two_gpus(tmp_path: Path) -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                         env={"PATH": f"{fake_bin}:/usr/bin:/bin", "OUT": str(tmp_path)})
    assert run.returncode == 2 and "this host has 1 GPU(s); issue 19 needs 2" in run.stderr


@pytest.mark.parametrize("mode", ["subprocess", "persistent"])
def test_the_run_composes_with_world_sizes_2_and_1_that_verl_accepts(mode: str, tmp_path: Path,
                                                                      tiny_model_dir: Path) -> None:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    settings = load_settings(overrides=f"output_dir={tmp_path} {_overrides(mode)}")
    assert settings.run.num_rounds == 2 and settings.run.clients.total == 2 and settings.trainer["mode"] == mode
    assert settings.storage.keep_client_checkpoints  # verify re-reads the clients' shards
    batch = sum(entry["n_envs"] for entry in settings.train_env_spec["envs"])
    worlds = []
    for client in (0, 1):
        trainer = {k: v for k, v in trainer_for_client(settings.trainer, client).items()
                   if k not in CLIENTAPP_TRAINER_KEYS}
        verl_settings, _ = VerlSettings.from_mapping(trainer)
        worlds.append(verl_settings.n_gpus_per_node)
        paths = job_paths(tmp_path / f"c{client}" / "verl", str(tiny_model_dir), "", "/tmp/fa-ray-test")
        cfg = compose_verl_config(build_overrides(algorithm=settings.run.algorithm, settings=verl_settings, paths=paths,
                                                  batch_size=batch, local_steps=settings.run.train.local_steps, seed=1,
                                                  experiment_name=f"client{client}"))
        validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        assert cfg.trainer.n_gpus_per_node == verl_settings.n_gpus_per_node
    assert worlds == [2, 1]
