"""Which tiles ops/gemm/fp8.py's decode kernel (fp8_kernels.py) launches with: each GPU's tuned tiles per weight
shape, weight-only and W8A8, else a rule drawn from the dense kernel's, fitted to the GPU's shared memory."""
from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import torch

from . import skinny

# Tiles per weight shape from sweeps of the FP8 kernel, weight-only and W8A8 (bench_fp8_gemm.py --tuned-out), one
# file per kind and GPU swept: tuned_fp8[_w8a8]_<gpu>.json. A decode GEMM's best tiles follow the GPU's bandwidth
# (the bytes each program must keep in flight), so each swept GPU reads its own; GPUs no sweep ran on (a GH200 too,
# until one does) and shapes no sweep covered take the H100's, then `default_config`'s rule.
TUNED_GPUS = ("h100", "h200")
FALLBACK_GPU = "h100"
TUNED_FILES = {(kind, gpu): Path(__file__).with_name(f"tuned_fp8{suffix}_{gpu}.json")
               for kind, suffix in (("weight-only", ""), ("w8a8", "_w8a8")) for gpu in TUNED_GPUS}
TUNED: dict[tuple[str, str], dict[tuple[int, int], skinny.SkinnyConfig]] = {
    key: skinny.load_configs(path, swap_ab=True) for key, path in TUNED_FILES.items() if path.exists()}
MAX_BLOCK_K = 512


def fitted_config(config: skinny.SkinnyConfig, x: torch.Tensor) -> skinny.SkinnyConfig:
    """The tiles a launch on x (as the kernel reads it: e4m3 with W8A8) runs: `config` fitted to the GPU's shared
    memory. e4m3 tiles take a byte an element beside x's (fp32 x's products convert them to fp32 there)."""
    return skinny.launched_config(config, x.shape[0], x, w_bytes=1 if x.element_size() <= 2 else None)


def default_config(n: int, k: int, device: torch.device, w8a8: bool = False) -> skinny.SkinnyConfig:
    """The FP8 kernel's tiles for a weight of shape (n, k), weight-only or W8A8: tuned for `device`'s GPU or the
    fallback's (TUNED), else the dense kernel's for that shape with twice its K step (at most MAX_BLOCK_K), so that a
    step moves as many bytes as the dense tile's does; W8A8 at least 64 columns (a Hopper wgmma's rows: Triton converts
    narrower tiles' e4m3 operands to fp16 for mma.sync; tuned W8A8 tiles of 16 or 32 put x's rows there instead,
    swap_ab). A decode GEMM is bound by the bytes each program keeps in flight; with the dense tiles an e4m3 weight
    kept half as many and measured no faster than bf16 (a batch-32 Llama-2-7B decode step 1.12× the bf16 one, H100)."""
    kind = "w8a8" if w8a8 else "weight-only"
    for gpu in dict.fromkeys((tuned_gpu(device) or FALLBACK_GPU, FALLBACK_GPU)):
        tuned = TUNED.get((kind, gpu), {}).get((n, k))
        if tuned is not None:
            return tuned
    dense = skinny.default_config(n, k, device)
    wide = max(skinny.WGMMA_ROWS, dense.block_n) if w8a8 else dense.block_n
    return replace(dense, block_n=wide, block_k=min(2 * dense.block_k, MAX_BLOCK_K))


def tuned_gpu(device: torch.device) -> str | None:
    """Which of TUNED_GPUS `device` is, by its name (None: another GPU, or not a CUDA device; such devices read
    FALLBACK_GPU's tiles)."""
    if device.type != "cuda":
        return None
    return _tuned_gpu(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _tuned_gpu(cuda_index: int) -> str | None:
    name = torch.cuda.get_device_name(cuda_index).lower()
    return next((gpu for gpu in TUNED_GPUS if gpu in name.split()), None)
