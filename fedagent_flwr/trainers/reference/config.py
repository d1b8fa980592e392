"""The reference trainer's hyper-parameters (``job.trainer``), built by the schema's one validator."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedagent_flwr.rollout.episode import SamplingParams
from fedagent_flwr.schema import SettingError, check
from fedagent_flwr.schema.trainer import ReferenceKnobs
from fedagent_flwr.trainers.common.checks import InputError
from fedagent_flwr.trainers.common.evaluator import EvalSettings
from fedagent_flwr.trainers.common.precision import torch_compute_dtype


@dataclass
class GRPOConfig(ReferenceKnobs, EvalSettings):
    """The reference trainer's settings: the fields, defaults and bounds are
    :class:`~fedagent_flwr.schema.trainer.ReferenceKnobs`'s; this class adds what the trainer does
    with them.

    The evaluation knobs are :class:`~fedagent_flwr.schema.trainer.EvalKnobs`'s: a GRPOConfig is
    what the evaluator reads. ``compute_dtype`` "bfloat16" samples with a bf16 copy of the weights
    and runs the update under bf16 autocast (fp32 master weights, optimiser and checkpoint), as
    verl's FSDP mixed precision + bf16 vLLM do. ``device`` is where evaluation runs; training
    always runs on the CPU.
    """

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> tuple[GRPOConfig, list[str]]:
        """Checked config from ``job.trainer`` and the keys it ignored (other backends' knobs).

        The server checked the same mapping with the same validator; a job file written by hand
        gets the same checks here.
        """
        try:
            return check(cls, raw, "trainer", known_only=True)
        except SettingError as exc:
            raise InputError(str(exc)) from None

    def torch_compute_dtype(self, device: Any = None) -> Any:
        """The resolved compute dtype (``torch.float32`` or ``torch.bfloat16``) on ``device``."""
        return torch_compute_dtype(self.compute_dtype, device)

    def sampling(self) -> SamplingParams:
        """Training sampling parameters (validation's: :meth:`val_sampling`)."""
        return SamplingParams(self.max_new_tokens, self.temperature, self.top_p)
