"""``fedagent COMMAND [ARGS]``: one console script for the commands users run.

Each command is a module's own ``main(argv)`` (so ``python -m fedagent_flwr.<module>`` keeps
working); modules are imported only when their command runs, so ``fedagent --help`` is instant.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import argparse

# command -> (module, one line for --help)
COMMANDS: dict[str, tuple[str, str]] = {
    "verify": ("fedagent_flwr.checkpoint.verify", "audit a run: recompute every round's aggregate"),
    "experiments": ("fedagent_flwr.experiments", "list FedAgent's paper runs with their flwr run lines"),
    "inspect": ("fedagent_flwr.hetero.inspect", "print a partition (clients' goal indices, --summary)"),
    "env-check": ("fedagent_flwr.envs.check", "check an environment against the text-environment contract"),
    "deploy": ("fedagent_flwr.deploy", "TLS files, node keys and connections for a deployment"),
    "outcome": ("fedagent_flwr.outcome", "a run's outcome as an exit status (wraps flwr run)"),
    "compare": ("fedagent_flwr.compare", "does one arm beat another? runs' means, Welch 95% intervals over seeds"),
    "warm-start": ("fedagent_flwr.trainers.common.warm_start", "supervised warm start (SFT) on recorded conversations"),
    "tiny-model": ("fedagent_flwr.models.tiny", "write the tiny random-weight smoke model"),
    "webshop-expert": ("fedagent_flwr.envs.webshop.expert_cli", "write expert WebShop episodes (train goals) as SFT"),
    "download-webshop": ("fedagent_flwr.envs.webshop.download", "fetch the WebShop data files"),
    "download-alfworld": ("fedagent_flwr.envs.alfworld.download", "fetch the ALFWorld game data"),
    "alfworld-venv": ("fedagent_flwr.envs.alfworld.service_venv", "build the ALFWorld service venv"),
}


def program(module_command: str) -> str:
    """A command's name for its usage and error lines: ``fedagent NAME`` when it runs through this
    script (:func:`main` sets ``sys.argv[0]`` so), else ``module_command`` (``python -m MODULE``)."""
    return sys.argv[0] if sys.argv[0].startswith("fedagent ") else module_command


def one_line_parser(name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """An ArgumentParser(``**kwargs``) whose usage errors are one line, ``NAME: error: MESSAGE (see --help)``,
    not argparse's usage block. argparse is imported here, not with this module: ``fedagent --help`` stays instant."""
    import argparse

    class OneLineParser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            self.exit(2, f"{name}: error: {message} (see --help)\n")

    return OneLineParser(**kwargs)


def print_output(text: str) -> None:
    """Print a command's output; a reader that stops early (piped into ``head``) ends it without a traceback."""
    try:
        print(text)
    except BrokenPipeError:  # e.g. piped into head
        sys.stderr.close()


def usage() -> str:
    """The list of commands, as ``fedagent --help`` prints it."""
    width = max(map(len, COMMANDS))
    lines = ["usage: fedagent COMMAND [ARGS]   (fedagent COMMAND --help for a command's options)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``COMMAND`` with the remaining arguments; return its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"fedagent: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    # a command whose parser names no prog of its own takes argparse's default, sys.argv[0]'s name:
    # "fedagent", which is no command; so its usage names the command as it was run
    program, sys.argv[0] = sys.argv[0], f"fedagent {name}"
    try:
        return int(importlib.import_module(COMMANDS[name][0]).main(rest) or 0)
    finally:
        sys.argv[0] = program


if __name__ == "__main__":
    raise SystemExit(main())
