"""HTTP env services: host text environments in their own process, play them over HTTP.

* ``app`` - ``create_service_app``: the FastAPI app (pool, sessions, idempotent ``/step``);
* ``server`` - ``python -m fedagent_flwr.envs.service.server``: bind, serve, write the URL;
* ``client`` - ``ServiceTextEnv`` (registered as ``Service``): the episode side, over httpx;
* ``manager`` - ``EnvServiceManager``: start, attach to, restart and stop a service process;
* ``engine_workers`` - ``EngineWorkers``: engine processes inside a service (ALFWorld, TextWorld).

Modules are imported on demand (not here) so that the client side never pulls in FastAPI and
uvicorn, and the service side never pulls in the rest of the package.
"""

#: How long a ``/create`` waits for a free env slot before the service answers 503 (its
#: ``--create-timeout``); the ServerApp's start-up checks quote it.
DEFAULT_CREATE_TIMEOUT_S = 300.0
