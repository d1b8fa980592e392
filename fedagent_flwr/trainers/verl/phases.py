"""Timed phases of a persistent verl session: one JSON line per phase, and one log line.

A persistent session (:mod:`.persistent`) spends its start-up and each round in phases (Ray start,
worker creation, FSDP and reference engines, the vLLM engine, the first weight sync, ...; per
round: reload, sync, dataloader, generation, update, checkpoint save). To see where the time goes
(issue 16), each process of the session that runs our code (the trainer server, the TaskRunner
actor, verl's workers of our subclasses) records what it times with a :class:`PhaseRecorder`:

* a line ``[phase] name=<p> t=<end, s since session start> dt=<s> ...`` in its output (the
  trainer server's log: Ray forwards its workers' output there);
* a JSON object appended to ``phases.jsonl`` (the persistent trainer's channel directory,
  ``<run>/trainers/client_<c>/``): ``phase``, ``start`` and ``t`` (seconds since the session
  began), ``dt``, ``pid``, ``session`` (one id per session: a restarted trainer appends a new
  one), ``round``/``client`` for a round's phases, plus any extra fields (``rank``, ``calls``).

One clock for all processes: ``t`` counts from the session's start as wall-clock time
(``time.time``), which every process of one host shares. Ray workers find the file and the start
time in ``$FEDAGENT_PHASES_FILE`` / ``$FEDAGENT_PHASES_T0`` / ``$FEDAGENT_PHASES_SESSION``, which
the session sets before ``ray.init`` (the workers inherit them); without them
:func:`from_environment` gives a recorder that records nothing, so the same code is inert in a
subprocess job. ``tools/gpu/phases.py`` turns the files of one or many runs into tables.

Recording never fails a job: a file that cannot be written costs a note on the log, nothing more.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_FILE = "FEDAGENT_PHASES_FILE"
ENV_T0 = "FEDAGENT_PHASES_T0"
ENV_SESSION = "FEDAGENT_PHASES_SESSION"
FILE_NAME = "phases.jsonl"
TAG = "[phase]"


class PhasesFileError(ValueError):
    """A phases.jsonl line that is not a phase record (the message names the file and line)."""


def process_started_at(pid: int | None = None) -> float | None:
    """When process ``pid`` (default: this one) started, as ``time.time()``; None off Linux.

    From ``/proc/<pid>/stat`` (start time in clock ticks after boot) and the boot time in
    ``/proc/stat``: the time a Ray worker spends before our code runs in it (interpreter start,
    Ray's worker set-up, the imports the class's module needs) is what it measures to.
    """
    try:
        fields = Path(f"/proc/{pid or os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class PhaseRecorder:
    """Records phases of one session into ``path`` (None: log lines only) relative to ``t0``.

    ``context`` fields (``round``, ``client``) go into every record; :meth:`bound` makes a
    recorder with more of them. ``enabled=False`` records nothing (the recorder of a process
    outside a persistent session).
    """

    def __init__(self, path: str | os.PathLike[str] | None, t0: float, session: str = "",
                 context: dict[str, Any] | None = None, enabled: bool = True,
                 log: Callable[[str], None] | None = None) -> None:
        self.path = Path(path) if path else None
        self.t0 = float(t0)
        self.session = session or f"{os.getpid()}-{int(self.t0)}"
        self.context = dict(context or {})
        self.enabled = enabled
        self.log = log or (lambda text: print(text, flush=True))
        self._warned = False

    def environment(self) -> dict[str, str]:
        """The variables through which the processes this one starts record into the same file."""
        return {ENV_FILE: str(self.path or ""), ENV_T0: repr(self.t0), ENV_SESSION: self.session}

    def bound(self, **context: Any) -> PhaseRecorder:
        """A recorder writing to the same file, with ``context`` added to every record."""
        return PhaseRecorder(self.path, self.t0, self.session, {**self.context, **context}, self.enabled, self.log)

    def record(self, name: str, started: float, ended: float | None = None, **fields: Any) -> dict[str, Any] | None:
        """Record phase ``name`` from ``started`` to ``ended`` (``time.time()`` values; default
        now); returns the record (None when disabled)."""
        if not self.enabled:
            return None
        ended = time.time() if ended is None else ended
        record = {"phase": name, "start": round(started - self.t0, 3), "t": round(ended - self.t0, 3),
                  "dt": round(ended - started, 3), "pid": os.getpid(), "session": self.session,
                  **self.context, **fields}
        extra = " ".join(f"{key}={value}" for key, value in record.items()
                         if key not in ("phase", "t", "dt", "start", "session"))
        self.log(f"{TAG} name={name} t={record['t']:.2f} dt={record['dt']:.2f} {extra}".rstrip())
        if self.path is not None:
            self._append(record)
        return record

    def record_seconds(self, name: str, seconds: float, **fields: Any) -> dict[str, Any] | None:
        """Record phase ``name`` that took ``seconds`` and ended now (a duration measured elsewhere,
        e.g. reported back by a worker)."""
        now = time.time()
        return self.record(name, now - float(seconds), now, **fields)

    @contextmanager
    def phase(self, name: str, **fields: Any) -> Iterator[dict[str, Any]]:
        """Time the ``with`` block as phase ``name``; the yielded dict's items go into the record
        (so the block can add what it learned); a block that raises records ``failed: true``."""
        started = time.time()
        extra: dict[str, Any] = dict(fields)
        try:
            yield extra
        except BaseException:
            extra["failed"] = True
            raise
        finally:
            self.record(name, started, **extra)

    def _append(self, record: dict[str, Any]) -> None:
        assert self.path is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            append_json_line(self.path, record)  # whole lines, also from concurrent processes
        except OSError as exc:
            if not self._warned:
                self._warned = True
                self.log(f"{TAG} note: cannot write {self.path} ({exc}); phases go to the log only")


@functools.lru_cache(maxsize=1)
def from_environment() -> PhaseRecorder:
    """This process's recorder, as the session set it up through the environment (cached); one
    that records nothing when the variables are absent or malformed."""
    path = os.environ.get(ENV_FILE, "")
    try:
        t0 = float(os.environ.get(ENV_T0, ""))
    except ValueError:
        return PhaseRecorder(None, 0.0, enabled=False)
    return PhaseRecorder(path or None, t0, os.environ.get(ENV_SESSION, ""))


def record_process_start(recorder: PhaseRecorder, name: str, **fields: Any) -> None:
    """Record ``name`` from this process's start until now (what it took before our code ran)."""
    started = process_started_at()
    if started is not None:
        recorder.record(name, started, **fields)


@dataclass
class CallLog:
    """How often a :func:`timed_calls` attribute was called, and when the last call began."""

    calls: int = 0
    last_started: float | None = None


@contextmanager
def timed_calls(owner: Any, attribute: str, recorder: PhaseRecorder, name: str,
                first_name: str = "", calls: CallLog | None = None) -> Iterator[CallLog]:
    """While active, each call of ``owner.attribute`` is recorded as phase ``name``.

    ``owner`` is a class (the wrapper keeps a classmethod a classmethod, so subclasses still get
    themselves as ``cls``), a module or an instance (the wrapper shadows the method on the
    instance). A call that returns an awaitable is timed until it is awaited. ``first_name``
    names the first call counted in ``calls`` (shared across uses, e.g. for the session's first
    weight sync) instead; every record has ``call``, its number among this context's calls.
    Yields the :class:`CallLog`; the attribute is restored on exit.
    """
    raw = inspect.getattr_static(owner, attribute)
    own = attribute in vars(owner)
    is_class = inspect.isclass(owner)
    log = calls if calls is not None else CallLog()
    here = CallLog()  # this context's calls: each record's ``call`` (1 = the first while active)

    def timed(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        log.calls += 1
        here.calls += 1
        log.last_started = here.last_started = started = time.time()
        label = first_name if first_name and log.calls == 1 else name
        fields = {"call": here.calls}
        try:
            result = call(*args, **kwargs)
        except BaseException:
            recorder.record(label, started, failed=True, **fields)
            raise
        if inspect.isawaitable(result):
            async def awaited() -> Any:
                try:
                    value = await result
                except BaseException:
                    recorder.record(label, started, failed=True, **fields)
                    raise
                recorder.record(label, started, **fields)
                return value
            return awaited()
        recorder.record(label, started, **fields)
        return result

    if is_class and isinstance(raw, classmethod):
        def as_classmethod(cls: type, *args: Any, **kwargs: Any) -> Any:
            return timed(raw.__get__(None, cls), *args, **kwargs)
        replacement: Any = classmethod(as_classmethod)
    elif is_class and isinstance(raw, staticmethod):
        replacement = staticmethod(functools.partial(timed, raw.__func__))
    elif is_class:
        @functools.wraps(raw)
        def as_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return timed(raw, self, *args, **kwargs)
        replacement = as_method
    else:
        replacement = functools.partial(timed, getattr(owner, attribute))
    setattr(owner, attribute, replacement)
    try:
        yield log
    finally:
        if own:
            setattr(owner, attribute, raw)
        else:
            delattr(owner, attribute)


def append_json_line(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Append ``record`` to ``path`` as one key-sorted JSON line; a single ``write`` on an
    ``O_APPEND`` descriptor keeps the lines of concurrent writers (processes too) whole. Here, in
    this standard-library-only module, so that the agent loop's episode logs share it."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_phases(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a phases.jsonl; a line that is not a phase record raises
    :class:`PhasesFileError` naming the file and line."""
    records = []
    text = Path(path).read_text()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise PhasesFileError(f"{path}:{number}: not JSON ({exc}); was the file cut off? "
                                  "remove the line and run again") from exc
        if not isinstance(record, dict) or not isinstance(record.get("phase"), str) \
                or not isinstance(record.get("dt"), (int, float)):
            raise PhasesFileError(f"{path}:{number}: not a phase record (needs 'phase' and 'dt'): {line[:200]}")
        records.append(record)
    return records
