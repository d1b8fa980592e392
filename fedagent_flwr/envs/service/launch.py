"""What an env service is started with: its settings (:class:`ServiceLaunch`), its command line,
its environment and the identity of the code it would run (:func:`service_code`).

A running service is reused only while all of these match what a service started now would get
(:meth:`.manager.EnvServiceManager.ensure_running`): the settings decide which world it serves,
the code (the package's ``.py`` files, the interpreter, the ``PYTHONPATH``, the installed
libraries) how it serves it, its env and reward code included.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedagent_flwr.code_identity import PACKAGE_DIR, code_identity
from fedagent_flwr.schema.run import EnvService

SERVER_MODULE = "fedagent_flwr.envs.service.server"
# Runs a module of this package under another interpreter: argv[1] is the directory holding the
# package (appended, so that interpreter's own packages win), argv[2] the module.
_FOREIGN_BOOTSTRAP = (
    "import runpy, sys; sys.path.append(sys.argv.pop(1)); "
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)


#: An env service is a CPU program, started beside the trainers that own the node's GPUs: it sees
#: none, so no library it imports can take GPU memory. bm25s (WebShop's search) uses JAX where it
#: is installed, and JAX reserves 75% of a GPU's memory when first used: on an H200 node two
#: WebShop services took 105 and 33 GiB and the trainers' evaluation ran out of memory
#: (docs/gpu.md §7). ``JAX_PLATFORMS`` keeps JAX itself on the CPU rather than failing to find CUDA.
CPU_ONLY_ENV: dict[str, str] = {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}


def module_command(module: str, interpreter: str) -> list[str]:
    """``python -m module`` for a module of this package under ``interpreter``, which need not
    have the package installed (an env's own virtual environment)."""
    return [interpreter, "-c", _FOREIGN_BOOTSTRAP, str(PACKAGE_DIR.parent), module]


@dataclass(frozen=True)
class ServiceLaunch:
    """Everything needed to (re)start one env service process."""

    env: str
    config: dict[str, Any] = field(default_factory=dict)
    pool_size: int = EnvService.pool_size  # the defaults are the env.service group's
    partition: dict[str, Any] = field(default_factory=dict)
    variant: dict[str, Any] = field(default_factory=dict)
    host: str = EnvService.host
    create_timeout_s: float | None = None
    max_body_bytes: int | None = None
    log_level: str = "warning"
    owner_pid: int | None = None  # the service exits when this process is gone
    # An interpreter other than the caller's (an env's own virtual environment, e.g. ALFWorld's);
    # the directory holding this package is appended to its sys.path, after its own packages.
    interpreter: str | None = None

    def command(self, ready_file: Path, python: str) -> list[str]:
        """The command line of the server module for this launch."""
        head = module_command(SERVER_MODULE, self.interpreter) if self.interpreter else [python, "-m", SERVER_MODULE]
        cmd = [
            *head,
            "--env", self.env,
            "--config", json.dumps(self.config, sort_keys=True),
            "--partition", json.dumps(self.partition, sort_keys=True),
            "--variant", json.dumps(self.variant, sort_keys=True),
            "--pool", str(self.pool_size),
            "--host", self.host,
            "--port", "0",
            "--ready-file", str(ready_file),
            "--log-level", self.log_level,
        ]
        if self.create_timeout_s is not None:
            cmd += ["--create-timeout", str(self.create_timeout_s)]
        if self.max_body_bytes is not None:
            cmd += ["--max-body-bytes", str(self.max_body_bytes)]
        if self.owner_pid is not None:
            cmd += ["--owner-pid", str(self.owner_pid)]
        return cmd

    def environment(self, extra: Mapping[str, str]) -> dict[str, str]:
        """The service's environment: this process's, ``extra`` and :data:`CPU_ONLY_ENV`. Under the
        caller's interpreter the folder holding this copy of the package comes first on the
        ``PYTHONPATH``, so the service runs the same copy as the ClientApp that starts it (Flower
        imports the app from its installed bundle, which may differ from what site-packages holds),
        the copy whose code :func:`service_code` records. Another interpreter gets the folder
        appended instead (:func:`module_command`): its own packages win."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra, **CPU_ONLY_ENV}
        if self.interpreter is None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_DIR.parent), env.get("PYTHONPATH", "")) if p)
        return env


def service_code(launch: ServiceLaunch, python: str) -> dict[str, str]:
    """The code a service of ``launch`` started now by ``python`` (the caller's interpreter, used
    unless the launch names its own) would run: :func:`~fedagent_flwr.code_identity.code_identity`
    of its interpreter and environment."""
    return code_identity(launch.environment({}), executable=launch.interpreter or python)
