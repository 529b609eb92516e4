"""The package's import structure: its import graph has no circle (every module's imports of
replayquant modules, at module level and inside functions alike: a function-local import hides an
edge from a reader, not from this check; read from the source with `ast`), kernels/ holds one
folder per operator with only Triton code, launch tables and references (which import no Triton
module), its functions outside the kernels take at most ten parameters, and the layer's state,
the format specification and the torch references import and run without Triton."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "replayquant"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _module_level(tree: ast.AST):
    """The nodes of a module that run when it is imported: all but the bodies of its functions
    (a class body runs; a method's body does not)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(c for c in ast.iter_child_nodes(node)
                     if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def _edges(mods: dict[str, Path], module_level: bool = False) -> dict[str, set[str]]:
    """module -> the replayquant modules it imports (a name imported from a package counts as
    its module where one exists, else the package); module_level: only the imports that run
    when it is imported."""
    edges = {m: set() for m in mods}
    for m, p in mods.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        tree = ast.parse(p.read_text())
        for node in (_module_level(tree) if module_level else ast.walk(tree)):
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


# kernels/: one folder per operator, and beside them the custom-operator registry and the compile
# checker (a developer's tool). In an operator folder a module is Triton code (it imports triton)
# or one of PLAIN: its launch table, its torch reference, the replay folder's torch engine.
OPERATORS = {"quant", "conventional", "replay", "chunk"}
PLAIN = {"launch", "reference", "engine"}


def _imports_triton(path: Path) -> bool:
    """Whether the module imports triton itself when it is imported."""
    for node in _module_level(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n == "triton" or n.startswith("triton.") for n in names):
            return True
    return False


def test_kernels_hold_kernels_launch_tables_and_references():
    """kernels/ is one folder per operator (and ops, compile_check); an operator folder holds
    Triton code (a module whose import imports triton), its launch table and its reference (the
    replay folder also its torch engine) and nothing else; no launch table, reference or engine
    imports a Triton module, directly (at module level or inside a function) or through what
    its imports import."""
    mods = _modules()
    kern = [m for m in mods if m.startswith("replayquant.kernels.")]
    assert {m.split(".")[2] for m in kern} == OPERATORS | {"ops", "compile_check"}
    direct, loaded = _edges(mods), _edges(mods, module_level=True)
    triton_mods = {m for m, p in mods.items() if _imports_triton(p)}
    while True:                       # and the modules whose import imports one of them
        more = {m for m in mods if loaded[m] & triton_mods} - triton_mods
        if not more:
            break
        triton_mods |= more
    plain = [m for m in kern if len(m.split(".")) == 4 and m.split(".")[3] in PLAIN]
    assert {m.split(".")[2] for m in plain} == OPERATORS        # a launch table in every folder
    for m in kern:
        parts = m.split(".")
        if len(parts) == 4 and m not in plain:
            assert parts[2] in OPERATORS and m in triton_mods, \
                f"{m}: neither Triton code nor a launch table, reference or engine"
    for m in plain:
        reach, todo = set(), [m]
        while todo:                                   # what importing m imports, transitively
            for e in loaded[todo.pop()] - reach:
                reach.add(e)
                todo.append(e)
        assert not (direct[m] | reach) & triton_mods, (m, sorted((direct[m] | reach)
                                                                  & triton_mods))


# Runs in a fresh interpreter in which `import triton` fails: the layer's state (the torch
# states, the decode stores, their roles and the conversions between them), the format
# specification, every torch reference and the torch engine's custom operator build and step on
# the CPU without Triton, which replayquant installs on Linux only.
_NO_TRITON = """
import sys
sys.modules["triton"] = None
sys.modules["triton.language"] = None
import torch
import replayquant.formats
from replayquant.formats import casts, philox
import replayquant.replay
from replayquant.replay import ConventionalStore, ReplayState, ReplayStore, convert, roles, stores
from replayquant.kernels import ops
from replayquant.kernels.chunk import launch as chunk_launch, reference as chunk_ref
from replayquant.kernels.conventional import launch as conventional_launch
from replayquant.kernels.conventional import reference as conventional_ref
from replayquant.kernels.quant import launch as quant_launch
from replayquant.kernels.replay import (engine as replay_torch, launch as replay_launch,
                                        reference as replay_ref)
from replayquant.models import decode_store
from replayquant.policy import resolve_pair

g = torch.Generator().manual_seed(0)
N, H, D, L = 2, 2, 16, 4
rnd = lambda *s: torch.randn(*s, generator=g)
pair = resolve_pair("tp4_hi32", L)
store = ReplayStore.from_state(rnd(N, H, D, D), pair, "gdn")       # the kernels' bf16 ring
ref = store.clone()
q, k, v, a, b = rnd(N, H, D), rnd(N, H, D), rnd(N, H, D), rnd(N, H), rnd(N, H)
A_log, dt_bias = rnd(H), rnd(H)
kb, vb = k.bfloat16(), v.bfloat16()
for _ in range(L + 1):                                # read steps and a flush
    y = replay_torch.replay_gdn_step_torch(store, q, kb, vb, a, b, A_log, dt_bias)
    y_ref = replay_ref.replay_gdn_step_ref(ref, q, kb, vb, a, b, A_log, dt_bias)
    assert torch.equal(y, y_ref)
assert int(store.n_flush.min()) == 1 and replay_launch.replay_launch_config(store, "flush")
with replay_launch.override_replay_launch({"flush": (16, 1)}):
    assert replay_launch.replay_launch_config(store, "flush") == (16, 1)
assert conventional_launch.launch_config("fp32", 4, 16, 16) == (8, 1)
assert chunk_launch.chunk_launch_config(pair, N, H, D, D, L)["buffer_tile"] == 16
assert quant_launch.quant_launch_config("nvfp4_quantize", 64)["plan"] == (0, 64, 1, True)
store.pack()
twin = store.clone()
ins = dict(q=q, k=kb, v=vb, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
y_op = ops.replay_step(store, ins, torch.arange(N, dtype=torch.int32),
                       meta=ops.store_meta(store, "torch"))
assert torch.equal(y_op, replay_torch.replay_gdn_step_torch(twin, q, kb, vb, a, b, A_log,
                                                            dt_bias))
conv = ConventionalStore.from_state(rnd(N, H, D, D), "fp8", "stochastic", seed=1)
assert conventional_ref.conventional_gdn_step_ref(conv, q, k, v, a, b, A_log, dt_bias).shape \\
    == (N, H, D)
snaps = stores.make_snapshots(conv, 2)
drafts = [t.unsqueeze(1).expand(-1, 2, *t.shape[1:]) for t in (q, k, v, a, b)]
conventional_ref.conventional_gdn_verify_ref(conv, snaps, *drafts, A_log, dt_bias)
conventional_ref.conventional_accept_ref(conv, snaps, torch.ones(N, dtype=torch.int32))
st = ReplayState(rnd(N, H, D, D), pair, delta=True, seed=2)
st.step(q, k, v, -torch.rand(N, H, generator=g), torch.rand(N, H, generator=g))
kv, idx = convert.state_to_store(st, H, ring_dtype=torch.float32)
back = convert.store_to_state(kv, idx, pair, 2, 0)
assert torch.equal(back.export().anchor.payload, st.export().anchor.payload)
ss = convert.store_to_scan(kv, idx, pair, 2, 0)
assert torch.equal(convert.scan_to_store(ss, H, ring_dtype=torch.float32)[0].anchor.payload,
                   kv.anchor.payload)
ss = chunk_ref.initial_scan_state(rnd(N, H, D, D), pair, delta=True)
chunk_ref.chunk_scan_ref(ss, rnd(N, 3, H, D), rnd(N, 3, H, D), rnd(N, 3, H, D),
                         -torch.rand(N, 3, H, generator=g), torch.rand(N, 3, H, generator=g),
                         pair=pair)
assert isinstance(store.anchor, roles.PackedRole) and stores.FaultRecord
assert casts.pow2_ref(torch.tensor([3])).item() == 8.0
assert philox.random_bits_ref((4,), 0, 0).numel() == 4
print("ok")
"""


MAX_PARAMETERS = 10


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
    assert not over, sorted(over)


def test_layer_state_and_references_import_without_triton():
    """`import triton` fails in the child: replay/ (stores and conversions), formats/ and the
    torch references import, build a store and step it (torch engine = reference, bit for
    bit; the custom operator on the torch engine = the engine), hand a ReplayState to a store
    and back, and run the chunked scan's reference."""
    env = dict(os.environ, REPLAYQUANT_BACKEND="torch",
               PYTHONPATH=os.pathsep.join([str(PKG.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    got = subprocess.run([sys.executable, "-c", _NO_TRITON], capture_output=True, text=True,
                         env=env, timeout=600)
    assert got.returncode == 0 and got.stdout.strip().endswith("ok"), got.stderr[-3000:]
