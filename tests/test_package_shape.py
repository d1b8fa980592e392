"""The package's shape: no file-level import cycles and no oversized modules in ``fedagent_flwr/``;
and the guides (README.md, docs/) name only files and Python names that exist.

Issue 14 asks for the first two. The module graph is read with :mod:`ast`, not by importing anything, so the
test is fast and sees exactly what a reader sees: the imports at a module's top level (including those
under a top-level ``if``/``try``), not those inside functions, which run lazily and are the natural way
to reach a heavy or optional dependency. ``if TYPE_CHECKING:`` blocks are left out too: they never run,
and importing a name only for annotations there is how a type reference avoids a runtime cycle.
"""

from __future__ import annotations

import ast
import re
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


# --------------------------------------------------------------------------------------------
# The guides name what exists
# --------------------------------------------------------------------------------------------

REPO = PACKAGE_DIR.parent
#: The guides that describe the code as it is. Left out: docs/results.md and docs/gpu-runs/ (records of
#: runs) and docs/performance.md (dated measurements, which name the code of their day: a benchmark on a
#: branch never merged, functions since renamed, each marked as such).
GUIDES = ("README.md", "docs/extending.md", "docs/agent-loop.md", "docs/deployment.md", "docs/gpu.md")
#: A repository path: a top-level folder of the checkout, then path characters. A path with a placeholder
#: or a glob (``round_<r>/``, ``tools/gpu/arms*.py``) is no one file and is not matched at all; a
#: sentence's full stop after a path is not part of it.
GUIDE_PATH = re.compile(r"(?<![\w./<-])((?:fedagent_flwr|tests|testkit|tools|benchmarks|examples|conf|docs|"
                        r"requirements)/[\w./-]*[\w/])(?![\w/*<{\[-]|\.\w)")
#: A dotted Python name of the checkout's code: a module, or a name a module defines.
GUIDE_NAME = re.compile(r"(?<![\w./])((?:fedagent_flwr|testkit|examples)(?:\.\w+)+)")
#: The checkout's top-level packages a dotted name may start with.
GUIDE_ROOTS = ("fedagent_flwr", "testkit", "examples")
#: A module named by its path inside the package (``serverapp/rounds.py``, ``rollout/episode.py::name``).
GUIDE_PACKAGE_PATH = re.compile(r"(?<![\w./-])((?:checkpoint|clientapp|envs|hetero|models|rollout|schema|serverapp|"
                                r"trainers)/[\w/]+\.py)(?:::(\w+))?")


def _names_defined(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """The names a module's (or class's) body binds, also under a top-level ``if`` or ``try``."""
    found: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            found |= {target.id: node for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= {(alias.asname or alias.name).split(".")[0]: node for alias in node.names}
        elif isinstance(node, ast.If):
            found |= _names_defined(node.body) | _names_defined(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found |= _names_defined(block)
    return found


def python_name_exists(dotted: str, root: Path = REPO) -> bool:
    """Whether ``dotted`` (``fedagent_flwr.config.load_settings``) is a module of the checkout or a name
    its module binds at the top level (and, for a class, an attribute its body binds), read with
    :mod:`ast`, importing nothing."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:end])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            break
    else:
        return False
    rest = parts[end:]
    if not rest:
        return True
    node: ast.stmt | None = _names_defined(ast.parse(module.read_text(), filename=str(module)).body).get(rest[0])
    if isinstance(node, ast.ImportFrom):  # a re-export: followed to the module that defines the name
        alias = next(alias for alias in node.names if (alias.asname or alias.name) == rest[0])
        package = module.parent.relative_to(root).parts  # where a relative import (level 1: this package) starts
        base = package[:len(package) - node.level + 1] if node.level else ()
        source = ".".join((*base, *([node.module] if node.module else [])))
        if source.split(".")[0] in GUIDE_ROOTS:
            return python_name_exists(".".join((source, alias.name, *rest[1:])), root)
        return len(rest) == 1  # imported from elsewhere (torch, flwr): what it holds is not read here
    for part in rest[1:]:  # a class's attribute, a nested class's; a function or a value has none to name
        node = _names_defined(node.body).get(part) if isinstance(node, ast.ClassDef) else None
    return node is not None


def named_in_guides() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(``guide:line``, path) and (``guide:line``, dotted name) of every repository path and Python name
    the guides name."""
    paths: list[tuple[str, str]] = []
    names: list[tuple[str, str]] = []
    for guide in GUIDES:
        for number, line in enumerate((REPO / guide).read_text().splitlines(), 1):
            where = f"{guide}:{number}"
            paths += [(where, match.group(1)) for match in GUIDE_PATH.finditer(line)]
            names += [(where, match.group(1)) for match in GUIDE_NAME.finditer(line)]
            for match in GUIDE_PACKAGE_PATH.finditer(line):
                paths.append((where, f"{PACKAGE}/{match.group(1)}"))
                if match.group(2):
                    names.append((where, ".".join((PACKAGE, *match.group(1)[:-3].split("/"), match.group(2)))))
    return paths, names


def test_the_guide_scan_finds_a_wrong_path_and_name() -> None:
    """The scan below can fail: a misspelt path and a misspelt name are found, placeholders and globs are
    not taken for paths."""
    line = ("`fedagent_flwr/serverapp/roundz.py` and `fedagent_flwr.config.load_setting`, not `round_<r>/x`, "
            "`tools/gpu/arms*.py` or `conf/<group>/`; see conf/recipe/webshop_verl.yaml and "
            "`rollout/episode.py::tokenize`, not verl's `trainer/ppo/utils.py`.")
    assert [m.group(1) for m in GUIDE_PATH.finditer(line)] == [
        "fedagent_flwr/serverapp/roundz.py", "conf/recipe/webshop_verl.yaml"]
    assert [m.group(1) for m in GUIDE_NAME.finditer(line)] == ["fedagent_flwr.config.load_setting"]
    assert [m.groups() for m in GUIDE_PACKAGE_PATH.finditer(line)] == [("rollout/episode.py", "tokenize")]
    assert not python_name_exists("fedagent_flwr.rollout.episode.tokenize")
    assert python_name_exists("fedagent_flwr.rollout.episode.tokenize_conversation")
    assert not (REPO / "fedagent_flwr/serverapp/roundz.py").exists()
    assert not python_name_exists("fedagent_flwr.config.load_setting")
    assert python_name_exists("fedagent_flwr.config.load_settings")
    assert python_name_exists("fedagent_flwr.checkpoint.verify")  # a module
    assert python_name_exists("fedagent_flwr.checkpoint.CheckpointRef.for_directory")  # imported, then a class's
    assert not python_name_exists("fedagent_flwr.checkpoint.ref.CheckpointRef.for_dir")
    assert not python_name_exists("fedagent_flwr.checkpoint.CheckpointRef.for_dir")  # re-exported, then followed
    assert not python_name_exists("fedagent_flwr.config.load_settings.bogus")  # a function has no attributes


def test_the_guides_name_only_files_and_python_names_that_exist() -> None:
    """README.md and docs/ "still describe the code as it is": every repository path they name exists, and
    every dotted name of the package, the test kit or the examples is a module or a name it defines."""
    paths, names = named_in_guides()
    missing = [f"{where}: {path}" for where, path in paths if not (REPO / path).exists()]
    missing += [f"{where}: {name}" for where, name in names if not python_name_exists(name)]
    assert not missing, f"the guides name what does not exist (fix the guide, or the name): {missing}"
    assert len(paths) > 150 and len(names) > 50  # not a vacuous pass
