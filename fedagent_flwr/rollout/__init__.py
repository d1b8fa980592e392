"""Multi-turn rollouts: the episode runner shared by the verl agent loop and the reference trainer."""

from fedagent_flwr.rollout.episode import (
    ChatTemplateError,
    Episode,
    GenerateFn,
    SamplingParams,
    TurnRecord,
    run_episode,
)

__all__ = ["ChatTemplateError", "Episode", "GenerateFn", "SamplingParams", "TurnRecord", "run_episode"]
