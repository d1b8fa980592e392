"""The reference trainer's command line (``python -m fedagent_flwr.trainers.reference``)."""

from __future__ import annotations

from collections.abc import Sequence

from fedagent_flwr.clientapp.job import JobFileError, backend_main
from fedagent_flwr.envs.base import EnvConfigError
from fedagent_flwr.envs.registry import UnknownEnvError
from fedagent_flwr.envs.spec import EnvSpecError
from fedagent_flwr.hetero import PartitionError
from fedagent_flwr.models.smollm2 import ModelResolutionError
from fedagent_flwr.trainers.common.checks import InputError
from fedagent_flwr.trainers.common.client_rule import ClientRuleError
from fedagent_flwr.trainers.reference.session import ReferenceSession
from fedagent_flwr.trainers.reference.train import PROG, evaluate, train

_BAD_INPUT = (InputError, JobFileError, EnvSpecError, UnknownEnvError, PartitionError, EnvConfigError,
              ModelResolutionError, ClientRuleError)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input)."""
    return backend_main(PROG, argv, train, evaluate, _BAD_INPUT, session_factory=ReferenceSession)
