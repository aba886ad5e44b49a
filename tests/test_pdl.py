"""ops/pdl.py (LORAPLEX_PDL, on by default where the GPU has it): every Triton kernel of the package starts with
`pdl_start()`, which compiles to nothing with PDL off (or before sm_90, or in the interpreter) and, with it on, to
`griddepcontrol.wait` before the kernel's first memory access and `griddepcontrol.launch_dependents` after it
(the PTX of every kernel family, compiled for sm_90 in a subprocess with PDL forced on and off: no GPU here). Its
effect on a GPU (graph replays against eager, the speed) is for the GPU tests and benchmarks."""
from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loraplex.ops import launch, pdl

TESTS = Path(__file__).parent
# a PTX memory instruction, predicated or not (Triton writes masked loads, stores and atomics as `@%p5 ld.global...`);
# not the kernel's parameter loads (ld.param), which read no memory another kernel writes
MEMORY_OP = re.compile(r"^(@!?%p\d+\s+)?((ld|st|atom|red)\.(?!param)|cp\.|ldmatrix|stmatrix|wgmma|mbarrier|prefetch)")


def _kernels():
    """Every `@triton.jit` function of the package whose name ends in `_kernel`."""
    import importlib
    import pkgutil

    import loraplex.ops as ops
    found = {}
    for info in pkgutil.walk_packages(ops.__path__, "loraplex.ops."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "fn") and obj.fn.__module__ == module.__name__:
                found[f"{info.name}.{name}"] = obj
    return found


def test_pdl_is_on_by_default_only_with_a_hopper_gpu():
    from loraplex import envs
    assert envs.pdl() or os.environ.get("LORAPLEX_PDL")
    if not envs.pdl() or not pdl._supported():   # off, or on without an sm_90 GPU (or in the interpreter)
        assert not pdl.PDL
    assert launch._PDL_OPTIONS == ({"launch_pdl": True} if pdl.PDL else {})


def test_every_kernel_starts_with_pdl_start():
    kernels = _kernels()
    assert len(kernels) >= 14, sorted(kernels)
    for name, kernel in kernels.items():
        tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
        body = tree.body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):   # the docstring
            body = body[1:]
        first = body[0]
        assert (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                and getattr(first.value.func, "id", None) == "pdl_start"), f"{name}: first statement is not pdl_start()"


@pytest.mark.compile
@pytest.mark.parametrize("forced", [True, False])
def test_kernels_wait_before_any_memory_access_with_pdl_on(forced):
    """Compiled for sm_90 with PDL forced on: each kernel's PTX waits (griddepcontrol.wait) before its first
    global or shared memory access (the LoRA consumers' EARLY variants: global loads only; the decode GEMMs'
    PREFETCH variants: L2 prefetches only; ops/pdl.py's early reads) and releases its dependents; forced off,
    neither instruction is there. (With
    PDL on every kernel compiles anew: two subprocesses side by side, ~35 s each on 2 CPUs.)"""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
    parts = ("fused", "attention") if forced else ("fused",)
    procs = [subprocess.Popen([sys.executable, __file__, "on" if forced else "off", part], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for part in parts]
    checked = early = after = 0
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        counts = [line for line in out.splitlines() if line.startswith("checked")]
        assert counts, out[-2000:]
        checked += int(counts[-1].split()[1])
        early += int(counts[-1].split()[3])
        after += int(counts[-1].split()[5])
    assert checked >= (90 if forced else 30), checked
    assert early >= (4 if forced else 0), early   # the LoRA consumers' EARLY and the GEMMs' PREFETCH variants
    assert after >= (1 if forced else 0), after   # the shrink's AFTER_GEMM variant (compile_kernels.shrink)


@pytest.mark.gpu
@pytest.mark.skipif(not pdl.PDL, reason="LORAPLEX_PDL=on on a GPU of compute capability 9.0 or more")
def test_launches_carry_the_programmatic_attribute_and_keep_their_results():
    """With PDL on, the compiled kernels the Launcher keeps are launched with programmatic serialization, and a
    chain of dependent launches (each reading the one before's output) in a CUDA graph gives eager's bits."""
    import torch

    from loraplex.ops.gemm import skinny as skinny_gemm
    x = torch.randn(8, 512, device="cuda").bfloat16()
    ws = [(torch.randn(512, 512, device="cuda") / 23).bfloat16() for _ in range(6)]

    def chain():
        y = x
        for w in ws:   # each launch reads the previous one's output
            y = skinny_gemm.skinny_linear(y, w)
        return y

    eager = chain()
    launcher = skinny_gemm._KERNEL[0]
    if launcher.enabled:   # the direct launches' compiled kernels (Triton 3.6, LORAPLEX_FAST_LAUNCH not off)
        assert launcher._compiled and all(k.metadata.launch_pdl for k in launcher._compiled.values())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def _check_ptx(ptx: str, forced: bool, seen: list, early: bool = False, after_gemm: bool = False) -> None:
    """`early`: a kernel compiled with EARLY or PREFETCH (ops/pdl.py's early reads): global loads or L2
    prefetches, and nothing else that touches memory, before the wait, and at least one of them (else the variant
    would be pointless).
    `after_gemm`: the shrink's AFTER_GEMM variant (ops/pdl.py's pdl_release / pdl_wait_last): it releases its
    dependents before its first memory access and waits after its last (program (0, 0) alone: the others leave
    without it, so a branch past the wait is expected)."""
    lines = [line.strip() for line in ptx.splitlines()]
    waits = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait")]
    if not forced:
        assert not waits and "griddepcontrol" not in ptx
    elif after_gemm:
        memory = [i for i, line in enumerate(lines) if MEMORY_OP.match(line)]
        releases = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.launch_dependents")]
        assert memory and waits and releases
        assert releases[0] < memory[0], "the AFTER_GEMM shrink touches memory before it releases its dependents"
        assert waits[-1] > memory[-1], "the AFTER_GEMM shrink touches memory after its last wait"
        guard = _guard_of(lines, waits[-1])
        assert guard is not None, "the AFTER_GEMM shrink's wait is not behind a branch (program (0, 0) alone waits)"
        assert {"%ctaid.x", "%ctaid.y"} <= _feeds(lines, guard), \
            "the branch around the AFTER_GEMM shrink's wait does not test both program ids"
        seen.append(3)
        return
    else:
        assert waits and any(line.startswith("griddepcontrol.launch_dependents") for line in lines)
        memory = [i for i, line in enumerate(lines) if MEMORY_OP.match(line)]
        assert memory, "no memory instruction found: the pattern is stale"
        before = [lines[i] for i in memory if i < waits[0]]
        if early:
            assert before, "an early-reading kernel reads nothing before the wait"
            other = [line for line in before if not EARLY_LOAD.match(line)]
            assert not other, f"a memory access before the wait that is not a global load: {other[0]}"
        else:
            assert not before, f"a memory access before the wait: {before[0]}"
    seen.append(2 if early and forced else 1)


EARLY_LOAD = re.compile(r"^(@!?%p\d+\s+)?(ld\.global\.|prefetch\.global\.L2 )")
PREDICATED = re.compile(r"^@!?(%p\d+)\s+(\S+)")


def _guard_of(lines: list[str], at: int) -> str | None:
    """The predicate register that decides whether line `at` runs: its own, or the last predicated branch's above it
    (the block the compiler jumps over)."""
    own = PREDICATED.match(lines[at])
    if own:
        return own.group(1)
    for line in reversed(lines[:at]):
        m = PREDICATED.match(line)
        if m and m.group(2).startswith("bra"):
            return m.group(1)
    return None


def _feeds(lines: list[str], reg: str, depth: int = 8) -> set[str]:
    """The registers, special ones (%ctaid.x, …) included, that `reg`'s value is computed from, following each
    register's defining instructions (Triton's PTX writes most virtual registers once) up to `depth` steps back."""
    found, frontier = set(), {reg}
    for _ in range(depth):
        sources = set()
        for line in lines:
            m = re.match(r"^(?:@!?%p\d+\s+)?[a-z][\w.]*\s+(%[\w.]+),\s*(.*);", line)
            if m and m.group(1) in frontier:
                sources |= set(re.findall(r"%[a-z]+[\w.]*", m.group(2)))
        frontier = sources - found
        found |= sources
        if not frontier:
            break
    return found


def _is_early(src, flag: str = "EARLY") -> bool:
    """Is a compile's EARLY (or other `flag`) constexpr true (an ASTSource's constants, keyed by name or by
    (index,))?"""
    names = src.fn.arg_names
    for key, value in getattr(src, "constants", {}).items():
        name = key if isinstance(key, str) else names[key[0]] if len(key) == 1 else None
        if name == flag and value:
            return True
    return False


if __name__ == "__main__":
    import triton
    import triton.language as tl

    forced = sys.argv[1] == "on"
    pdl.PDL = tl.constexpr(forced)   # read by pdl_start when a kernel compiles
    seen: list = []
    real_compile = triton.compile

    def checked_compile(*args, **kwargs):
        compiled = real_compile(*args, **kwargs)
        if args[0].fn.fn.__name__.endswith("_kernel"):   # not a helper compiled alone (test_fused_compile.lora_loads)
            _check_ptx(compiled.asm["ptx"], forced, seen, early=_is_early(args[0]) or _is_early(args[0], "PREFETCH"),
                       after_gemm=_is_early(args[0], "AFTER_GEMM"))
        return compiled

    triton.compile = checked_compile
    import compile_kernels
    import test_attention_compile
    import test_fused_compile
    if sys.argv[2] == "fused":   # off: these suffice (the other compile tests build every kernel that way)
        for name, build in test_fused_compile.KERNELS.items():
            build("bf16", 90)
        if forced:
            for kind in ("shrink", "expand"):
                getattr(compile_kernels, kind)("bf16", 16)
    else:
        for kind in test_attention_compile.KINDS:
            test_attention_compile.compile_kind(90, "bf16", kind)
    print("checked", len(seen), "early", seen.count(2), "after_gemm", seen.count(3))
