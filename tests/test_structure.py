"""The package's import graph has no circle: every module's imports of replayquant modules, at
module level and inside functions alike (a function-local import hides an edge from a reader, not
from this check), read from the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "replayquant"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the replayquant modules it imports (a name imported from a package counts as
    its module where one exists, else the package)."""
    edges = {m: set() for m in mods}
    for m, p in mods.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:                                  # relative: from . / .. import
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if not base.startswith("replayquant"):
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    edges[m].add(sub if sub in mods else base)
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name.startswith("replayquant"))
    return {m: {e for e in es if e in mods and e != m} for m, es in edges.items()}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_circle():
    """Package __init__ modules that import their own submodules are edges like any other: a
    circle through one is a circle."""
    edges = _edges(_modules())
    assert sum(map(len, edges.values())) > 100              # the scan saw the package's imports
    assert _circles(edges) == []
