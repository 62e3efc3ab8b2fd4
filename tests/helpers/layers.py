"""The import graph of a package, read from its source (``ast``): which sibling modules each module
imports, and the modules that sit on an import circle. Used by the layering tests."""
from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["sibling_imports", "import_graph", "circles", "absolute_imports"]


def sibling_imports(module: Path) -> set[str]:
    """The sibling modules ``module`` imports (``from .x import ...`` and ``from . import x``), at
    any depth of the file (function-local and ``TYPE_CHECKING`` imports included)."""
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                names.add(node.module.split(".")[0])
            else:
                names.update(a.name for a in node.names)
    return names


def absolute_imports(module: Path) -> set[str]:
    """The top-level names of the absolute imports of ``module`` (``import x.y``, ``from x import``)."""
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def import_graph(package: Path) -> dict[str, set[str]]:
    """module name -> the sibling modules it imports, for every ``*.py`` of ``package``; a name taken
    from the package itself (``from . import __version__``) counts as importing ``__init__``."""
    mods = {p.stem: p for p in package.glob("*.py")}
    return {name: {n if n in mods else "__init__" for n in sibling_imports(p)} for name, p in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[str]:
    """The modules (other than ``__init__``) from which an import chain leads back to themselves."""
    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and nxt != "__init__" and reaches(nxt, target, seen | {nxt})):
                return True
        return False
    return sorted(m for m in graph if m != "__init__" and reaches(m, m, {m}))
