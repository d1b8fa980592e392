"""Fixtures shared by the trainer tests of this folder."""

from __future__ import annotations

from typing import Any

import pytest

from fedagent_flwr.rollout.episode import Episode
from fedagent_flwr.trainers.common import evaluator


@pytest.fixture
def played_batches(monkeypatch: pytest.MonkeyPatch) -> list[list[Episode]]:
    """The episodes of every ``play_episodes`` call the evaluator makes during the test, call by
    call (the real player runs; this only keeps what it returned)."""
    played: list[list[Episode]] = []
    play = evaluator.play_episodes

    def recording(*args: Any, **kwargs: Any) -> list[Episode]:
        played.append(play(*args, **kwargs))
        return played[-1]

    monkeypatch.setattr(evaluator, "play_episodes", recording)
    return played
