"""The public LoRA operators: check arguments once, then run the Triton or the reference backend."""
from __future__ import annotations

import contextlib

import torch

from ... import envs
from . import reference
from .batch import LoraBatch
from .checks import TensorOrList, check_batch, check_slices, check_v, check_x, check_y

try:  # Triton is optional: without it (or without a GPU) the reference path runs.
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - triton is a dependency on Linux
    sgmv = None
else:  # with Triton present, a broken kernel module is an error, not a silent fallback
    from . import sgmv

BACKENDS = ("auto", "triton", "reference")


def triton_interpreted() -> bool:
    """True when the kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return sgmv is not None and type(sgmv._sgmv_shrink_kernel).__name__ == "InterpretedFunction"


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """`backend` (or LORAPLEX_OPS_BACKEND, default "auto": envs.py) → "triton" or "reference"."""
    name = backend or envs.ops_backend()
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" and sgmv is not None else "reference"
    if name == "triton":
        if sgmv is None:
            raise ValueError("backend='triton' but triton is not installed")
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before import); "
                             f"the tensors are on {device}")
    return name


def _on(device: torch.device):
    """Launch on the tensors' GPU even when another one is current (Triton launches on the current one)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _bump_version(y: torch.Tensor) -> None:
    # The kernels write y behind autograd's back; bump its version counter as an in-place op would.
    if not y.is_inference():
        torch.autograd.graph.increment_version(y)


def _single_members(batch: LoraBatch, op: str) -> None:
    if batch.composed:
        raise ValueError(f"{op} takes batches of one adapter a segment at weight 1; add_lora takes compositions "
                         f"and weights")


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: TensorOrList, lora_b: TensorOrList, batch: LoraBatch,
             ranks: TensorOrList, scalings: TensorOrList, *, y_offset: int = 0,
             backend: str | None = None) -> torch.Tensor:
    """Add every segment's LoRA delta to y, in place; returns y. A segment may combine adapters with weights
    (`LoraBatch.from_lengths(..., slot_ids=[[3, 7], 2, -1], weights=[[0.7, 0.3], None, None])`).

    `x [T, K]`, `y [T, N_total]`; `lora_a [num_slots, R, K]`, `lora_b [num_slots, N, R]`
    (PEFT's orientation, stacked over slots); `ranks` int32 `[num_slots]` (each slot's real
    rank ≤ R; columns past it are never read); `scalings` float32 `[num_slots]`. lora_a,
    lora_b, ranks and scalings may be lists (one entry per output slice, up to 4): slice i
    fills y's columns from `y_offset + N_0 + … + N_{i-1}`; rank 0 leaves that slice alone.

        for s in range(S):
            for slot, w in members[s]:     # none for -1; (slot, 1.0) for a plain slot; a composition's pairs
                r = ranks[slot]; rows = seg_indptr[s]:seg_indptr[s+1]
                y[rows, y_offset:y_offset+N] += w * scalings[slot] * (x[rows] @ lora_a[slot, :r].T) @ lora_b[slot, :, :r].T

    The intermediate is accumulated and kept in fp32, and y is rounded once, after every member of the row. Never
    synchronises with the host on the Triton path (two launches), so it can be captured in a CUDA graph. A rank
    above R counts as R (ranks are validated where they are written, not here). Not differentiable.
    """
    check_x(x)
    sl, num_slots = check_slices(x, lora_a, lora_b, ranks, scalings)
    check_y(y, x, sl.lora_b, y_offset)
    check_batch(batch, x, num_slots)
    if resolve_backend(backend, x.device) == "triton":
        with _on(x.device):
            sgmv.add_lora(y, x, sl.lora_a, sl.lora_b, batch, sl.ranks, sl.scalings, y_offset)
        _bump_version(y)
        return y
    v = reference.shrink_impl(x, sl.lora_a, sl.ranks, batch)
    return reference.expand_impl(y, v, sl.lora_b, sl.ranks, sl.scalings, batch, y_offset)


def lora_shrink(x: torch.Tensor, lora_a: TensorOrList, batch: LoraBatch, ranks: TensorOrList, *,
                out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """The first half: `v[rows, :r] = x[rows] @ lora_a[slot, :r]ᵀ` in fp32, zero elsewhere.

    Returns fp32 `[T, R]` for a single `lora_a`, `[slices, T, R]` for a list (written into
    `out` when given).
    """
    check_x(x)
    sl, num_slots = check_slices(x, lora_a, None, ranks, None, b_given=False)
    check_batch(batch, x, num_slots)
    _single_members(batch, "lora_shrink")
    single = isinstance(lora_a, torch.Tensor)
    R = sl.lora_a[0].shape[1]
    if out is None:
        shape = (x.shape[0], R) if single else (sl.num, x.shape[0], R)
        out = torch.empty(shape, dtype=torch.float32, device=x.device)
    else:
        check_v(out, x.shape[0], sl.num, R, x.device, single, name="out")
    if resolve_backend(backend, x.device) == "triton":
        out.zero_()
        with _on(x.device):
            sgmv.shrink_into(out.view(1, sl.num, x.shape[0], R), x, sl.lora_a, sl.ranks, batch,
                             sgmv.config_for(batch.block_m))
        return out
    vs = reference.shrink_impl(x, sl.lora_a, sl.ranks, batch)
    out.copy_(vs[0] if single else torch.stack(vs))
    return out


def lora_expand(y: torch.Tensor, v: torch.Tensor, lora_b: TensorOrList, batch: LoraBatch, ranks: TensorOrList,
                scalings: TensorOrList, *, y_offset: int = 0, backend: str | None = None) -> torch.Tensor:
    """The second half: `y[rows, cols] += scalings[slot] * v[rows, :r] @ lora_b[slot, :, :r]ᵀ`, in place.

    `v` is fp32 `[T, R]` for a single `lora_b`, `[slices, T, R]` for a list (as `lora_shrink` returns).
    """
    check_x(y, "y")
    sl, num_slots = check_slices(y, None, lora_b, ranks, scalings, a_given=False)
    check_y(y, y, sl.lora_b, y_offset)
    check_batch(batch, y, num_slots)
    _single_members(batch, "lora_expand")
    R = sl.lora_b[0].shape[2]
    single = isinstance(lora_b, torch.Tensor)
    check_v(v, y.shape[0], sl.num, R, y.device, single)
    if resolve_backend(backend, y.device) == "triton":
        part = v.view(1, sl.num, y.shape[0], R)
        with _on(y.device):
            sgmv.expand_from(y, part, sl.lora_b, sl.ranks, sl.scalings, batch, y_offset,
                             sgmv.config_for(batch.block_m))
        _bump_version(y)
        return y
    vs = [v] if single else list(v.unbind(0))
    return reference.expand_impl(y, vs, sl.lora_b, sl.ranks, sl.scalings, batch, y_offset)
