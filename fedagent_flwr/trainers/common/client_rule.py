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
strategy that wants per-round values rewrites ``trainer-json`` in its ``configure_train``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from fedagent_flwr.plugins import PluginError, load_object

#: The trainer-group keys of a client rule (no backend's own hyper-parameters).
RULE_KEYS = ("client_rule", "client_rule_args")


class ClientRuleError(ValueError):
    """A client rule that cannot be loaded or built; the message names the config key."""


class ClientRule(Protocol):
    """What a trainer needs from a client rule."""

    def apply(self, named_parameters: Iterable[tuple[str, Any]]) -> float:
        """Change the gradients in place before an optimiser step; return a value to log."""


def without_rule_keys(trainer: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer knobs minus the client-rule keys (which backends' own settings do not know)."""
    return {key: value for key, value in trainer.items() if key not in RULE_KEYS}


def load_client_rule(trainer: Mapping[str, Any]) -> ClientRule | None:
    """Build the rule named by ``trainer["client_rule"]`` ("" or absent: None)."""
    path = trainer.get("client_rule") or ""
    if not path:
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
        raise ClientRuleError(f"trainer.client_rule {path!r} rejected trainer.client_rule_args {dict(args)}: {exc}") from None
    if not callable(getattr(rule, "apply", None)):
        raise ClientRuleError(f"trainer.client_rule {path!r} built an object without an apply(named_parameters) method")
    return rule  # type: ignore[no-any-return]
