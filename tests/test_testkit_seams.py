"""The shared test harness (``testkit/``) reaches the package through its public names only.

Many tests build on the testkit's helpers; a helper that writes a private attribute or imports a
private function ties all of them to an internal detail the package may change without notice, and
the helper stops exercising the path a run takes (the node registry filled by discovery, the
partitions' sizes derived from the specification). Read with :mod:`ast`, nothing is imported.
What it sees: imports of ``_``-prefixed names and ``_``-prefixed attribute access; not private names
reached through strings (``getattr(x, "_name")``, ``monkeypatch.setattr(module, "_name", ...)``) nor
private module paths (``fedagent_flwr._x``), none of which the testkit uses today.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTKIT = Path(__file__).resolve().parent.parent / "testkit"

#: (file, what) reaches that stay, each with why. Add one only with a reason.
ALLOWED = {
    # torch's FSDP check patched out for the CPU stand-in of verl's workers: torch's private, not the package's
    ("verl_cpu.py", "fsdp_init._check_module_states_for_sync_module_states"),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _reaches(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, what)`` of every private package name imported and every private attribute read or
    written on something other than ``self`` or ``cls``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedagent_flwr"):
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names if _private(alias.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = ast.unparse(node.value)
            if base not in ("self", "cls"):
                found.append((node.lineno, f"{base}.{node.attr}"))
    return found


def test_the_testkit_uses_no_private_name_of_the_package() -> None:
    reaches = {(path.name, line, what) for path in sorted(TESTKIT.glob("*.py"))
               for line, what in _reaches(ast.parse(path.read_text(), str(path)))}
    unexpected = sorted(r for r in reaches if (r[0], r[2]) not in ALLOWED)
    assert not unexpected, "testkit reaches private names (use or add a public seam): " + "; ".join(
        f"{file}:{line} {what}" for file, line, what in unexpected)
    stale = ALLOWED - {(file, what) for file, _, what in reaches}
    assert not stale, f"ALLOWED entries no longer needed: {sorted(stale)}"
