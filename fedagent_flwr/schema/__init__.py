"""The configuration schema: each setting's type, default and bound, declared once.

* :mod:`.fields`: :func:`~.fields.setting` (a field with its bound) and :func:`~.fields.check`,
  the one validator (server and trainers);
* :mod:`.run`: ``conf/config.yaml`` and its groups; :mod:`.trainer`: one schema per backend.

:func:`register` stores them in Hydra's ConfigStore, where the YAML files' defaults lists extend
them (``run_schema`` in ``config.yaml``, ``/schema/trainer/<backend>`` in ``trainer/<backend>.yaml``):
Hydra then refuses unknown keys and values of the wrong type while it composes.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from fedagent_flwr.schema.fields import SettingError, check, setting
from fedagent_flwr.schema.run import RunSchema
from fedagent_flwr.schema.trainer import CLIENTAPP_TRAINER_KEYS, TRAINER_MODES, TRAINER_SCHEMAS

__all__ = ["CLIENTAPP_TRAINER_KEYS", "TRAINER_MODES", "TRAINER_SCHEMAS", "RunSchema", "SettingError",
           "check", "register", "setting"]


def register() -> None:
    """Put the schemas in Hydra's ConfigStore (idempotent; before composing ``conf/``)."""
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunSchema)
    for backend, schema in TRAINER_SCHEMAS.items():
        store.store(group="schema/trainer", name=backend, node=schema)
