"""``ServiceTextEnv``: a :class:`BaseTextEnv` whose episodes run inside a remote env service.

Registered as ``Service``; an env spec points at a running service with::

    envs:
      - name: Service
        n_envs: 16
        config: {url: "http://127.0.0.1:40123", env: TinyGuess}

One instance plays one episode at a time: ``/create`` (lazily, on the first call) → ``/reset`` →
``/step``* → ``/close``. Only transport errors (connection refused, timeouts, dropped
connections) are retried, with capped exponential backoff and a deterministic jitter; an HTTP
error status is an answer, not a glitch, and raises :class:`ServiceError` at once. The step id
advances only after a step succeeded, so a retried step carries the same id and the service
replays its cached reply instead of applying the action twice. ``close()`` always gives the
session back (callers put it in ``finally``) and never raises, so it cannot mask the error that
ended an episode.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import Mapping
from typing import Any

import httpx

from fedagent_flwr.envs.base import BaseTextEnv, EnvConfigError, config_int, optional_config_int
from fedagent_flwr.envs.registry import get_env_class, register_env
from fedagent_flwr.envs.window import Window

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_RETRIES = 8
DEFAULT_BACKOFF_BASE_S = 0.3
DEFAULT_BACKOFF_CAP_S = 4.0


class ServiceError(RuntimeError):
    """The env service answered with an error status (or could not be reached at all)."""

    def __init__(self, endpoint: str, status: int | None, message: str) -> None:
        where = f"{endpoint} -> HTTP {status}" if status is not None else endpoint
        super().__init__(f"env service {where}: {message}")
        self.endpoint = endpoint
        self.status = status
        self.message = message


def backoff_delay(attempt: int, base_s: float, cap_s: float, key: str) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): ``min(cap, base * 2**attempt)`` with jitter.

    The jitter scales the delay into ``[0.5, 1.0)`` of its nominal value so that many clients
    that failed together do not retry together. It is derived from ``key`` (the session id) and
    the attempt through BLAKE2b, not a random generator or the salted ``hash()``, so a given
    session's retry schedule is reproducible.
    """
    nominal = min(cap_s, base_s * (2.0 ** attempt))
    digest = hashlib.blake2b(f"{key}:{attempt}".encode(), digest_size=8).digest()
    fraction = int.from_bytes(digest, "big") / 2.0 ** 64
    return nominal * (0.5 + 0.5 * fraction)


def _number(config: Mapping[str, Any], key: str, default: float | None, *, minimum: float) -> float | None:
    value = config.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise EnvConfigError(f"Service config '{key}' must be a number >= {minimum}, got {value!r}")
    return float(value)


def _create_may_have_applied(exc: BaseException) -> bool:
    """Whether a failed /create might still have taken a slot on the service."""
    if isinstance(exc, ServiceError):
        # An HTTP status means the service refused; a connect error means it never heard us.
        return exc.status is None and not isinstance(exc.__cause__, httpx.ConnectError)
    return True  # cancelled or failed mid-flight: assume the service acted


@register_env("Service")
class ServiceTextEnv(BaseTextEnv):
    """A text environment served over HTTP by ``fedagent_flwr.envs.service``.

    Config keys: ``url`` (required), ``env`` (the remote env name; checked against the service
    when given), ``timeout_s`` (per request, default 60), ``create_timeout_s`` (how long ``/create``
    may wait for a pool slot; default None = as long as the service lets it, since waiting for a
    slot is normal under load), ``max_retries`` (default 8), ``backoff_base_s`` (0.3),
    ``backoff_cap_s`` (4.0), ``pool_size`` (the service's pool: :meth:`max_concurrent`). Other keys
    (``max_turns`` from the env spec) are the remote env's business and ignored here.
    """

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        url = self.config.get("url")
        if not isinstance(url, str) or not url.strip():
            raise EnvConfigError(f"Service config 'url' must be the service URL, got {url!r}")
        self.url = url.strip().rstrip("/")
        remote = self.config.get("env")
        if remote is not None and (not isinstance(remote, str) or not remote.strip()):
            raise EnvConfigError(f"Service config 'env' must be an environment name, got {remote!r}")
        self.remote_env: str | None = remote.strip() if remote else None
        self.timeout_s = _number(self.config, "timeout_s", DEFAULT_TIMEOUT_S, minimum=0.001)
        self.create_timeout_s = _number(self.config, "create_timeout_s", None, minimum=0.001)
        self.max_retries = config_int(self.config, "max_retries", DEFAULT_MAX_RETRIES, 0, "Service")
        self.max_concurrent(self.config)  # a bad pool_size is refused here, when the job is checked
        self.backoff_base_s = _number(self.config, "backoff_base_s", DEFAULT_BACKOFF_BASE_S, minimum=0.0) or 0.0
        self.backoff_cap_s = _number(self.config, "backoff_cap_s", DEFAULT_BACKOFF_CAP_S, minimum=0.0) or 0.0
        self._client: httpx.AsyncClient | None = None
        self.session_id: str | None = None
        self._system_prompt: str | None = None
        self._served_env: str | None = None
        self.step_id = 0

    @classmethod
    def served_env_name(cls, config: Mapping[str, Any]) -> str | None:
        """The served env's name (``config["env"]``, which the client's services always set), or None."""
        remote = config.get("env")
        return remote.strip() if isinstance(remote, str) and remote.strip() else None

    @classmethod
    def max_concurrent(cls, config: Mapping[str, Any]) -> int | None:
        """The service's pool (``config["pool_size"]``, which the client's services always set), or
        None when the entry does not say: more sessions than that wait for a slot."""
        return optional_config_int(config, "pool_size", None, 1, "Service")

    # --- transport -------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s)
        return self._client

    async def _post(self, endpoint: str, payload: dict[str, Any], *, waits_for_slot: bool = False,
                    retries: int | None = None) -> dict[str, Any]:
        """POST with retries on transport errors only; HTTP error statuses raise at once."""
        timeout: Any = httpx.USE_CLIENT_DEFAULT
        if waits_for_slot:
            # /create legitimately blocks while the pool is busy; only its read phase is longer.
            timeout = httpx.Timeout(self.timeout_s, read=self.create_timeout_s)
        key = self.session_id or ""
        attempts = (self.max_retries if retries is None else retries) + 1
        for attempt in range(attempts):
            try:
                response = await self._http().post(endpoint, json=payload, timeout=timeout)
            except httpx.TransportError as exc:
                if attempt + 1 >= attempts:
                    raise ServiceError(
                        endpoint, None,
                        f"unreachable at {self.url} after {attempts} attempt(s): {type(exc).__name__}: {exc}",
                    ) from exc
                delay = backoff_delay(attempt, self.backoff_base_s, self.backoff_cap_s, key)
                logger.warning("env service %s%s: %s; retry %d/%d in %.2f s", self.url, endpoint,
                               type(exc).__name__, attempt + 1, attempts - 1, delay)
                await asyncio.sleep(delay)
                continue
            return self._decode(endpoint, response)
        raise AssertionError("unreachable")  # the loop either returns or raises

    @staticmethod
    def _decode(endpoint: str, response: httpx.Response) -> dict[str, Any]:
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code >= 400:
            message = body.get("error") if isinstance(body, dict) else None
            raise ServiceError(endpoint, response.status_code, str(message or response.text[:500]))
        if not isinstance(body, dict):
            raise ServiceError(endpoint, response.status_code, f"expected a JSON object, got {response.text[:200]!r}")
        return body

    # --- episode ---------------------------------------------------------------------------

    async def _ensure_session(self) -> str:
        if self.session_id is None:
            # The id is ours, not the service's: a create retried after a lost reply re-asks for
            # the same session instead of borrowing a second slot.
            session_id = uuid.uuid4().hex
            self.session_id = session_id
            try:
                reply = await self._post("/create", {"session_id": session_id}, waits_for_slot=True)
            except BaseException as exc:
                self.session_id = None
                if _create_may_have_applied(exc):
                    # The reply was lost, not the request: the slot may be ours, so give it back.
                    await self._release(session_id)
                raise
            if self.remote_env and str(reply.get("env", "")).lower() != self.remote_env.lower():
                await self._release(session_id)
                self.session_id = None
                raise EnvConfigError(
                    f"service at {self.url} hosts {reply.get('env')!r}, but the config expects {self.remote_env!r}"
                )
            self._system_prompt = str(reply.get("system_prompt", ""))
            self._served_env = str(reply.get("env") or "") or None
        return self.session_id

    async def system_prompt(self) -> str:
        await self._ensure_session()
        return self._system_prompt or ""

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        session_id = await self._ensure_session()
        reply = await self._post("/reset", {"session_id": session_id, "seed": int(seed)})
        self.step_id = 0
        return str(reply["obs"]), dict(reply.get("info") or {})

    async def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.session_id is None:
            raise RuntimeError("ServiceTextEnv.step called without an episode; call reset first")
        reply = await self._post(
            "/step", {"session_id": self.session_id, "step_id": self.step_id, "action": str(action_text)}
        )
        # Only now: a step that failed in transport is retried under the same id (a replay).
        self.step_id += 1
        return str(reply["obs"]), float(reply["reward"]), bool(reply["done"]), dict(reply.get("info") or {})

    def window_prompt(self, window: Window) -> str:
        """The windowed prompt as the served environment renders it (a pure function of the
        observations and infos the service returned, so it is rendered here, by that env's class)."""
        name = self.remote_env or self._served_env
        if not name:
            raise EnvConfigError(
                f"Service at {self.url}: windowed prompts need the served environment's name; set the "
                "env spec entry's config 'env' (or start an episode first)"
            )
        return get_env_class(name).render_window(window)

    async def _release(self, session_id: str) -> bool:
        """Best-effort ``/close``; True if the service confirmed it (or never had the session)."""
        try:
            await self._post("/close", {"session_id": session_id}, retries=min(self.max_retries, 3))
            return True
        except Exception as exc:  # close must not raise: it runs in finally blocks
            logger.warning("could not close env service session %s at %s: %s", session_id, self.url, exc)
            return False

    async def close(self) -> None:
        """Return the session to the service's pool and drop the HTTP connection; never raises."""
        session_id, self.session_id = self.session_id, None
        self._system_prompt = None
        self.step_id = 0
        try:
            if session_id is not None:
                await self._release(session_id)
        finally:
            client, self._client = self._client, None
            if client is not None:
                try:
                    await client.aclose()
                except Exception:  # the connection is being discarded anyway
                    logger.debug("closing the HTTP client failed", exc_info=True)
