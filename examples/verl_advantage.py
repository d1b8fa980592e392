"""A verl advantage estimator: GRPO's group baseline, with the group median instead of the mean.

An episode's advantage is its return minus the median return of its group (the ``rollout_n``
episodes of the same env instance), on every response token; no division by the group's spread.
With few successes per group a single lucky episode moves the mean but not the median, so the
other episodes' advantages stay at zero instead of all turning negative. (Registered as
``group_median_baseline``; verl's own estimators live in ``verl.trainer.ppo.core_algos``.)

verl computes advantages in its TaskRunner, a Ray worker process, so the registration must run
there: list this module in ``trainer.plugin_modules`` and the job's ``sitecustomize`` imports it
in every verl process right after ``core_algos``. Select the estimator with an override of verl's
own config; ``examples/conf/trainer/verl_median_baseline.yaml`` does both::

    flwr run . --run-config 'overrides="hydra.searchpath=[pkg://examples.conf] trainer=verl_median_baseline"'
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch
from verl.trainer.ppo.core_algos import register_adv_est

NAME = "group_median_baseline"


@register_adv_est(NAME)
def compute_group_median_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    config: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns, both ``(batch, response_length)``: ``(R_i - median_group(R)) * mask``.

    ``index`` holds each row's group id (verl's ``uid``: rows of one prompt share it); the
    episode's return ``R_i`` is the sum of its token-level rewards (the outcome score).
    """
    scores = token_level_rewards.sum(dim=-1)
    members: dict[Any, list[int]] = defaultdict(list)
    for row, group in enumerate(index):
        members[group].append(row)
    baseline = torch.zeros_like(scores)
    with torch.no_grad():
        for rows in members.values():
            # torch.median returns the lower middle value; the mean of the two middles is the median.
            ordered = scores[rows].sort().values
            middle = len(rows) // 2
            baseline[rows] = ordered[middle] if len(rows) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
        advantages = (scores - baseline).unsqueeze(-1) * response_mask
    return advantages, advantages
