"""The run-wide part of every instruction: what the run's config says each client trains and
evaluates on (the ServerApp builds it from the resolved config; a strategy adds the per-round,
per-client part)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedagent_flwr.per_client import trainer_for_client


@dataclass(frozen=True)
class RunPlan:
    """Algorithm, trainer settings, env specs, partition and env-service settings of a run.

    ``epochs`` is E, the passes over a round's instances; ``client_eval_seeds`` (empty: off) are the
    validation episodes each trained client plays with its own model (per-client validation)."""

    algorithm: str = "grpo"
    local_steps: int = 1
    epochs: int = 1
    client_eval_seeds: tuple[int, ...] = ()
    trainer: dict[str, Any] = field(default_factory=dict)
    train_env_spec: dict[str, Any] = field(default_factory=dict)
    val_env_spec: dict[str, Any] = field(default_factory=dict)
    partition: dict[str, Any] = field(default_factory=lambda: {"strategy": "none"})
    service: dict[str, Any] = field(default_factory=lambda: {"enabled": False})

    def trainer_for(self, client: int) -> dict[str, Any]:
        """Client ``client``'s trainer group: the run's with its ``trainer.per_client`` resources."""
        return trainer_for_client(self.trainer, client)

    def train_episodes(self) -> int | None:
        """Episodes one client plays in a round: ``epochs`` x ``local_steps`` x ``rollout_n`` x the
        env instances (``n_envs``) of the train env spec. None when the plan does not say (a strategy
        built without the ServerApp's plan)."""
        try:
            rollout_n = self.trainer.get("rollout_n")
            if rollout_n is None:  # the backend's own default
                if self.trainer.get("backend") == "verl":
                    from fedagent_flwr.trainers.verl.settings import VerlSettings

                    rollout_n = VerlSettings.rollout_n
                else:
                    from fedagent_flwr.trainers.reference.config import GRPOConfig

                    rollout_n = GRPOConfig.rollout_n
            instances = sum(int(entry["n_envs"]) for entry in self.train_env_spec["envs"])
            return int(self.epochs) * int(self.local_steps) * int(rollout_n) * instances
        except (KeyError, TypeError, ValueError):
            return None
