"""Helpers of the verl tests: verl's own config composition, and a probe of its FSDP engine.

``compose_verl_config`` composes verl's ``ppo_trainer`` config with a job's overrides, as
``python -m verl.trainer.main_ppo`` would. ``ENGINE``, code for a fresh process started with a
verl job's environment, defines ``engine(cls)``: an instance of one of verl's FSDP engine classes that has just
what ``optimizer_step`` touches (a small seeded torch module, plain SGD with lr 1, no clipping),
so a test can call the real, patched ``optimizer_step`` on CPU without Ray or a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def compose_verl_config(overrides: list[str]) -> Any:
    """verl's ``ppo_trainer`` config with ``overrides`` applied (verl's own Hydra schema)."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


ENGINE = r"""
import json, sys, types, torch
import verl.workers.engine.fsdp.transformer_impl as impl
def engine(cls):
    e = object.__new__(cls)
    torch.manual_seed(0)
    e.module = torch.nn.Linear(3, 2)
    e.optimizer = torch.optim.SGD(e.module.parameters(), lr=1.0)
    e.optimizer_config = types.SimpleNamespace(clip_grad=1e9)
    e._qat_enabled = False
    return e
"""
