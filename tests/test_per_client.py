"""``trainer.per_client`` (issue 19): one client on two GPUs beside one on a single GPU, refused
at composition when it cannot apply, and carried into that client's instructions only."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
from flwr.app import ConfigRecord

from fedagent_flwr.checkpoint import CheckpointRef
from fedagent_flwr.clientapp.backend import CLIENTAPP_TRAINER_KEYS
from fedagent_flwr.config import ConfigError, load_settings
from fedagent_flwr.per_client import trainer_for_client
from fedagent_flwr.serverapp.app import build_strategy
from fedagent_flwr.trainers.verl.settings import VerlSettings

MIXED = "trainer=verl trainer.per_client={0:{n_gpus_per_node:2,timeout_s:7200}}"


def test_a_client_gets_its_own_gpus_and_the_others_keep_the_run_value(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = load_settings(overrides=f"output_dir={tmp_path} {MIXED}")
    assert settings.trainer["per_client"] == {"0": {"n_gpus_per_node": 2, "timeout_s": 7200.0}}  # typed as the run's
    strategy = build_strategy(settings, tmp_path, CheckpointRef.for_directory(tiny_model_dir))
    sent = {c: asdict(strategy.train_instruction(1, c, ConfigRecord()).trainer) for c in (0, 1)}
    assert "per_client" not in sent[0] and "per_client" not in sent[1]
    assert (sent[0]["n_gpus_per_node"], sent[0]["timeout_s"]) == (2, 7200.0)
    assert (sent[1]["n_gpus_per_node"], sent[1]["timeout_s"]) == (1, 3600.0)
    # what the verl job of each client reads (the ClientApp drops its own keys first)
    worlds = [VerlSettings.from_mapping({k: v for k, v in sent[c].items() if k not in CLIENTAPP_TRAINER_KEYS})[0]
              .n_gpus_per_node for c in (0, 1)]
    assert worlds == [2, 1]
    assert strategy.eval_instruction(1, 0, [1, 2], ConfigRecord()).trainer.n_gpus_per_node == 2
    # everything else is the run's
    assert {k: v for k, v in sent[0].items() if k not in ("n_gpus_per_node", "timeout_s")} == \
        {k: v for k, v in sent[1].items() if k not in ("n_gpus_per_node", "timeout_s")}


def test_a_run_without_per_client_values_is_unchanged() -> None:
    settings = load_settings(overrides="trainer=verl")
    assert "per_client" not in settings.trainer and "per_client" not in settings.raw["trainer"]
    assert trainer_for_client(settings.trainer, 1) == settings.trainer


@pytest.mark.parametrize(("override", "message"), [
    ("+trainer.per_client={0:{lr:0.1}}", r"'trainer.per_client.0.lr' cannot differ between clients: only resources"),
    ("+trainer.per_client={2:{n_gpus_per_node:2}}", r"names client 2: expected a client id in \[0, 1\]"),
    ("+trainer.per_client={0:{n_gpus_per_node:0}}",
     r"'trainer.per_client.0.n_gpus_per_node' = 0 is invalid: expected >= 1"),
    ("+trainer.per_client={1:{timeout_s:-1}}", r"'trainer.per_client.1.timeout_s' = -1.0 is invalid: expected > 0"),
    ("+trainer.per_client={0:{}}", r"'trainer.per_client.0' must map trainer keys to values"),
    ("+trainer.per_client=[1]", r"'trainer.per_client' must map client ids to trainer keys"),
])
def test_per_client_values_that_cannot_apply_stop_the_run_at_composition(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(overrides=f"trainer=verl {override}")


def test_a_key_the_backend_does_not_read_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'trainer.per_client.1.n_gpus_per_node': the trainer group \(backend "
                                          r"'reference'\) has no key"):
        load_settings(overrides="trainer=reference +trainer.per_client={1:{n_gpus_per_node:2}}")
    reference = load_settings(overrides="trainer=reference +trainer.per_client={1:{timeout_s:60}}")
    assert trainer_for_client(reference.trainer, 1)["timeout_s"] == 60.0
