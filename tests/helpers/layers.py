"""The import graph of a package tree, read from its source (``ast``): which modules each module
imports (relative imports resolved, subpackages included), the modules on an import circle, the
longest import chain, and each module's layer. Used by the layering tests (tests/test_api.py)."""
from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["absolute_imports", "circles", "depth", "import_graph", "modules"]


def modules(package: Path) -> dict[str, Path]:
    """Dotted name (relative to ``package``; a subpackage's ``__init__`` is the subpackage's own name,
    the package's is ``__init__``) -> file, for every ``*.py`` below ``package``."""
    out = {}
    for p in sorted(package.rglob("*.py")):
        parts = list(p.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _package_of(name: str, path: Path) -> list[str]:
    parts = [] if name == "__init__" else name.split(".")
    return parts if path.name == "__init__.py" else parts[:-1]


def _imports(tree: ast.AST, runtime_only: bool) -> list[ast.ImportFrom]:
    """The ``from`` imports of a module at any depth; without those under ``if TYPE_CHECKING:`` when
    ``runtime_only``."""
    out: list[ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if runtime_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            out.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(tree)
    return out


def import_graph(package: Path, *, with_inits: bool = False, runtime_only: bool = False,
                 external: tuple[str, ...] = ("readers",)) -> dict[str, set[str]]:
    """module -> the modules of the tree it imports (function-local and ``TYPE_CHECKING`` imports too).

    A name outside the tree (``readers`` when it is installed beside the tree) is kept as written.
    With ``with_inits``, importing ``a.b.c`` from outside ``a`` also counts as importing ``a`` (its
    ``__init__`` runs first), as Python does: that graph has the circles Python would meet. With
    ``runtime_only``, imports for type checkers alone (``if TYPE_CHECKING:``) are left out. Names in
    ``external`` are subpackages installed into the tree from elsewhere (``datacache.readers``)."""
    mods = modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        here = _package_of(name, path)
        for node in _imports(ast.parse(path.read_text()), runtime_only):
            if node.level < 1:
                continue
            base = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            targets = []
            for alias in node.names:
                sub = ".".join(base + [alias.name])
                if sub in mods or sub.split(".")[0] in external:
                    targets.append(sub)
                else:
                    targets.append(".".join(base) or "__init__")
            for t in targets:
                deps.add(t)
                if with_inits:
                    parts = t.split(".")
                    for k in range(1, len(parts)):
                        pkg = ".".join(parts[:k])
                        if pkg in mods and not ".".join(here).startswith(pkg):
                            deps.add(pkg)
        deps.discard(name)
        graph[name] = deps
    return graph


def absolute_imports(module: Path) -> set[str]:
    """The top-level names of the absolute imports of ``module`` (``import x.y``, ``from x import``)."""
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def circles(graph: dict[str, set[str]]) -> list[str]:
    """The modules (other than ``__init__``) from which an import chain leads back to themselves."""
    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and nxt != "__init__" and reaches(nxt, target, seen | {nxt})):
                return True
        return False
    return sorted(m for m in graph if m != "__init__" and reaches(m, m, {m}))


def depth(graph: dict[str, set[str]], start: str) -> list[str]:
    """The longest import chain from ``start`` (a list of modules; the graph must have no circle)."""
    memo: dict[str, list[str]] = {}

    def longest(m: str) -> list[str]:
        if m not in memo:
            tails = [longest(d) for d in graph.get(m, ()) if d in graph]
            memo[m] = [m] + max(tails, key=len, default=[])
        return memo[m]
    return longest(start)
