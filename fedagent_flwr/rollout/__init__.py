"""Multi-turn rollouts: the episode runners (concat and windowed) shared by the verl agent loop and the
reference trainer."""

from fedagent_flwr.rollout.episode import (
    ChatTemplateError,
    ConversationError,
    Episode,
    GenerateFn,
    SamplingParams,
    TurnRecord,
    WindowSample,
    run_episode,
    tokenize_conversation,
)
from fedagent_flwr.rollout.windowed import ROLLOUT_MODES, run_windowed_episode

__all__ = ["ROLLOUT_MODES", "ChatTemplateError", "ConversationError", "Episode", "GenerateFn", "SamplingParams",
           "TurnRecord", "WindowSample", "run_episode", "run_windowed_episode", "tokenize_conversation"]
