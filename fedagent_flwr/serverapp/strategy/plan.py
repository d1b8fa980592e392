"""The run-wide part of every instruction: what the run's config says each client trains and
evaluates on (the ServerApp builds it from the resolved config; a strategy adds the per-round,
per-client part)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from fedagent_flwr.schema.run import RunSchema, Train
from fedagent_flwr.schema.trainer import TrainerSettings, trainer_settings


@dataclass(frozen=True)
class RunPlan:
    """Algorithm, trainer settings, env specs, partition and env-service settings of a run.

    ``epochs`` is E, the passes over a round's instances; ``client_eval_seeds`` (empty: off) are the
    validation episodes each trained client plays with its own model (per-client validation)."""

    algorithm: str = RunSchema.algorithm  # the schema's defaults
    local_steps: int = Train.local_steps
    epochs: int = Train.epochs
    client_eval_seeds: tuple[int, ...] = ()
    # the checked trainer group (a mapping given here is checked by the schema's validator)
    trainer: TrainerSettings = field(default_factory=lambda: trainer_settings({}))
    train_env_spec: dict[str, Any] = field(default_factory=dict)
    val_env_spec: dict[str, Any] = field(default_factory=dict)
    partition: dict[str, Any] = field(default_factory=lambda: {"strategy": "none"})
    service: dict[str, Any] = field(default_factory=lambda: {"enabled": False})
    # trainer.per_client: client id (str) -> its own resource values, checked when the run was composed
    per_client: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "trainer", trainer_settings(self.trainer))

    def trainer_for(self, client: int) -> TrainerSettings:
        """Client ``client``'s trainer settings: the run's with its ``trainer.per_client`` resources."""
        return replace(self.trainer, **self.per_client.get(str(client), {}))

    def train_episodes(self) -> int | None:
        """Episodes one client plays in a round: ``epochs`` x ``local_steps`` x ``rollout_n`` x the
        env instances (``n_envs``) of the train env spec. None when the plan has no train env spec (a
        strategy built without the ServerApp's plan)."""
        try:
            rollout_n = self.trainer.rollout_n  # type: ignore[attr-defined]  # every backend's schema has it
            instances = sum(int(entry["n_envs"]) for entry in self.train_env_spec["envs"])
            return int(self.epochs) * int(self.local_steps) * int(rollout_n) * instances
        except (KeyError, TypeError, ValueError):
            return None

    def eval_episodes(self, seeds: int) -> int | None:
        """Episodes a client plays evaluating ``seeds`` validation seeds: one per seed in every env of
        the validation env spec (the evaluator's rule). None when the plan has no validation env spec."""
        try:
            entries = len(self.val_env_spec["envs"])
        except (KeyError, TypeError):
            return None
        return seeds * entries if entries else None
