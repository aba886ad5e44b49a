"""The attention kernels compile for Hopper (sm_90) and Ampere (sm_80) on a machine without a GPU.

Triton's CPU interpreter runs kernel logic but accepts code its compiler rejects (mismatched
types across a branch, a bf16 dot it cannot lower), so every variant the launchers pick is also
compiled here ahead of time, with the launchers' own constexprs and num_warps/num_stages, in a
subprocess without TRITON_INTERPRET (this session's kernels may be the interpreter's). The
subprocess is this file run as a script:

    TRITON_INTERPRET=0 python tests/test_attention_compile.py 90 bf16 prefill

The "fp8kv" family compiles the three kernels over float8 e4m3 caches (bf16, fp16 and fp32 activations) for Hopper:
Triton converts e4m3 from sm_89 on, so the engine refuses an FP8 KV cache on older GPUs. With bf16 the prompt tiles
convert by ops/e4m3.py's integer operations (E4M3_PTX), none through fp16; the decode tiles by the paired e4m3 → fp16
instruction into fp16 dots (F16_DOTS); with 16-bit q, no byte-wide shared-memory loads (V converted in its load's
layout), on Hopper and on sm_89 (Ada: its mma.sync reads the prompt kernel's V from registers too).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_fused_compile import rounds_by_conversion

pytestmark = pytest.mark.compile

ARCHS = [90, 80]
DTYPES = ["bf16", "fp16"]
KINDS = ["store", "prefill", "decode"]
FP8_KV = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}   # the caches' type in the fp8kv family
HEAD_DIMS = (16, 32, 64, 128, 256)
SM80_HEAD_DIMS = (64, 128)
PAGE = 16  # the system's default block size (a constexpr: each block size is its own variant)


def _signature(kernel, dtype: str, constexprs: dict, overrides: dict | None = None) -> dict:
    """Triton signature by argument name: tensors of the model's dtype, fp32 partials, int32 metadata."""
    overrides = overrides or {}
    types = {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "k_cache_ptr": dtype, "v_cache_ptr": dtype,
             "out_ptr": dtype, "part_o_ptr": "fp32", "part_ml_ptr": "fp32", "qk_scale": "fp32",
             "k_scale_ptr": "fp32", "v_scale_ptr": "fp32"}
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in overrides:
            sig[name] = overrides[name]
        elif name.endswith("_ptr"):
            sig[name] = "*" + types.get(name, "i32")
        else:
            sig[name] = types.get(name, "i32")
    return sig


# Arguments a real launch specializes as divisible by 16 (Triton's "D"): every pointer (torch's
# allocations, and the views the model passes, are 16-byte aligned) and the strides of q, out
# and the caches (multiples of head_dim). Without this, loads compile unvectorized and unpipelined:
# legal code, but not the code that runs.
ALIGNED_INTS = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_kt", "stride_vt",
                "stride_kh", "stride_vh", "chunk")
# Ints that are 1 in some batches (one sequence, one kv head, a one-column block table, window 1,
# one split): Triton then compiles them as constants, a variant of its own.
ONES = ("num_seqs", "window", "stride_bt", "num_q_heads", "num_splits", "num_kv_heads")


def _compile(kernel, dtype: str, constexprs: dict, num_warps: int, num_stages: int, arch: int,
             overrides: dict | None = None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = _signature(kernel, dtype, constexprs, overrides)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if sig[name].startswith("*") or name in ALIGNED_INTS}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


# The variants compiled: every head_dim with MHA (G = 1); GQA shapes where models use them
# (G = 4: Llama-3-8B, Mistral; G = 7, padded to 8: Qwen2-7B; G = 8: Llama-3-70B) and the
# sliding-window variant at the common head sizes. The block size (PAGE) is the system's default.
PREFILL_VARIANTS = ([(D, 1, 0) for D in HEAD_DIMS] + [(D, 4, w) for D in (64, 128) for w in (0, 4096)]
                    + [(128, 7, 4096), (128, 8, 0)])                      # (head_dim, G, sliding_window)
DECODE_VARIANTS = ([(D, 1, split) for D in HEAD_DIMS for split in (False, True)]
                   + [(D, 4, split) for D in (64, 128) for split in (False, True)] + [(128, 7, True)])  # (D, G, split)
# fp32 caches only serve tests and CPU-sized models: their (slow to compile) tf32x3 variants for Hopper.
FP32_PREFILL_VARIANTS = [(32, 1, 0), (128, 4, 4096), (256, 3, 0)]
FP32_DECODE_VARIANTS = [(32, 16, True), (128, 4, False), (256, 3, True)]
# Shared memory one program may use (bytes): a variant over it compiles but fails at launch.
SMEM_LIMIT = {90: 227 * 1024, 89: 99 * 1024, 80: 163 * 1024}
STORE_VARIANTS = [(D, Hkv, "i32") for D in HEAD_DIMS for Hkv in (8, 32)] + [(128, 8, "i64")]  # (D, Hkv, slot dtype)


def compile_kind(arch: int, dtype: str, kind: str) -> int:
    """Compile every listed variant of one kernel family with the launchers' settings; returns how many."""
    import torch

    from loraplex.ops.attention import kernels as ak
    from loraplex.ops.attention import launchers as al
    from loraplex.ops.attention import store_kernel as sk

    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    prefill_variants = FP32_PREFILL_VARIANTS if dtype == "fp32" else PREFILL_VARIANTS
    decode_variants = FP32_DECODE_VARIANTS if dtype == "fp32" else DECODE_VARIANTS
    if arch < 90:  # Ampere lowers every head_dim alike (mma.sync): the Llama sizes suffice there
        prefill_variants = [v for v in prefill_variants if v[0] in SM80_HEAD_DIMS]
        decode_variants = [v for v in decode_variants if v[0] in SM80_HEAD_DIMS]
    n = 0

    def build(kernel, consts: dict, num_warps: int, num_stages: int, overrides: dict | None = None) -> None:
        nonlocal n
        compiled = _compile(kernel, dtype, consts, num_warps, num_stages, arch, overrides)
        if compiled.metadata.shared > SMEM_LIMIT[arch]:
            raise RuntimeError(f"{kernel.fn.__name__} {consts} needs {compiled.metadata.shared} bytes of shared "
                               f"memory; sm_{arch} has {SMEM_LIMIT[arch]}")
        ptx = compiled.asm["ptx"]
        # a tile read from shared memory a byte at a time: V converted in the dot's layout, not in place
        if consts.get("FP8_KV") and dtype != "fp32" and re.search(r"ld\.shared(?:::cta)?(?:\.v[24])?\.[bsu]8\b", ptx):
            raise RuntimeError(f"{kernel.fn.__name__} {consts}: a tile read from shared memory a byte at a time")
        if consts.get("F16_DOTS"):
            if "cvt.rn.f16x2.e4m3x2" not in ptx or "fma.rn.bf16x2" in ptx or ".f16.f16" not in ptx:
                raise RuntimeError(f"{kernel.fn.__name__} {consts}: not fp16 dots on the paired conversion")
        elif consts.get("E4M3_PTX") and ("fma.rn.bf16x2" not in ptx or "cvt.bf16.f16" in ptx):
            raise RuntimeError(f"{kernel.fn.__name__} {consts}: an e4m3 tile converted by Triton, not ops/e4m3.py")
        elif consts.get("FP8") and not rounds_by_conversion(ptx):   # the store: ops/e4m3.py's to_e4m3
            raise RuntimeError(f"{kernel.fn.__name__} {consts}: k and v not rounded by the paired conversion")
        n += 1

    def with_ones(kernel, consts: dict) -> dict:
        return dict(consts, **{name: 1 for name in ONES if name in kernel.arg_names})

    if kind == "store":
        for D, Hkv, slot in STORE_VARIANTS:
            build(sk._store_kv_kernel, sk.store_kv_constexprs(Hkv, D), sk.STORE_WARPS, 1, {"slot_ptr": "*" + slot})
        build(sk._store_kv_kernel, with_ones(sk._store_kv_kernel, sk.store_kv_constexprs(1, 128)), sk.STORE_WARPS, 1,
              {"slot_ptr": "*i32"})
    elif kind == "prefill":
        for D, G, window in prefill_variants:
            cfg = al.prefill_config(D, tdtype)
            build(ak._prefill_kernel, al.prefill_constexprs(G, D, PAGE, window, tdtype, cfg), cfg.num_warps,
                  cfg.num_stages)
        cfg = al.PREFILL_CONFIGS[128]
        if dtype != "fp32":
            consts = with_ones(ak._prefill_kernel, al.prefill_constexprs(4, 128, PAGE, 1, tdtype, cfg))
            build(ak._prefill_kernel, consts, cfg.num_warps, cfg.num_stages)
    elif kind == "decode":
        def partials(split: bool) -> dict:  # without splits the launcher passes `out` for the unused partials
            return {} if split else {"part_o_ptr": "*" + dtype, "part_ml_ptr": "*" + dtype}

        for D, G, split in decode_variants:
            cfg = al.decode_config(D, tdtype)
            build(ak._decode_kernel, al.decode_constexprs(G, D, PAGE, split, tdtype, cfg), cfg.num_warps,
                  cfg.num_stages, partials(split))
        cfg = al.DECODE_CONFIGS[128]
        for split in (False, True) if dtype != "fp32" else ():
            consts = with_ones(ak._decode_kernel, al.decode_constexprs(4, 128, PAGE, split, tdtype, cfg))
            build(ak._decode_kernel, consts, cfg.num_warps, cfg.num_stages, partials(split))
        for D in HEAD_DIMS:
            for splits_pad in (2, 64):
                consts = dict(HEAD_DIM=D, SPLITS_PAD=splits_pad, BLOCK_N=al.decode_config(D, tdtype).block_n)
                build(ak._decode_reduce_kernel, consts, al.REDUCE_WARPS, 1)
        reduce_ones = with_ones(ak._decode_reduce_kernel, dict(HEAD_DIM=128, SPLITS_PAD=2,
                                                               BLOCK_N=al.decode_config(128, tdtype).block_n))
        build(ak._decode_reduce_kernel, reduce_ones, al.REDUCE_WARPS, 1)
    elif kind == "fp8kv":
        # the launchers' choice for compiled kernels and bf16 q: ops/e4m3.py's conversion for prompts, fp16 dots for
        # decode
        wanted = dtype == "bf16"
        cfg = al.decode_config(128, tdtype, fp8_kv=True)
        if al.prefill_constexprs(4, 128, PAGE, 0, tdtype, al.prefill_config(128, tdtype), fp8_kv=True)["E4M3_PTX"] \
                != wanted or al.decode_constexprs(4, 128, PAGE, False, tdtype, cfg, fp8_kv=True)["F16_DOTS"] != wanted:
            raise RuntimeError(f"fp8kv {dtype}: the launchers' E4M3_PTX or F16_DOTS is not {wanted}")
        for D, Hkv, narrow in ((128, 8, False), (64, 32, False), (128, 32, True)):   # narrow: decode steps' programs
            build(sk._store_kv_kernel, sk.store_kv_constexprs(Hkv, D, fp8=True, narrow=narrow), sk.STORE_WARPS, 1,
                  dict(FP8_KV, slot_ptr="*i64"))
        for D, G, window in [(128, 1, 0), (128, 4, 4096), (64, 4, 0)]:
            cfg = al.prefill_config(D, tdtype)
            build(ak._prefill_kernel, al.prefill_constexprs(G, D, PAGE, window, tdtype, cfg, fp8_kv=True),
                  cfg.num_warps, cfg.num_stages, FP8_KV)
        for D, G, split in [(128, 4, False), (128, 4, True), (128, 1, True), (64, 8, False), (32, 4, True),
                            (256, 2, False)]:
            cfg = al.decode_config(D, tdtype, fp8_kv=True)   # the 16-bit tiles' keys at 2 warps
            partials = {} if split else {"part_o_ptr": "*" + dtype, "part_ml_ptr": "*" + dtype}
            build(ak._decode_kernel, al.decode_constexprs(G, D, PAGE, split, tdtype, cfg, fp8_kv=True),
                  cfg.num_warps, cfg.num_stages, dict(FP8_KV, **partials))
    else:
        raise ValueError(f"unknown kernel family {kind!r}")
    return n


# (arch, dtype, kernel family) per subprocess; fp32 (tf32x3 dots) for Hopper only.
JOBS = [(arch, dtype, kind) for arch in ARCHS for dtype in DTYPES for kind in KINDS] + \
       [(90, "fp32", "prefill"), (90, "fp32", "decode"), (90, "bf16", "fp8kv"), (90, "fp16", "fp8kv"),
        (90, "fp32", "fp8kv"), (89, "bf16", "fp8kv")]


def _compile_in_subprocess(arch: int, dtype: str, kind: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="0")
    return subprocess.run([sys.executable, __file__, str(arch), dtype, kind], env=env, capture_output=True, text=True,
                          timeout=1200)


@pytest.fixture(scope="module")
def compile_jobs(request):
    """Start the selected jobs at once, one subprocess per CPU: compiling is most of this file's time."""
    wanted = [tuple(item.callspec.params[k] for k in ("arch", "dtype", "kind")) for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")]
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
    yield {job: pool.submit(_compile_in_subprocess, *job) for job in dict.fromkeys(wanted)}
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("arch, dtype, kind", JOBS, ids=[f"sm{a}-{d}-{k}" for a, d, k in JOBS])
def test_attention_kernels_compile(compile_jobs, arch, dtype, kind):
    proc = compile_jobs[(arch, dtype, kind)].result()
    assert proc.returncode == 0, proc.stderr[-4000:]


if __name__ == "__main__":
    arch_, dtype_, kind_ = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    print("compiled", compile_kind(arch_, dtype_, kind_), kind_, "variants for sm", arch_, dtype_)
