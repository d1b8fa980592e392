"""The text-environment contract every agent environment implements.

Gymnasium-style, but text in, text out, and async so that service-backed environments (WebShop,
ALFWorld behind HTTP) and in-process ones (TinyGuess) look the same to the episode runner:

* ``system_prompt()`` - the task description shown as the chat's system message;
* ``reset(seed)`` - start an episode; the same seed always gives the same episode;
* ``step(action_text)`` - apply the model's reply; returns (observation, reward, done, info) with
  ``info["success"]`` telling whether the task was solved;
* ``close()`` - release the episode's resources (a pooled service session, for example);
* ``window_prompt(window)`` - windowed mode's single-message prompt for the next turn (the generic
  template unless the environment renders its own, see :mod:`fedagent_flwr.envs.window`).

Environments with a finite pool of goals (TinyGuess's secrets, WebShop's instructions) also say
how large that pool is and how to restrict a config to a subset of it; heterogeneity partitions
(``fedagent_flwr.hetero``) use that to give each federated client its own goals.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, ClassVar

from fedagent_flwr.envs.window import Window, generic_window


class EnvConfigError(ValueError):
    """An environment config value that the environment cannot use.

    ``key`` names the config field at fault (``"data_dir"``) when one does, so the ServerApp's
    start-up check can name the run-config key (``env.data_dir``) rather than only the env's field.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class EnvDataError(EnvConfigError):
    """The environment's data files are missing or unusable on this machine.

    Separate from other config errors because it depends on the machine: in a simulation the
    ServerApp's machine is the clients' machine, so it refuses the run at start; across machines the
    data may live only on the clients, so it only warns.
    """


def config_int(config: Mapping[str, Any], key: str, default: int, minimum: int, env: str) -> int:
    """``config[key]`` (``default`` when absent) as an integer ``>= minimum``; an error naming the key
    otherwise. One check, so that every environment refuses a bad count with the same words."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EnvConfigError(f"{env} config '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def optional_config_int(config: Mapping[str, Any], key: str, default: int | None, minimum: int,
                        env: str) -> int | None:
    """:func:`config_int` for a key where None (given, or the default) means unset."""
    value = config.get(key, default)
    return None if value is None else config_int(config, key, value, minimum, env)


def config_int_list(config: Mapping[str, Any], key: str, env: str) -> list[int] | None:
    """``config[key]`` as a non-empty list of integers; None when unset."""
    raw = config.get(key)
    if raw is None:
        return None
    if (isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or not raw
            or any(isinstance(g, bool) or not isinstance(g, int) for g in raw)):
        raise EnvConfigError(f"{env} config '{key}' must be a non-empty list of integers, got {raw!r}")
    return list(raw)


def configured_goal_indices(env_name: str, config: Mapping[str, Any], pool_size: int) -> list[int] | None:
    """``config["goal_indices"]`` checked against a pool of ``pool_size`` goals; None when unset.

    Shared by the environments that keep their goal restriction in the config (WebShop and the
    TextWorld game pools), so that they refuse a bad list with the same words.
    """
    indices = config_int_list(config, "goal_indices", env_name)
    if indices is None:
        return None
    bad = [g for g in indices if not 0 <= g < pool_size]
    if bad:
        raise EnvConfigError(f"{env_name} goal_indices {bad[:5]} are outside the split's pool of {pool_size}")
    return indices


def pool_index_for_seed(seed: int, goal_indices: Sequence[int] | None, pool_size: int) -> int:
    """The pool index an episode with ``seed`` plays: ``goal_indices[random.Random(seed).randrange(len)]``
    under a restriction (as FedAgent's partitioned services pick), else ``seed % pool_size``."""
    if goal_indices is not None:
        return goal_indices[random.Random(seed).randrange(len(goal_indices))]
    return seed % pool_size


def restricted_goal_config(env_name: str, config: Mapping[str, Any], goal_indices: Sequence[int], pool: int,
                           current: list[int] | None) -> dict[str, Any]:
    """:meth:`BaseTextEnv.restrict_goals` for an env whose config keeps ``goal_indices``: a copy
    of ``config`` limited to ``goal_indices`` of its ``pool`` goals, composed with the restriction
    ``current`` it already has (indices into the split's pool, or None)."""
    if not goal_indices:
        raise EnvConfigError(f"{env_name} cannot be restricted to an empty goal list")
    bad = [g for g in goal_indices if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < pool]
    if bad:
        raise EnvConfigError(f"{env_name} goal indices {bad[:5]} are outside the pool of {pool}")
    chosen = [current[g] for g in goal_indices] if current is not None else [int(g) for g in goal_indices]
    return {**dict(config), "goal_indices": chosen}


class BaseTextEnv(abc.ABC):
    """Abstract async text environment; one instance runs one episode at a time."""

    #: Display name under which the class is registered (set by ``register_env``).
    env_name: ClassVar[str] = ""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config: dict[str, Any] = dict(config or {})

    @abc.abstractmethod
    async def system_prompt(self) -> str:
        """The task description, used as the system message of every episode."""

    @abc.abstractmethod
    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        """Start a new episode chosen by ``seed`` (deterministic); return (observation, info)."""

    @abc.abstractmethod
    async def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Apply one model reply; return (observation, reward, done, info with ``success``)."""

    async def close(self) -> None:  # noqa: B027 -- optional hook, no-op by default
        """Release resources held by the episode; the default has nothing to release."""

    def window_prompt(self, window: Window) -> str:
        """Windowed mode's prompt for the next turn (one user message, no system message).

        The default renders with this class's :meth:`render_window`; an env whose episodes run
        elsewhere (the service client) renders with the served environment's class instead.
        """
        return type(self).render_window(window)

    @classmethod
    def render_window(cls, window: Window) -> str:
        """The windowed prompt as a pure function of ``window`` (FedAgent's templates for WebShop
        and ALFWorld override it; everything else gets :func:`~fedagent_flwr.envs.window.generic_window`)."""
        return generic_window(window)

    async def __aenter__(self) -> BaseTextEnv:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @classmethod
    def served_env_name(cls, config: Mapping[str, Any]) -> str | None:
        """The name of the environment an entry with ``config`` plays on this one's behalf (the
        env-service client names the served env), or None: the entry plays this environment."""
        return None

    @classmethod
    def max_concurrent(cls, config: Mapping[str, Any]) -> int | None:
        """How many episodes of an entry with ``config`` can be played at once, or None for no limit.
        A lockstep player plays the entry's episodes in waves of this many: an episode waiting for
        a free env would stall all the others (the env-service client is limited by its pool)."""
        return None

    # --- goal pools (for partitioning); environments without a finite pool keep the defaults ---

    @classmethod
    def num_goals(cls, config: Mapping[str, Any]) -> int | None:
        """Size of the goal pool ``config`` draws episodes from, or None if there is no pool."""
        return None

    @classmethod
    def restrict_goals(cls, config: Mapping[str, Any], goal_indices: Sequence[int]) -> dict[str, Any]:
        """Return a copy of ``config`` whose episodes only use the given goal indices.

        Indices refer to the pool that :meth:`num_goals` counts for the same ``config``.
        """
        raise NotImplementedError(f"{cls.__name__} has no goal pool to restrict")

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> None:
        """Refuse a config this environment cannot run, before any client starts.

        The ServerApp calls it once per env-spec entry (train and val) before round 0, so a bad value
        stops the run at start with one message instead of failing every client. The default builds
        one instance with ``config``; an environment whose construction is expensive (a catalogue to
        load, games to generate) overrides it with the checks that need no such work. Raise
        :class:`EnvConfigError` (with ``key``), or :class:`EnvDataError` for missing data files.
        """
        cls(config)
