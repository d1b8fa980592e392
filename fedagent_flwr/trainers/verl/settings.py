"""The verl backend's knobs (the ``trainer`` config group with ``backend: verl``), typed and checked.

The fields, defaults and bounds are :class:`~fedagent_flwr.schema.trainer.VerlKnobs`'s, checked by
the schema's one validator (on the server when the run is composed, and here for a job file).
Importable without verl or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedagent_flwr.rollout.bounds import TokenBounds
from fedagent_flwr.schema import check
from fedagent_flwr.schema.trainer import VERL_LOGGERS, AgentLoopKnobs, VerlKnobs  # noqa: F401  # VERL_LOGGERS: re-exported


@dataclass
class VerlSettings(AgentLoopKnobs, VerlKnobs):
    """Hyper-parameters and resources of one client's verl job (see ``conf/trainer/verl.yaml``)."""

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> tuple[VerlSettings, list[str]]:
        """Checked settings from the trainer group, and the keys it does not know (sorted).

        Unknown keys are returned rather than refused: the group also carries the ClientApp's own
        keys (``backend``, ``timeout_s``) and evaluation knobs of the reference trainer.
        """
        return check(cls, raw, "trainer", known_only=True)

    @property
    def loggers(self) -> list[str]:
        """verl's ``trainer.logger`` list: console (the job's log), file (the per-step metrics the
        client reads, :mod:`.verl_log`), then the user's ``verl_logger`` in its order."""
        return list(dict.fromkeys(("console", "file", *self.verl_logger)))

    @property
    def token_bounds(self) -> TokenBounds:
        """The bounds the agent loop plays every episode under (``data.max_prompt_length`` and
        ``data.max_response_length`` are these two keys), and so the ones validation plays under."""
        return TokenBounds.prompt_response(self.max_prompt_length, self.max_response_length)

    @property
    def max_model_len(self) -> int:
        """Token budget of one episode (prompt plus every turn), as the agent loop enforces it."""
        return self.token_bounds.max_model_len
