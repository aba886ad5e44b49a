"""`skinny_linear`: y = x @ wᵀ (+ bias) for decode steps of up to MAX_ROWS rows, one Triton launch
(kernels.py states the exact sums); `linear`, the model's projections: skinny_linear for forwards of
up to DECODE_MAX_ROWS rows on CUDA GPUs of compute capability 8.0 or more, else F.linear (cuBLAS).

LORAPLEX_SKINNY_GEMM (envs.py, read at import): "auto" (the default: as above, for fp16 and bf16 weights; F.linear
for fp32 weights and in Triton's interpreter, where the kernel is slow), "on" (fp32 weights too, and in the
interpreter: the CPU tests' way to run it in the model) or "off" (F.linear everywhere). Launches take fewer stages
or smaller tiles where a config would need more shared memory than the GPU has (`fit_config`).

Why the default: on an H200 at batch 32 a Llama-2-7B layer's four projections took 110.3 µs against cuBLAS's 117.6
(floor 94.9), and the decode forward in a CUDA graph 0.948× cuBLAS's time (0.968× with distinct adapters).
CONFIGS holds the tiles benchmarks/bench_skinny_gemm.py picked per weight shape (tuned_h200.json, or the file
LORAPLEX_SKINNY_CONFIGS names); other shapes take `pick_config`'s rule, drawn from the same sweep.

Split-K launches need an fp32 workspace [split, MAX_ROWS, N] and a counter per column tile. Both are allocated on
the first call for a (device, split, N) and kept, so CUDA graphs capture the same buffers; a first call inside a
capture is refused (the engine's graphs are each captured after an eager run of the same forward). Launches that
share a workspace must not run concurrently on two streams (a forward's projections run one after another).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ... import envs

MAX_ROWS = 64
DECODE_MAX_ROWS = 32   # `linear` takes skinny_linear for forwards of at most this many rows
SETTING = envs.triton_gemm()   # "auto", "on" or "off"
_KERNEL = []   # its Launcher, made on first use: Triton is imported only where the kernel runs
# With PDL, each program of the decode GEMMs (this one and fp8_kernels.py's) asks L2 for the first PREFETCH_BYTES of
# each of its weight rows before it waits for the kernel before it (kernels.py's prefetch_rows).
PREFETCH_BYTES = 512
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles and launch settings: each program streams a [block_n, K / split_k] block of w. `swap_ab` (the FP8
    kernel's, ops/gemm/fp8_kernels.py): x's rows, padded to 64, on the MMA's long side and w's block_n rows on its
    short one, so that tiles narrower than a wgmma's 64 rows make more programs."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    warps: int = 4
    stages: int = 4
    swap_ab: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"SkinnyConfig.{name}={value}: expected a power of two of at least 16")
        if self.split_k < 1 or self.split_k > 16:
            raise ValueError(f"SkinnyConfig.split_k={self.split_k}: expected 1 to 16")
        if self.warps not in (1, 2, 4, 8) or self.stages < 1:
            raise ValueError(f"SkinnyConfig: warps={self.warps} (1, 2, 4 or 8), stages={self.stages} (≥ 1)")
        if not isinstance(self.swap_ab, bool):
            raise ValueError(f"SkinnyConfig.swap_ab={self.swap_ab!r}: expected true or false")


def pick_config(n: int, k: int, sms: int) -> SkinnyConfig:
    """Tiles for a shape the sweep did not time, by what it found at Llama-2-7B's (H200, 24 configs): no K split
    (split launches were slower at every shape), 64-column tiles, and
    - at most one tile per SM (o's and down's 4,096 columns: 64 tiles): 256 of K a step in 4 stages, so each of
      the few programs keeps more bytes in flight;
    - more tiles: 128 of K a step, in 3 stages where three programs an SM then hold every tile in one wave
      (gate/up's 344 tiles: 45.2 µs against 48.5 in 4 stages, two programs an SM), else 4 stages."""
    tiles = -(-n // 64)
    if tiles <= sms:
        return SkinnyConfig(block_k=256, stages=4)
    return SkinnyConfig(block_k=128, stages=3 if 2 * sms < tiles <= 3 * sms else 4)


def shared_bytes(config: SkinnyConfig, block_m: int, elem_bytes: int, w_bytes: int | None = None) -> int:
    """An upper bound of a launch's shared memory: a [block_n, block_k] tile of w (`w_bytes` an element: 1 for
    ops/gemm/fp8.py's e4m3 weights; default `elem_bytes`) and a [block_m, block_k] tile of x per stage (Triton 3.6's
    count on sm_90 with 16-bit wgmma; elsewhere it keeps one stage fewer), checked by compiles for sm_90 and sm_80
    (test_fused_compile.py)."""
    return config.stages * (config.block_n * (w_bytes or elem_bytes) + block_m * elem_bytes) * config.block_k


def fit_config(config: SkinnyConfig, block_m: int, elem_bytes: int, limit: int,
               w_bytes: int | None = None) -> SkinnyConfig:
    """`config` with fewer stages (to 2), then shorter K steps (to 32), then narrower tiles (to 16) until
    `shared_bytes` is within `limit`: tiles tuned for an H200's 227 KiB at 16 bits and 32 rows also launch at 64
    rows, in fp32, and on GPUs of 99 KiB a block."""
    while shared_bytes(config, block_m, elem_bytes, w_bytes) > limit:
        if config.stages > 2:
            config = replace(config, stages=config.stages - 1)
        elif config.block_k > 32:
            config = replace(config, block_k=config.block_k // 2)
        elif config.block_n > 16:
            config = replace(config, block_n=config.block_n // 2)
        else:
            break   # (2 × 32 × (16 + 64) × 4 = 20 KiB: within every CUDA GPU's shared memory)
    return config


def launched_config(config: SkinnyConfig, rows: int, x: torch.Tensor, w_bytes: int | None = None) -> SkinnyConfig:
    """The config a launch for `rows` rows of x's dtype and device runs (w `w_bytes` an element, default x's):
    `config` fitted to the GPU's shared memory (as given in the interpreter, which has no such limit)."""
    if not x.is_cuda:
        return config
    return fit_config(config, tile_rows(config, rows), x.element_size(), _shared_limit(x.device.index), w_bytes)


WGMMA_ROWS = 64   # a Hopper wgmma's M; within MAX_ROWS, the rows split_buffers' partials hold


def tile_rows(config: SkinnyConfig, rows: int) -> int:
    """The height of x's tile (BLOCK_M) in a launch of `config` over `rows` rows: a power of two of at least 16, and
    at least WGMMA_ROWS with swap_ab (x's rows on a wgmma's long side)."""
    return max(WGMMA_ROWS, _block_m(rows)) if config.swap_ab else _block_m(rows)


@functools.lru_cache(maxsize=None)
def _shared_limit(cuda_index: int) -> int:
    """The shared memory a block may opt in to on that GPU (232,448 bytes on an H100/H200)."""
    props = torch.cuda.get_device_properties(cuda_index)
    return getattr(props, "shared_memory_per_block_optin", None) or props.shared_memory_per_block


@functools.lru_cache(maxsize=None)
def _picked(n: int, k: int, cuda_index: int | None) -> SkinnyConfig:
    """`pick_config` for a CUDA device's SM count (132, an H100/H200's, in the interpreter), once per shape."""
    sms = torch.cuda.get_device_properties(cuda_index).multi_processor_count if cuda_index is not None else 132
    return pick_config(n, k, sms)


def default_config(n: int, k: int, device: torch.device) -> SkinnyConfig:
    """The tiles of a weight of shape (n, k) on `device`: tuned (CONFIGS) or picked by `pick_config`."""
    return CONFIGS.get((n, k)) or _picked(n, k, device.index if device.type == "cuda" else None)


def block_m(rows: int) -> int:
    """The tile height of a launch for `rows` rows of x (a power of two of at least 16)."""
    return _block_m(rows)


def _block_m(rows: int) -> int:
    return max(16, 1 << (rows - 1).bit_length())


def split_plan(K: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits, K per split) of a launch: each split a whole number of K steps of block_k; fewer splits where K has
    fewer steps than split_k (this kernel's and fp8_kernels.py's)."""
    k_steps = -(-K // block_k)
    k_per_split = -(-k_steps // min(split_k, k_steps)) * block_k
    return -(-K // k_per_split), k_per_split


def split_buffers(device: torch.device, split: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 partials [split, MAX_ROWS, n] and the zeroed counters (enough for 16-column tiles) of split
    launches of width n (this kernel's and fp8_kernels.py's: launches on one stream take turns with them)."""
    key = (device, split, n)
    got = _WORKSPACES.get(key)
    if got is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-K GEMM: no workspace yet for split {split} and N = {n}, and a CUDA graph is "
                               f"being captured; run the same shape once before capturing")
        got = (torch.empty(split, MAX_ROWS, n, dtype=torch.float32, device=device),
               torch.zeros(-(-n // 16), dtype=torch.int32, device=device))
        _WORKSPACES[key] = got
    return got


def load_configs(path: str | Path, swap_ab: bool = False) -> dict[tuple[int, int], SkinnyConfig]:
    """Tuned configs per weight shape from a JSON file {"N,K": {SkinnyConfig's fields}} (bench_skinny_gemm.py's
    --configs-out; keys starting with "_" are notes, skipped); a malformed file is an error that names it and the
    entry, as is an entry with swap_ab unless `swap_ab` allows it (the FP8 kernel's files)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"LORAPLEX_SKINNY_CONFIGS={str(path)!r}: cannot read it as JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"LORAPLEX_SKINNY_CONFIGS={str(path)!r}: expected an object of \"N,K\": config entries")
    configs = {}
    for key, fields in raw.items():
        if key.startswith("_"):
            continue
        try:
            n, k = (int(v) for v in key.split(","))
            configs[(n, k)] = SkinnyConfig(**fields)
            if configs[(n, k)].swap_ab and not swap_ab:
                raise ValueError("swap_ab is the FP8 kernel's (ops/gemm/fp8.py); this GEMM does not take it")
        except (ValueError, TypeError) as e:
            raise ValueError(f"LORAPLEX_SKINNY_CONFIGS={str(path)!r}: entry {key!r}: {e}") from e
    return configs


# The sweep's fastest tiles at 32 rows per weight shape (N, K), bundled; LORAPLEX_SKINNY_CONFIGS replaces them.
TUNED_FILE = Path(__file__).with_name("tuned_h200.json")
TUNED: dict[tuple[int, int], SkinnyConfig] = load_configs(TUNED_FILE)
CONFIGS: dict[tuple[int, int], SkinnyConfig] = load_configs(envs.gemm_configs_path() or TUNED_FILE)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by `skinny_linear` where x is 2-D with 1 to DECODE_MAX_ROWS rows, of w's float
    dtype, with unit strides along K, on a CUDA GPU of compute capability 8.0 or more (16-bit dtypes with "auto",
    fp32 too with "on") or in Triton's interpreter ("on" only); see LORAPLEX_SKINNY_GEMM above."""
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


def takes_input(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does `linear(x, weight)` run skinny_linear's kernel (rather than F.linear)?"""
    return _skinny_ok(x, weight)


def _skinny_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does `linear` take skinny_linear for x (see its docstring)?"""
    if x.dim() != 2 or not 0 < x.shape[0] <= DECODE_MAX_ROWS or weight.dtype != x.dtype:
        return False
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return False
    return takes(x.dtype, x.device)


def takes(dtype: torch.dtype, device: torch.device) -> bool:
    """Does `linear` take skinny_linear for inputs of this dtype on this device (of a shape it takes)?"""
    if SETTING == "off" or dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if _interpreted():   # CPU tensors in Triton's interpreter
        return SETTING == "on"
    # "auto": 16-bit weights, as timed (fp32's products run on CUDA cores, not timed against cuBLAS)
    return device.type == "cuda" and (SETTING == "on" or dtype != torch.float32) and _capable(device.index)


@functools.lru_cache(maxsize=None)
def _capable(cuda_index: int | None) -> bool:
    """An NVIDIA GPU of compute capability 8.0 or more (bf16 and the MMA shapes of the kernel's tl.dot; tuned on
    Hopper)."""
    if torch.version.hip is not None:   # ROCm: the kernel and its tiles are NVIDIA's
        return False
    return torch.cuda.get_device_capability(cuda_index) >= (8, 0)


@functools.lru_cache(maxsize=1)
def _interpreted() -> bool:
    from ..lora.api import triton_interpreted   # fixed at import (TRITON_INTERPRET)
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
    if config.swap_ab:
        raise ValueError(f"skinny_linear: {config} has swap_ab, which only the FP8 kernel (ops/gemm/fp8.py) takes")
    block_m = _block_m(M)
    config = launched_config(config, M, x)
    split, k_per_split = split_plan(K, config.block_k, config.split_k)
    tiles = -(-N // config.block_n)
    part, count = split_buffers(x.device, split, N) if split > 1 else (out, out)
    args = (x, weight, bias if bias is not None else out, out, part, count, M, N, K, k_per_split, x.stride(0),
            weight.stride(0), out.stride(0))
    if not _KERNEL:
        from ..launch import Launcher
        from .kernels import _skinny_gemm_kernel
        _KERNEL.append(Launcher(_skinny_gemm_kernel))
    consts = dict(HAS_BIAS=bias is not None, SPLIT_K=split, EVEN_N=N % config.block_n == 0,
                  EVEN_K=K % config.block_k == 0, IEEE=x.dtype == torch.float32,
                  PREFETCH=prefetch_elements(weight, _KERNEL[0].compiles), BLOCK_M=block_m, BLOCK_N=config.block_n,
                  BLOCK_K=config.block_k)
    _KERNEL[0]((tiles, split), args, consts, config.warps, config.stages)
    return out


def prefetch_elements(weight: torch.Tensor, compiles: bool) -> int:
    """The decode GEMMs' PREFETCH constexpr for a weight of this element size: PREFETCH_BYTES of each row where PDL
    is on (a compiled kernel on a GPU), else 0 (no prefetch: without PDL there is nothing to overlap).
    PREFETCH_BYTES is 0 (none) or a power of two of at least 128 (whole 128-byte lines: kernels.py's prefetch_rows)."""
    from .. import pdl
    if PREFETCH_BYTES and (PREFETCH_BYTES < 128 or PREFETCH_BYTES & (PREFETCH_BYTES - 1)):
        raise ValueError(f"PREFETCH_BYTES must be 0 or a power of two of at least 128, got {PREFETCH_BYTES}")
    return PREFETCH_BYTES // weight.element_size() if pdl.PDL and compiles and weight.is_cuda else 0
