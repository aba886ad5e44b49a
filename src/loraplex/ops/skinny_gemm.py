"""`skinny_linear`: y = x @ wᵀ (+ bias) for decode steps of up to MAX_ROWS rows, one Triton launch
(skinny_gemm_kernels.py states the exact sums); `linear`, the model's projections: F.linear (cuBLAS), or
skinny_linear for forwards of up to DECODE_MAX_ROWS rows where LORAPLEX_SKINNY_GEMM=on (off by default: built
2026-12-02 for the backbone's decode step, whose cuBLAS GEMMs read the weights at ~0.84 of the copy bandwidth, and
not yet timed; benchmarks/bench_skinny_gemm.py times it against cuBLAS at Llama's projection shapes).

Split-K launches need an fp32 workspace [split, MAX_ROWS, N] and a counter per column tile. Both are allocated on
the first call for a (device, split, N) and kept, so CUDA graphs capture the same buffers; a first call inside a
capture is refused (the engine's graphs are each captured after an eager run of the same forward). Launches that
share a workspace must not run concurrently on two streams (a forward's projections run one after another).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..env_switch import env_switch

MAX_ROWS = 64
DECODE_MAX_ROWS = 32   # `linear` takes skinny_linear for forwards of at most this many rows
SETTING = env_switch("LORAPLEX_SKINNY_GEMM", "off", on="on", off="off")
_KERNEL = []   # its Launcher, made on first use: Triton is imported only where the kernel runs
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles and launch settings: each program streams a [block_n, K / split_k] block of w."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    warps: int = 4
    stages: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"SkinnyConfig.{name}={value}: expected a power of two of at least 16")
        if self.split_k < 1 or self.split_k > 16:
            raise ValueError(f"SkinnyConfig.split_k={self.split_k}: expected 1 to 16")
        if self.warps not in (1, 2, 4, 8) or self.stages < 1:
            raise ValueError(f"SkinnyConfig: warps={self.warps} (1, 2, 4 or 8), stages={self.stages} (≥ 1)")


def pick_config(n: int, k: int, sms: int) -> SkinnyConfig:
    """A first guess, before any GPU sweep: 64-column tiles, and K split until there are about two programs per
    SM, each streaming at least 1,024 of K (so a split carries ≥ 128 KB of a 16-bit w)."""
    tiles = -(-n // 64)
    split = 1
    while split < 8 and tiles * split < 2 * sms and k // (2 * split) >= 1024:
        split *= 2
    return SkinnyConfig(split_k=split)


@functools.lru_cache(maxsize=None)
def _picked(n: int, k: int, cuda_index: int | None) -> SkinnyConfig:
    """`pick_config` for a CUDA device's SM count (132, an H100/H200's, in the interpreter), once per shape."""
    sms = torch.cuda.get_device_properties(cuda_index).multi_processor_count if cuda_index is not None else 132
    return pick_config(n, k, sms)


def _block_m(rows: int) -> int:
    return max(16, 1 << (rows - 1).bit_length())


def _buffers(device: torch.device, split: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 partials [split, MAX_ROWS, n] and the zeroed counters (enough for 16-column tiles) of split
    launches of width n."""
    key = (device, split, n)
    got = _WORKSPACES.get(key)
    if got is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"skinny_linear: no workspace yet for split {split} and N = {n}, and a CUDA graph is "
                               f"being captured; run the same shape once before capturing")
        got = (torch.empty(split, MAX_ROWS, n, dtype=torch.float32, device=device),
               torch.zeros(-(-n // 16), dtype=torch.int32, device=device))
        _WORKSPACES[key] = got
    return got


def load_configs(path: str) -> dict[tuple[int, int], SkinnyConfig]:
    """Tuned configs per weight shape from a JSON file {"N,K": {SkinnyConfig's fields}} (bench_skinny_gemm.py's
    --configs-out); a malformed file is an error that names it and the entry."""
    import json
    from pathlib import Path
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"LORAPLEX_SKINNY_CONFIGS={path!r}: cannot read it as JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"LORAPLEX_SKINNY_CONFIGS={path!r}: expected an object of \"N,K\": config entries")
    configs = {}
    for key, fields in raw.items():
        try:
            n, k = (int(v) for v in key.split(","))
            configs[(n, k)] = SkinnyConfig(**fields)
        except (ValueError, TypeError) as e:
            raise ValueError(f"LORAPLEX_SKINNY_CONFIGS={path!r}: entry {key!r}: {e}") from e
    return configs


# Tuned configs per weight shape (N, K) (LORAPLEX_SKINNY_CONFIGS: a file bench_skinny_gemm.py wrote); others
# take `pick_config`.
CONFIGS: dict[tuple[int, int], SkinnyConfig] = (load_configs(os.environ["LORAPLEX_SKINNY_CONFIGS"])
                                                 if os.environ.get("LORAPLEX_SKINNY_CONFIGS") else {})


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; with LORAPLEX_SKINNY_GEMM=on, `skinny_linear` where x is 2-D with 1 to
    DECODE_MAX_ROWS rows, of w's float dtype, on CUDA (or in Triton's interpreter), with unit strides along K."""
    if _skinny_ok(x, weight):
        return skinny_linear(x, weight, bias, config=CONFIGS.get(tuple(weight.shape)))
    return F.linear(x, weight, bias)


def linear_into(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """y = `linear(x, weight, bias)` for 2-D x, into y (cuBLAS: the GEMM F.linear calls)."""
    if _skinny_ok(x, weight):
        skinny_linear(x, weight, bias, out=y, config=CONFIGS.get(tuple(weight.shape)))
    elif bias is None:
        torch.mm(x, weight.t(), out=y)
    else:
        torch.addmm(bias, x, weight.t(), out=y)


def _skinny_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does `linear` take skinny_linear for x (see its docstring)?"""
    return (SETTING == "on" and x.dim() == 2 and 0 < x.shape[0] <= DECODE_MAX_ROWS
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1 and (x.is_cuda or _interpreted()))


@functools.lru_cache(maxsize=1)
def _interpreted() -> bool:
    from .api import triton_interpreted   # fixed at import (TRITON_INTERPRET)
    return triton_interpreted()


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]ᵀ (+ bias [N]) into `out` [M, N] (new if None), M ≤ MAX_ROWS; every tensor of
    one float dtype on one device, unit stride along K and N."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"skinny_linear: x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"skinny_linear: x has K = {K} columns but weight {tuple(weight.shape)} has {weight.shape[1]}")
    if M > MAX_ROWS:
        raise ValueError(f"skinny_linear: x has {M} rows, more than MAX_ROWS = {MAX_ROWS}")
    tensors = {"x": x, "weight": weight, **({"bias": bias} if bias is not None else {}),
               **({"out": out} if out is not None else {})}
    for name, t in tensors.items():
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"skinny_linear: {name} is {t.dtype} on {t.device}, x {x.dtype} on {x.device}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"skinny_linear: dtype {x.dtype} is not float16, bfloat16 or float32")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"skinny_linear: bias has shape {tuple(bias.shape)}, expected ({N},)")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, N):
        raise ValueError(f"skinny_linear: out has shape {tuple(out.shape)}, expected ({M}, {N})")
    for name, t in (("x", x), ("weight", weight), ("out", out), ("bias", bias)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"skinny_linear: {name} must have unit stride along its last dimension")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(M, N) if bias is not None else torch.zeros_like(out))
    if config is None:
        config = _picked(N, K, x.device.index if x.is_cuda else None)
    block_m = _block_m(M)
    # each split a whole number of K tiles; fewer splits where K has fewer tiles than splits
    k_tiles = -(-K // config.block_k)
    split = min(config.split_k, k_tiles)
    k_per_split = -(-k_tiles // split) * config.block_k
    split = -(-K // k_per_split)
    tiles = -(-N // config.block_n)
    part, count = _buffers(x.device, split, N) if split > 1 else (out, out)
    args = (x, weight, bias if bias is not None else out, out, part, count, M, N, K, k_per_split, x.stride(0),
            weight.stride(0), out.stride(0))
    consts = dict(HAS_BIAS=bias is not None, SPLIT_K=split, EVEN_N=N % config.block_n == 0,
                  EVEN_K=K % config.block_k == 0, IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
                  BLOCK_N=config.block_n, BLOCK_K=config.block_k)
    if not _KERNEL:
        from .launch import Launcher
        from .skinny_gemm_kernels import _skinny_gemm_kernel
        _KERNEL.append(Launcher(_skinny_gemm_kernel))
    _KERNEL[0]((tiles, split), args, consts, config.warps, config.stages)
    return out
