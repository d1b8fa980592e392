"""User-style Strategy subclasses, loaded by dotted path in the simulation tests.

``ClientIdWeighted`` changes the aggregation rule (client c weighs c + 1, whatever its episode
count) and, to test failure handling, gives client 1 an unknown environment in round 1 so that
client's trainer subprocess exits non-zero. The ``Breaks*`` strategies break round 1 (or every
round) for every client, alike or differently, to test how the run ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from flwr.app import ConfigRecord

from fedagent_flwr.protocol import TrainInstruction, TrainReply
from fedagent_flwr.serverapp.strategy import FedAvgFSDP

BROKEN_SPEC = {"envs": [{"name": "NoSuchEnv", "n_envs": 1, "max_turns": 1, "config": {}}]}


# TinyGuess with an empty range: the trainer refuses it, with an error other than NoSuchEnv's.
EMPTY_RANGE_SPEC = {"envs": [{"name": "TinyGuess", "n_envs": 1, "max_turns": 1, "config": {"lo": 20, "hi": 10}}]}


class _BreaksRoundOne(FedAvgFSDP):
    """FedAvgFSDP that gives chosen clients of round 1 an env spec their trainer cannot play."""

    broken: ClassVar[dict[int, dict]] = {}

    def train_instruction(self, server_round: int, client: int, config: ConfigRecord) -> TrainInstruction:
        instruction = super().train_instruction(server_round, client, config)
        spec = self.broken.get(client) if server_round == 1 else None
        return instruction if spec is None else dataclasses.replace(instruction, env_spec=spec)


class ClientIdWeighted(_BreaksRoundOne):
    """FedAvgFSDP with weights client_id + 1 and a broken round-1 instruction for client 1."""

    broken: ClassVar[dict[int, dict]] = {1: BROKEN_SPEC}

    def aggregation_weights(self, server_round: int, replies: Sequence[TrainReply]) -> list[float]:
        return [float(reply.client_id + 1) for reply in replies]


class BreaksEveryClientAlike(_BreaksRoundOne):
    """Round 1: both clients get the unknown environment, so both fail the same way."""

    broken: ClassVar[dict[int, dict]] = {0: BROKEN_SPEC, 1: BROKEN_SPEC}


class BreaksEveryClientDifferently(_BreaksRoundOne):
    """Round 1: client 0 gets the unknown environment, client 1 an empty TinyGuess range: round 1
    aggregates nothing, for two different reasons."""

    broken: ClassVar[dict[int, dict]] = {0: BROKEN_SPEC, 1: EMPTY_RANGE_SPEC}


class BreaksEveryRoundDifferently(FedAvgFSDP):
    """Every round: client 0 gets the unknown environment, client 1 an empty TinyGuess range, so no
    round aggregates anything, and never for one reason."""

    broken: ClassVar[dict[int, dict]] = BreaksEveryClientDifferently.broken

    def train_instruction(self, server_round: int, client: int, config: ConfigRecord) -> TrainInstruction:
        instruction = super().train_instruction(server_round, client, config)
        return dataclasses.replace(instruction, env_spec=self.broken[client])
