"""TrainJob / TrainResult (and the evaluation pair): the JSON contract between the ClientApp and
a trainer subprocess.

The ClientApp writes a job file, starts ``python -m <backend module> train|evaluate <job.json>``
and reads the result file the subprocess wrote (atomically) next to it. Keeping this contract
small and typed lets the CPU reference trainer and the verl backend be swapped freely.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fedagent_flwr.atomic import write_json_atomic
from fedagent_flwr.schema.fields import Bound, SettingError, check, renamed
from fedagent_flwr.schema.run import RunSchema, Strategy, Train

T = TypeVar("T")


class JobFileError(ValueError):
    """A job or result file that is missing, not JSON, or lacks required fields."""


@dataclass
class TrainJob:
    """Everything a trainer needs for one (round, client) training run."""

    model_path: str  # HF directory of the global model to start from
    output_dir: str  # where the trainer writes checkpoints/, train_result.json, logs
    env_spec: dict[str, Any]  # {"envs": [{name, n_envs, max_turns, config}]}
    round: int
    client_id: int = field(metadata={"bound": Bound(ge=0)})
    num_clients: int = field(metadata={"bound": Bound(ge=1)})
    data_seed: int  # base_seed + 100 * round + client_id (FedAgent's rule)
    base_seed: int = renamed(RunSchema, "seed")  # the run's seed: partitions are drawn from it, every round alike
    algorithm: str = RunSchema.algorithm
    local_steps: int = renamed(Train, "local_steps")  # optimiser steps per epoch, each on new env instances
    proximal_mu: float = renamed(Strategy, "proximal_mu")
    critic_path: str = ""
    partition: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)  # backend hyper-parameters
    epochs: int = renamed(Train, "epochs")  # E: passes over the round's instances (x local_steps optimiser steps)

    def check_together(self, prefix: str) -> None:
        """Fields that constrain each other (run by :func:`load`)."""
        if self.client_id >= self.num_clients:
            raise SettingError(f"client_id {self.client_id} is out of range for num_clients {self.num_clients}")


@dataclass
class TrainResult:
    """What a trainer reports back: checkpoint directories and metrics."""

    actor_dir: str  # checkpoint directory to aggregate (fsdp-shards or hf-safetensors)
    actor_format: str
    num_episodes: int
    metrics: dict[str, float]
    critic_dir: str = ""
    world_size: int = 1


@dataclass
class EvalJob:
    """Validation episodes of one model on the unperturbed validation setting."""

    model_path: str
    output_dir: str
    env_spec: dict[str, Any]
    round: int
    seeds: list[int]  # one episode per seed
    trainer: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalResult:
    """Validation outcome: episodes run, success rate and mean reward."""

    num_episodes: int
    success_rate: float
    reward_mean: float
    metrics: dict[str, float] = field(default_factory=dict)


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write a job/result dataclass as JSON, atomically."""
    write_json_atomic(path, asdict(obj))


def load(cls: type[T], path: str | os.PathLike[str]) -> T:
    """Read a job/result dataclass from JSON; unknown, missing or bad fields give a JobFileError
    (the schema's one validator checks them, as it checks the trainer settings in ``trainer``)."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise JobFileError(f"{cls.__name__} file {path} does not exist") from exc
    except json.JSONDecodeError as exc:
        raise JobFileError(f"{cls.__name__} file {path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise JobFileError(f"{cls.__name__} file {path} must hold a JSON object")
    try:
        return check(cls, raw)[0]
    except SettingError as exc:
        raise JobFileError(f"{cls.__name__} file {path}: {exc}") from None


def backend_main(
    prog: str,
    argv: Sequence[str] | None,
    train: Callable[[TrainJob], Any],
    evaluate: Callable[[EvalJob], Any],
    bad_input: tuple[type[BaseException], ...],
    failures: tuple[type[BaseException], ...] = (),
    session_factory: Callable[[], Any] | None = None,
) -> int:
    """The command line every trainer backend shares: ``train|evaluate JOB.json``, and
    ``serve CHANNEL_DIR`` for a backend with a ``session_factory`` (the persistent trainer,
    :mod:`.trainer_server`).

    Returns the exit status: 0 done, 1 one of ``failures`` (the job ran but produced nothing
    usable), 2 bad input (``bad_input`` or a bad job file). Errors are one line on stderr,
    ``<prog>: error: ...``, which the ClientApp quotes to the server.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    modes = ("train", "evaluate", "serve") if session_factory is not None else ("train", "evaluate")
    if len(args) != 2 or args[0] not in modes:
        usage = " or ".join(f"'{m} {'CHANNEL_DIR' if m == 'serve' else 'JOB.json'}'" for m in modes)
        print(f"{prog}: error: expected {usage}", file=sys.stderr)
        return 2
    mode, job_path = args
    if mode == "serve":
        from fedagent_flwr.clientapp.trainer_server import serve

        assert session_factory is not None
        return serve(job_path, session_factory, prog, bad_input, failures)
    try:
        if mode == "train":
            train(load(TrainJob, job_path))
        else:
            evaluate(load(EvalJob, job_path))
    except failures as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except (JobFileError, SettingError, *bad_input) as exc:  # type: ignore[misc]  # mypy cannot type a starred except tuple
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0
