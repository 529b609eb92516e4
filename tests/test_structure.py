"""The package's structure, read from the source with `ast`: its import graph has no circle
(every module's imports of replayquant modules, at module level and inside functions alike: a
function-local import hides an edge from a reader, not from this check), and its functions
outside the kernels take at most ten parameters."""

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


# Functions outside kernels/ that take more than MAX_PARAMETERS: the benchmarks' runners and the
# decode store's builders. The check fails on any other function over the limit,
# and on one of these once it is under it (then it comes off this list).
MAX_PARAMETERS = 10
OVER_LIMIT = {
    "replayquant.bench.generate:_result", "replayquant.bench.generate:_run_generate_bench",
    "replayquant.bench.kernels.plan:plan", "replayquant.bench.kernels.rows:_replay_rounds",
    "replayquant.bench.kernels.rows:_snapshot_rounds",
    "replayquant.bench.kernels.rows:bench_replay",
    "replayquant.bench.kernels.run:_run_kernels_bench",
    "replayquant.bench.kernels.sweep:_sweep_replay",
    "replayquant.models.decode_store:_build", "replayquant.models.decode_store:from_parts",
    "replayquant.models.decode_store:parts_to_store",
}


def _is_command(fn: ast.FunctionDef) -> bool:
    """A command of the command line (`@app.command(...)`): its parameters are its options."""
    return any(isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
               and d.func.attr == "command" for d in fn.decorator_list)


def _parameters(fn: ast.FunctionDef) -> int:
    """Parameters of `fn`, self / cls not counted, *args and **kwargs one each."""
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    return (len(names) - (names[:1] in (["self"], ["cls"])) + (a.vararg is not None)
            + (a.kwarg is not None))


def test_no_function_outside_the_kernels_takes_more_than_ten_parameters():
    """Options travel as one object (a run's settings, `replayquant.kl.KLSettings`), not as a
    parameter each; the Triton kernels, whose parameters are their launch arguments, aside."""
    over = set()
    for name, path in _modules().items():
        if name == "replayquant.kernels" or name.startswith("replayquant.kernels."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_command(node)
                    and _parameters(node) > MAX_PARAMETERS):
                over.add(f"{name}:{node.name}")
    assert over == OVER_LIMIT
