"""A user-style Strategy subclass, loaded by dotted path in the simulation tests.

It changes the aggregation rule (client c weighs c + 1, whatever its episode count) and, to test
failure handling, gives client 1 an unknown environment in round 1 so that client's trainer
subprocess exits non-zero.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from fedagent_flwr.serverapp.strategy import FedAvgFSDP

BROKEN_SPEC = {"envs": [{"name": "NoSuchEnv", "n_envs": 1, "max_turns": 1, "config": {}}]}


class ClientIdWeighted(FedAvgFSDP):
    """FedAvgFSDP with weights client_id + 1 and a broken round-1 instruction for client 1."""

    def aggregation_weights(self, server_round: int, replies: Sequence[Message]) -> list[float]:
        return [float(int(r.content["config"]["client-id"]) + 1) for r in replies]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if server_round == 1:
            for message in messages:
                instruction = message.content["config"]
                if int(instruction["client-id"]) == 1:
                    instruction["env-spec-json"] = json.dumps(BROKEN_SPEC)
        return messages
