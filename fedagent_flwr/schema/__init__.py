"""The configuration schema: each setting's type, default and bound, declared once.

* :mod:`.fields`: :func:`~.fields.setting` (a field with its bound) and :func:`~.fields.check`,
  the one validator (server and trainers);
* :mod:`.run`: ``conf/config.yaml`` and its groups; :mod:`.lora`: ``model.lora`` (federated LoRA);
  :mod:`.trainer`: one schema per backend.

:func:`register` stores them in Hydra's ConfigStore, where the YAML files' defaults lists extend
them (``run_schema`` in ``config.yaml``, ``/schema/trainer/<backend>`` in ``trainer/<backend>.yaml``):
Hydra then refuses unknown keys and values of the wrong type while it composes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

from fedagent_flwr.schema.fields import SettingError, check, setting
from fedagent_flwr.schema.run import RunSchema
from fedagent_flwr.schema.trainer import CLIENTAPP_TRAINER_KEYS, TRAINER_GROUPS, TRAINER_MODES, TRAINER_SCHEMAS

__all__ = ["CLIENTAPP_TRAINER_KEYS", "TRAINER_GROUPS", "TRAINER_MODES", "TRAINER_SCHEMAS", "RunSchema", "SettingError",
           "check", "declared_keys", "declared_type", "register", "setting"]


def register() -> None:
    """Put the schemas in Hydra's ConfigStore (idempotent; before composing ``conf/``)."""
    # Imported here: trainer and env-service processes import the schema for its validator only,
    # and need not load Hydra for it.
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunSchema)
    for backend, schema in TRAINER_GROUPS.items():
        store.store(group="schema/trainer", name=backend, node=schema)


def declared_default(dotted: str) -> Any:
    """The schema's default of a dotted run key outside ``trainer`` (``MISSING`` where none is
    declared): what a key added to the schema meant for a run recorded before it existed."""
    node: Any = RunSchema
    *parents, last = dotted.split(".")
    for part in parents:
        declared = getattr(node, "__dataclass_fields__", {}).get(part)
        if declared is None:
            return dataclasses.MISSING
        node = declared.metadata.get("keys") or get_type_hints(node)[part]
    declared = getattr(node, "__dataclass_fields__", {}).get(last)
    if declared is None or dotted.startswith("trainer."):
        return dataclasses.MISSING
    if declared.default is dataclasses.MISSING and declared.default_factory is not dataclasses.MISSING:
        return declared.default_factory()  # a list or mapping: a fresh one ({} for model.chat_template_kwargs)
    return declared.default


def declared_type(dotted: str) -> Any:
    """The type the schema declares for a dotted config key (``trainer.*``: either backend's), or None."""
    first, _, rest = dotted.partition(".")
    roots: list[tuple[Any, list[str]]] = [(s, rest.split(".")) for s in TRAINER_GROUPS.values()] if (
        first == "trainer") else [(RunSchema, dotted.split("."))]
    for node, parts in roots:
        for part in parts:
            fields = getattr(node, "__dataclass_fields__", {})
            if not dataclasses.is_dataclass(node) or part not in fields:
                node = None
                break
            node = fields[part].metadata.get("keys") or get_type_hints(node)[part]
        if node is not None:
            return node
    return None


def declared_keys() -> list[str]:
    """Every dotted key the schema declares (``trainer.*``: either backend's), sorted: what an
    unknown key is matched against for a "did you mean" (:mod:`fedagent_flwr.config`)."""

    def walk(node: Any, prefix: str) -> set[str]:
        keys: set[str] = set()
        for field in dataclasses.fields(node):
            hint = field.metadata.get("keys") or get_type_hints(node)[field.name]
            keys |= walk(hint, f"{prefix}{field.name}.") if dataclasses.is_dataclass(hint) else {prefix + field.name}
        return keys

    keys = walk(RunSchema, "") - {"trainer"}
    for schema in TRAINER_GROUPS.values():
        keys |= walk(schema, "trainer.")
    return sorted(keys)
