"""Config-group selections (``strategy=fedprox``, ``recipe=webshop_verl``) that Hydra would take
wrongly or answer with a bare traceback, refused or translated before it composes.

Hydra itself refuses an option that no config directory on its search path has (``conf/`` and any
``hydra.searchpath``), and :func:`fedagent_flwr.config._explain_hydra_error` turns that into one line.
What it does not refuse: ``group=null`` (a bare ``ValueError``), a list (``strategy=[a,b]``: both
files, merged) and an empty or non-string name. ``null`` means "no preset" for a group that has a
``none`` option (``recipe``, ``partition``) and is refused for the others.
"""

from __future__ import annotations

from pathlib import Path

from fedagent_flwr.config_keys import ConfigError

NONE_OPTION = "none"  # the option that selects nothing (conf/recipe/none.yaml: no preset)


def group_options(conf: Path, group: str) -> list[str]:
    """The options of config group ``group`` under ``conf`` (``sub/name`` for a nested file), sorted."""
    root = conf / group
    return sorted(str(path.relative_to(root).with_suffix("")) for path in root.rglob("*.yaml"))


def _selected(item: str) -> object:
    """The value an override gives, as Hydra parses it (quotes removed, ``null`` is None)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides([item])[0].value()
    except HydraException:
        return item.split("=", 1)[1]  # unparsable: left to Hydra, which names the fault when it composes


def check_selections(items: list[str], conf: Path) -> list[str]:
    """``items`` with each selection of a group under ``conf`` checked: ``null`` becomes the group's
    ``none`` option where it has one and is a :class:`ConfigError` where not; a list, an empty name
    or a number or boolean is a :class:`ConfigError`. An unknown name is left to Hydra (it also
    knows the options of a ``hydra.searchpath``)."""
    groups = {path.name for path in conf.iterdir() if path.is_dir() and not path.name.startswith(("_", "."))}
    checked = []
    for item in items:
        group = item.split("=", 1)[0].lstrip("+")
        value = _selected(item) if group in groups else ""
        if group not in groups or (isinstance(value, str) and value):
            checked.append(item)
            continue
        options = group_options(conf, group)
        listed = f"(options in {conf}: {' '.join(options)})"
        if value is None and NONE_OPTION in options:
            checked.append(f"{item.split('=', 1)[0]}={NONE_OPTION}")
        elif value is None:
            raise ConfigError(f"config group '{group}' needs one of its options, not null {listed}")
        elif isinstance(value, (list, dict)):
            raise ConfigError(f"config group '{group}' takes one option, not {value!r} {listed}")
        elif value == "":
            none = f"; {group}={NONE_OPTION} selects none" if NONE_OPTION in options else ""
            raise ConfigError(f"config group '{group}' needs an option's name, got '' {listed}{none}")
        else:
            raise ConfigError(f"config group '{group}' has no option '{item.split('=', 1)[1]}' {listed}")
    return checked
