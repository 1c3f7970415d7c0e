"""The layering of engine/, server/ and clients/, checked on the source's import statements.

engine imports nothing from server or clients; clients speaks HTTP only (nothing from engine or server);
server imports nothing from clients. No two modules import each other, directly or around a loop. Every
import counts: at module level, inside functions, and `from package import module` as an edge to that
module. Imports under `if TYPE_CHECKING:` never run, so they count for the layering but not for cycles.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "server", "clients")
# package -> the packages it must not import
FORBIDDEN = {"engine": {"server", "clients"}, "clients": {"engine", "server"}, "server": {"clients"}}


@dataclass(frozen=True)
class ImportEdge:
    importer: str  # dotted module names
    imported: str
    where: str  # path:line of the import statement
    is_runtime: bool = True  # False under `if TYPE_CHECKING:`


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers of every statement inside an `if TYPE_CHECKING:` block."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for statement in node.body:
                lines.update(range(statement.lineno, (statement.end_lineno or statement.lineno) + 1))
    return lines


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Dotted names this statement imports: `from x import y` gives x.y (a module, maybe) and x."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: `from . import x` in package p.q names p.q.x (p.x from module p.q.r)
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")]


def _resolve(name: str, modules: set[str]) -> str | None:
    """The most specific known module a dotted name lies in; None outside the checked packages."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return name if parts[0] in PACKAGES else None


def collect_edges(root: Path, packages: Iterable[str] = PACKAGES) -> list[ImportEdge]:
    files = {module_name(path, root): path for package in packages for path in sorted((root / package).rglob("*.py"))}
    modules = set(files)
    edges = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        type_only = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = _imported_names(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):
                # `from x import y`: the edge goes to module x.y when y is a module, else to x.
                base, *candidates = names
                submodules = [n for n in candidates if n in modules]
                names = submodules + ([base] if len(submodules) < len(candidates) or not candidates else [])
            targets = {target for n in names if (target := _resolve(n, modules)) and target != module}
            for target in sorted(targets):
                edges.append(
                    ImportEdge(module, target, f"{path.relative_to(root)}:{node.lineno}", node.lineno not in type_only)
                )
    return sorted(edges, key=lambda e: (e.importer, int(e.where.rsplit(":", 1)[1]), e.imported))


def forbidden_edges(edges: Iterable[ImportEdge], forbidden: Mapping[str, set[str]] = FORBIDDEN) -> list[ImportEdge]:
    return [e for e in edges if e.imported.split(".")[0] in forbidden.get(e.importer.split(".")[0], set())]


def find_cycles(edges: Iterable[ImportEdge]) -> list[list[str]]:
    """Import loops as [a, b, ..., a] (runtime imports only): in each group of modules that reach each other,
    the shortest loop through each member, each loop once."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.is_runtime:
            graph.setdefault(e.importer, set()).add(e.imported)
            graph.setdefault(e.imported, set())
    # Tarjan's strongly connected components, iterative (no recursion limit on deep import chains).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    loops: list[list[str]] = []
    for group in groups:
        for member in sorted(group):
            loop = _shortest_loop(member, group, graph)[:-1]
            first = loop.index(min(loop))
            loop = [*loop[first:], *loop[:first], loop[first]]  # rotated to start at its first name
            if loop not in loops:
                loops.append(loop)
    return sorted(loops)


def _shortest_loop(start: str, group: set[str], graph: Mapping[str, set[str]]) -> list[str]:
    """A shortest loop from `start` back to it, staying inside its strongly connected group."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no loop in strongly connected group {sorted(group)}")


def describe(bad: list[ImportEdge], cycles: list[list[str]]) -> str:
    lines = [f"{e.where}: {e.importer} imports {e.imported}" for e in bad]
    lines += ["import cycle: " + " -> ".join(cycle) for cycle in cycles]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the checker itself


def _edges(*pairs: tuple[str, str]) -> list[ImportEdge]:
    return [ImportEdge(a, b, f"{a.replace('.', '/')}.py:1") for a, b in pairs]


def test_checker_reports_forbidden_edges_and_cycles() -> None:
    edges = _edges(
        ("engine.core.scheduler", "engine.core.sequence"),
        ("engine.core.sequence", "server.app"),  # engine -> server: forbidden
        ("clients.bench", "clients.sse"),
        ("server.app", "server.routes.openai"),  # server.app -> routes -> state -> app: a loop
        ("server.routes.openai", "server.state"),
        ("server.state", "server.app"),
        ("server.cli", "engine.core.scheduler"),  # allowed
        ("clients.chat_cli", "clients.client"),
    )
    bad = forbidden_edges(edges)
    assert [(e.importer, e.imported) for e in bad] == [("engine.core.sequence", "server.app")]
    assert find_cycles(edges) == [["server.app", "server.routes.openai", "server.state", "server.app"]]
    message = describe(bad, find_cycles(edges))
    assert "engine/core/sequence.py:1: engine.core.sequence imports server.app" in message
    assert "import cycle: server.app -> server.routes.openai -> server.state -> server.app" in message
    # clients -> engine and clients -> server are forbidden too; server -> engine is not
    assert (
        len(forbidden_edges(_edges(("clients.bench", "engine.x"), ("clients.y", "server"), ("server.z", "engine"))))
        == 2
    )
    # a type-only import does not close a loop
    assert find_cycles([*_edges(("a", "b")), ImportEdge("b", "a", "b.py:3", is_runtime=False)]) == []
    assert find_cycles(_edges(("a", "b"), ("b", "a"))) == [["a", "b", "a"]]
    # two loops through one module are both reported
    assert find_cycles(_edges(("a", "b"), ("b", "a"), ("c", "a"), ("a", "c"))) == [["a", "b", "a"], ["a", "c", "a"]]


def test_checker_reads_every_kind_of_import(tmp_path: Path) -> None:
    files = {
        "engine/__init__.py": "",
        "engine/core/__init__.py": "",
        "engine/core/a.py": "from engine.core import b\nfrom . import c\n",
        "engine/core/b.py": "def later():\n    import engine.core.c as c\n    from engine.core.c import helper\n",
        "engine/core/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from server.app import App\n",
        "server/__init__.py": "",
        "server/app.py": "from ..clients import chat\nimport os\n",
        "clients/__init__.py": "",
        "clients/chat.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    edges = collect_edges(tmp_path)
    got = {(e.importer, e.imported, e.is_runtime) for e in edges}
    assert got == {
        ("engine.core.a", "engine.core.b", True),  # `from package import module` is an edge to the module
        ("engine.core.a", "engine.core.c", True),  # relative
        ("engine.core.b", "engine.core.c", True),  # inside a function, both spellings
        ("engine.core.c", "server.app", False),
        ("server.app", "clients.chat", True),
    }
    assert {(e.importer, e.imported) for e in forbidden_edges(edges)} == {
        ("engine.core.c", "server.app"),
        ("server.app", "clients.chat"),
    }


# --------------------------------------------------------------------------- the code base


def test_no_package_imports_across_a_forbidden_layer() -> None:
    bad = forbidden_edges(collect_edges(ROOT))
    assert not bad, "imports that break the layering:\n" + describe(bad, [])


def test_no_import_cycles() -> None:
    cycles = find_cycles(collect_edges(ROOT))
    assert not cycles, "modules that import each other:\n" + describe([], cycles)
