"""The Flower app's declared run config, as ``flwr run`` reads it from the repository's
pyproject.toml (``[tool.flwr.app.config]``): the keys and defaults a run starts from, before the
command line's ``--run-config`` values."""

from __future__ import annotations

import tomllib

from testkit.flower_harness import REPO


def declared_run_config() -> dict[str, object]:
    """The run-config keys pyproject.toml declares for the app, with their default values."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
