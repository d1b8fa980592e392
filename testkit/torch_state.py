"""Process-wide torch switches a command under test turns on, put back for the next test."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def deterministic_algorithms_restored() -> Iterator[None]:
    """Yield once, then restore torch's deterministic-algorithms switch (and its warn-only mode) as it
    was: the warm-start command turns it on for the whole process (``yield from`` in a fixture)."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(before, warn_only=warn_only)
