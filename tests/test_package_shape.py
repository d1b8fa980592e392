"""The package's shape: no file-level import cycles and no oversized modules in ``fedagent_flwr/``.

Issue 14 asks for both. The module graph is read with :mod:`ast`, not by importing anything, so the
test is fast and sees exactly what a reader sees: the imports at a module's top level (including those
under a top-level ``if``/``try``), not those inside functions, which run lazily and are the natural way
to reach a heavy or optional dependency. ``if TYPE_CHECKING:`` blocks are left out too: they never run,
and importing a name only for annotations there is how a type reference avoids a runtime cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "fedagent_flwr"
PACKAGE = PACKAGE_DIR.name

#: The project's size limit for one module (its code standards).
MAX_MODULE_LINES = 500

#: Import cycles still present, each as the sorted module names of one strongly connected component.
#: Empty: every cycle has been removed. Add an entry only with a comment saying why it stays.
ALLOWED_CYCLES: list[list[str]] = []


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module is imported (not in functions or classes' methods)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _top_level_imports(node.body)
            found += _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += _top_level_imports(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            found += _top_level_imports(node.body)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each package module -> the package modules its top-level imports name.

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``;
    an import of a module that is not a file (an attribute path) counts as its nearest enclosing module.
    """
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in _top_level_imports(ast.parse(path.read_text(), filename=str(path)).body):
            if isinstance(node, ast.Import):
                targets |= {owner(alias.name) for alias in node.names if alias.name.split(".")[0] == PACKAGE}
                continue
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if source.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                targets.add(full if full in modules else owner(source))
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return sorted(cycles)


def test_the_graph_sees_the_package() -> None:
    """A guard against a vacuous pass: the graph finds the modules and the edges known to exist."""
    graph = import_graph()
    assert len(graph) > 100
    assert "fedagent_flwr.checkpoint.ref" in graph["fedagent_flwr.protocol"]
    # ``from fedagent_flwr.checkpoint import ...`` names the package's __init__.
    assert "fedagent_flwr.checkpoint" in graph["fedagent_flwr.serverapp.resume"]
    # An import inside a function is lazy and not an edge (config.validate imports hetero there).
    assert "fedagent_flwr.hetero.env_level" not in graph["fedagent_flwr.config"]


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    cycles = import_cycles(import_graph())
    assert cycles == ALLOWED_CYCLES, (
        "file-level import cycles in fedagent_flwr/ (move the function to the module that owns it, or "
        f"import inside the function that needs it): {[c for c in cycles if c not in ALLOWED_CYCLES]}"
    )


def test_no_module_over_the_size_limit() -> None:
    sizes = {str(path.relative_to(PACKAGE_DIR.parent)): len(path.read_text().splitlines())
             for path, _ in _modules().values()}
    too_big = {path: lines for path, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert not too_big, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {too_big}"


TESTS_DIR = PACKAGE_DIR.parent / "tests"


def test_imports_between_test_modules(tmp_path: Path) -> None:
    """Issue 14 item 7: helpers that several test modules share live in ``testkit/``; a test module never
    imports another test module or a conftest (including through a string run in a subprocess), so moving
    or deleting one test file cannot break another."""
    def offending(root: Path) -> list[str]:
        found = []
        for path in sorted(root.rglob("*.py")):
            if path == Path(__file__).resolve():
                continue  # this file names the forms it looks for
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    # tests/ is a package: a relative import reaches another test module or a conftest
                    names = [f"{root.name}.(relative){'.' * node.level}{node.module or ''}" if node.level
                             else node.module or ""]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names = [line.split()[1] for line in node.value.replace(";", "\n").splitlines()
                             if line.strip().startswith(("from tests", "import tests")) and len(line.split()) > 1]
                found += [f"{path.relative_to(root.parent)}:{node.lineno}: {name}" for name in names
                          if name == root.name or name.startswith(root.name + ".")]
        return found

    # The check itself sees both forms (not a vacuous pass).
    planted = tmp_path / "tests"
    (planted / "sub").mkdir(parents=True)
    (planted / "sub" / "test_a.py").write_text("from tests.sub.conftest import helper\n")
    (planted / "test_b.py").write_text("import subprocess\nCODE = 'from tests.sub.test_a import x; print(x)'\n")
    (planted / "sub" / "test_c.py").write_text("from .conftest import helper\n")
    assert len(offending(planted)) == 3
    assert offending(TESTS_DIR) == [], "move the shared helper into testkit/ and import it from there"
