"""Fused elementwise ops of the Llama-family forward: RMSNorm (with the residual add), SiLU-and-multiply,
rotary embedding. One launch each on the Triton path, where PyTorch takes several kernels and passes
over memory.

Each op reproduces Hugging Face transformers' Llama/Mistral/Qwen2 numerics: the same op order, and a
rounding to the model dtype wherever transformers' separate PyTorch ops round (a 16-bit PyTorch op
computes in fp32 and rounds once). The reference backend runs transformers' op sequence in PyTorch
(the CPU path, and the oracle of the kernels): on the same device it gives transformers' bits. The
Triton kernels (kernels.py; lora_kernels.py and rope_lora.py where a LoRA product is expanded) follow the same
order in fp32 registers; where they can differ is documented per op.

Backends as for the LoRA ops (`resolve_backend`): Triton for CUDA tensors, the reference otherwise;
`backend="triton" | "reference"` or LORAPLEX_OPS_BACKEND forces one. Bad arguments raise ValueError
naming the argument, from metadata only. The Triton path never synchronises with the host, so a
decode step that calls these ops can be captured in a CUDA graph. Not differentiable.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..gemm.fp8 import QuantizedRows, quantize_rows
from ..lora.api import _bump_version, _on, resolve_backend
from ..lora.checks import FLOAT_DTYPES, _desc
from ..lora.delta import LoraDelta
from ..lora.product import LoraProduct

try:  # as in api.py: without Triton the reference path runs
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - triton is a dependency on Linux
    fused_kernels = None
else:
    from . import kernels as fused_kernels
    from . import lora_kernels as fused_lora_kernels
    from . import rope_lora

# ---------------------------------------------------------------------------------------------
# Argument checks


def _tensor(t, name: str, ndim: int, shape_doc: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {shape_doc}, got {_desc(t)}")


def _float_rows(t: torch.Tensor, name: str, shape_doc: str, ndim: int) -> None:
    """A float tensor whose last dimension is contiguous, not requiring grad."""
    _tensor(t, name, ndim, shape_doc)
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {_desc(t)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension, got {_desc(t)} with strides "
                         f"{t.stride()}")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but the fused ops are not differentiable: call them under "
                         f"torch.no_grad() or torch.inference_mode()")


def _same_device(t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def _writable(t: torch.Tensor, name: str) -> None:
    if torch._debug_has_internal_overlap(t) == 1:
        raise ValueError(f"{name} has elements that share memory ({_desc(t)}, strides {t.stride()}): "
                         f"it is written")


def _delta(delta, name: str, rows: int, widths: tuple[int, ...], like: torch.Tensor, like_name: str) -> None:
    """A LoRA delta (ops/lora/overlap.py makes them): a contiguous float32 `[rows, Σwidths]` on `like`'s
    device, a LoraDelta of one, or a LoraProduct whose slices are `widths` wide."""
    if isinstance(delta, LoraProduct):
        delta.check(rows, widths, like, like_name, name)
        return
    if isinstance(delta, LoraDelta):
        delta.check(rows, sum(widths), like, like_name, name)
        return
    width = sum(widths)
    _tensor(delta, name, 2, f"float32 [T={rows}, {width}]")
    _same_device(delta, name, like, like_name)
    if delta.dtype != torch.float32 or tuple(delta.shape) != (rows, width) or not delta.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32 [T={rows}, {width}] ({like_name} is {_desc(like)}), "
                         f"got {_desc(delta)} with strides {delta.stride()}")


def _dense(delta: torch.Tensor | LoraDelta | LoraProduct) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fp32 delta, rows that keep their bits or None) of a delta tensor, LoraDelta or LoraProduct."""
    if isinstance(delta, (LoraProduct, LoraDelta)):
        return delta.dense(), delta.row_slot < 0
    return delta, None


def _kernel_delta(delta: torch.Tensor | LoraDelta | None) -> dict:
    """kernels.py's delta arguments: the fp32 buffer, and the rows that take it (a LoraDelta's)."""
    if isinstance(delta, LoraDelta):
        return dict(delta=delta.values, delta_rows=delta.row_slot)
    return dict(delta=delta)


def _plus_delta(t: torch.Tensor, delta, keep: torch.Tensor | None = None) -> torch.Tensor:
    # The reference of every kernel's delta: the sum in fp32, rounded to t's dtype once; rows in
    # `keep` (a LoraProduct's rows without an adapter) stay as they are.
    if delta is None:
        return t
    if isinstance(delta, (LoraProduct, LoraDelta)):
        delta, keep = _dense(delta)
    summed = (t.to(torch.float32) + delta.reshape(t.shape)).to(t.dtype)
    return summed if keep is None else torch.where(keep.view(-1, *[1] * (t.dim() - 1)), t, summed)


# ---------------------------------------------------------------------------------------------
# RMSNorm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             delta: torch.Tensor | LoraDelta | LoraProduct | None = None, e4m3: QuantizedRows | None = None,
             backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x, or of `residual + x`; returns `(normed, s)`.

    `x [T, H]` (last dimension contiguous; T may be 0), `weight [H]` (float16, bfloat16 or
    float32), `eps` ≥ 0. With `residual=None`, s is x itself (no copy). With `residual [T, H]`
    (x's dtype), `s = residual + x` rounded to x's dtype, as transformers' `residual + hidden_states`.
    With `delta` (contiguous float32 `[T, H]`, a LoRA delta that ops/lora/overlap.py left for this op),
    x is first replaced by `(x.float() + delta)` rounded to x's dtype, the sum the LoRA expand
    would have written into x; s is then a new tensor even without a residual. A LoraDelta (ops/lora/
    delta.py) is such a delta whose rows without an adapter take nothing. `delta` may also be a
    one-slice LoraProduct (ops/lora/product.py): the kernel expands each row's product as it loads
    the row (rows without an adapter take nothing).

        v = s.float()
        n = (v * rsqrt(mean(v ** 2, -1) + eps)).to(x.dtype)
        normed = (weight * n).to(x.dtype)      # product in fp32, rounded once

    This is LlamaRMSNorm's op sequence; with weight in x's dtype (as transformers loads it) the
    final cast changes nothing. Triton: one program per row, the row held in registers up to
    8192 wide, re-read in tiles beyond. s is exact. The kernel sums the squares in another order
    than PyTorch, which can move the mean, hence rsqrt, by a few fp32 ulps: fp32 outputs of such
    a row move with it (≤ 8 ulps), 16-bit ones only where n sits next to a rounding boundary
    (rare elements, ≤ 2 ulps after the product with weight).

    `e4m3` (ops/gemm/fp8.py's buffers for normed's rows, e.g. `QuantizedRows.empty(x)`): also filled with normed
    quantized a row, `fp8.quantize_rows(normed)`'s bits, for an FP8 GEMM that would quantize it (W8A8). Triton: by
    the program that writes the row (by a launch of its own past 8192 columns).
    """
    check_rms_args(x, weight, eps, residual, delta)
    T, H = x.shape
    if e4m3 is not None:
        e4m3.check(x, "e4m3")
    if resolve_backend(backend, x.device) == "reference":
        out, s = _rms_norm_reference(x, weight, eps, residual, delta)
        if e4m3 is not None:
            q, scale = quantize_rows(out)
            e4m3.q.copy_(q)
            e4m3.scale.copy_(scale)
        return out, s
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    fresh_s = residual is not None or delta is not None
    s = torch.empty((T, H), dtype=x.dtype, device=x.device) if fresh_s else x
    with _on(x.device):
        if isinstance(delta, LoraProduct):
            fused_lora_kernels.rms_norm(x, weight, eps, residual, out, s, delta, e4m3=e4m3)
        else:
            fused_kernels.rms_norm(x, weight, eps, residual, out, s if fresh_s else None, e4m3=e4m3,
                                   **_kernel_delta(delta))
    return out, s


def check_rms_args(x, weight, eps, residual, delta) -> None:
    """`rms_norm`'s argument checks."""
    _float_rows(x, "x", "[T, H]", 2)
    T, H = x.shape
    if H == 0:
        raise ValueError(f"x must have at least one column, got {_desc(x)}")
    _tensor(weight, "weight", 1, f"[H={H}]")
    _same_device(weight, "weight", x, "x")
    if weight.dtype not in FLOAT_DTYPES or weight.shape[0] != H or (H > 1 and weight.stride(0) != 1):
        raise ValueError(f"weight must be a contiguous float16, bfloat16 or float32 [H={H}] (x is {_desc(x)}), "
                         f"got {_desc(weight)}")
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("weight requires grad, but the fused ops are not differentiable: call them under "
                         "torch.no_grad() or torch.inference_mode()")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number ≥ 0, got {eps!r}")
    if residual is not None:
        _float_rows(residual, "residual", f"[T={T}, H={H}]", 2)
        _same_device(residual, "residual", x, "x")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x ({_desc(x)}), got {_desc(residual)}")
    if delta is not None:
        _delta(delta, "delta", T, (H,), x, "x")


def _rms_norm_reference(x, weight, eps, residual, delta=None):
    x = _plus_delta(x, delta)
    s = x if residual is None else residual + x
    v = s.to(torch.float32)
    n = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * n).to(x.dtype), s


# ---------------------------------------------------------------------------------------------
# SiLU and multiply


def silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None,
                 delta: torch.Tensor | LoraDelta | LoraProduct | None = None,
                 backend: str | None = None) -> torch.Tensor:
    """`silu(gate) * up` from a fused gate/up GEMM output; returns `[T, I]` (`out` when given).

    `gate_up [T, 2·I]` (last dimension contiguous): gate is columns `:I`, up columns `I:`.
    `out [T, I]`, gate_up's dtype, last dimension contiguous (it may be `gate_up[:, :I]`).
    `delta` (contiguous float32 `[T, 2·I]`, a LoRA delta left by ops/lora/overlap.py): gate and up are
    first `(gate_up.float() + delta)` rounded to the dtype (gate_up is only written where `out` lies in it);
    a LoraDelta's rows without an adapter take nothing.
    `delta` may also be a two-slice (gate, up) LoraProduct, expanded by the kernel as it loads.

        a = silu(gate) rounded to the dtype      # silu(g) = g / (1 + exp(-g)), in fp32
        out = (a * up) rounded to the dtype

    which is LlamaMLP's `act_fn(gate_proj(x)) * up_proj(x)`. Triton: exp from libdevice (CUDA's
    expf, as PyTorch's kernel), IEEE division; results agree with PyTorch's CUDA silu unless the
    two compilers contract `1 + exp(-g)` differently.
    """
    _float_rows(gate_up, "gate_up", "[T, 2*I]", 2)
    T, width = gate_up.shape
    if width == 0 or width % 2:
        raise ValueError(f"gate_up must be [T, 2*I] with I ≥ 1 (gate then up), got {_desc(gate_up)}")
    I = width // 2
    if out is None:
        out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    else:
        _float_rows(out, "out", f"[T={T}, I={I}]", 2)
        _same_device(out, "out", gate_up, "gate_up")
        if tuple(out.shape) != (T, I) or out.dtype != gate_up.dtype:
            raise ValueError(f"out must be [T={T}, I={I}] of gate_up's dtype {gate_up.dtype}, got {_desc(out)}")
        _writable(out, "out")
    if delta is not None:
        _delta(delta, "delta", T, (I, I), gate_up, "gate_up")
    if resolve_backend(backend, gate_up.device) == "reference":
        gate_up = _plus_delta(gate_up, delta)
        # silu on a contiguous gate, as transformers' gate_proj output is: PyTorch's CPU silu takes
        # a scalar path for each inner loop's tail, so a strided view would round differently there.
        torch.mul(F.silu(gate_up[:, :I].contiguous()), gate_up[:, I:], out=out)
        return out
    with _on(gate_up.device):
        if isinstance(delta, LoraProduct):
            fused_lora_kernels.silu_and_mul(gate_up, out, delta)
        else:
            fused_kernels.silu_and_mul(gate_up, out, **_kernel_delta(delta))
    _bump_version(out)
    return out


# ---------------------------------------------------------------------------------------------
# Rotary embedding


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
               v: torch.Tensor | None = None, delta: torch.Tensor | LoraDelta | LoraProduct | None = None,
               backend: str | None = None) -> None:
    """Rotary embedding of q and k in place (transformers' rotate_half convention).

    `q [T, Hq, D]`, `k [T, Hkv, D]` of one dtype, last dimension contiguous, any token and head
    strides (views into a fused qkv GEMM output). `positions` int32 or int64 `[T]`; `inv_freq`
    float32 `[D/2]`, with linear or llama3 scaling already folded in (attention scaling 1).

        freqs = positions.float()[:, None] * inv_freq[None, :]         # fp32
        cos, sin = cat(freqs, freqs).cos(), .sin(), each cast to q's dtype
        q = q * cos + rotate_half(q) * sin                             # each product and the sum rounded
        k = k * cos + rotate_half(k) * sin                             #   to the dtype, as transformers

    Triton: one program per token rotates all heads of q and k (at decode steps of many heads, a program per
    chunk of heads: `kernels.rope_splits`); cos/sin come from libdevice
    (CUDA's cosf/sinf, as torch.cos on CUDA: within 2 fp32 ulps of the exact cosine of the fp32
    angle for any angle, Payne-Hanek reduction past ~1e5 rad). The angle itself is fp32, as in
    transformers: at position 1e5 it is only good to ~4e-3 rad, the same error in both.
    q and k must not overlap each other.

    With `delta` (contiguous float32 `[T, (Hq + 2·Hkv)·D]`, a fused q/k/v LoRA delta left by
    ops/lora/overlap.py, laid out q | k | v per token) and `v [T, Hkv, D]` (q's dtype): q, k and v
    first become `(t.float() + their delta)` rounded to the dtype, in place; then q and k rotate.
    v must not overlap q or k; a LoraDelta's rows without an adapter take nothing. `delta` may also be a
    three-slice (q, k, v) LoraProduct: one program per
    (token, q|k|v, block of heads) expands its heads' products as it loads them.
    """
    _float_rows(q, "q", "[T, Hq, D]", 3)
    _float_rows(k, "k", "[T, Hkv, D]", 3)
    _same_device(k, "k", q, "q")
    T, _, D = q.shape
    if k.dtype != q.dtype:
        raise ValueError(f"k is {k.dtype} but q is {q.dtype}")
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k must be [T={T}, Hkv, D={D}] to match q ({_desc(q)}), got {_desc(k)}")
    if D == 0 or D % 2:
        raise ValueError(f"the head dimension D must be even and positive, got q {_desc(q)}")
    _writable(q, "q")
    _writable(k, "k")
    _tensor(positions, "positions", 1, f"[T={T}]")
    _same_device(positions, "positions", q, "q")
    if positions.dtype not in (torch.int32, torch.int64) or positions.shape[0] != T:
        raise ValueError(f"positions must be int32 or int64 [T={T}], got {_desc(positions)}")
    _tensor(inv_freq, "inv_freq", 1, f"[D/2={D // 2}]")
    _same_device(inv_freq, "inv_freq", q, "q")
    if inv_freq.dtype != torch.float32 or inv_freq.shape[0] != D // 2 or (D > 2 and inv_freq.stride(0) != 1):
        raise ValueError(f"inv_freq must be contiguous float32 [D/2={D // 2}], got {_desc(inv_freq)}")
    if delta is not None:
        if v is None:
            raise ValueError("delta covers q, k and v: pass v too")
        _float_rows(v, "v", f"[T={T}, Hkv={k.shape[1]}, D={D}]", 3)
        _same_device(v, "v", q, "q")
        if v.dtype != q.dtype or tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"v must be {q.dtype} [T={T}, Hkv={k.shape[1]}, D={D}] as k, got {_desc(v)}")
        _writable(v, "v")
        _delta(delta, "delta", T, (q.shape[1] * D, k.shape[1] * D, k.shape[1] * D), q, "q")
    elif v is not None:
        raise ValueError("v is only taken with a delta")
    if resolve_backend(backend, q.device) == "reference":
        if delta is not None:
            widths = (q.shape[1] * D, k.shape[1] * D, k.shape[1] * D)
            dense, keep = _dense(delta)
            for t, d in zip((q, k, v), dense.split(widths, dim=1)):
                t.copy_(_plus_delta(t, d, keep))
        _rope_reference(q, k, positions, inv_freq)
        return
    with _on(q.device):
        if isinstance(delta, LoraProduct):
            rope_lora.apply_rope(q, k, v, positions, inv_freq, delta)
        else:
            fused_kernels.apply_rope(q, k, positions, inv_freq, v=v, **_kernel_delta(delta))
    _bump_version(q)
    _bump_version(k)
    if v is not None:
        _bump_version(v)


def _rope_reference(q, k, positions, inv_freq):
    half = q.shape[2] // 2
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    # cos/sin of the concatenated [T, D] angles, as transformers takes them: PyTorch's CPU cos can
    # round a value differently in a loop's scalar tail, and the tail depends on the tensor's size.
    angles = torch.cat((freqs, freqs), dim=-1)
    cos = angles.cos().to(q.dtype)[:, None, :]
    sin = angles.sin().to(q.dtype)[:, None, :]
    for t in (q, k):
        x1, x2 = t[..., :half], t[..., half:]
        # transformers adds rotate_half(t) * sin = (-x2, x1) * sin; (-x2)·sin = -(x2·sin) exactly.
        o1 = x1 * cos[..., :half] - x2 * sin[..., :half]
        o2 = x2 * cos[..., half:] + x1 * sin[..., half:]
        x1.copy_(o1)
        x2.copy_(o2)
