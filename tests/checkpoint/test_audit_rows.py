"""The audits' shared row reading (:mod:`fedagent_flwr.checkpoint.audit_rows`): the one chunk size
that both audits follow, and the two audits independent of each other (no import between them, not
even one inside a function, which tests/test_package_shape.py does not count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fedagent_flwr.checkpoint import audit_rows
from fedagent_flwr.checkpoint.audit_rows import row_chunks

CHECKPOINT_DIR = Path(audit_rows.__file__).parent


def _imported(module: str) -> set[str]:
    """Every module ``fedagent_flwr/checkpoint/<module>.py`` imports, at any depth."""
    tree = ast.parse((CHECKPOINT_DIR / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def test_the_mean_audit_and_the_optimiser_audit_do_not_import_each_other() -> None:
    assert not {m for m in _imported("mean_audit") if m.endswith("verify_optimizer")}
    assert not {m for m in _imported("verify_optimizer") if m.endswith("mean_audit")}


def test_the_chunks_follow_the_patched_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests force small chunks by patching ``audit_rows.CHUNK_ELEMENTS``: the chunks the audits
    take (``row_chunks`` with no limit) must follow it."""
    assert list(row_chunks((257, 64))) == [(0, 257)]
    monkeypatch.setattr(audit_rows, "CHUNK_ELEMENTS", 3 * 64)
    assert len(list(row_chunks((257, 64)))) == 86
    assert list(row_chunks(())) == [None]
