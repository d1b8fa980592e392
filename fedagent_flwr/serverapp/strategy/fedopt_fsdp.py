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

**Choosing eta and tau.** Per weight the step is ``step m / (sqrt(v) + tau)``, and which term of
the denominator wins decides its size. Where the clients' change is well above ``tau``, ``m /
sqrt(v)`` is about +-1 and every weight moves by about ``eta``, however small its change (Adam's
regime). Where it is well below ``tau`` (an LLM fine-tuned by RL changes by roughly 1e-6 to 1e-4 a
round, under the default tau 1e-3), ``sqrt(v)`` is negligible and the step is ``(step / tau) m``:
FedAvg's change, momentum-averaged, scaled by up to ``eta / tau``, which every rule's step tends to
for a steady change (FedAdagrad from round 1; FedAdam with Flower's defaults, eta / tau = 100: about
7 times FedAvg's change in round 1, 30 times by round 10, 51 by round 30). docs/extending.md §4
tabulates the factors. A warning is logged when ``eta / tau >= 10`` with ``tau > 1e-4`` (an LLM's
change is then below tau), or when ``eta >= 1e-3`` with ``tau <= 1e-4``.
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

#: eta / tau at or above this, with tau above SMALL_TAU, logs a warning: the step tends to that many times
#: FedAvg's change where the change is below tau (an LLM's per-round change is).
LARGE_GAIN = 10.0
#: eta at or above this with tau at or below SMALL_TAU logs a warning: about eta per weight a round.
LARGE_ETA, SMALL_TAU = 1e-3, 1e-4


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
        if self.tau > SMALL_TAU and self.eta / self.tau >= LARGE_GAIN:
            log(WARNING, "%s: eta / tau = %g: where the clients' change is below tau = %g (an LLM's per-round change "
                "is ~1e-6..1e-4), each round's step tends to %g times FedAvg's change "
                "(set +strategy.kwargs.eta, docs/extending.md §4)", type(self).__name__, self.eta / self.tau,
                self.tau, self.eta / self.tau)
        elif self.eta >= LARGE_ETA and self.tau <= SMALL_TAU:
            log(WARNING, "%s: eta = %g with tau = %g: where the clients' change is above tau, every weight moves by "
                "about %g a round, far more than an LLM's own per-round change (~1e-6..1e-4)",
                type(self).__name__, self.eta, self.tau, self.eta)

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
