"""Flower's server-optimiser steps restated in float64, with the bound of their fp32 rounding.

The arithmetic of :mod:`.verify_optimizer`'s audit (its module docstring, "Pass or fail", derives
the bounds): :func:`recompute_step` takes one chunk of a key's elements (the clients' weighted
mean, the previous global model, the previous buffers) and returns the new global model, its
per-element bound and each new buffer's. Every operation is element-wise, so a chunk's results are the
corresponding elements of the whole key's: the audit may process a key in chunks of any size and
report the same errors and ratios.
"""

from __future__ import annotations

import math

import torch

from fedagent_flwr.checkpoint.key_checks import count_non_finite
from fedagent_flwr.checkpoint.ref import CheckpointError

__all__ = ["EPS32", "buffers_of", "max_of", "non_finite_in_audit", "recompute_step", "require_finite", "worst_ratio"]

#: fp32's machine epsilon: the strategy's arithmetic (verify_optimizer's docstring, "Pass or fail").
EPS32 = torch.finfo(torch.float32).eps


def buffers_of(rule: str, settings: dict[str, float]) -> list[str]:
    """The buffers Flower's rule keeps with these settings (FedAvgM's only with momentum, m only
    with beta_1 > 0)."""
    if rule == "fedavgm":
        return ["momentum"] if settings.get("server_momentum", 0.0) > 0.0 else []
    return ["m", "v"] if settings.get("beta_1", 0.0) > 0.0 else ["v"]


def recompute_step(rule: str, settings: dict[str, float], server_round: int, x: torch.Tensor, mean: torch.Tensor,
                   state: dict[str, torch.Tensor], slack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                dict[str, torch.Tensor]]:
    """The new ``x`` in float64 from Flower's formulas, with its fp32 bound and each new buffer's
    (verify_optimizer's docstring, "Pass or fail"; ``slack`` bounds the fp32 error of ``delta``); ``state``
    (zeros at first) is updated in place."""
    twice = 2.0 * EPS32  # one fp32 rounding of a result, with the docstring's margin
    if rule == "fedavgm":
        rate, bounds = settings["server_learning_rate"], {}
        gradient, error = x - mean, slack
        if "momentum" in state:  # zeros at first: mu 0 + g is Flower's first-round momentum = g
            mu, old = settings["server_momentum"], state["momentum"]
            state["momentum"] = mu * old + gradient
            error = bounds["momentum"] = slack + twice * (mu * old.abs() + state["momentum"].abs())
            gradient = state["momentum"]
        new = x - rate * gradient
        return new, rate * error + twice * (rate * gradient.abs() + new.abs()), bounds
    beta_1, beta_2, eta, tau = settings["beta_1"], settings["beta_2"], settings["eta"], settings["tau"]
    delta = mean - x
    m, m_error, bounds = delta, slack, {}
    if "m" in state:
        m = beta_1 * state["m"] + (1.0 - beta_1) * delta
        m_error = bounds["m"] = (1.0 - beta_1) * slack + twice * (beta_1 * state["m"].abs() + m.abs())
        state["m"] = m
    v, squared = state["v"], delta * delta
    squared_error = 2.0 * delta.abs() * slack + slack * slack + twice * squared
    if rule == "fedadam":
        v = beta_2 * v + (1.0 - beta_2) * squared
        v_error = (1.0 - beta_2) * squared_error + twice * (beta_2 * state["v"].abs() + v.abs())
        eta = eta * math.sqrt(1.0 - beta_2 ** (server_round + 1.0)) / (1.0 - beta_1 ** (server_round + 1.0))
    elif rule == "fedyogi":
        unsure = (v - squared).abs() <= squared_error + twice * (v.abs() + squared)  # fp32 may take the other sign
        v = v - (1.0 - beta_2) * squared * torch.sign(v - squared)
        v_error = ((1.0 - beta_2) * squared_error + twice * (state["v"].abs() + v.abs())
                   + torch.where(unsure, 2.0 * (1.0 - beta_2) * (squared + squared_error), 0.0))
    else:  # fedadagrad
        v = v + squared
        v_error = squared_error + twice * v.abs()
    state["v"], bounds["v"] = v, v_error
    root = torch.sqrt(v.clamp(min=0.0))
    shift = root - torch.sqrt((v - v_error).clamp(min=0.0))  # the most sqrt moves for v within v_error
    denominator = root + tau
    lowest = denominator - shift  # >= tau
    update = eta * m / denominator
    new = x + update
    error = (eta * (m_error / lowest + (m.abs() + m_error) * shift / (denominator * lowest))
             + 2.0 * twice * update.abs() + twice * new.abs())
    return new, error, bounds


def worst_ratio(error: torch.Tensor, allowed: torch.Tensor) -> float:
    """The largest ``error / allowed``, 0 where the error is 0 (an exact zero allowed nothing and got
    it: 0/0 would be NaN, which max() passes over), infinite where something was not allowed."""
    ratio = torch.where(error == 0, torch.zeros_like(error), error / allowed)
    return max_of(ratio)


def require_finite(values: torch.Tensor, name: str, where: str, rows: tuple[int, int] | None) -> None:
    """CheckpointError naming ``where`` (the file read, or what the audit computed), tensor ``name``
    and its first non-finite element when ``values`` (rows ``rows`` of it, None: all) hold NaN or Inf.

    An audit must check every input and every recomputed value: NaN compares false with any bound
    and Python's ``max()`` passes over it, so a NaN in a client's checkpoint or a buffer would make
    the error NaN and the round pass unjudged. The element is named by its index in the whole
    tensor. Which of several bad inputs of a key is named first can depend on the chunk size (the
    first chunk that holds one raises); that the round fails does not."""
    if not count_non_finite(values):
        return
    index = [int(i) for i in torch.nonzero(~torch.isfinite(values))[0]]
    value = float(values[tuple(index)])
    if rows is not None:
        index[0] += rows[0]
    raise CheckpointError(f"{where}: '{name}' holds a non-finite value ({value} at {index}, the first), so the "
                          "recomputed round cannot be compared with what was written")


def non_finite_in_audit(name: str, bad: int, where: str) -> CheckpointError:
    """The audit's refusal of ``bad`` NaN or Inf values (counted over a key's chunks) in tensor
    ``name`` of the file ``where``: the strategy refuses them in what it aggregates and writes, so in
    the audit they mean the file changed after its round (:func:`.key_checks.non_finite_error` is
    the strategy's refusal, with the strategy's advice)."""
    return CheckpointError(f"{where}: '{name}' holds {bad} non-finite value(s) (NaN or Inf), which the round could not "
                           "have aggregated or written (it refuses them): the file changed after the round, so the "
                           "recomputed round cannot be compared with it")


def max_of(values: torch.Tensor) -> float:
    """The largest element (0 for an empty tensor)."""
    return float(values.max()) if values.numel() else 0.0
