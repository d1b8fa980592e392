"""The env-episode dataset verl trains on (``data.custom_cls``): one row per environment instance.

verl's trainer iterates a ``torch.utils.data.Dataset`` of prompts; for agentic RL a "prompt" is an
environment instance (env name, config, seed, turn budget) that the agent loop plays. The rows are
planned by the entry module (:func:`plan_rows`) with the same seed rule as the CPU reference
trainer, written to a JSON file, and that file is what ``data.train_files`` names, so the dataset
itself is a plain, deterministic reader.

Each row carries what verl's loop machinery requires (``raw_prompt``, ``index``, ``extra_info``,
``agent_name``, ``data_source``, ``reward_model`` and a one-element ``dummy_tensor`` so the
batch is never empty) and **no** ``input_ids``/``attention_mask``/``position_ids``: the agent
loop's output provides those, and verl would refuse the collision. verl repeats every row
``rollout.n`` times to form GRPO groups.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedagent_flwr.atomic import write_json_atomic
from fedagent_flwr.envs.spec import EnvSpec
from fedagent_flwr.seeding import train_env_seed

AGENT_NAME = "fedagent_env"

#: where ``trainer.request_fingerprints`` makes the agent loop write, beside a row's episode log
#: (``<output>/verl``); here, not in the agent loop, so that job.py can name it without importing verl
FINGERPRINT_FILE = "request_fingerprints.jsonl"


class RowPlanError(ValueError):
    """A row plan file that is missing, not JSON, or has malformed rows."""


def plan_rows(spec: EnvSpec, data_seed: int, local_steps: int, episode_log: str = "") -> list[dict[str, Any]]:
    """Rows for ``local_steps`` training steps, step-major: step ``s`` is rows
    ``[s * B, (s + 1) * B)`` with ``B = sum(n_envs)``, so an unshuffled loader with batch size
    ``B`` plays exactly the reference trainer's instances at each step. The rows are one epoch:
    with ``epochs`` E verl goes through them E times (``trainer.total_epochs``), replaying the
    same instances as FedAgent does, so no row (and no seed) is added for later epochs.

    ``episode_log`` (when given) rides in every row: the agent loop appends each episode there,
    so a persistent trainer whose agent loops outlive the round still logs round ``r``'s episodes
    into round ``r``'s output."""
    rows = []
    for step in range(local_steps):
        for j, entry in enumerate(spec.envs):
            for i in range(entry.n_envs):
                rows.append({
                    "env_name": entry.name,
                    "env_config": entry.env_config(),
                    "seed": train_env_seed(data_seed, j, step, entry.n_envs, i),
                    "max_turns": entry.max_turns,
                    **({"episode_log": episode_log} if episode_log else {}),
                })
    return rows


def write_rows(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Write a row plan atomically; returns ``path``."""
    write_json_atomic(path, {"rows": list(rows)})
    return path


def read_rows(data_files: Any) -> list[dict[str, Any]]:
    """Rows of every plan file in ``data_files`` (one path or a list, as verl passes them)."""
    paths = [data_files] if isinstance(data_files, (str, Path)) else list(data_files)
    rows: list[dict[str, Any]] = []
    for path in paths:
        try:
            raw = json.loads(Path(str(path)).read_text())
        except FileNotFoundError:
            raise RowPlanError(f"row plan {path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise RowPlanError(f"row plan {path} is not JSON: {exc}") from None
        plan = raw.get("rows") if isinstance(raw, dict) else None
        if not isinstance(plan, list):
            raise RowPlanError(f"row plan {path} must be an object with a 'rows' list")
        for k, row in enumerate(plan):
            missing = {"env_name", "env_config", "seed", "max_turns"} - set(row if isinstance(row, dict) else ())
            if missing:
                raise RowPlanError(f"row {k} of {path} lacks {sorted(missing)}")
        rows += plan
    if not rows:
        raise RowPlanError(f"row plan(s) {paths} hold no rows")
    return rows


def _torch_dataset_base() -> type:
    # verl requires a torch Dataset subclass; importing torch lazily keeps `plan_rows` light.
    from torch.utils.data import Dataset

    return Dataset


class EnvEpisodeDataset(_torch_dataset_base()):  # type: ignore[misc]
    """verl ``data.custom_cls``: rows of a plan file as verl batch entries.

    verl constructs it as ``EnvEpisodeDataset(data_files=..., tokenizer=..., processor=...,
    config=..., max_samples=...)``; only ``data_files`` and ``max_samples`` matter here.
    """

    def __init__(self, data_files: Any, tokenizer: Any = None, processor: Any = None,
                 config: Any = None, max_samples: int = -1, **_: Any) -> None:
        self.rows = read_rows(data_files)
        if max_samples is not None and 0 < int(max_samples) < len(self.rows):
            self.rows = self.rows[: int(max_samples)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

        row = self.rows[index]
        name = str(row["env_name"])
        return {
            # verl's loops and the V1 trainer read these; the agent loop builds the real prompt.
            "raw_prompt": [{"role": "user", "content": f"<{name} episode, seed {row['seed']}>"}],
            "index": index,
            "extra_info": {"index": index, "seed": int(row["seed"])},
            "agent_name": AGENT_NAME,
            "data_source": name.lower(),
            "reward_model": {"style": "env", "ground_truth": ""},
            "env_name": name,
            "env_config": dict(row["env_config"]),
            "seed": int(row["seed"]),
            "max_turns": int(row["max_turns"]),
            "episode_log": str(row.get("episode_log", "")),
            "dummy_tensor": torch.tensor([0], dtype=torch.uint8),
        }
