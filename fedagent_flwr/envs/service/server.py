"""Run an env service process: ``python -m fedagent_flwr.envs.service.server --env TinyGuess ...``.

The process binds to loopback by default (env services are per-node plumbing, not public APIs),
and with ``--port 0`` binds a free port itself *before* handing the listening socket to uvicorn,
so there is no window in which another process can take the port. Once uvicorn serves, the
actual URL is written atomically to ``--ready-file``: whoever started the process reads the URL
from there instead of guessing ports (FedAgent's fixed port blocks collided between clients).

Any registered environment can be served. By default every pool slot is
``make_env(env, config)``, where a partition with ``goal_indices`` first restricts the config
through the env's ``restrict_goals``. An environment that needs more (shared catalogues, search
indexes, env variants) defines a classmethod ``service_setup(config, partition, variant)``
returning a :class:`ServiceEnvSetup`; the service then uses its factory and ``/health`` info.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import uvicorn

from fedagent_flwr.atomic import write_text_atomic
from fedagent_flwr.envs.registry import get_env_class
from fedagent_flwr.envs.service import DEFAULT_CREATE_TIMEOUT_S
from fedagent_flwr.envs.service.app import (
    DEFAULT_MAX_BODY_BYTES,
    ServiceEnvSetup,
    ServiceSettings,
    create_service_app,
)
from fedagent_flwr.procs import OwnerWatch

__all__ = ["ServiceEnvSetup", "bind_socket", "build_env_setup", "serve", "socket_url"]


DEFAULT_HOST = "127.0.0.1"


def build_env_setup(
    env_name: str,
    config: Mapping[str, Any],
    partition: Mapping[str, Any] | None = None,
    variant: Mapping[str, Any] | None = None,
) -> ServiceEnvSetup:
    """The pool factory for ``env_name`` under ``partition``/``variant`` (see the module docstring).

    Raises ``UnknownEnvError``/``EnvConfigError`` here, before any port is bound, so a bad
    config fails the process at once with a message instead of a service that never gets ready.
    """
    cls = get_env_class(env_name)
    partition = dict(partition or {})
    variant = dict(variant or {})
    custom = getattr(cls, "service_setup", None)
    if custom is not None:
        setup = custom(dict(config), partition, variant)
        if not isinstance(setup, ServiceEnvSetup):
            raise TypeError(f"{cls.__name__}.service_setup must return a ServiceEnvSetup, got {setup!r}")
        return setup
    if variant:
        raise ValueError(f"{cls.env_name} has no env variants (it defines no service_setup); got {variant}")
    effective = dict(config)
    goal_indices = partition.get("goal_indices")
    if goal_indices is not None:
        effective = cls.restrict_goals(effective, list(goal_indices))
    # Build one instance now: config errors surface before the service starts.
    cls(effective)

    def factory(_slot: int) -> Any:
        return cls(effective)

    return ServiceEnvSetup(factory=factory, info={"num_goals": cls.num_goals(effective)})


def bind_socket(host: str = DEFAULT_HOST, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: a free port the kernel picks)."""
    family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def socket_url(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _ReadyFileServer(uvicorn.Server):
    """A uvicorn server that writes its URL to a file once it is actually serving."""

    def __init__(self, config: uvicorn.Config, url: str, ready_file: Path | None) -> None:
        super().__init__(config)
        self.url = url
        self.ready_file = ready_file

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit and self.ready_file is not None:
            write_text_atomic(self.ready_file, self.url + "\n")


async def _exit_with_owner(server: uvicorn.Server, owner: OwnerWatch, interval_s: float = 2.0) -> None:
    """Stop serving once the owner process is gone.

    The service runs in its own session so that stopping it never touches its owner; the price
    is that nothing stops it when the owner dies without a clean shutdown (a crash, SIGKILL,
    Ctrl-C of the run). Watching the owner closes that gap: no orphaned services.
    """
    while not server.should_exit:
        if owner.gone():
            logging.getLogger(__name__).warning("owner process %d is gone; shutting down", owner.pid)
            server.should_exit = True
            return
        await asyncio.sleep(interval_s)


async def serve(
    setup: ServiceEnvSetup,
    settings: ServiceSettings,
    sock: socket.socket,
    ready_file: str | Path | None = None,
    log_level: str = "warning",
    owner_pid: int | None = None,
) -> None:
    """Serve the env service on an already listening socket until SIGTERM/SIGINT (or until
    ``owner_pid`` exits, when given)."""
    app = create_service_app(setup.factory, settings)
    # No websockets: the protocol is plain request/reply, and it keeps the deprecated
    # websockets.legacy import (and its warning) out of the process.
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", ws="none")
    server = _ReadyFileServer(config, socket_url(sock), Path(ready_file) if ready_file else None)
    # Watched from now on: a pid reused after the owner died is never taken for it.
    watchdog = asyncio.create_task(_exit_with_owner(server, OwnerWatch(owner_pid))) if owner_pid else None
    try:
        await server.serve(sockets=[sock])
    finally:
        if watchdog is not None:
            watchdog.cancel()


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options of the service process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help="registered environment name, e.g. TinyGuess")
    parser.add_argument("--config", default="{}", type=lambda s: _json_object(s, "--config"),
                        help="environment config as a JSON object")
    parser.add_argument("--partition", default="{}", type=lambda s: _json_object(s, "--partition"),
                        help="partition description as a JSON object (goal_indices restricts goals)")
    parser.add_argument("--variant", default="{}", type=lambda s: _json_object(s, "--variant"),
                        help="environment-variant description as a JSON object")
    parser.add_argument("--pool", type=int, required=True,
                        help="number of pre-warmed env instances (the client's env.service.pool_size)")
    parser.add_argument("--host", default=DEFAULT_HOST, help="bind address (loopback by default)")
    parser.add_argument("--port", type=int, default=0, help="port; 0 picks a free one")
    parser.add_argument("--ready-file", default=None, help="file that receives the URL once serving")
    parser.add_argument("--create-timeout", type=float, default=DEFAULT_CREATE_TIMEOUT_S,
                        help="seconds /create waits for a free slot before 503")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest accepted request body")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--owner-pid", type=int, default=None,
                        help="exit when this process is gone (the node's long-lived process)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: validate, bind, serve; returns the process exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        setup = build_env_setup(args.env, args.config, args.partition, args.variant)
        settings = ServiceSettings(
            env_name=get_env_class(args.env).env_name,
            pool_size=args.pool,
            create_timeout_s=args.create_timeout,
            max_body_bytes=args.max_body_bytes,
            partition=args.partition,
            variant=args.variant,
            info=setup.info,
        )
    except (ValueError, TypeError, NotImplementedError) as exc:
        print(f"env service: cannot start {args.env}: {exc}", file=sys.stderr)
        return 2
    sock = bind_socket(args.host, args.port)
    # Printed, not logged: the log file should name the URL whatever the log level.
    print(f"env service {settings.env_name} listening on {socket_url(sock)} (pool {args.pool})",
          file=sys.stderr, flush=True)
    try:
        asyncio.run(serve(setup, settings, sock, args.ready_file, args.log_level.lower(), args.owner_pid))
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
