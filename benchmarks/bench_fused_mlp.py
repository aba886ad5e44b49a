"""Probe of the persistent decode layer's lead (docs/design-notes.md, "Open leads"): a layer's FP8 MLP at decode
rows as one persistent launch, against today's four (the gate/up W8A8 GEMM, SiLU-and-mul, down's quantize launch,
the down W8A8 GEMM), from the same e4m3 rows of x. Not the model's path: a kernel to time before building one.

The fused kernel's semantics, for rows m < M (≤ 64), xq e4m3 [M, H] with row scales sx, gate/up e4m3 [2I, H] and
down e4m3 [H, I] with a scale per output column (sg, sd), groups of GROUP columns of h:

    g[m, n] = sx[m] · sg[n] · Σ_k xq[m, k] · wg[n, k]          u[m, n]: the same over rows I + n
    h[m, n] = silu(g[m, n]) · u[m, n]                           (fp32, no rounding to the model's dtype)
    s[m, j] = max_{n in group j} |h[m, n]| / 448 (1 where 0),   hq[m, n] = e4m3(h[m, n] / s[m, j])
    y[m, c] = round(sd[c] · Σ_j s[m, j] · Σ_{n in group j} hq[m, n] · wd[c, n])

One program an SM walks the gate/up groups first (each writes its hq columns and scales, then counts itself done;
or a group's sums in K parts, which more programs share, the last part to finish adding them in their order), then
down's tiles of BN_B rows, each after the count shows every group written: no kernel boundary, no launch of
SiLU-and-mul or of the quantize kernel, and down's weight asked of L2 before the wait (as the decode GEMMs do before
their PDL wait). Every program must be resident at once (a grid of at most the SM count, one program an SM fits),
which the interpreter's one-program-at-a-time grid is not: the CPU run takes one program, which does every item.

    python benchmarks/bench_fused_mlp.py --out benchmarks/results/fused_mlp.json --md benchmarks/results/fused_mlp.md
    TRITON_INTERPRET=1 python benchmarks/bench_fused_mlp.py --smoke   # toy shapes on the CPU, no timing
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from loraplex import envs  # noqa: E402
from loraplex.ops.fused.api import silu_and_mul  # noqa: E402
from loraplex.ops.e4m3 import to_e4m3  # noqa: E402
from loraplex.ops.gemm.fp8 import Fp8Matrix, linear, quantize_rows, quantizes_x  # noqa: E402
from loraplex.ops.gemm.kernels import prefetch_rows  # noqa: E402
from loraplex.ops.gemm.quantized_rows import QuantizedRows  # noqa: E402
from loraplex.ops.launch import Launcher, num_sms  # noqa: E402
from loraplex.ops.pdl import pdl_start  # noqa: E402

SHAPES = {"Llama-2-7B": (4096, 11008), "Llama-3-8B": (4096, 14336)}   # hidden H, intermediate I
ROWS, BN_B = "32,64", 32   # (64 rows: h's rows 32-63 stored by the second warp)
# (group, K parts): 86 groups of 128 columns for 132 SMs (Llama-2-7B), 172 of 64, 258 parts of 128
VARIANTS = ((128, 1), (64, 1), (128, 3))
ROTATION_BYTES = 600 << 20


@triton.jit
def _fused_mlp_kernel(xq_ptr, sx_ptr, wgu_ptr, sgu_ptr, wd_ptr, sd_ptr, hq_ptr, hs_ptr, y_ptr, part_ptr, count_ptr,
                      M, H, I, num_programs, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr,
                      BN_B: tl.constexpr, KSPLIT: tl.constexpr, PREFETCH: tl.constexpr):
    pdl_start()   # ops/pdl.py: wait for the grids before this one first
    pid = tl.program_id(0)
    n_groups = I // GROUP
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    sx = tl.load(sx_ptr + offs_m, mask=m_mask, other=0.0)
    for item in range(pid, n_groups * KSPLIT, num_programs):   # (group, K part): KSPLIT parts of each group's sums
        _gate_up_part(xq_ptr, sx, wgu_ptr, sgu_ptr, hq_ptr, hs_ptr, part_ptr, count_ptr, offs_m, m_mask, item, H, I,
                      n_groups, BLOCK_M, GROUP, BK, KSPLIT)
    b_pid = num_programs - 1 - pid   # down's tiles from the last program: those without gate/up items start first
    if b_pid < H // BN_B:
        if PREFETCH > 0:   # this program's first rows of down into L2 while the groups finish
            prefetch_rows(wd_ptr, b_pid * BN_B + tl.arange(0, BN_B), H, I, 0, I, PREFETCH, 128)
        while tl.atomic_add(count_ptr, 0, sem="acquire") < n_groups:
            pass
        for t in range(b_pid, H // BN_B, num_programs):
            _down_rows(hq_ptr, hs_ptr, wd_ptr, sd_ptr, y_ptr, offs_m, m_mask, t, H, I, n_groups, BLOCK_M, GROUP,
                       BN_B)
    if tl.atomic_add(count_ptr + 1, 1, sem="acq_rel") == num_programs - 1:   # the last one out resets the counts
        tl.atomic_xchg(count_ptr, 0)
        tl.atomic_xchg(count_ptr + 1, 0)


@triton.jit
def _gate_up_part(xq_ptr, sx, wgu_ptr, sgu_ptr, hq_ptr, hs_ptr, part_ptr, count_ptr, offs_m, m_mask, item, H, I,
                  n_groups, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, KSPLIT: tl.constexpr):
    """K part `item % KSPLIT` of group `item // KSPLIT`'s gate and up sums; the group's last part to finish adds the
    parts in their order (each stored in part_ptr first, so the sum does not depend on which finishes last), writes
    the group's h (`_store_group`) and counts the group done in count_ptr[0]; its own count (count_ptr[2 + j]) it
    leaves at zero again."""
    j = item // KSPLIT
    p = item % KSPLIT
    offs_n = j * GROUP + tl.arange(0, GROUP)
    acc_g = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
    steps = H // BK   # part p: K steps [p · steps / KSPLIT, (p + 1) · steps / KSPLIT)
    for k in range(p * steps // KSPLIT * BK, (p + 1) * steps // KSPLIT * BK, BK):
        offs_k = k + tl.arange(0, BK)
        x = tl.load(xq_ptr + offs_m.to(tl.int64)[:, None] * H + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        wg = tl.load(wgu_ptr + offs_n.to(tl.int64)[:, None] * H + offs_k[None, :])
        wu = tl.load(wgu_ptr + (I + offs_n).to(tl.int64)[:, None] * H + offs_k[None, :])
        acc_g += tl.dot(x, tl.trans(wg), max_num_imprecise_acc=BK)   # (each step's e4m3 sum added in fp32)
        acc_u += tl.dot(x, tl.trans(wu), max_num_imprecise_acc=BK)
    if KSPLIT == 1:
        _store_group(acc_g, acc_u, sx, sgu_ptr, hq_ptr, hs_ptr, offs_m, m_mask, offs_n, j, I, n_groups)
        tl.debug_barrier()   # every thread's stores before the one thread's release (Triton 3.6 does not add it)
        tl.atomic_add(count_ptr, 1, sem="release")
    else:
        tile = offs_m[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        parts = part_ptr + j.to(tl.int64) * (KSPLIT * 2 * BLOCK_M * GROUP)
        tl.store(parts + (2 * p) * BLOCK_M * GROUP + tile, acc_g, mask=m_mask[:, None])
        tl.store(parts + (2 * p + 1) * BLOCK_M * GROUP + tile, acc_u, mask=m_mask[:, None])
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + 2 + j, 1, sem="acq_rel") == KSPLIT - 1:
            sum_g = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
            sum_u = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
            for q in range(KSPLIT):
                sum_g += tl.load(parts + (2 * q) * BLOCK_M * GROUP + tile, mask=m_mask[:, None], other=0.0,
                                 cache_modifier=".cg")
                sum_u += tl.load(parts + (2 * q + 1) * BLOCK_M * GROUP + tile, mask=m_mask[:, None], other=0.0,
                                 cache_modifier=".cg")
            _store_group(sum_g, sum_u, sx, sgu_ptr, hq_ptr, hs_ptr, offs_m, m_mask, offs_n, j, I, n_groups)
            tl.atomic_xchg(count_ptr + 2 + j, 0)
            tl.debug_barrier()
            tl.atomic_add(count_ptr, 1, sem="release")


@triton.jit
def _store_group(acc_g, acc_u, sx, sgu_ptr, hq_ptr, hs_ptr, offs_m, m_mask, offs_n, j, I, n_groups):
    """Group j's h from its gate and up sums (the docstring's g, u, h, s and hq), stored: hq [M, I] e4m3, s into
    hs [M, n_groups]."""
    g = acc_g * sx[:, None] * tl.load(sgu_ptr + offs_n)[None, :]
    u = acc_u * sx[:, None] * tl.load(sgu_ptr + I + offs_n)[None, :]
    h = g / (1.0 + tl.exp(-g)) * u
    amax = tl.max(tl.abs(h), axis=1)
    s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    q = to_e4m3(tl.math.div_rn(h, s[:, None]))
    tl.store(hq_ptr + offs_m.to(tl.int64)[:, None] * I + offs_n[None, :], q, mask=m_mask[:, None])
    tl.store(hs_ptr + offs_m * n_groups + j, s, mask=m_mask)


@triton.jit
def _down_rows(hq_ptr, hs_ptr, wd_ptr, sd_ptr, y_ptr, offs_m, m_mask, t, H, I, n_groups, BLOCK_M: tl.constexpr,
               GROUP: tl.constexpr, BN_B: tl.constexpr):
    """y's columns t · BN_B on (the docstring's y), hq and its scales read from L2 (`.cg`: written by this launch)."""
    offs_c = t * BN_B + tl.arange(0, BN_B)
    acc = tl.zeros((BLOCK_M, BN_B), dtype=tl.float32)
    for j in range(0, n_groups):
        offs_k = j * GROUP + tl.arange(0, GROUP)
        h = tl.load(hq_ptr + offs_m.to(tl.int64)[:, None] * I + offs_k[None, :], mask=m_mask[:, None], other=0.0,
                    cache_modifier=".cg")
        s = tl.load(hs_ptr + offs_m * n_groups + j, mask=m_mask, other=0.0, cache_modifier=".cg")
        w = tl.load(wd_ptr + offs_c.to(tl.int64)[:, None] * I + offs_k[None, :])
        acc += tl.dot(h, tl.trans(w), max_num_imprecise_acc=GROUP) * s[:, None]
    y = acc * tl.load(sd_ptr + offs_c)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * H + offs_c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None])


_FUSED = Launcher(_fused_mlp_kernel)


def fused_mlp(xq: torch.Tensor, sx: torch.Tensor, gate_up: Fp8Matrix, down: Fp8Matrix, counts: torch.Tensor,
              programs: int, dtype: torch.dtype = torch.bfloat16, group: int = 128, ksplit: int = 1, bk: int = 128,
              warps: int = 4, stages: int = 3) -> torch.Tensor:
    """y [M, H] of the module docstring (groups of `group` columns, also down's K step; each group's gate/up sums in
    `ksplit` parts of K, so that more programs share them) in one launch of `programs` programs (all resident at once
    on a GPU; 1 in the interpreter); `counts`: int32 zeros, 2 + I / group of them, left zero again by the launch."""
    M, H = xq.shape
    I = down.shape[1]
    if gate_up.shape != (2 * I, H) or down.shape != (H, I) or gate_up.block[0] != 1 or down.block[0] != 1 or \
            gate_up.scale.shape[1] != 1 or down.scale.shape[1] != 1:
        raise ValueError(f"fused_mlp: gate/up {tuple(gate_up.shape)} and down {tuple(down.shape)} with a scale per "
                         f"output column for x {tuple(xq.shape)}")
    if M > 64 or I % group or H % BN_B or H % bk or H // bk < ksplit:
        raise ValueError(f"fused_mlp: at most 64 rows, I a multiple of {group}, H of {BN_B} and {bk} with {ksplit} K "
                         f"steps at least; got {M}, {I}, {H}")
    if counts.dtype != torch.int32 or counts.numel() < 2 + I // group:
        raise ValueError(f"fused_mlp: counts must be int32 zeros, at least {2 + I // group} of them")
    hq = torch.empty(M, I, dtype=torch.float8_e4m3fn, device=xq.device)
    hs = torch.empty(M, I // group, dtype=torch.float32, device=xq.device)
    y = torch.empty(M, H, dtype=dtype, device=xq.device)
    part = torch.empty(I // group * ksplit * 2 * 64 * group if ksplit > 1 else 1, dtype=torch.float32,
                       device=xq.device)
    prefetch = 512 if _FUSED.compiles and xq.is_cuda else 0
    _FUSED((programs,), (xq, sx, gate_up.qweight, gate_up.scale, down.qweight, down.scale, hq, hs, y, part, counts,
                         M, H, I, programs),
           dict(BLOCK_M=64, GROUP=group, BK=bk, BN_B=BN_B, KSPLIT=ksplit, PREFETCH=prefetch), warps, stages)
    return y


def reference(xq, sx, gate_up: Fp8Matrix, down: Fp8Matrix, group: int = 128) -> torch.Tensor:
    """The module docstring's y in float64 (h's groups quantized as the kernel does, from float64 h)."""
    I = down.shape[1]
    x = xq.double() * sx.double().view(-1, 1)
    gu = x @ (gate_up.qweight.double() * gate_up.scale.double()).t()
    h = F.silu(gu[:, :I]) * gu[:, I:]
    groups = h.unflatten(1, (-1, group))
    amax = groups.abs().amax(dim=2, keepdim=True)
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    hq = (groups / s).float().to(torch.float8_e4m3fn).double() * s
    return hq.flatten(1) @ (down.qweight.double() * down.scale.double()).t()


def today(x: torch.Tensor, x_e4m3: QuantizedRows, gate_up: Fp8Matrix, down: Fp8Matrix) -> torch.Tensor:
    """The model's MLP at decode rows today (backbone, no adapters): four launches on Hopper (the CPU's reference
    path dequantizes the weights)."""
    h = silu_and_mul(linear(x, gate_up, x_e4m3=x_e4m3 if quantizes_x(x, gate_up) else None))
    return linear(h, down)


def weights(H: int, I: int, copies: int, device, gen) -> list[tuple[Fp8Matrix, Fp8Matrix]]:
    """`copies` (gate/up, down) pairs quantized a row from random bf16 weights (the same values in each copy)."""
    pairs = []
    for w in (torch.randn(2 * I, H, generator=gen, device=device) / H ** 0.5,
              torch.randn(H, I, generator=gen, device=device) / I ** 0.5):
        q, s = quantize_rows(w)
        pairs.append([Fp8Matrix(q.clone(), s.clone(), (1, w.shape[1])) for _ in range(copies)])
    return list(zip(*pairs))


def bench_shape(name: str, H: int, I: int, rows: int, device, gen, smoke: bool, copy_gbs: float | None) -> dict:
    """One shape: each of VARIANTS' fused launch against the float64 loop, today's launches against the same loop
    (their own roundings differ: bf16 h, a scale a row), and (on a GPU) µs a call of each in CUDA graphs over
    rotating weights."""
    if not smoke:
        from bench_lora_ops import graphed, time_us
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    copies = 1 if smoke else max(2, -(-ROTATION_BYTES // (3 * I * H)))
    pairs = weights(H, I, copies, device, gen)
    x = torch.randn(rows, H, generator=gen, device=device).to(dtype)
    xq, sx = quantize_rows(x)
    x_e4m3 = QuantizedRows(xq, sx)
    counts = torch.zeros(2 + I // min(g for g, _ in VARIANTS), dtype=torch.int32, device=device)
    row = dict(model=name, H=H, I=I, rows=rows, copies=copies, fused={})
    for group, ksplit in VARIANTS:
        programs = 1 if smoke else min(num_sms(device), max(I // group * ksplit, H // BN_B))
        ref = reference(xq, sx, *pairs[0], group)
        scale = ref.abs().max().item()
        if not smoke:   # another x first, so that the buffers the allocator hands back hold other values
            fused_mlp(*quantize_rows(-x), *pairs[0], counts, programs, dtype, group, ksplit)
        y = fused_mlp(xq, sx, *pairs[0], counts, programs, dtype, group, ksplit)
        if counts.any():
            raise RuntimeError(f"fused_mlp left its counts at {counts.tolist()}, not zero")
        if not torch.equal(y, fused_mlp(xq, sx, *pairs[0], counts, 1, dtype, group, ksplit)):
            raise RuntimeError(f"fused_mlp ({variant_name(group, ksplit)}): {programs} programs differ from one, "
                               "which does every item in order (a write another program read too early)")
        entry = row["fused"][variant_name(group, ksplit)] = dict(
            programs=programs, rel_err=(y.double() - ref).abs().max().item() / scale)
        if "today_rel_err" not in row:
            row["today_rel_err"] = (today(x, x_e4m3, *pairs[0]).double() - ref).abs().max().item() / scale
        if not smoke:
            entry["us"] = time_us([graphed(lambda p=p, g=group, k=ksplit: fused_mlp(xq, sx, *p, counts, programs,
                                                                                   dtype, g, k)) for p in pairs])
    if not smoke:
        row["today_us"] = time_us([graphed(lambda p=p: today(x, x_e4m3, *p)) for p in pairs])
        row["floor_us"] = 3 * I * H / copy_gbs / 1e3
    return row


def variant_name(group: int, ksplit: int) -> str:
    return f"groups of {group}" + (f", {ksplit} K parts" if ksplit > 1 else "")


def markdown(env: dict, rows: list[dict]) -> str:
    names = [variant_name(g, k) for g, k in VARIANTS]
    lines = [f"# A decode MLP in one persistent launch — {env['device']}, {env['date']}", "",
             f"torch {env['torch']}, Triton {env['triton']}; copy bandwidth {env.get('copy_gbs', 0):.0f} GB/s; "
             "µs a call in CUDA graphs over rotating weights (benchmarks/bench_fused_mlp.py). Today: the gate/up W8A8 "
             "GEMM, SiLU-and-mul, the quantize launch and the down W8A8 GEMM; fused: one launch, h quantized in groups "
             "of columns, gate/up's sums of a group in one program or in K parts; the floor: gate/up's and down's e4m3 "
             "bytes over the copy bandwidth. Errors: the largest against the float64 loop, over its largest value.", "",
             "| model | rows | floor | today | " + " | ".join(names) + " | error today / fused |",
             "|---|---:|---:|---:|" + "---:|" * len(names) + "---:|"]
    for r in rows:
        fused = [r["fused"][n] for n in names]
        cells = [f"{f.get('us', 0):.1f} ({f['programs']} programs)" for f in fused]
        lines.append(f"| {r['model']} | {r['rows']} | {r.get('floor_us', 0):.1f} | {r.get('today_us', 0):.1f} | "
                     + " | ".join(cells) + f" | {r['today_rel_err']:.1e} / {max(f['rel_err'] for f in fused):.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--rows", default=ROWS, help="decode rows, comma-separated (at most 64)")
    ap.add_argument("--smoke", action="store_true", help="toy shapes on the CPU, one program, no timing")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("bench_fused_mlp needs a CUDA GPU (or --smoke)")
    shapes = SHAPES if not args.smoke else {"toy": (3 * 128, 3 * 128)}
    env = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               date=datetime.date.today().isoformat(), torch=torch.__version__, triton=triton.__version__,
               settings=envs.snapshot())
    copy_gbs = None
    if not args.smoke:
        from bench_lora_ops import copy_bandwidth_gbs
        copy_gbs = env["copy_gbs"] = copy_bandwidth_gbs()
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, (H, I) in shapes.items():
        for m in args.rows.split(","):
            rows.append(bench_shape(name, H, I, int(m), device, gen, args.smoke, copy_gbs))
            print(json.dumps(rows[-1]), flush=True)   # each as it comes: a call cut short keeps the rows done
    if args.out:
        args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    if args.md:
        args.md.write_text(markdown(env, rows))
    bad = [(r["model"], r["rows"], g) for r in rows for g, f in r["fused"].items() if not f["rel_err"] <= 2e-2]
    if bad:
        raise SystemExit(f"the fused MLP is off the float64 loop by more than 2% of its largest value: {bad}")


if __name__ == "__main__":
    main()
