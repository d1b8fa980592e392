"""Adaptive federated optimisation over checkpoint references: FedAdam, FedYogi, FedAdagrad.

Adaptive Federated Optimization [Reddi et al., 2021, arxiv.org/abs/2003.00295], as Flower's
``FedOpt`` family computes it, on checkpoints streamed key by key (:mod:`.server_optimizer`).
Per floating-point tensor, with ``x`` the current global model and ``delta`` the clients'
weighted mean (FedAvg's) minus ``x``::

    m = beta_1 m + (1 - beta_1) delta                  (m starts at 0)
    v = beta_2 v + (1 - beta_2) delta^2                FedAdam    (v starts at 0)
    v = v - (1 - beta_2) delta^2 sign(v - delta^2)     FedYogi
    v = v + delta^2                                    FedAdagrad (beta_1 = 0: m = delta)
    x = x + step m / (sqrt(v) + tau)

with ``step = eta`` for FedYogi and FedAdagrad and, for FedAdam, Flower's bias correction
``eta sqrt(1 - beta_2^(r+1)) / (1 - beta_1^(r+1))`` at server round r (Flower's exponent, one more
than the paper's step count, kept so results match Flower's). The keyword arguments and their
defaults are Flower's; ``eta_l`` (the clients' learning rate in the paper) is accepted and
recorded, as Flower does, but the clients' learning rate is the trainer's own setting.

**Choosing eta.** The step moves every weight by about ``eta`` in the first rounds (``m / sqrt(v)``
is about +-1 per element), whatever the size of the clients' change. Flower's defaults (0.1, 0.01)
suit small models trained from scratch; an LLM fine-tuned by RL changes its weights by roughly
1e-6 to 1e-4 per round, so ``eta`` must be of that order (a warning is logged for eta >= 1e-3).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from logging import INFO, WARNING
from typing import Any, ClassVar

import torch
from flwr.common import log

from .server_optimizer import ServerOptimizerFSDP, checked_number

__all__ = ["FedAdagradFSDP", "FedAdamFSDP", "FedOptFSDP", "FedYogiFSDP"]

#: eta at or above this logs a warning: larger than any per-round change of an LLM's weights.
LARGE_ETA = 1e-3


class FedOptFSDP(ServerOptimizerFSDP):
    """The FedOpt family's common part: m, the step and the settings; a subclass gives v's update.

    Parameters (as Flower's ``FedOpt``; the others are FedAvgFSDP's)
    ----------
    eta : float
        Server learning rate, > 0.
    eta_l : float
        Clients' learning rate, recorded only (set the trainer's), > 0.
    beta_1 : float
        Momentum of m, in [0, 1); 0 keeps no m (m is delta).
    beta_2 : float
        Decay of v, in [0, 1).
    tau : float
        Adaptivity: added to sqrt(v), > 0.
    """

    def __init__(self, *, eta: float = 1e-1, eta_l: float = 1e-1, beta_1: float = 0.0, beta_2: float = 0.0,
                 tau: float = 1e-3, **kwargs: Any) -> None:
        self.eta = checked_number("eta", eta, above=0.0)
        self.eta_l = checked_number("eta_l", eta_l, above=0.0)
        self.beta_1 = checked_number("beta_1", beta_1, at_least=0.0, below=1.0)
        self.beta_2 = checked_number("beta_2", beta_2, at_least=0.0, below=1.0)
        self.tau = checked_number("tau", tau, above=0.0)
        super().__init__(**kwargs)
        if self.eta >= LARGE_ETA:
            log(WARNING, "%s: eta = %g moves every weight by about %g per round; an LLM's own per-round change "
                "is ~1e-6..1e-4 (set +strategy.kwargs.eta)", type(self).__name__, self.eta, self.eta)

    def buffers(self) -> tuple[str, ...]:
        """m (unless beta_1 = 0, where m is delta) and v."""
        return ("m", "v") if self.beta_1 > 0.0 else ("v",)

    def hyperparameters(self) -> dict[str, float]:
        """eta, eta_l, beta_1, beta_2, tau."""
        return {"eta": self.eta, "eta_l": self.eta_l, "beta_1": self.beta_1, "beta_2": self.beta_2, "tau": self.tau}

    def step_size(self, server_round: int) -> float:
        """The multiplier of ``m / (sqrt(v) + tau)``: eta (FedAdam corrects it for bias)."""
        return self.eta

    @abstractmethod
    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """v after this round (``v`` is the previous one, zeros at first; may be changed in place)."""

    def server_step(self, server_round: int, x: torch.Tensor, delta: torch.Tensor,
                    state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x + step m / (sqrt(v) + tau), m and v updated in ``state``."""
        if self.beta_1 > 0.0:
            m = state["m"] if "m" in state else torch.zeros_like(delta)
            state["m"] = m.mul_(self.beta_1).add_(delta, alpha=1.0 - self.beta_1)
        else:
            m = delta
        v = self.second_moment(state["v"] if "v" in state else torch.zeros_like(delta), delta)
        state["v"] = v
        return x.addcdiv_(m, v.sqrt().add_(self.tau), value=self.step_size(server_round))

    def summary(self) -> None:
        """Log FedAvgFSDP's settings and the optimiser's."""
        super().summary()
        log(INFO, "\t└── %s: eta %g (eta_l %g), beta_1 %g, beta_2 %g, tau %g; state in round_<r>/server_optimizer/",
            self.rule_name, self.eta, self.eta_l, self.beta_1, self.beta_2, self.tau)


class FedAdamFSDP(FedOptFSDP):
    """FedAdam: v = beta_2 v + (1 - beta_2) delta^2, with Flower's bias-corrected step (module docstring).

    Defaults as Flower's ``FedAdam``: eta 0.1, eta_l 0.1, beta_1 0.9, beta_2 0.99, tau 1e-3."""

    rule_name: ClassVar[str] = "fedadam"

    def __init__(self, *, eta: float = 1e-1, eta_l: float = 1e-1, beta_1: float = 0.9, beta_2: float = 0.99,
                 tau: float = 1e-3, **kwargs: Any) -> None:
        super().__init__(eta=eta, eta_l=eta_l, beta_1=beta_1, beta_2=beta_2, tau=tau, **kwargs)

    def step_size(self, server_round: int) -> float:
        """eta sqrt(1 - beta_2^(r+1)) / (1 - beta_1^(r+1)), Flower's exponent."""
        power = server_round + 1.0
        return self.eta * math.sqrt(1.0 - self.beta_2 ** power) / (1.0 - self.beta_1 ** power)

    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Exponential moving average of delta^2."""
        return v.mul_(self.beta_2).addcmul_(delta, delta, value=1.0 - self.beta_2)


class FedYogiFSDP(FedOptFSDP):
    """FedYogi: v = v - (1 - beta_2) delta^2 sign(v - delta^2) (v changes additively, not by decay).

    Defaults as Flower's ``FedYogi``: eta 0.01, eta_l 0.0316, beta_1 0.9, beta_2 0.99, tau 1e-3."""

    rule_name: ClassVar[str] = "fedyogi"

    def __init__(self, *, eta: float = 1e-2, eta_l: float = 0.0316, beta_1: float = 0.9, beta_2: float = 0.99,
                 tau: float = 1e-3, **kwargs: Any) -> None:
        super().__init__(eta=eta, eta_l=eta_l, beta_1=beta_1, beta_2=beta_2, tau=tau, **kwargs)

    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Yogi's sign-controlled update of v."""
        squared = delta * delta
        return v.addcmul_(squared, torch.sign(v - squared), value=-(1.0 - self.beta_2))


class FedAdagradFSDP(FedOptFSDP):
    """FedAdagrad: v = v + delta^2 and m = delta (Flower fixes beta_1 = beta_2 = 0).

    Defaults as Flower's ``FedAdagrad``: eta 0.1, eta_l 0.1, tau 1e-3."""

    rule_name: ClassVar[str] = "fedadagrad"

    def __init__(self, *, eta: float = 1e-1, eta_l: float = 1e-1, tau: float = 1e-3, **kwargs: Any) -> None:
        fixed = sorted({"beta_1", "beta_2"} & set(kwargs))
        if fixed:
            raise ValueError(f"strategy.kwargs.{fixed[0]} cannot be set: FedAdagrad fixes beta_1 = beta_2 = 0, as "
                             "Flower's does (strategy=fedadam or fedyogi have them)")
        super().__init__(eta=eta, eta_l=eta_l, beta_1=0.0, beta_2=0.0, tau=tau, **kwargs)

    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The running sum of delta^2."""
        return v.addcmul_(delta, delta)
