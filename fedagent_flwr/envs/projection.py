"""FedAgent's projection of a model reply to an environment action (WebShop spec §7, ALFWorld §3.3).

Shared by the service-backed environments; pure Python so that it imports in any service venv.
"""

from __future__ import annotations

import re

CJK_RE = re.compile("[\u4e00-\u9fff]")


def project_action(text: str, fallback_chars: int = 20) -> tuple[str, bool]:
    """FedAgent's ``webshop_projection`` / ``alfworld_projection``: (action, is_valid) of a model reply.

    Lowercases; without both ``<action>``/``</action>`` tags the action is the last ``fallback_chars``
    characters (WebShop 20, ALFWorld 30) and the reply is invalid. Otherwise the action is the text
    between the first tags (empty if the close tag comes first); the reply is invalid without
    ``<think>``/``</think>`` in the original text or with CJK characters.
    """
    lowered = text.lower()
    start_tag, end_tag = "<action>", "</action>"
    if start_tag not in lowered or end_tag not in lowered:
        return lowered[-fallback_chars:], False
    start = lowered.find(start_tag) + len(start_tag)
    end = lowered.find(end_tag)
    action = lowered[start:end].strip() if end >= start else ""
    valid = "<think>" in text and "</think>" in text and CJK_RE.search(text) is None
    return action, valid
