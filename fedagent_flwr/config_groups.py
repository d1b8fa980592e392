"""Config-group selections (``strategy=fedprox``, ``recipe=webshop_verl``) checked against ``conf/``
before Hydra composes.

Hydra refuses an unknown option of a required group, but an *optional* group (``optional recipe``
in ``config.yaml``) it skips without a word: a misspelt recipe ran the default job and ended
``completed``. And ``group=null`` made it raise a bare ``ValueError``. Checked here, every group
answers alike, in one line that names the group, the option given, the options there are and the
closest one; ``null`` deselects an optional group and is refused for a required one.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from omegaconf import OmegaConf

from fedagent_flwr.config_keys import ConfigError


def group_options(conf: Path, group: str) -> list[str]:
    """The options of config group ``group`` under ``conf`` (``sub/name`` for a nested file), sorted."""
    root = conf / group
    return sorted(str(path.relative_to(root).with_suffix("")) for path in root.rglob("*.yaml"))


def optional_groups(conf: Path, config_name: str) -> set[str]:
    """The groups that ``conf/<config_name>.yaml`` lists as ``optional`` in its defaults."""
    path = conf / f"{config_name}.yaml"
    loaded = OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}
    defaults = loaded.get("defaults", []) if isinstance(loaded, dict) else []
    names = (str(next(iter(entry))) for entry in defaults if isinstance(entry, dict) and len(entry) == 1)
    return {name.split()[1] for name in names if name.startswith("optional ") and len(name.split()) == 2}


def _selected(item: str) -> object:
    """The value an override gives, as Hydra parses it (quotes removed, ``null`` is None)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides([item])[0].value()
    except HydraException:
        return item.split("=", 1)[1]  # unparsable: checked as the text it is, which no option is


def _check_option(group: str, value: object, text: str, options: list[str], optional: bool) -> None:
    """ConfigError unless ``value`` (``text`` as written) names one option of ``group`` (None: no
    option, where ``optional``)."""
    listed = f"(available: {' '.join(options)})"
    if value is None:
        if not optional:
            raise ConfigError(f"config group '{group}' needs one of its options, not null {listed}")
    elif isinstance(value, (list, dict)):
        raise ConfigError(f"config group '{group}' takes one option, not {value!r} {listed}")
    elif value == "":
        none = f"; {group}=null selects none" if optional else ""
        raise ConfigError(f"config group '{group}' needs an option's name, got '' {listed}{none}")
    elif str(value) not in options:
        name = value if isinstance(value, str) else text  # recipe=true: 'true', not Python's True
        close = difflib.get_close_matches(str(name), options, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"config group '{group}' has no option '{name}' {listed}{hint}")


def check_selections(items: list[str], conf: Path, config_name: str) -> list[str]:
    """``items`` with each config-group selection checked, and only the last one of a group kept
    (Hydra's rule, made explicit so that ``null`` can be translated): an option that
    ``conf/<group>/`` lacks, a list or ``null`` for a required group is a :class:`ConfigError`;
    ``null`` for an optional group becomes Hydra's deletion (``~group``), i.e. no preset."""
    groups = {path.name for path in conf.iterdir() if path.is_dir() and not path.name.startswith(("_", "."))}
    optional = optional_groups(conf, config_name)
    last: dict[str, int] = {}
    selections: dict[int, tuple[str, object]] = {}
    for index, item in enumerate(items):
        group = item.split("=", 1)[0].lstrip("+")
        if group in groups:
            value = _selected(item)
            _check_option(group, value, item.split("=", 1)[1], group_options(conf, group), group in optional)
            last[group], selections[index] = index, (group, value)
    checked = []
    for index, item in enumerate(items):
        if index not in selections:
            checked.append(item)
            continue
        group, value = selections[index]
        if last[group] == index:
            checked.append(f"~{group}" if value is None else item)
    return checked
