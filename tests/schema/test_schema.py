"""Each setting is declared once: in one schema field (type, default, bound), and nowhere else.

Walks the schema (:mod:`fedagent_flwr.schema`), every YAML file under ``conf/`` and the package
code that reads settings: a key the schema lacks, a field declared twice or a default re-declared
where a setting is read fails here. The README's settings table is held to the same schema: every
key it names is declared, with the default it states.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import pkgutil
import re
from pathlib import Path
from typing import Any, get_type_hints

import pytest
import yaml
from omegaconf import MISSING, OmegaConf

import fedagent_flwr
from fedagent_flwr.checkpoint.ref import CheckpointRef
from fedagent_flwr.config import ConfigError, compose_config, conf_dir, load_settings
from fedagent_flwr.protocol import TRAINER_JSON, ProtocolError, TrainInstruction
from fedagent_flwr.schema import TRAINER_GROUPS, TRAINER_SCHEMAS, RunSchema, SettingError, check, declared_type
from fedagent_flwr.schema.trainer import (
    AGENT_LOOP_KEYS,
    AgentLoopKnobs,
    ClientAppKeys,
    ReferenceTrainer,
    VerlTrainer,
    trainer_settings,
)
from fedagent_flwr.trainers import BACKEND_MODULES
from fedagent_flwr.trainers.reference.config import GRPOConfig
from fedagent_flwr.trainers.verl.settings import VerlSettings

PACKAGE = Path(fedagent_flwr.__file__).resolve().parent
SCHEMA_DIR = PACKAGE / "schema"


def schema_classes() -> list[type]:
    """Every dataclass the schema package declares."""
    found = []
    for info in pkgutil.iter_modules([str(SCHEMA_DIR)]):
        module = importlib.import_module(f"fedagent_flwr.schema.{info.name}")
        found += [v for v in vars(module).values()
                  if dataclasses.is_dataclass(v) and isinstance(v, type) and v.__module__ == module.__name__]
    return found


def declarations(cls: type) -> dict[str, list[str]]:
    """field name -> the classes of ``cls``'s MRO whose own body declares it."""
    found: dict[str, list[str]] = {}
    for klass in cls.__mro__:
        for name in vars(klass).get("__annotations__", {}):
            if name in {f.name for f in dataclasses.fields(cls)}:
                found.setdefault(name, []).append(klass.__qualname__)
    return found


def field_schema(cls: type, name: str) -> Any:
    """The schema a field's value follows: its dataclass type, or the known keys of an open mapping."""
    return cls.__dataclass_fields__[name].metadata.get("keys") or get_type_hints(cls)[name]  # type: ignore[attr-defined]


def leaves(cls: type, prefix: str = "") -> dict[str, tuple[str, ...]]:
    """dotted key -> the classes declaring it, through nested schema dataclasses."""
    out: dict[str, tuple[str, ...]] = {}
    for name, owners in declarations(cls).items():
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(field_schema(cls, name)):
            out.update(leaves(field_schema(cls, name), f"{key}."))
        else:
            out[key] = tuple(owners)
    return out


def test_every_leaf_setting_is_declared_in_exactly_one_field() -> None:
    trees = {"run": leaves(RunSchema)} | {f"trainer/{b}": leaves(s, "trainer.") for b, s in TRAINER_SCHEMAS.items()} | {
        f"trainer group {b}": leaves(s, "trainer.") for b, s in TRAINER_GROUPS.items()}
    twice = {f"{tree}: {key}": owners
             for tree, keys in trees.items() for key, owners in keys.items() if len(owners) != 1}
    assert not twice, f"settings declared in more than one field: {twice}"
    assert len(trees["trainer/reference"]) > 20 and len(trees["trainer/verl"]) > 25 and len(trees["run"]) > 40


def _run_field(dotted: str) -> dataclasses.Field[Any]:
    """The schema field of the run key ``dotted`` (``rollout.mode``)."""
    *parents, last = dotted.split(".")
    node: Any = RunSchema
    for part in parents:
        node = field_schema(node, part)
    return node.__dataclass_fields__[last]  # type: ignore[no-any-return]


def test_the_agent_loop_is_declared_once_in_the_rollout_group() -> None:
    """The jobs' rollout_mode/history_length are the rollout group's fields renamed, chat_template_kwargs
    the model group's (same default and bound objects); the trainer groups a user sets do not declare them."""
    assert AGENT_LOOP_KEYS["chat_template_kwargs"] == "model.chat_template_kwargs"
    for key, source in AGENT_LOOP_KEYS.items():
        mine, theirs = AgentLoopKnobs.__dataclass_fields__[key], _run_field(source)
        assert mine.default == theirs.default and mine.metadata["bound"] is theirs.metadata["bound"]
        assert mine.default_factory == theirs.default_factory
        assert all(key not in group.__dataclass_fields__ for group in TRAINER_GROUPS.values())
        assert all(issubclass(schema, AgentLoopKnobs) for schema in TRAINER_SCHEMAS.values())


def test_trainers_and_evaluator_add_behaviour_not_settings() -> None:
    """GRPOConfig, VerlSettings and EvalSettings take every field from the schema: none declares one."""
    from fedagent_flwr.envs.spec import EnvSpecEntry
    from fedagent_flwr.schema.run import EnvEntry
    from fedagent_flwr.trainers.common.evaluator import EvalSettings

    for cls, schema in ((GRPOConfig, ReferenceTrainer), (VerlSettings, VerlTrainer), (EvalSettings, ReferenceTrainer),
                        (EnvSpecEntry, EnvEntry)):
        own = [n for n in vars(cls).get("__annotations__", {}) if not n.startswith("_")]
        assert own == [], f"{cls.__name__} re-declares {own}: declare settings in fedagent_flwr/schema/"
        assert {f.name for f in dataclasses.fields(cls)} <= {f.name for f in dataclasses.fields(schema)}
        assert all(f.default == schema.__dataclass_fields__[f.name].default for f in dataclasses.fields(cls))


def test_partition_knobs_come_from_the_schema() -> None:
    """hetero reads a knob through its schema field: the schema's default when absent, its bound
    (in the server's words) when set."""
    from fedagent_flwr.hetero import PartitionError, partition_goals
    from fedagent_flwr.hetero.common import knob
    from fedagent_flwr.schema.run import Partition

    for name in ("min_goals_per_client", "omega", "tau", "size_std", "env_div", "keep_ratio", "fallback", "unit"):
        assert knob({}, name) == Partition.__dataclass_fields__[name].default
    assert partition_goals("uniform", 0, 2, 500, {}) == partition_goals(
        "uniform", 0, 2, 500, {"min_goals_per_client": Partition.min_goals_per_client})
    with pytest.raises(ConfigError) as server:
        load_settings(overrides="partition=preference partition.omega=1.5")
    with pytest.raises(PartitionError) as library:
        knob({"omega": 1.5}, "omega")
    assert str(server.value) == str(library.value) == (
        "config key 'partition.omega' = 1.5 is invalid: expected in (0, 1)")


def test_backend_registry_is_the_schema_registry() -> None:
    assert BACKEND_MODULES == {b: s.module for b, s in TRAINER_SCHEMAS.items()}
    assert all(issubclass(s, ClientAppKeys) for s in TRAINER_SCHEMAS.values())


def _yaml_files() -> list[Path]:
    return sorted(conf_dir().rglob("*.yaml"))


def _place(path: Path) -> str:
    """The package a conf file's keys land in ('' = the root)."""
    text = path.read_text()
    group = path.parent.relative_to(conf_dir()).as_posix()
    return "" if "@package _global_" in text or group == "." else group


def _unknown_keys(node: Any, schema: Any, where: str) -> list[str]:
    """Keys of a YAML mapping that the schema type ``schema`` does not declare."""
    if schema is Any or not dataclasses.is_dataclass(schema) or not isinstance(node, dict):
        return []  # a free-form value (env spec, kwargs): checked by its own reader
    missing = []
    for key, value in node.items():
        if key == "defaults":
            continue
        if key not in schema.__dataclass_fields__:
            missing.append(f"{where}{key}")
        else:
            missing += _unknown_keys(value, _strip_optional(field_schema(schema, key)), f"{where}{key}.")
    return missing


def _strip_optional(hint: Any) -> Any:
    args = [a for a in getattr(hint, "__args__", ()) if a is not type(None)]
    return args[0] if len(args) == 1 and type(None) in getattr(hint, "__args__", ()) else hint


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: p.relative_to(conf_dir()).as_posix())
def test_every_conf_key_exists_in_the_schema(path: Path) -> None:
    tree = yaml.safe_load(path.read_text()) or {}
    place = _place(path)
    if place:
        tree = {place.split("/")[0]: tree}
    trainer = tree.pop("trainer", None) if isinstance(tree, dict) else None
    missing = _unknown_keys(tree, RunSchema, "")
    if isinstance(trainer, dict):
        # the trainer keys must exist in the schema of the backend the file is for (either when unsaid)
        backend = trainer.get("backend") or ("verl" if "verl" in path.stem else None)
        schemas = [TRAINER_GROUPS[backend]] if backend else list(TRAINER_GROUPS.values())
        unknown = [_unknown_keys(trainer, s, "trainer.") for s in schemas]
        missing += min(unknown, key=len)
    assert not missing, f"{path.name}: keys not in the schema (fedagent_flwr/schema/): {missing}"


_NO_DEFAULT = object()


def _default(field: dataclasses.Field[Any]) -> Any:
    """A schema field's default value (``_NO_DEFAULT`` for a required one)."""
    if field.default is not dataclasses.MISSING and field.default is not MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else _NO_DEFAULT


def _repeated_defaults(node: Any, schema: Any, where: str) -> list[tuple[str, Any]]:
    """(dotted key, value) of a YAML mapping's keys set to the value the schema already gives them.

    Hydra fills a structured node's defaults from the schema, so such a key only repeats it. An open
    mapping (``setting(keys=...)``: ``partition``, ``env``) is composed as the YAML gives it, without
    the schema's defaults: its values are what a strategy and the env spec receive, and stay.
    """
    if not dataclasses.is_dataclass(schema) or not isinstance(node, dict):
        return []
    found = []
    for key, value in node.items():
        field = schema.__dataclass_fields__.get(key)
        if key == "defaults" or field is None or field.metadata.get("keys") is not None:
            continue
        inner = _strip_optional(field_schema(schema, key))
        if dataclasses.is_dataclass(inner) and isinstance(value, dict):
            found += _repeated_defaults(value, inner, f"{where}{key}.")
        elif value == _default(field) and type(value) is type(_default(field)) or (
                isinstance(value, int) and type(_default(field)) is float and value == _default(field)):
            found.append((f"{where}{key}", value))
    return found


def _trainer_backend(path: Path, tree: dict[str, Any]) -> str:
    """The backend whose group a file's ``trainer`` keys land in: its own, or the one it composes."""
    group = _group(path)
    if group == "trainer" and _place(path):
        return str(tree.get("backend") or ClientAppKeys.backend)
    return str(load_settings(overrides=f"{group}={path.stem}").trainer_backend) if group != "." else "reference"


def _flat(node: Any, where: str = "") -> dict[str, Any]:
    """A YAML tree as dotted key -> leaf value."""
    if not isinstance(node, dict):
        return {where[:-1]: node}
    return {k: v for key, value in node.items() if key != "defaults" for k, v in _flat(value, f"{where}{key}.").items()}


def _conf_tree(path: Path) -> dict[str, Any]:
    """A conf file's keys where they land in the composed config."""
    tree = yaml.safe_load(path.read_text()) or {}
    place = _place(path)
    return {place.split("/")[0]: tree} if place else tree


#: the order config.yaml's defaults list composes the groups in (a later one overrides an earlier one)
LAYERS = (".", "env", "trainer", "strategy", "partition", "experiment", "recipe")


def _group(path: Path) -> str:
    return path.parent.relative_to(conf_dir()).as_posix()


def _repeated_in(path: Path) -> list[str]:
    """A conf file's keys that only repeat a schema default: the schema gives the value, and no conf
    file composed beneath it (an earlier group, or its own group's) sets another one, which this file
    would pin the key against."""
    tree = _conf_tree(path)
    trainer = tree.pop("trainer", None)
    repeated = _repeated_defaults(tree, RunSchema, "")
    if isinstance(trainer, dict):
        repeated += _repeated_defaults(trainer, TRAINER_GROUPS[_trainer_backend(path, trainer)], "trainer.")
    elsewhere: dict[str, list[Any]] = {}
    for other in _yaml_files():
        if other != path and LAYERS.index(_group(other)) <= LAYERS.index(_group(path)):
            for key, value in _flat(_conf_tree(other)).items():
                elsewhere.setdefault(key, []).append(value)
    return [f"{key}: {value!r}" for key, value in repeated if all(v == value for v in elsewhere.get(key, []))]


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: p.relative_to(conf_dir()).as_posix())
def test_no_conf_file_repeats_a_schema_default(path: Path) -> None:
    """A file under conf/ sets only what differs from the schema: each default is declared there once."""
    repeated = _repeated_in(path)
    assert not repeated, (f"{path.relative_to(conf_dir())} repeats the schema's defaults (fedagent_flwr/schema/), "
                          f"leave them out: {repeated}")


def test_the_repeated_default_scan_can_fail() -> None:
    from fedagent_flwr.schema.trainer import VerlGroup

    tree = {"num_rounds": 2, "seed": 5, "eval": {"seed": 7, "enabled": True}, "partition": {"omega": 0.5},
            "strategy": {"weights": [], "proximal_mu": 0.01}, "round_timeout": 3600}
    assert _repeated_defaults(tree, RunSchema, "") == [
        ("num_rounds", 2), ("eval.seed", 7), ("eval.enabled", True), ("strategy.weights", []), ("round_timeout", 3600)]
    assert _repeated_defaults({"rollout_n": 4, "lr": 1e-6, "stall_timeout_s": 600}, VerlGroup, "") == [
        ("rollout_n", 4), ("lr", 1e-6)]


def _reads_with_default(tree: ast.AST) -> list[tuple[int, str]]:
    """``x.get("<setting>", <default>)`` / ``x.get("<setting>") or <literal>`` calls."""
    names = set(leaves(RunSchema)) | {k for s in TRAINER_SCHEMAS.values() for k in leaves(s)}
    leaf = {k.rsplit(".", 1)[-1] for k in names}
    hits = []
    for node in ast.walk(tree):
        call = node.values[0] if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) else node
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "get"
                and call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value in leaf):
            continue
        receiver = ast.unparse(call.func.value)
        if "trainer" not in receiver and "settings" not in receiver:
            continue  # other mappings (partition knobs, env configs) are read by their own modules
        defaulted = len(call.args) > 1 or (node is not call and isinstance(node.values[-1], ast.Constant))
        if defaulted:
            hits.append((node.lineno, ast.unparse(node)))
    return hits


def test_code_reading_settings_does_not_redeclare_defaults() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if SCHEMA_DIR in path.parents:
            continue
        found += [f"{path.relative_to(PACKAGE)}:{line}: {text}"
                  for line, text in _reads_with_default(ast.parse(path.read_text()))]
    assert not found, f"settings read with a default of their own (take it from fedagent_flwr/schema/): {found}"


def _trainer_keys_read(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, key) of ``<trainer mapping>.get("key")`` / ``.pop("key")`` / ``["key"]`` reads: a receiver
    named like the trainer group (``settings.trainer``, ``job.trainer``, ``trainer``)."""
    reads = []
    for node in ast.walk(tree):
        key = receiver = None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop")
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            key, receiver = node.args[0].value, ast.unparse(node.func.value)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(
                node.slice.value, str):
            key, receiver = node.slice.value, ast.unparse(node.value)
        if key is not None and receiver is not None and receiver.split(".")[-1] == "trainer":
            reads.append((node.lineno, key))
    return reads


def _dotted_keys_read(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, key) of ``get_key(raw, "a.b")`` reads of a composed config by dotted key."""
    return [(node.lineno, node.args[1].value) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("get_key", "_get") and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)]


def test_code_reads_only_settings_the_schema_declares() -> None:
    """Every trainer key and dotted config key the package reads is a schema field."""
    from fedagent_flwr.schema import declared_type

    trainer_keys = {f.name for s in (*TRAINER_GROUPS.values(), *TRAINER_SCHEMAS.values())
                    for f in dataclasses.fields(s)}
    undeclared = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        undeclared += [f"{path.relative_to(PACKAGE)}:{line}: trainer.{key}"
                       for line, key in _trainer_keys_read(tree) if key not in trainer_keys]
        undeclared += [f"{path.relative_to(PACKAGE)}:{line}: {key}"
                       for line, key in _dotted_keys_read(tree)
                       if declared_type(key) is None and key not in RunSchema.__dataclass_fields__]
    assert not undeclared, f"settings read but not declared in fedagent_flwr/schema/: {undeclared}"
    assert len(trainer_keys) > 40


def test_the_reader_scan_finds_an_undeclared_setting() -> None:
    source = "def f(settings, raw):\n    return settings.trainer.get('per_gpu'), get_key(raw, 'env.nope')\n"
    assert _trainer_keys_read(ast.parse(source)) == [(2, "per_gpu")]
    assert _dotted_keys_read(ast.parse(source)) == [(2, "env.nope")]


def test_the_scan_finds_a_redeclared_default() -> None:
    """The scan above can fail: a trainer setting read with its own default is found."""
    source = "def f(trainer):\n    return trainer.get('stall_timeout_s', 0.0), trainer.get('mode') or 'subprocess'\n"
    assert [text for _, text in _reads_with_default(ast.parse(source))] == [
        "trainer.get('stall_timeout_s', 0.0)", "trainer.get('mode') or 'subprocess'"]


def test_one_validator_gives_the_same_words_on_the_server_and_in_a_job_file() -> None:
    with pytest.raises(ConfigError) as server:
        load_settings(overrides="trainer=verl trainer.top_p=1.5")
    with pytest.raises(SettingError) as job:
        VerlSettings.from_mapping({"top_p": 1.5})
    assert str(server.value) == str(job.value) == "config key 'trainer.top_p' = 1.5 is invalid: expected in (0, 1]"
    with pytest.raises(ConfigError, match=r"config key 'trainer.max_model_len' = 8 is invalid: expected >= 16"):
        load_settings(overrides="trainer.max_model_len=8")
    with pytest.raises(Exception, match=r"config key 'trainer.max_model_len' = 8 is invalid"):
        GRPOConfig.from_mapping({"max_model_len": 8})


def test_instructions_carry_the_checked_trainer_settings() -> None:
    settings = load_settings(overrides="trainer=verl_ppo")
    assert isinstance(settings.trainer_settings, VerlTrainer) and settings.trainer_settings.rollout_n == 1
    assert settings.trainer == dataclasses.asdict(settings.trainer_settings)
    typed = trainer_settings({"backend": "verl", "rollout_n": 3})
    assert typed == VerlTrainer(backend="verl", rollout_n=3) and trainer_settings(typed) is typed
    with pytest.raises(SettingError, match="config key 'trainer.rollout_n'"):
        trainer_settings({"backend": "reference", "rollout_n": 0})
    with pytest.raises(SettingError, match="available backends are"):
        trainer_settings({"backend": "nope"})
    # the client rebuilds the typed object from the message with the same validator
    model = CheckpointRef(path="/run/global", kind="actor", format="fsdp-shards", world_size=1, sha256="0" * 64)
    sent = TrainInstruction(server_round=1, client_id=0, num_clients=2, data_seed=1, base_seed=1, algorithm="ppo",
                            local_steps=1, trainer=settings.trainer_settings, env_spec={"envs": []},
                            partition={"strategy": "none"}, service={"enabled": False}, global_model=model)
    record = sent.to_record()
    assert TrainInstruction.from_record(record).trainer == settings.trainer_settings
    record.config_records["config"][TRAINER_JSON] = json.dumps({"backend": "verl", "rollout_n": 0})
    with pytest.raises(ProtocolError, match="instruction field 'trainer-json': config key 'trainer.rollout_n'"):
        TrainInstruction.from_record(record)


def test_bounds_are_checked_by_the_validator() -> None:
    _, unknown = check(VerlTrainer, {"backend": "verl", "extra": 1}, "trainer", known_only=True)
    assert unknown == ["extra"]
    for raw, message in [({"backend": "verl", "extra": 1}, "unknown config key 'trainer.extra'"),
                         ({"backend": "verl", "plugin_modules": ["a b"]}, "'trainer.plugin_modules' entry 0"),
                         ({"backend": "verl", "enforce_eager": 1}, "'trainer.enforce_eager' must be bool"),
                         ({"backend": "verl", "lr": float("nan")}, "'trainer.lr' must be float")]:
        with pytest.raises(SettingError, match=message):
            check(VerlTrainer, raw, "trainer")


# --------------------------------------------------------------------------------------------
# The README's settings table
# --------------------------------------------------------------------------------------------

README = PACKAGE.parent / "README.md"
_UNSET = object()


def readme_settings(text: str) -> list[tuple[int, list[str], str]]:
    """(line, keys, default cell) of each row of the README's settings table (``| key | default | meaning |``)."""
    rows: list[tuple[int, list[str], str]] = []
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("| key | default | meaning |"):
            inside = True
        elif inside and line.startswith("|"):
            if not line.startswith("|---"):
                keys, default, _ = line[1:].split(" | ", 2)
                rows.append((number, re.findall(r"`([^`]+)`", keys), default.strip()))
        elif inside:
            break
    return rows


def _composed_default(key: str, configs: list[Any], groups: dict[str, Any]) -> Any:
    """What a run that sets nothing has for ``key``: a group's option from ``config.yaml``'s defaults
    list, else the value in the composed config of the reference trainer or, for a verl-only key, of verl."""
    if key in groups:
        return groups[key]
    for cfg in configs:
        value = OmegaConf.select(cfg, key, default=_UNSET)
        if value is not _UNSET:
            return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return _UNSET


def readme_setting_problems(text: str) -> tuple[list[str], int]:
    """The README table's keys that the schema does not declare and its literal defaults (``2``, ``reset``,
    ``[jsonl]``, with or without backticks) that a run does not get, and how many defaults were compared.
    A default in words (``on, 8 episodes``, ``run-<id>``) is not compared."""
    defaults = yaml.safe_load((conf_dir() / "config.yaml").read_text())["defaults"]
    groups = {name.split()[-1]: option for entry in defaults if isinstance(entry, dict)
              for name, option in entry.items()}
    configs = [compose_config(), compose_config(overrides="trainer=verl")]
    problems, compared = [], 0
    for number, keys, cell in readme_settings(text):
        parts = [part.strip().strip("`") for part in cell.split(" / ")]
        parts = parts * len(keys) if len(parts) == 1 else parts
        for key, part in zip(keys, parts if len(parts) == len(keys) else [None] * len(keys)):
            prefix = key.removesuffix(".*")
            if key not in groups and not (declared_type(prefix) is not None and (
                    key == prefix or dataclasses.is_dataclass(declared_type(prefix)))):
                problems.append(f"README.md:{number}: {key} is not a setting of the schema")
                continue
            if part is None or not re.fullmatch(r"[\w.\[\]{},\"-]*", part):
                continue
            # a group's default is an option's name (recipe: none, the no-preset option); elsewhere none is null
            stated = part if key in groups else None if part == "none" else yaml.safe_load(part)
            actual = _composed_default(key, configs, groups)
            compared += 1
            if actual is _UNSET or stated != actual:
                problems.append(f"README.md:{number}: {key} defaults to {actual!r}, the README says {part}")
    return problems, compared


def test_the_readme_table_scan_finds_an_unknown_key_and_a_wrong_default() -> None:
    table = ("| key | default | meaning |\n|---|---|---|\n| `eval.nope` / `seed` | 1 / 41 | x |\n"
             "| `eval.*` | on, 8 episodes | y |\n| `recipe` | none | z |\n")
    problems, compared = readme_setting_problems(table)
    assert problems == ["README.md:3: eval.nope is not a setting of the schema",
                        "README.md:3: seed defaults to 42, the README says 41"]
    assert compared == 2


def test_the_readme_settings_table_names_schema_keys_with_their_defaults() -> None:
    problems, compared = readme_setting_problems(README.read_text())
    assert not problems, f"the README's settings table is out of date (fix the README or the schema): {problems}"
    assert len(readme_settings(README.read_text())) > 25 and compared > 25  # not a vacuous pass
