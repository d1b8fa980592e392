"""Client rules: user code that shapes every local update of a client, like FedProx's proximal term.

A client rule is a class named in the trainer config by its dotted path and built with keyword
arguments from the config::

    trainer.client_rule=mypkg.rules.MyRule  trainer.client_rule_args={mu:0.1}

The trainer builds one rule per client round and calls ``rule.apply(model.named_parameters())``
after the backward pass and before gradient clipping and the optimiser step, every step. The
rule changes ``param.grad`` in place (adding a regulariser's gradient, masking, rescaling) and
returns a float for the log. It may keep state between calls: the parameters at the first call are
the round's global weights, which is where FedProx anchors its term.

The settings travel in the trainer group, so every client gets them with its instruction; a
strategy that wants per-round values overrides ``train_instruction`` and returns the instruction
with a changed ``trainer`` mapping (``dataclasses.replace``).

FedProx is the built-in rule (:mod:`.fedprox`): FedProxFSDP's ``proximal-mu`` instruction puts it
first in the job's rule list (:func:`job_rule_specs`). Both backends run that list through
:class:`RuleChain`, the reference trainer in its update and the verl backend in every actor
worker (:mod:`fedagent_flwr.trainers.verl.user_hooks`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from fedagent_flwr.plugins import PluginError, load_object
from fedagent_flwr.schema.trainer import RULE_KEYS
from fedagent_flwr.trainers.common.fedprox import FEDPROX_RULE

S = TypeVar("S")  # a backend's settings type (backend_settings)


class ClientRuleError(ValueError):
    """A client rule that cannot be loaded or built; the message names the config key."""


class ClientRule(Protocol):
    """What a trainer needs from a client rule."""

    def apply(self, named_parameters: Iterable[tuple[str, Any]]) -> float:
        """Change the gradients in place before an optimiser step; return a value to log.

        A rule that adds a term to the local objective may also keep that term's value of the
        last call in a ``penalty`` attribute; the reference trainer adds it to its reported loss.
        """


def without_rule_keys(trainer: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer knobs minus the client-rule keys (which backends' own settings do not know)."""
    return {key: value for key, value in trainer.items() if key not in RULE_KEYS}


def backend_settings(from_mapping: Callable[[Mapping[str, Any]], tuple[S, list[str]]], trainer: Mapping[str, Any],
                     prog: str) -> S:
    """A backend's settings read by ``from_mapping`` from the trainer knobs (rule keys left out), noting on
    stderr the keys it ignores (another backend's knobs, or a typo) so that none is dropped unseen."""
    settings, ignored = from_mapping(without_rule_keys(trainer))
    if ignored:
        print(f"{prog}: note: ignoring trainer keys {ignored}", file=sys.stderr)
    return settings


def load_client_rule(trainer: Mapping[str, Any]) -> ClientRule | None:
    """Build the rule named by ``trainer["client_rule"]`` ("" or absent: None)."""
    path = trainer.get("client_rule")
    if not path:  # "" or absent
        return None
    if not isinstance(path, str):
        raise ClientRuleError(f"trainer.client_rule must be a dotted path string, got {path!r}")
    args = trainer.get("client_rule_args") or {}
    if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
        raise ClientRuleError(f"trainer.client_rule_args must be a mapping of argument names to values, got {args!r}")
    try:
        factory = load_object(path, "trainer.client_rule")
    except PluginError as exc:
        raise ClientRuleError(str(exc)) from None
    try:
        rule = factory(**dict(args))
    except (TypeError, ValueError) as exc:
        raise ClientRuleError(
            f"trainer.client_rule {path!r} rejected trainer.client_rule_args {dict(args)}: {exc}"
        ) from None
    if not callable(getattr(rule, "apply", None)):
        raise ClientRuleError(f"trainer.client_rule {path!r} built an object without an apply(named_parameters) method")
    return rule  # type: ignore[no-any-return]


def job_rule_specs(proximal_mu: float, trainer: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The client rules of a train job, in the order they run, as ``{client_rule, client_rule_args}``.

    FedProx's rule first when the strategy sent ``proximal-mu`` > 0 (the job's ``proximal_mu``),
    then the user's ``trainer.client_rule``, so the user's rule sees the gradients with the
    proximal term in them (it may mask or rescale it).
    """
    specs: list[dict[str, Any]] = []
    if proximal_mu > 0:
        specs.append({"client_rule": FEDPROX_RULE, "client_rule_args": {"mu": float(proximal_mu)}})
    if trainer.get("client_rule"):
        specs.append({key: trainer.get(key) for key in RULE_KEYS})
    return specs


class RuleChain:
    """Several client rules run as one, in order; what both backends call before each step.

    After :meth:`apply`, ``values`` holds what each rule returned and ``penalty`` the sum of the
    rules' optional ``penalty`` attributes (a rule's part of the local objective, such as
    FedProx's ``mu/2 * ||w - w_t||^2``; the reference trainer counts it in its loss).
    """

    def __init__(self, rules: Sequence[ClientRule]) -> None:
        self.rules = list(rules)
        self.values = [0.0] * len(self.rules)
        self.penalty = 0.0

    @classmethod
    def from_specs(cls, specs: Sequence[Mapping[str, Any]]) -> RuleChain:
        """Build every rule of ``specs`` (see :func:`job_rule_specs`)."""
        rules = [load_client_rule(spec) for spec in specs]
        return cls([rule for rule in rules if rule is not None])

    def apply(self, named_parameters: Iterable[tuple[str, Any]]) -> float:
        """Run every rule on the same parameters; returns the sum of their values."""
        named = list(named_parameters)
        self.values = [float(rule.apply(named)) for rule in self.rules]
        self.penalty = float(sum(getattr(rule, "penalty", 0.0) for rule in self.rules))
        return sum(self.values)

    def anchored(self) -> int:
        """How many tensors the rules anchored (the most any one rule holds), for the log."""
        return max((len(getattr(rule, "anchor", None) or {}) for rule in self.rules), default=0)
