"""`skinny_linear`: y = x @ wᵀ (+ bias) for decode steps of up to MAX_ROWS rows, one Triton launch
(skinny_gemm_kernels.py states the exact sums). Not used by the model yet: benchmarks/bench_skinny_gemm.py
times it against `torch.nn.functional.linear` (cuBLAS) at Llama's projection shapes first.

Split-K launches need an fp32 workspace and a counter per column tile. Both are allocated on the first call
for a (device, split, rows tile, N) shape and kept, so CUDA graphs can capture the same buffers; a first call
inside a capture is refused (run one eagerly first, as the engine's warm-up does). Launches that share a
shape must not run concurrently on two streams.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .launch import Launcher
from .skinny_gemm_kernels import _skinny_gemm_kernel

MAX_ROWS = 64
_KERNEL = Launcher(_skinny_gemm_kernel)
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


def _block_m(rows: int) -> int:
    return max(16, 1 << (rows - 1).bit_length())


def _buffers(device: torch.device, split: int, block_m: int, n: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, split, block_m, n)
    got = _WORKSPACES.get(key)
    if got is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"skinny_linear: no workspace yet for split {split}, {block_m} rows, N = {n}, and a "
                               f"CUDA graph is being captured; run the same shape once before capturing")
        got = (torch.empty(split, block_m, n, dtype=torch.float32, device=device),
               torch.zeros(tiles, dtype=torch.int32, device=device))
        _WORKSPACES[key] = got
    return got


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
    for name, t in (("x", x), ("weight", weight), ("out", out)):
        if t.stride(1) != 1:
            raise ValueError(f"skinny_linear: {name} must have unit stride along its last dimension")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(M, N) if bias is not None else torch.zeros_like(out))
    if config is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        config = pick_config(N, K, sms)
    block_m = _block_m(M)
    # each split a whole number of K tiles; fewer splits where K has fewer tiles than splits
    k_tiles = -(-K // config.block_k)
    split = min(config.split_k, k_tiles)
    k_per_split = -(-k_tiles // split) * config.block_k
    split = -(-K // k_per_split)
    tiles = -(-N // config.block_n)
    part, count = _buffers(x.device, split, block_m, N, tiles) if split > 1 else (out, out)
    args = (x, weight, bias if bias is not None else out, out, part, count, M, N, K, k_per_split, x.stride(0),
            weight.stride(0), out.stride(0))
    consts = dict(HAS_BIAS=bias is not None, SPLIT_K=split, EVEN_N=N % config.block_n == 0,
                  EVEN_K=K % config.block_k == 0, IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
                  BLOCK_N=config.block_n, BLOCK_K=config.block_k)
    _KERNEL((tiles, split), args, consts, config.warps, config.stages)
    return out
