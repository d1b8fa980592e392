"""Every seeded choice of a run, in one place, so runs are reproducible and match FedAgent.

FedAgent's rules (reference/fedagent.md §1.2-1.3): round r samples
``sorted(random.Random(base_seed + r - 1).sample(range(N), M))`` (all clients when M >= N, the
pinned client in local mode), and client c trains round r with data seed
``base_seed + 100 * r + c``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def select_clients(
    server_round: int, total: int, per_round: int, base_seed: int, local_client_id: int = -1
) -> list[int]:
    """Client (partition) ids trained in ``server_round`` (1-based)."""
    if local_client_id >= 0:
        return [local_client_id]
    if per_round >= total:
        return list(range(total))
    return sorted(random.Random(base_seed + server_round - 1).sample(range(total), per_round))


def data_seed(base_seed: int, server_round: int, client_id: int) -> int:
    """Seed of client ``client_id``'s environments and sampling in ``server_round``."""
    return base_seed + 100 * server_round + client_id


def validation_seeds(eval_seed: int, num_episodes: int) -> list[int]:
    """Episode seeds of the validation set: fixed across rounds so curves are comparable."""
    return [eval_seed * 100000 + i for i in range(num_episodes)]


# Seeds one env-spec entry may use per round before running into the next entry's block.
SEEDS_PER_ENTRY = 1000


def train_env_seed(data_seed: int, spec_index: int, step: int, n_envs: int, i: int) -> int:
    """Environment seed of row ``i`` of spec entry ``spec_index`` at local step ``step``.

    ``data_seed * 100000 + spec_index * 1000 + step * n_envs + i``: FedAgent's dataset rule
    (``data_seed * 100000 + spec_index * 1000 + i``) with the rows of later local steps following
    those of earlier ones, so each step plays new seeds. Both trainer backends use it, so they
    play the same environment instances. Valid while ``local_steps * n_envs <= 1000``: past it, an
    entry plays some of the next entry's seeds (a duplicate instance where both entries are the same
    env and config), but never shares its GRPO groups (:func:`train_group_ids`).
    """
    return data_seed * 100_000 + spec_index * SEEDS_PER_ENTRY + step * n_envs + i


def train_group_ids(seeds: Sequence[int]) -> list[int]:
    """The GRPO group id of each env instance of one local step, given their env seeds in order.

    An instance's id is its env seed, unique within a step while every entry's rows stay in its
    block of :data:`SEEDS_PER_ENTRY` seeds. An entry whose rows run past its block plays seeds of
    the next entry's block, so a seed can repeat within a step (two instances of different entries);
    the later instance then gets the next free negative id instead, and two instances never share a
    group. Runs in which no seed repeats keep their ids.
    """
    ids: list[int] = []
    taken: set[int] = set()
    fresh = -1
    for seed in seeds:
        group = seed
        if group in taken:
            while fresh in taken:
                fresh -= 1
            group = fresh
        taken.add(group)
        ids.append(group)
    return ids
