"""verl's agent-loop manager with a worker class of our own (``agent_loop_manager_class``).

verl names the manager by dotted path and builds its Ray workers from the manager's
``agent_loop_workers_class``; each of our managers (windowed rows, seeded requests, both) differs
only in that worker, so each is a subclass of :class:`WorkerManager` that names it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorker


class WorkerManager(AgentLoopManager):
    """verl's agent-loop manager running :attr:`worker` (set by each subclass) as its Ray workers."""

    worker: ClassVar[type[AgentLoopWorker]] = AgentLoopWorker

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import ray

        self.agent_loop_workers_class = ray.remote(self.worker)
        super().__init__(*args, **kwargs)
