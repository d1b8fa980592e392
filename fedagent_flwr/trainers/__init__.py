"""Trainer backends: the processes that train and evaluate one client's model for the ClientApp.

A backend is a module run as ``python -m <module> train|evaluate JOB.json`` (and ``serve
CHANNEL_DIR`` for a persistent trainer); it reads a :class:`~fedagent_flwr.clientapp.job.TrainJob`
or ``EvalJob`` and writes the matching result file. :data:`BACKEND_MODULES` (backend name to
module) is derived from :data:`fedagent_flwr.schema.trainer.TRAINER_SCHEMAS`, the one registry of
backends that the config check reads; the ClientApp's dispatch reads this mapping.

* :mod:`.common`: what both backends share (job checks, client rules and the built-in FedProx
  rule, the Hugging Face sampler and evaluator);
* :mod:`.reference`: the CPU reference trainer (a compact GRPO loop, for laptops and CI);
* :mod:`.verl`: the verl backend (one verl GRPO/PPO job per client-round, on GPUs).

Importing this package is cheap (no torch, no verl): the ServerApp's config check reads it.
"""

from __future__ import annotations

from fedagent_flwr.schema.trainer import TRAINER_SCHEMAS

#: trainer.backend -> the module the ClientApp runs (``python -m``), from the schema registry.
BACKEND_MODULES: dict[str, str] = {backend: schema.module for backend, schema in TRAINER_SCHEMAS.items()}
