"""The layering of engine/, server/ and clients/, checked on the source's import statements.

- engine imports nothing from server or clients; clients speaks HTTP only (nothing from engine or server);
  server imports nothing from clients.
- Inside engine, every package imports only packages of a lower layer (ENGINE_LAYERS), and a few pairs
  are named outright (ENGINE_FORBIDDEN; nothing imports engine.bench).
- server reaches the engine through its surface only (SERVER_ENGINE_SURFACE).
- A third-party package with an owner is imported by its owner only (`ray`: server/ray/).
- No two modules import each other, directly or around a loop.

Every import counts: at module level, inside functions, and `from package import module` as an edge to that
module. Imports under `if TYPE_CHECKING:` never run: they count for the layering, and for cycles only in
the stricter check that lists the loops they would close.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "server", "clients")
# package -> the packages it must not import
FORBIDDEN = {"engine": {"server", "clients"}, "clients": {"engine", "server"}, "server": {"clients"}}

# The engine's packages (and top-level modules), lowest layer first. A package may import its own modules
# and packages of lower layers only; packages of one layer may not import each other.
ENGINE_LAYERS: tuple[tuple[str, ...], ...] = (
    ("engine.errors",),  # the exception types every layer raises
    ("engine.config",),  # frozen configs and the one copy of every default
    ("engine.structured", "engine.hub"),  # output grammars (specs, compilers, masks); the model cache
    ("engine.params", "engine.outputs"),  # a request's parameters (they carry a StructuredOutput); results
    ("engine.text",),  # tokenizer (it builds the grammar compiler), detokenizer (stop strings), chat text
    ("engine.core", "engine.ops"),  # sync scheduling state, token ids only; kernels and their bindings
    ("engine.attention", "engine.quantization"),  # attention on the ops' kernels; weight formats on the ops
    ("engine.models",),  # one file per family: attention, quantized layers and ops put together
    ("engine.runner", "engine.pooling"),  # a step's forward and sampling; the encoder models' forward
    ("engine.spec",),  # proposers: the draft model runs a runner of its own
    ("engine.engine_core",),  # LLMEngine, the composition root: core, runner, spec
    ("engine.loader", "engine.model_info"),  # checkpoint -> engine; read-only facts of a built engine
    ("engine.serving", "engine.inspect"),  # the server's clients of the engine; what the playground reads
    ("engine.llm",),  # offline generation: serving's output processor turns its token ids into text
    ("engine.bench",),  # micro-benchmarks over everything above, imported by nothing
    ("engine",),  # the public surface: engine/__init__.py
)
ENGINE_RANKS = {package: rank for rank, layer in enumerate(ENGINE_LAYERS) for package in layer}
# Named outright, on top of the layers (so a re-ranking cannot allow them): engine package -> packages it must
# not import.
ENGINE_FORBIDDEN = {
    "engine.core": {
        "engine.runner",
        "engine.models",
        "engine.ops",
        "engine.attention",
        "engine.serving",
        "engine.spec",
    },
    "engine.models": {"engine.runner", "engine.core"},
    "engine.ops": {"engine.runner", "engine.models", "engine.core", "engine.attention", "engine.quantization"},
}
BENCH = "engine.bench"  # imported by nothing but itself
# What server may import of engine: the surface, what the playground reads, and the surface's leaf modules
# (frozen configs, request parameters and their limits, outputs, errors: no engine state behind them).
SERVER_ENGINE_SURFACE = {
    "engine",
    "engine.inspect",
    "engine.config",
    "engine.params",
    "engine.outputs",
    "engine.errors",
}
# third-party package -> the packages (dotted prefixes) that alone may import it
THIRD_PARTY_OWNERS = {"ray": ("server.ray",)}
# Loops that only imports under `if TYPE_CHECKING:` close, tolerated until they are taken apart.
KNOWN_TYPE_ONLY_LOOPS: list[list[str]] = []


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


def _import_statements(
    root: Path, packages: Iterable[str]
) -> Iterator[tuple[str, Path, ast.Import | ast.ImportFrom, bool, set[str]]]:
    """(module, its path, an import statement in it, whether it runs, every module name) for each import."""
    files = {module_name(path, root): path for package in packages for path in sorted((root / package).rglob("*.py"))}
    modules = set(files)
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        type_only = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield module, path, node, node.lineno not in type_only, modules


def _sorted_edges(edges: Iterable[ImportEdge]) -> list[ImportEdge]:
    return sorted(edges, key=lambda e: (e.importer, int(e.where.rsplit(":", 1)[1]), e.imported))


def collect_edges(root: Path, packages: Iterable[str] = PACKAGES) -> list[ImportEdge]:
    edges = []
    for module, path, node, is_runtime, modules in _import_statements(root, packages):
        names = _imported_names(node, module, path.name == "__init__.py")
        if isinstance(node, ast.ImportFrom):
            # `from x import y`: the edge goes to module x.y when y is a module, else to x.
            base, *candidates = names
            submodules = [n for n in candidates if n in modules]
            names = submodules + ([base] if len(submodules) < len(candidates) or not candidates else [])
        targets = {target for n in names if (target := _resolve(n, modules)) and target != module}
        for target in sorted(targets):
            edges.append(ImportEdge(module, target, f"{path.relative_to(root)}:{node.lineno}", is_runtime))
    return _sorted_edges(edges)


def collect_third_party_imports(root: Path, packages: Iterable[str] = PACKAGES) -> list[ImportEdge]:
    """Edges to the top-level name of every absolute import outside the checked packages (`ray`, `torch`,
    `os`): `import ray.serve` and `from ray import serve` are both an edge to `ray`."""
    edges = set()
    for module, path, node, is_runtime, _ in _import_statements(root, packages):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif node.level == 0 and node.module:
            names = [node.module]
        else:
            continue  # relative: inside the checked packages
        for top in {name.split(".")[0] for name in names} - set(PACKAGES):
            edges.add(ImportEdge(module, top, f"{path.relative_to(root)}:{node.lineno}", is_runtime))
    return _sorted_edges(edges)


def forbidden_edges(edges: Iterable[ImportEdge], forbidden: Mapping[str, set[str]] = FORBIDDEN) -> list[ImportEdge]:
    return [e for e in edges if e.imported.split(".")[0] in forbidden.get(e.importer.split(".")[0], set())]


def engine_package(module: str) -> str:
    """The package (or top-level module) of engine that a module lies in: engine.core.scheduler -> engine.core."""
    return ".".join(module.split(".")[:2])


def _engine_pairs(edges: Iterable[ImportEdge]) -> Iterator[tuple[ImportEdge, str, str]]:
    """(edge, importer's package, imported package) for each edge between two different engine packages."""
    for e in edges:
        if e.importer.split(".")[0] == "engine" and e.imported.split(".")[0] == "engine":
            importer, imported = engine_package(e.importer), engine_package(e.imported)
            if importer != imported:
                yield e, importer, imported


def unranked_engine_modules(edges: Iterable[ImportEdge], ranks: Mapping[str, int] = ENGINE_RANKS) -> list[str]:
    """Engine modules whose package has no layer (a new package must be given one)."""
    modules = {m for e in edges for m in (e.importer, e.imported) if m.split(".")[0] == "engine"}
    return sorted(m for m in modules if engine_package(m) not in ranks)


def engine_layer_violations(edges: Iterable[ImportEdge], ranks: Mapping[str, int] = ENGINE_RANKS) -> list[ImportEdge]:
    """Imports of an engine package of the same or a higher layer (packages without a layer are skipped)."""
    return [
        e
        for e, importer, imported in _engine_pairs(edges)
        if importer in ranks and imported in ranks and ranks[imported] >= ranks[importer]
    ]


def engine_forbidden_edges(
    edges: Iterable[ImportEdge], forbidden: Mapping[str, set[str]] = ENGINE_FORBIDDEN
) -> list[ImportEdge]:
    """The pairs named outright, and every import of engine.bench from another engine package."""
    return [
        e
        for e, importer, imported in _engine_pairs(edges)
        if imported in forbidden.get(importer, set()) or imported == BENCH
    ]


def server_engine_edges(edges: Iterable[ImportEdge], surface: set[str] = SERVER_ENGINE_SURFACE) -> list[ImportEdge]:
    """Imports from server of an engine module outside the surface."""
    return [
        e
        for e in edges
        if e.importer.split(".")[0] == "server" and e.imported.split(".")[0] == "engine" and e.imported not in surface
    ]


def unowned_third_party_imports(
    edges: Iterable[ImportEdge], owners: Mapping[str, tuple[str, ...]] = THIRD_PARTY_OWNERS
) -> list[ImportEdge]:
    """Imports of an owned third-party package from outside its owners."""
    return [
        e
        for e in edges
        if e.imported in owners
        and not any(e.importer == owner or e.importer.startswith(owner + ".") for owner in owners[e.imported])
    ]


def find_cycles(edges: Iterable[ImportEdge], count_type_only: bool = False) -> list[list[str]]:
    """Import loops as [a, b, ..., a]: in each group of modules that reach each other, the shortest loop
    through each member, each loop once. Runtime imports only, unless count_type_only."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.is_runtime or count_type_only:
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


def test_checker_ranks_engine_packages() -> None:
    edges = _edges(
        ("engine.core.scheduler", "engine.core.sequence"),  # inside one package: allowed
        ("engine.core.scheduler", "engine.params"),  # downwards: allowed
        ("engine.params", "engine.core.sequence"),  # upwards
        ("engine.core.block_pool", "engine.ops.rms_norm"),  # one layer
        ("engine.core.scheduler", "engine.newpkg.x"),  # no layer: reported apart
        ("engine", "engine.llm"),  # the surface sits on top
    )
    ranks = {"engine.params": 0, "engine.core": 1, "engine.ops": 1, "engine.llm": 2, "engine": 3}
    assert [(e.importer, e.imported) for e in engine_layer_violations(edges, ranks)] == [
        ("engine.params", "engine.core.sequence"),
        ("engine.core.block_pool", "engine.ops.rms_norm"),
    ]
    assert unranked_engine_modules(edges, ranks) == ["engine.newpkg.x"]
    assert engine_package("engine.core.scheduler") == "engine.core"
    assert engine_package("engine.llm") == "engine.llm"
    assert engine_package("engine") == "engine"


def test_checker_reports_named_engine_pairs_and_bench() -> None:
    edges = _edges(
        ("engine.models.llama", "engine.core.sequence"),  # named outright
        ("engine.models.llama", "engine.ops.rms_norm"),
        ("engine.llm", "engine.bench.prefix_hash"),  # nothing imports bench
        ("engine.bench.bench_engine", "engine.bench.prefix_hash"),  # but bench itself
        ("engine", "engine.bench"),
    )
    assert [(e.importer, e.imported) for e in engine_forbidden_edges(edges)] == [
        ("engine.models.llama", "engine.core.sequence"),
        ("engine.llm", "engine.bench.prefix_hash"),
        ("engine", "engine.bench"),
    ]


def test_checker_holds_server_to_the_engine_surface() -> None:
    edges = _edges(
        ("server.app", "engine"),
        ("server.playground.kv_cache", "engine.inspect"),
        ("server.config", "engine.config"),
        ("server.playground.kv_cache", "engine.core.kv_snapshot"),
        ("server.routes.rerank", "engine.pooling.reranker"),
        ("engine.llm", "engine.core.sequence"),  # not server's
    )
    assert [e.where for e in server_engine_edges(edges)] == [
        "server/playground/kv_cache.py:1",
        "server/routes/rerank.py:1",
    ]


def test_checker_finds_third_party_imports_by_top_level_name(tmp_path: Path) -> None:
    files = {
        "server/__init__.py": "",
        "server/ray/__init__.py": "",
        "server/ray/replica.py": "import ray\nfrom ray import serve\n",
        "server/app.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ray.serve.handle import H\n",
        "server/ray_free.py": "from . import app\nimport rayon\n",  # relative, and another package
        "engine/__init__.py": "def later():\n    import ray.util\n",
        "clients/__init__.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    edges = collect_third_party_imports(tmp_path)
    assert {(e.importer, e.imported, e.is_runtime) for e in edges} == {
        ("server.ray.replica", "ray", True),
        ("server.app", "typing", True),
        ("server.app", "ray", False),
        ("server.ray_free", "rayon", True),
        ("engine", "ray", True),
    }
    assert [e.where for e in unowned_third_party_imports(edges)] == ["engine/__init__.py:2", "server/app.py:3"]


def test_checker_counts_type_only_imports_in_the_strict_cycle_check() -> None:
    edges = [*_edges(("a", "b")), ImportEdge("b", "a", "b.py:3", is_runtime=False)]
    assert find_cycles(edges) == []
    assert find_cycles(edges, count_type_only=True) == [["a", "b", "a"]]


# --------------------------------------------------------------------------- the code base


@functools.cache
def _repo_edges() -> tuple[ImportEdge, ...]:
    return tuple(collect_edges(ROOT))


def test_no_package_imports_across_a_forbidden_layer() -> None:
    bad = forbidden_edges(_repo_edges())
    assert not bad, "imports that break the layering:\n" + describe(bad, [])


def test_no_import_cycles() -> None:
    cycles = find_cycles(_repo_edges())
    assert not cycles, "modules that import each other:\n" + describe([], cycles)


def test_every_engine_package_has_a_layer() -> None:
    unranked = unranked_engine_modules(_repo_edges())
    assert not unranked, "engine modules whose package has no place in ENGINE_LAYERS:\n" + "\n".join(unranked)


def test_no_engine_layer_has_a_package_twice() -> None:
    packages = [package for layer in ENGINE_LAYERS for package in layer]
    assert len(packages) == len(set(packages))


def test_engine_packages_import_only_lower_layers() -> None:
    bad = engine_layer_violations(_repo_edges())
    assert not bad, "engine imports of a package of the same or a higher layer:\n" + describe(bad, [])


def test_engine_imports_none_of_the_named_pairs() -> None:
    bad = engine_forbidden_edges(_repo_edges())
    assert not bad, "engine imports named as forbidden (ENGINE_FORBIDDEN, engine.bench):\n" + describe(bad, [])


def test_server_imports_only_the_engine_surface() -> None:
    bad = server_engine_edges(_repo_edges())
    allowed = ", ".join(sorted(SERVER_ENGINE_SURFACE))
    assert not bad, f"server imports of engine internals (allowed: {allowed}):\n" + describe(bad, [])


def test_owned_third_party_packages_are_imported_by_their_owners_only() -> None:
    bad = unowned_third_party_imports(collect_third_party_imports(ROOT))
    assert not bad, f"imports outside their owners ({THIRD_PARTY_OWNERS}):\n" + describe(bad, [])


def test_no_import_cycles_counting_type_only_imports() -> None:
    cycles = [c for c in find_cycles(_repo_edges(), count_type_only=True) if c not in KNOWN_TYPE_ONLY_LOOPS]
    assert not cycles, "modules that import each other (imports under TYPE_CHECKING too):\n" + describe([], cycles)
