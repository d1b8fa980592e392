"""A generic HTTP service that hosts text environments for remote episode runners.

One service process holds a pool of pre-built environment instances (building one can be slow
and memory-hungry, as FedAgent's 26 s / 14 GB WebShop instances show) and lends them out as
sessions. The wire protocol follows FedAgent's env services:

* ``GET /health`` - readiness, pool size, free slots, live sessions, and the partition and env
  variant the service was started with (so a federated run can check each client's world);
* ``POST /create {session_id?}`` - borrow a pooled instance; when the pool is exhausted the
  request waits (asynchronously) for a slot, up to ``create_timeout_s``, then answers 503;
  creating an existing session again is a no-op, so a retried create never leaks a slot;
* ``POST /reset {session_id, seed}`` - start an episode; step ids restart at 0 (the previous
  episode ends even if the reset fails: a step then gets 409 until a reset succeeds); the seed must be a
  signed 64-bit integer (422 otherwise, naming the seed and the range);
* ``POST /step {session_id, step_id, action}`` - apply one reply, idempotently: a step id that
  was already applied returns the cached reply without touching the environment (a client that
  lost a response retries safely), a step id ahead of the next one is 409, an unknown session 404;
* ``POST /close {session_id}`` - return the instance to the pool (closing an unknown session is a
  no-op that says so, because a retried close whose first reply was lost must not fail).

Bad input (malformed JSON, JSON nested deeper than 32 levels, wrong types, unknown fields, a seed
outside the signed 64-bit range, bodies over ``max_body_bytes``) gets a 4xx with a readable
``{"error": ...}`` body; the service keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fedagent_flwr.envs.base import BaseTextEnv
from fedagent_flwr.envs.service import DEFAULT_CREATE_TIMEOUT_S
from fedagent_flwr.jsonbody import JsonBodyError, loads_bounded

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 * 1024
# Episode seeds a service accepts: a signed 64-bit integer, what every consumer of a seed here
# holds (verl's dataset columns, numpy and torch generators). Python would take any int, so a
# larger one would be accepted here and fail, or wrap around, further down.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1

#: Builds the environment instance of pool slot ``i`` (called once per slot at start-up).
EnvFactory = Callable[[int], BaseTextEnv]


@dataclass(frozen=True)
class ServiceEnvSetup:
    """How a service builds its pool: the per-slot factory and env facts for ``/health``."""

    factory: EnvFactory
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServiceSettings:
    """What a service hosts and how; fixed for the life of the service.

    ``partition`` and ``variant`` are descriptions only (the factory already built envs that obey
    them); the service echoes them in ``/health`` so a caller can verify which world it talks to.
    ``info`` is env-specific facts for ``/health`` (goal pool or catalogue size, data paths).
    """

    env_name: str
    pool_size: int  # env.service.pool_size, passed by the client (fedagent_flwr/schema/run.py)
    create_timeout_s: float = DEFAULT_CREATE_TIMEOUT_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    partition: Mapping[str, Any] = field(default_factory=dict)
    variant: Mapping[str, Any] = field(default_factory=dict)
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {self.pool_size}")
        if self.create_timeout_s <= 0:
            raise ValueError(f"create_timeout_s must be > 0, got {self.create_timeout_s}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")


# --- request bodies: strict so that "3" is not silently an int and a typo'd field is reported ---

SessionId = Annotated[str, Field(min_length=1, max_length=128)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class CreateRequest(_Strict):
    session_id: SessionId | None = None


class ResetRequest(_Strict):
    session_id: SessionId
    seed: int


class StepRequest(_Strict):
    session_id: SessionId
    step_id: Annotated[int, Field(ge=0)]
    action: str


class CloseRequest(_Strict):
    session_id: SessionId


@dataclass
class _Session:
    """One borrowed pool slot and the idempotency state of its current episode."""

    slot: int
    env: BaseTextEnv
    # Serialises everything on this session: concurrent duplicates of a step apply once.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    reset_done: bool = False
    done: bool = False
    next_step_id: int = 0
    # Replies of the current episode by step id (episodes are tens of turns, so keeping all is
    # cheap and lets any already-applied step id be replayed, not only the last one).
    replies: dict[int, dict[str, Any]] = field(default_factory=dict)


class _BodyLimitMiddleware:
    """Refuse request bodies over ``limit`` bytes with 413 before any handler parses them.

    The body is buffered (it is at most ``limit`` bytes) so chunked uploads without a
    Content-Length are bounded too.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await self._reply(send, 400, "invalid Content-Length header")
                    return
                if declared > self.limit:
                    await self._reply(send, 413, self._too_large())
                    return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._reply(send, 413, self._too_large())
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: pass disconnects through

        await self.app(scope, replay, send)

    def _too_large(self) -> str:
        return f"request body too large (limit {self.limit} bytes)"

    @staticmethod
    async def _reply(send: Send, status: int, message: str) -> None:
        response = JSONResponse({"error": message}, status_code=status)
        await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


_ModelT = TypeVar("_ModelT", bound=BaseModel)


def _parse(model: type[_ModelT], raw: bytes) -> _ModelT:
    """Validate a JSON request body: 400 if it is not JSON at all (or nests deeper, or holds a
    longer number, than any request here can: :mod:`fedagent_flwr.jsonbody`), 422 if fields are wrong."""
    try:
        payload = loads_bounded(raw)
    except JsonBodyError as exc:
        raise HTTPException(400, f"malformed JSON body: the body {exc}") from None
    if not isinstance(payload, dict):
        raise HTTPException(422, f"request body must be a JSON object, got {type(payload).__name__}")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise HTTPException(422, _describe_errors(exc.errors())) from None


def _describe_errors(errors: Sequence[Any]) -> str:
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


class EnvService:
    """The state behind one service app: the pool, the sessions and the endpoint logic."""

    def __init__(self, env_factory: EnvFactory, settings: ServiceSettings) -> None:
        self.env_factory = env_factory
        self.settings = settings
        self.envs: list[BaseTextEnv] = []
        # Slots not lent out; filled once the pool is built, so early creates simply wait.
        self.free: asyncio.Queue[int] = asyncio.Queue()
        self.sessions: dict[str, _Session] = {}
        self.ready = False
        self.error: str | None = None
        self.waiting = 0  # /create requests queued for a slot (visible in /health)

    async def build_pool(self) -> None:
        """Build every slot's env in worker threads (factories may block for seconds)."""
        try:
            self.envs = list(
                await asyncio.gather(
                    *(asyncio.to_thread(self.env_factory, i) for i in range(self.settings.pool_size))
                )
            )
        except Exception as exc:  # reported through /health and /create, never a dead process
            logger.exception("building the env pool failed")
            self.error = f"building the env pool failed: {type(exc).__name__}: {exc}"
            return
        for slot in range(len(self.envs)):
            self.free.put_nowait(slot)
        self.ready = True

    async def close_all(self) -> None:
        """Close every pooled env at shutdown (errors ignored: the process is going away)."""
        for env in self.envs:
            with contextlib.suppress(Exception):
                await env.close()

    def health(self) -> dict[str, Any]:
        """The ``/health`` reply: readiness, pool occupancy and the start-up settings."""
        return {
            "ok": self.ready,
            "ready": self.ready,
            "error": self.error,
            "env": self.settings.env_name,
            "pool_size": self.settings.pool_size,
            "free": self.free.qsize(),
            "sessions": len(self.sessions),
            "waiting": self.waiting,
            "partition": dict(self.settings.partition),
            "variant": dict(self.settings.variant),
            "info": dict(self.settings.info),
        }

    def _session(self, session_id: str) -> _Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise HTTPException(404, f"unknown session {session_id!r} (create it first, or it was closed)")
        return session

    def _still_open(self, session_id: str, session: _Session) -> None:
        # A close that won the lock first has already lent this env to someone else.
        if self.sessions.get(session_id) is not session:
            raise HTTPException(404, f"unknown session {session_id!r} (it was closed)")

    async def create(self, body: CreateRequest) -> dict[str, Any]:
        """Lend a slot to ``body.session_id`` (waiting for one if needed); a known id is a no-op."""
        session_id = body.session_id or uuid.uuid4().hex
        if session_id in self.sessions:
            return await self._created(session_id, existed=True)
        if self.error is not None:
            raise HTTPException(503, self.error)
        assert self.free is not None
        self.waiting += 1
        try:
            # Queue.get never loses an item when cancelled, so a timed-out waiter leaks no slot.
            async with asyncio.timeout(self.settings.create_timeout_s):
                slot = await self.free.get()
        except TimeoutError:
            raise HTTPException(
                503,
                f"no free env slot within {self.settings.create_timeout_s:g} s "
                f"(pool of {self.settings.pool_size}, all in use); retry later, close sessions, or start the "
                "service with a larger pool (a run's env.service.pool_size)",
            ) from None
        finally:
            self.waiting -= 1
        if session_id in self.sessions:
            # A duplicate create for the same id won the race while this one waited.
            self.free.put_nowait(slot)
            return await self._created(session_id, existed=True)
        self.sessions[session_id] = _Session(slot=slot, env=self.envs[slot])
        return await self._created(session_id, existed=False)

    async def _created(self, session_id: str, existed: bool) -> dict[str, Any]:
        session = self.sessions[session_id]
        return {
            "session_id": session_id,
            "existed": existed,
            "env": self.settings.env_name,
            "system_prompt": await session.env.system_prompt(),
        }

    async def reset(self, body: ResetRequest) -> dict[str, Any]:
        """Start an episode with ``body.seed``; forgets the previous episode's step replies.

        A seed outside [SEED_MIN, SEED_MAX] is refused (422) before the environment sees it.
        """
        if not SEED_MIN <= body.seed <= SEED_MAX:
            raise HTTPException(
                422, f"seed {body.seed} is outside the allowed range [{SEED_MIN}, {SEED_MAX}] (a signed "
                "64-bit integer); derive episode seeds that fit",
            )
        session = self._session(body.session_id)
        async with session.lock:
            self._still_open(body.session_id, session)
            # The previous episode ends here, before the env is touched: if this reset fails, a
            # step must get 409 (no episode), not that episode's cached replies or an env left
            # half reset.
            session.reset_done = False
            session.done = False
            session.next_step_id = 0
            session.replies.clear()
            obs, info = await session.env.reset(body.seed)
            session.reset_done = True
            return {"obs": obs, "info": info}

    async def step(self, body: StepRequest) -> dict[str, Any]:
        """Apply step ``body.step_id`` once; an applied id replays its cached reply."""
        session = self._session(body.session_id)
        async with session.lock:
            self._still_open(body.session_id, session)
            cached = session.replies.get(body.step_id)
            if cached is not None:
                return {**cached, "replayed": True}
            if not session.reset_done:
                raise HTTPException(409, "no episode in progress: call /reset before /step")
            if body.step_id != session.next_step_id:
                raise HTTPException(
                    409,
                    f"step_id {body.step_id} is out of order: the next step of this episode is "
                    f"{session.next_step_id}",
                )
            if session.done:
                raise HTTPException(409, "the episode has ended: call /reset to start another")
            obs, reward, done, info = await session.env.step(body.action)
            reply = {
                "step_id": body.step_id,
                "obs": obs,
                "reward": float(reward),
                "done": bool(done),
                "info": info,
            }
            session.replies[body.step_id] = reply
            session.next_step_id += 1
            session.done = bool(done)
            return {**reply, "replayed": False}

    async def close(self, body: CloseRequest) -> dict[str, Any]:
        """Give the session's slot back to the pool; an unknown session reports ``released: false``."""
        session = self.sessions.get(body.session_id)
        if session is None:
            return {"session_id": body.session_id, "released": False}
        async with session.lock:
            if self.sessions.get(body.session_id) is not session:
                return {"session_id": body.session_id, "released": False}
            del self.sessions[body.session_id]
            try:
                await session.env.close()
            except Exception:  # the slot goes back regardless; a stuck slot would starve the pool
                logger.exception("env.close failed for session %s", body.session_id)
            self.free.put_nowait(session.slot)
        return {"session_id": body.session_id, "released": True}


def create_service_app(env_factory: EnvFactory, settings: ServiceSettings) -> FastAPI:
    """Build the FastAPI app of an env service hosting ``settings.pool_size`` envs from ``env_factory``.

    The pool is built in the background after start-up, so ``/health`` answers (with
    ``ready: false``) while slow environments load; ``/create`` simply waits for a slot.
    """
    service = EnvService(env_factory, settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        build = asyncio.create_task(service.build_pool())
        try:
            yield
        finally:
            build.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await build
            await service.close_all()

    app = FastAPI(title=f"{settings.env_name} env service", lifespan=lifespan)
    app.state.env_service = service

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": _describe_errors(exc.errors())}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _env_error(_request: Request, exc: Exception) -> JSONResponse:
        # An environment bug: say what it was instead of a bare 500 page.
        logger.exception("unhandled error in env service")
        return JSONResponse({"error": f"environment error: {type(exc).__name__}: {exc}"}, status_code=500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return service.health()

    # Bodies are parsed here rather than by FastAPI so that any content type carrying JSON works
    # (curl's default form type included) and every failure gets the same readable shape.
    @app.post("/create")
    async def create(request: Request) -> dict[str, Any]:
        raw = await request.body()
        return await service.create(_parse(CreateRequest, raw) if raw.strip() else CreateRequest())

    @app.post("/reset")
    async def reset(request: Request) -> dict[str, Any]:
        return await service.reset(_parse(ResetRequest, await request.body()))

    @app.post("/step")
    async def step(request: Request) -> dict[str, Any]:
        return await service.step(_parse(StepRequest, await request.body()))

    @app.post("/close")
    async def close(request: Request) -> dict[str, Any]:
        return await service.close(_parse(CloseRequest, await request.body()))

    app.add_middleware(_BodyLimitMiddleware, limit=settings.max_body_bytes)
    return app
