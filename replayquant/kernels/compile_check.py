"""Compile for a real GPU what the Triton interpreter ran: catches code that the interpreter
accepts and the compiler rejects (or that ptxas cannot assemble), without a GPU.

    python -m replayquant.kernels.compile_check record LAUNCHES.json -- CMD...   (interpreter)
    python -m replayquant.kernels.compile_check compile LAUNCHES.json [--arch 90]
    python -m replayquant.kernels.compile_check sass LAUNCHES.json [--arch 90] [--kernel NAME]

`record` runs a Python command (`-m module args` or `script.py args`) with TRITON_INTERPRET=1 and
writes every distinct kernel launch it made: the kernel, the type of each runtime argument, the
constexpr values, num_warps (and maxnreg). `compile` (no TRITON_INTERPRET) compiles each
distinct specialization once (specialization_key: what Triton compiles anew for, so launches
that differ only in an argument the kernel does not specialize on share one) with
`triton.compile` for sm_<arch> (PTX, then ptxas if Triton ships one) and reports failures with
the compiler's message. tests/kernels/test_compile_check.py does both for the model decode path.
`sass` prints, per specialization, the static count of SASS instructions (nvdisasm of the cubin, as
Triton ships it; --ops N: the N commonest opcodes) with ptxas's register and spill report: for
kernels without runtime loops that is the instruction count of one program, a proxy (not a
timing) for instruction-bound kernels. The result is the installed Triton's: Triton 3.6 and 3.9
lay out the same kernel differently, and a venv with the H200 image's Triton (3.6.0) reproduced
the device's ptxas register and spill reports exactly. To make one (run `sass` from the checkout
with its python; `record` stays with the main venv):

    python3 -m venv .venv-triton36
    .venv-triton36/bin/pip install -c constraints.txt torch numpy pyyaml
    .venv-triton36/bin/pip install --no-deps triton==3.6.0
"""

from __future__ import annotations

import collections
import importlib
import inspect
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile

from replayquant.outputs import write_json

_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
           "int8": "i8", "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64",
           "bool": "i1"}


def _arg_type(v) -> str:
    if hasattr(v, "dtype") and hasattr(v, "data_ptr"):
        return "*" + _DTYPES[str(v.dtype).removeprefix("torch.")]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        if v == 1:                                      # Triton specializes 1 as a constexpr
            return "one"
        return "i32" if -2**31 <= v < 2**31 else ("u64" if v >= 2**63 else "i64")
    if isinstance(v, float):
        return "fp32"
    if v is None:
        return "none"
    raise TypeError(f"compile_check: cannot type kernel argument {v!r}")


def _aligned(v) -> bool:
    """What Triton's launcher tells the compiler about an argument (divisibility by 16: a
    tensor's address, an integer's value), which lets it vectorize loads and stores."""
    if hasattr(v, "data_ptr"):
        return v.data_ptr() % 16 == 0
    return isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0


def _const(v):
    if hasattr(v, "value"):                             # tl.constexpr wrapper
        v = v.value
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return str(v)


def record_launches(launches: list):
    """Patch the interpreter so each kernel launch is appended to `launches` (deduplicated by
    the caller). Needs TRITON_INTERPRET=1 set before triton is imported."""
    # Triton (Linux only): loaded where a kernel runs
    from triton.runtime.interpreter import InterpretedFunction

    orig = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        params = inspect.signature(fn).parameters
        bound = dict(zip(self.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in params})
        sig, consts, aligned = {}, {}, []
        for name in self.arg_names:
            if name not in bound:
                continue                                # default value: compile uses it too
            p = params[name]
            if "constexpr" in str(p.annotation):
                consts[name] = _const(bound[name])
            else:
                sig[name] = _arg_type(bound[name])
                if _aligned(bound[name]):
                    aligned.append(name)
        launches.append({"module": fn.__module__, "kernel": fn.__name__, "signature": sig,
                         "constexprs": consts, "aligned": aligned,
                         "num_warps": kwargs.get("num_warps", 4),
                         **({"maxnreg": kwargs["maxnreg"]} if kwargs.get("maxnreg") else {})})
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def unique(launches: list) -> list:
    seen, out = set(), []
    for ln in launches:
        key = json.dumps(ln, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(ln)
    return out


def compile_ptx(fn, signature: dict, constexprs: dict, num_warps: int, arch: int = 90,
                attrs: dict | None = None, maxnreg: int | None = None) -> str:
    """PTX of JIT function `fn` for sm_<arch>, compiled here by Triton (no GPU needed).
    signature: {argument: Triton type or "constexpr"}, as triton.compile takes it."""
    import triton   # Triton (Linux only): loaded where a kernel runs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps,
                                   **({"maxnreg": maxnreg} if maxnreg else {})}).asm["ptx"]


def _nvidia_tool(*names):
    """The first of `names` that Triton ships in its nvidia backend's bin folder, or None."""
    import triton   # Triton (Linux only): loaded where a kernel runs
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for n in names:
        if os.path.exists(os.path.join(bindir, n)):
            return os.path.join(bindir, n)
    return None


def assemble(ptx: str, arch: int = 90, verbose: bool = False, sass: bool = False):
    """Run the newest ptxas Triton ships (plain ptxas may be too old to read Triton's PTX) on
    `ptx` for sm_<arch>(a): (returncode, stderr), or None when Triton ships no ptxas; sass:
    (returncode, stderr, the cubin's disassembly by nvdisasm or None)."""
    exe = _nvidia_tool("ptxas-blackwell", "ptxas")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        suffix = "a" if arch >= 90 else ""
        r = subprocess.run([exe, f"-arch=sm_{arch}{suffix}", *(["-v"] if verbose else []),
                            src, "-o", cubin], capture_output=True, text=True)
        if not sass:
            return r.returncode, r.stderr
        dis, nvdisasm = None, _nvidia_tool("nvdisasm")
        if r.returncode == 0 and nvdisasm is not None:
            dis = subprocess.run([nvdisasm, "-c", cubin], capture_output=True,
                                 text=True).stdout
    return r.returncode, r.stderr, dis


def ptxas_report(stderr: str) -> str:
    """The register and spill lines of `ptxas -v` output, on one line."""
    return " ".join(ln.split(":", 1)[-1].strip() for ln in stderr.splitlines()
                    if "registers" in ln or "spill" in ln)


def sass_opcodes(disassembly: str) -> list:
    """The opcode (without modifiers or predicate) of each instruction in an nvdisasm listing
    (lines `/*addr*/ [@P0] OPCODE.MOD ...`)."""
    return [m.split(".")[0] for m in re.findall(
        r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", disassembly,
        flags=re.M)]


def count_sass(disassembly: str) -> int:
    """Instructions in an nvdisasm listing."""
    return len(sass_opcodes(disassembly))


def _compile_inputs(ln: dict):
    """(JIT function, signature, constexprs, attrs) that Triton compiles for one recorded
    launch: an argument in the kernel's do_not_specialize list stays a runtime integer (1
    included) without a divisibility hint, as Triton's launcher treats it. A constexpr ON_GPU
    (False in the interpreter, where a kernel takes another route around an interpreter
    limitation) is compiled as the GPU runs it, True."""
    fn = getattr(importlib.import_module(ln["module"]), ln["kernel"])
    keep = {p.name for p in fn.params if p.do_not_specialize}   # 1 stays a runtime integer
    sig, consts, attrs = {}, dict(ln["constexprs"]), {}
    if "ON_GPU" in consts:
        consts["ON_GPU"] = True
    for i, name in enumerate(fn.arg_names):
        if name in ln.get("aligned", ()) and name not in keep:
            attrs[(i,)] = [["tt.divisibility", 16]]
        t = ln["signature"].get(name)
        if t is None:                                   # a constexpr (recorded or its default)
            sig[name] = "constexpr"
        elif t == "none" or (t == "one" and name not in keep):
            sig[name], consts[name] = "constexpr", (None if t == "none" else 1)
        else:
            sig[name] = "i32" if t == "one" else t
    return fn, sig, consts, attrs


def specialization_key(ln: dict) -> str:
    """What makes Triton compile a launch anew: the kernel, its compiled signature, constexprs
    and divisibility hints, num_warps and maxnreg. Launches that differ only in what Triton does
    not specialize on (e.g. a do_not_specialize key word equal to 1 or not) share one key."""
    _, sig, consts, attrs = _compile_inputs(ln)
    return json.dumps([ln["module"], ln["kernel"], sig, consts, sorted(k[0] for k in attrs),
                       ln["num_warps"], ln.get("maxnreg")], sort_keys=True)


def distinct_specializations(launches: list) -> list:
    """The first launch of each specialization_key, in recorded order."""
    seen, out = set(), []
    for ln in launches:
        key = specialization_key(ln)
        if key not in seen:
            seen.add(key)
            out.append(ln)
    return out


def _launch_ptx(ln: dict, arch: int):
    """(PTX, '') of one recorded launch compiled for sm_<arch>, or (None, the compiler's
    error)."""
    fn, sig, consts, attrs = _compile_inputs(ln)
    try:
        return compile_ptx(fn, sig, consts, ln["num_warps"], arch, attrs, ln.get("maxnreg")), ""
    except Exception as e:                              # the compiler's message is the point
        while e.__cause__ is not None:                  # the innermost error says what failed
            e = e.__cause__
        return None, f"{type(e).__name__}: {e}"[-1500:]


def compile_launch(ln: dict, arch: int = 90) -> str:
    """Compile one recorded launch for sm_<arch>: '' when it compiles (and assembles), else the
    error's last lines."""
    ptx, err = _launch_ptx(ln, arch)
    if ptx is None:
        return err
    r = assemble(ptx, arch)
    return "" if r is None or r[0] == 0 else "ptxas: " + r[1].strip()[-800:]


def sass_launch(ln: dict, arch: int = 90):
    """(error or '', ptxas -v report, the SASS opcodes or None) of one recorded launch."""
    ptx, err = _launch_ptx(ln, arch)
    if ptx is None:
        return err, "", None
    r = assemble(ptx, arch, verbose=True, sass=True)
    if r is None:
        return "ptxas: Triton ships none", "", None
    if r[0] != 0:
        return "ptxas: " + r[1].strip()[-800:], "", None
    return "", ptxas_report(r[1]), (sass_opcodes(r[2]) if r[2] else None)


def recorded(cmd: list, root: str) -> list:
    """The launches that `record` writes for the Python command `cmd` (as after `--`), run in a
    child interpreter with TRITON_INTERPRET=1 and `root` on its path (the evals' SASS tables)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "launches.json")
        r = subprocess.run([sys.executable, "-m", "replayquant.kernels.compile_check", "record",
                            out, "--", *map(str, cmd)], env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stdout + r.stderr)
        with open(out) as f:
            return json.load(f)


def print_sass_table(variants, arch: int = 90, ops=()) -> None:
    """For each distinct (name, launch) of `variants`: a line with its SASS instructions,
    ptxas's register and spill report and the counts of the opcodes `ops`."""
    seen = set()
    for name, ln in variants:
        if name in seen:
            continue
        seen.add(name)
        err, report, got = sass_launch(ln, arch)
        if err:
            print(f"{name}: FAIL {err}")
            continue
        cnt = collections.Counter(got or [])
        extra = " ".join(f"{op} {cnt[op]}" for op in ops)
        print(f"{name}: {len(got or [])} SASS, {report}; {extra}", flush=True)


def main(argv: list[str]) -> int:
    usage = ("usage: python -m replayquant.kernels.compile_check record OUT.json -- "
             "(-m module | script.py) ARGS...  |  compile LAUNCHES.json [--arch 90]  |  "
             "sass LAUNCHES.json [--arch 90] [--kernel NAME] [--ops N]")
    if len(argv) < 2 or argv[0] not in ("record", "compile", "sass"):
        print(usage, file=sys.stderr)
        return 2
    if argv[0] == "record":
        if os.environ.get("TRITON_INTERPRET") != "1" or "--" not in argv:
            print("compile_check record: set TRITON_INTERPRET=1 and give the command after --",
                  file=sys.stderr)
            return 2
        out, cmd = argv[1], argv[argv.index("--") + 1:]
        launches: list = []
        record_launches(launches)
        rc = 0
        try:
            if cmd[0] == "-m":
                sys.argv = [cmd[1]] + cmd[2:]
                runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = cmd
                runpy.run_path(cmd[0], run_name="__main__")
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        write_json(out, unique(launches))
        print(f"compile_check: {len(unique(launches))} distinct launches -> {out} (command rc={rc})")
        return rc
    if os.environ.get("TRITON_INTERPRET") == "1":
        print(f"compile_check {argv[0]}: unset TRITON_INTERPRET (it must compile, not "
              f"interpret)", file=sys.stderr)
        return 2
    arch = int(argv[argv.index("--arch") + 1]) if "--arch" in argv else 90
    with open(argv[1]) as f:
        recorded = json.load(f)
    launches = distinct_specializations(recorded)
    if argv[0] == "sass":
        only = argv[argv.index("--kernel") + 1] if "--kernel" in argv else None
        top = int(argv[argv.index("--ops") + 1]) if "--ops" in argv else 0
        bad = 0
        for ln in launches:
            if only is not None and ln["kernel"] != only:
                continue
            err, report, ops = sass_launch(ln, arch)
            bad += bool(err)
            consts = " ".join(f"{k}={v}" for k, v in ln["constexprs"].items())
            n = None if ops is None else len(ops)
            cap = f" maxnreg={ln['maxnreg']}" if ln.get("maxnreg") else ""
            print(f"{ln['kernel']} warps={ln['num_warps']}{cap} {consts}\n    "
                  + (f"FAIL {err}" if err else f"{n} SASS instructions; {report}"))
            if top and ops:
                print("    " + ", ".join(f"{op} {c}" for op, c in
                                         collections.Counter(ops).most_common(top)))
        return 1 if bad else 0
    bad = 0
    for ln in launches:
        err = compile_launch(ln, arch)
        name = f"{ln['kernel']} {ln['constexprs']}"
        if err:
            bad += 1
            print(f"FAIL {name}\n     {err}")
        else:
            print(f"ok   {ln['kernel']}")
    print(f"compile_check: {len(launches) - bad}/{len(launches)} specializations (of "
          f"{len(recorded)} recorded launches) compile for sm_{arch}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
