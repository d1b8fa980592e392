"""The reference trainer's command line (``python -m fedagent_flwr.trainers.reference``)."""

from __future__ import annotations

from collections.abc import Sequence

from fedagent_flwr.clientapp.job import backend_main
from fedagent_flwr.trainers.common.checks import BAD_INPUT
from fedagent_flwr.trainers.reference.session import ReferenceSession
from fedagent_flwr.trainers.reference.train import PROG, evaluate, train


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input)."""
    return backend_main(PROG, argv, train, evaluate, BAD_INPUT, session_factory=ReferenceSession)
