#!/usr/bin/env python3
"""Import circles among pagedllm's modules, read from the source with `ast` (nothing is imported).

A circle (two or more modules that reach each other through imports) makes the import order
matter, hides which module is the lower layer, and is what function-local imports are usually
written to hold apart; issue 44 asks for none.

Every `import` / `from ... import` naming a pagedllm module is sorted by where it runs:

* module level: runs when the module is imported (the module body, also inside `if`, `try`,
  `with` and class bodies). These edges form the graph whose circles are errors.
* TYPE_CHECKING: inside `if TYPE_CHECKING:` at module level. Never runs, so it cannot break an
  import; such edges are kept out of the graph and only counted (`--type-checking` adds them).
* function-local: inside a function body; runs on the first call. Listed with file:line, since
  each should have a reason (an optional heavy dependency, CLI start-up time); `--local` adds
  them to the graph to show the circles they would close if written at the top.

`from a.b import c` is an edge to the module `a.b.c` when that is a module, else to `a.b`.
Importing `a.b.c` first runs the packages `a` and `a.b` (their `__init__.py`), so the edge also
reaches those of them that are not packages of the importing module itself (those already ran:
a package's `__init__` importing its own modules, which import their siblings, is no circle).
`importlib.import_module("...")` strings are not followed.

    python scripts/import_cycles.py            # circles of module-level imports; exit 1 if any
    python scripts/import_cycles.py --local    # ... counting function-local imports as well
    python scripts/import_cycles.py --list-local   # every function-local import, file:line
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "pagedllm"

MODULE_LEVEL = "module"
TYPE_CHECKING = "type_checking"
LOCAL = "local"


@dataclass(frozen=True)
class ImportEdge:
    """One import statement's target, where it is written, and when it runs."""

    source: str
    target: str  # a module name; for external imports the top-level name as written
    kind: str  # MODULE_LEVEL, TYPE_CHECKING or LOCAL
    path: str
    line: int
    internal: bool


def module_names(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file} for every .py file of the package (packages by __init__)."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(node: ast.AST, kind: str = MODULE_LEVEL):
    """(import statement, kind) for every import under `node`, classified by where it runs."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, kind
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _statements(child, LOCAL)
        elif isinstance(child, ast.If) and kind == MODULE_LEVEL and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _statements(ast.Module(body=[stmt], type_ignores=[]), TYPE_CHECKING)
            for stmt in child.orelse:
                yield from _statements(ast.Module(body=[stmt], type_ignores=[]), kind)
        else:
            yield from _statements(child, kind)


def _resolve_from(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = source.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(modules: dict[str, Path], root: Path = ROOT) -> list[ImportEdge]:
    """Every import statement of every module, resolved to module names."""
    edges: list[ImportEdge] = []
    for source, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        rel = str(path.relative_to(root))
        is_package = path.name == "__init__.py"
        for node, kind in _statements(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve_from(source, is_package, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in dict.fromkeys(targets):
                internal = target == PACKAGE or target.startswith(PACKAGE + ".")
                if internal:
                    # `import pagedllm.a.b` for a name that is no module: its nearest module.
                    while target not in modules and "." in target:
                        target = target.rsplit(".", 1)[0]
                else:
                    target = target.split(".")[0]
                edges.append(ImportEdge(source, target, kind, rel, node.lineno, internal))
    return edges


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; the components of two or more modules (or one importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0

    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop(0)
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
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
                if len(component) > 1 or node in graph.get(node, ()):
                    out.append(sorted(component))
    return sorted(out)


def import_graph(edges: list[ImportEdge], kinds: set[str]) -> dict[str, set[str]]:
    """{module: modules its imports run} over the internal edges of the given kinds."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set())
        if not edge.internal or edge.kind not in kinds:
            continue
        ran_already = set(_packages_of(edge.source)) | {edge.source}
        for target in [*_packages_of(edge.target), edge.target]:
            if target not in ran_already:
                graph[edge.source].add(target)
    return graph


def _packages_of(module: str) -> list[str]:
    """The packages importing `module` runs first: `a`, `a.b` for `a.b.c`."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def circles(kinds: set[str] = frozenset({MODULE_LEVEL}), root: Path = ROOT) -> list[list[str]]:
    """The import circles of pagedllm counting the given kinds of import."""
    return strongly_connected(import_graph(import_edges(module_names(root), root), kinds))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local", action="store_true", help="count function-local imports too")
    parser.add_argument(
        "--type-checking", action="store_true", help="count `if TYPE_CHECKING:` imports too"
    )
    parser.add_argument("--list-local", action="store_true", help="list function-local imports")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to read (default: this one)")
    args = parser.parse_args(argv)

    edges = import_edges(module_names(args.root), args.root)
    kinds = {MODULE_LEVEL}
    if args.local:
        kinds.add(LOCAL)
    if args.type_checking:
        kinds.add(TYPE_CHECKING)
    found = strongly_connected(import_graph(edges, kinds))
    local = [e for e in edges if e.kind == LOCAL]
    if args.list_local:
        for edge in sorted(local, key=lambda e: (e.path, e.line, e.target)):
            where = "internal" if edge.internal else "external"
            print(f"{edge.path}:{edge.line}: {edge.target} ({where})")
    for number, component in enumerate(found, 1):
        print(f"circle {number} ({len(component)} modules): " + " ".join(component))
    statements = {(e.path, e.line) for e in local}
    internal = {(e.path, e.line) for e in local if e.internal}
    print(
        f"{len(found)} circles counting {', '.join(sorted(kinds))} imports; "
        f"function-local import statements: {len(statements)} ({len(internal)} of pagedllm modules)"
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
