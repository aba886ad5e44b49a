"""`skinny_lora_linear`: a decode projection and its LoRA in one launch (skinny_lora_kernels.py states the sums).

    y = x @ wᵀ (+ bias) + [for each row with an adapter: scaling · (x @ Aᵀ) @ Bᵀ, per slice of y's columns]

for up to MAX_ROWS rows, 1 to 3 slices (q/k/v, gate/up, o or down), the adapters in the pool's stacks (A
[slots, R, K], B [slots, N_i, R], ranks and scalings per slot) and the rows' slots in a `LoraBatch`. It
replaces skinny_gemm's GEMM plus the SGMV shrink and expand (or their fusions into the ops around) in decode
forwards: `applies` says where it can run. The LoRA programs (`lora_programs`) take the program slots the GEMM's
tiles leave, at most one per SM, so that all of them run at once (they wait for each other).

LORAPLEX_SKINNY_LORA: "on" makes it the model's path for Triton forwards of up to skinny_gemm.DECODE_MAX_ROWS
rows where skinny_gemm takes the model's dtype and GPU (ops/overlap.lora_path: "gemm-lora"; projections it does
not apply to take the SGMV kernels after the GEMM); "off", the default, keeps the paths of ops/overlap.py.
Measured on an H200 (2026-12-02, benchmarks/NOTES.md, results/skinny_lora_v{2,3}.json): slower than those paths
(Llama-2-7B decode forwards at 32 distinct adapters 8.9-11.1 ms against 7.3), the expand being the cost.

Workspace per (device, BLOCK_R, N): fp32 v [3, MAX_ROWS, BLOCK_R], the fp32 products [MAX_ROWS, N] and four
counters, allocated on first use and kept (CUDA graphs capture them; a first call inside a capture is refused).
Launches must not run concurrently on two streams.
"""
from __future__ import annotations

import torch

from ...env_switch import env_switch
from . import skinny as skinny_gemm
from ..lora.batch import LoraBatch
from .skinny import SkinnyConfig

SETTING = env_switch("LORAPLEX_SKINNY_LORA", "off", on="on", off="off")
MAX_ROWS = skinny_gemm.MAX_ROWS
MAX_SLICES = 3
_KERNEL = []
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def config_for(weight: torch.Tensor) -> SkinnyConfig:
    """skinny_gemm's tiles for the weight's shape (tuned or picked)."""
    config = skinny_gemm.CONFIGS.get(tuple(weight.shape))
    if config is None:
        config = skinny_gemm._picked(weight.shape[0], weight.shape[1],
                                     weight.device.index if weight.is_cuda else None)
    return config


def used_for(rows: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Does a Triton forward of `rows` rows of a model of this dtype on this device take the "gemm-lora" path
    (LORAPLEX_SKINNY_LORA on, and skinny_gemm taking its projections)?"""
    return SETTING == "on" and 0 < rows <= skinny_gemm.DECODE_MAX_ROWS and skinny_gemm.takes(dtype, device)


def applies(x: torch.Tensor, weight: torch.Tensor, widths: list[int] | tuple[int, ...]) -> bool:
    """Can the model take `skinny_lora_linear` for this projection: skinny_gemm would run it (its dtypes, rows and
    GPUs, LORAPLEX_SKINNY_GEMM), 1 to 3 slices, and every slice a whole number of the tiles' columns (a tile
    expands from one slice's B)."""
    if not skinny_gemm._skinny_ok(x, weight) or not 1 <= len(widths) <= MAX_SLICES:
        return False
    block_n = config_for(weight).block_n
    return sum(widths) == weight.shape[0] and all(n % block_n == 0 for n in widths)


def shrink_block_k(config: SkinnyConfig, block_m: int, tile_m: int, block_r: int) -> int:
    """The shrink's K step: the widest power of two (32 to 1024) whose [tile_m + block_r, step] stage takes no
    more shared memory than the GEMM's [block_n + block_m, block_k] one, so the launch needs no more than the GEMM
    alone (Triton reuses the main loop's buffers after it). Wide steps keep more of A in flight: a LoRA program
    streams several adapters' A alone."""
    room = (config.block_n + block_m) * config.block_k // (tile_m + block_r)
    return max(32, min(1024, 1 << (max(room, 1).bit_length() - 1)))


def _block_r(R: int) -> int:
    return max(16, 1 << (R - 1).bit_length())


def _workspace(device: torch.device, block_r: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(v [3, MAX_ROWS, block_r] fp32, the products [MAX_ROWS, n] fp32, four zeroed counters) for launches of
    width n."""
    key = (device, block_r, n)
    got = _WORKSPACES.get(key)
    if got is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"skinny_lora_linear: no workspace yet for {n} columns on this device, and a CUDA graph "
                               f"is being captured; run the same shape once before capturing")
        got = (torch.empty(MAX_SLICES, MAX_ROWS, block_r, dtype=torch.float32, device=device),
               torch.empty(MAX_ROWS, n, dtype=torch.float32, device=device),
               torch.zeros(4, dtype=torch.int32, device=device))
        _WORKSPACES[key] = got
    return got


def lora_programs(tiles: int, config: SkinnyConfig, block_m: int, x: torch.Tensor) -> int:
    """The LoRA programs of a launch: the program slots the GEMM's tiles leave free (by the GEMM's shared memory,
    at most 4 programs an SM), at least 1 and at most one per SM, so that all of them run at once whatever the
    kernel's real occupancy (they wait for each other); one in Triton's interpreter, which runs programs one
    after another."""
    if not x.is_cuda:
        return 1
    from ..lora.sgmv import _sm_count   # (sgmv imports Triton: only where the kernel runs)
    limit = skinny_gemm._shared_limit(x.device.index)
    per_sm = max(1, min(4, limit // max(1, skinny_gemm.shared_bytes(config, block_m, x.element_size()))))
    sms = _sm_count(x.device.index)
    return max(1, min(sms, sms * per_sm - tiles))


def skinny_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: list[torch.Tensor],
                       lora_b: list[torch.Tensor], batch: LoraBatch, ranks: list[torch.Tensor],
                       scalings: list[torch.Tensor], *, out: torch.Tensor | None = None,
                       config: SkinnyConfig | None = None, parts: int = 7) -> torch.Tensor:
    """y = x @ weightᵀ (+ bias) + each row's LoRA product, slice i of y's columns from lora_a[i] and lora_b[i]
    (see the module docstring); `out` [M, N] or a new tensor. `parts` < 7 leaves parts out, to time them apart
    (the kernel's PARTS; benchmarks/bench_skinny_lora.py): not the op."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"skinny_lora_linear: x and weight must be 2-D, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    S = len(lora_a)
    if weight.shape[1] != K:
        raise ValueError(f"skinny_lora_linear: x has K = {K} columns but weight {tuple(weight.shape)} has "
                         f"{weight.shape[1]}")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"skinny_lora_linear: x has {M} rows; expected 1 to MAX_ROWS = {MAX_ROWS}")
    if not 1 <= S <= MAX_SLICES or not len(lora_b) == len(ranks) == len(scalings) == S:
        raise ValueError(f"skinny_lora_linear: expected 1 to {MAX_SLICES} slices with one lora_a, lora_b, ranks and "
                         f"scalings each, got {len(lora_a)}, {len(lora_b)}, {len(ranks)}, {len(scalings)}")
    if batch.num_rows != M:
        raise ValueError(f"skinny_lora_linear: the LoraBatch covers {batch.num_rows} rows, x has {M}")
    slots, R = lora_a[0].shape[0], lora_a[0].shape[1]
    widths = [b.shape[1] if b.dim() == 3 else -1 for b in lora_b]
    for i, (a, b) in enumerate(zip(lora_a, lora_b)):
        if tuple(a.shape) != (slots, R, K) or tuple(b.shape) != (slots, widths[i], R):
            raise ValueError(f"skinny_lora_linear: slice {i}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)}; "
                             f"expected [{slots}, {R}, {K}] and [{slots}, N_{i}, {R}]")
        if not (a.is_contiguous() and b.is_contiguous()):
            raise ValueError(f"skinny_lora_linear: slice {i}: lora_a and lora_b must be contiguous")
        for name, t in (("lora_a", a), ("lora_b", b)):
            if t.dtype != weight.dtype or t.device != x.device:
                raise ValueError(f"skinny_lora_linear: slice {i}: {name} is {t.dtype} on {t.device}, weight "
                                 f"{weight.dtype} on {x.device}")
        if tuple(ranks[i].shape) != (slots,) or tuple(scalings[i].shape) != (slots,):
            raise ValueError(f"skinny_lora_linear: slice {i}: ranks and scalings must have one entry per slot "
                             f"({slots})")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"skinny_lora_linear: bias has shape {tuple(bias.shape)}, expected ({N},)")
    if sum(widths) != N:
        raise ValueError(f"skinny_lora_linear: the slices' widths {widths} do not add up to the weight's {N} rows")
    if config is None:
        config = config_for(weight)
    block_m = skinny_gemm._block_m(M)
    if x.is_cuda:   # fp32: the shrink and expand buffers took up to a third more than the GEMM's (sm_90 compiles)
        limit = skinny_gemm._shared_limit(x.device.index)
        config = skinny_gemm.fit_config(config, block_m, x.element_size(),
                                        limit // 2 if x.dtype == torch.float32 else limit)
    if any(n % config.block_n for n in widths):
        raise ValueError(f"skinny_lora_linear: slice widths {widths} are not multiples of the tiles' {config.block_n} "
                         f"columns (see `applies`)")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"skinny_lora_linear: out must be [{M}, {N}] {x.dtype} with unit column stride")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and (t.stride(-1) != 1 or t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"skinny_lora_linear: {name} must be {x.dtype} on {x.device} with unit last stride")
    block_r = _block_r(R)
    part, delta, count = _workspace(x.device, block_r, N)
    tiles = -(-N // config.block_n)
    units = batch.num_work * S
    programs = lora_programs(tiles, config, block_m, x)
    pad = MAX_SLICES - S
    args = (x, weight, bias if bias is not None else out, out, part, delta, count, batch.row_slot, batch.sorted_rows,
            batch.work_slot, batch.work_start, batch.work_end, *lora_a, *[lora_a[0]] * pad, *lora_b,
            *[lora_b[0]] * pad, *ranks, *[ranks[0]] * pad, *scalings, *[scalings[0]] * pad,
            *widths, *[0] * pad, units, programs, tiles, M, N, K, R, x.stride(0), weight.stride(0), out.stride(0),
            part.stride(0), part.stride(1))
    ieee = x.dtype == torch.float32
    step = shrink_block_k(config, block_m, batch.block_m, block_r)
    consts = dict(NUM_SLICES=S, HAS_BIAS=bias is not None, EVEN_N=N % config.block_n == 0,
                  EVEN_K=K % config.block_k == 0,
                  SHRINK_EVEN_K=K % step == 0, IEEE=ieee,
                  BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, TILE_M=batch.block_m,
                  BLOCK_R=block_r, SHRINK_BLOCK_K=step,
                  CHUNK=max(1, 64 // block_r), PARTS=parts)
    if not _KERNEL:
        from ..launch import Launcher
        from .skinny_lora_kernels import _skinny_lora_kernel
        _KERNEL.append(Launcher(_skinny_lora_kernel))
    _KERNEL[0]((programs + tiles,), args, consts, config.warps, config.stages)
    return out
