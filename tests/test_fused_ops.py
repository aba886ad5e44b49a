"""rms_norm, silu_and_mul and apply_rope on the CPU.

The oracle is transformers' own code (LlamaRMSNorm, ACT2FN["silu"], LlamaRotaryEmbedding +
apply_rotary_pos_emb), applied as LlamaDecoderLayer / LlamaMLP / LlamaAttention apply it. The
reference backend must give its bits exactly. The Triton kernels run in Triton's interpreter (numpy
stand-ins for libdevice's exp/cos/sin/rsqrt, see fused_kernels.py) and are held to the reference
within what those stand-ins and another summation order can move, on fresh random inputs with
outputs poisoned (NaN) before the call. tests/test_fused_gpu.py holds the real kernels to
transformers on CUDA.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from loraplex import ops
from loraplex.ops.fused import api as fused
from loraplex.ops.fused import kernels as fused_kernels
from loraplex.ops.lora.delta import LoraDelta

from lora_cases import stable_seed

interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")
BACKENDS = ["reference", pytest.param("triton", marks=interpreted)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SCALINGS = {  # rope_scaling variants whose inv_freq the caller folds in
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
}


# ---------------------------------------------------------------------------------------------
# The oracle (transformers) and comparison helpers, shared with test_fused_gpu.py


def hf_rms_norm(x, weight, eps, residual=None):
    """LlamaDecoderLayer: `hidden = residual + hidden` (when given), then LlamaRMSNorm."""
    s = x if residual is None else residual + x
    norm = LlamaRMSNorm(x.shape[1], eps=eps).to(device=x.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(s), s


def hf_silu_and_mul(gate, up):
    """LlamaMLP's `act_fn(gate_proj(x)) * up_proj(x)` on the two projections' outputs."""
    return ACT2FN["silu"](gate) * up


def rope_config(Hq, Hkv, D, scaling="default", theta=500000.0):
    return LlamaConfig(hidden_size=Hq * D, num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D,
                       rope_theta=theta, max_position_embeddings=131072, rope_scaling=SCALINGS[scaling])


def hf_rope(q, k, positions, rotary):
    """LlamaRotaryEmbedding for one sequence, then apply_rotary_pos_emb on [1, T, heads, D]."""
    cos, sin = rotary(q, positions.long()[None])
    qe, ke = apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)
    return qe[0], ke[0]


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place of a's dtype (0 between +0 and -0)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    magnitude = (1 << (torch.iinfo(ints).bits - 1)) - 1

    def ordered(t):
        i = t.contiguous().view(ints).long()
        return torch.where(i < 0, -(i & magnitude), i)
    return (ordered(a) - ordered(b)).abs()


def assert_ulps(got, ref, max_ulps: int, max_frac: float = 1.0, what: str = "") -> None:
    d = ulps(got, ref)
    frac = (d > 0).float().mean().item() if d.numel() else 0.0
    assert d.numel() == 0 or d.max().item() <= max_ulps, f"{what}: {d.max().item()} ulps apart"
    assert frac <= max_frac, f"{what}: {frac:.2%} of elements differ"


def rows_with_scales(gen, T, H, dtype, large: bool):
    """Random unit rows; with `large`, rows of very different magnitudes (tiny, huge for the dtype)."""
    x = torch.randn(T, H, generator=gen)
    if large:
        big = 3e3 if dtype == torch.float16 else 1e15  # fp16 stops at 65504; squares must stay finite in fp32
        scales = torch.tensor([1.0, 1e-3, big, 0.05, big / 7, 1e-5, 40.0])
        x *= scales[torch.arange(T) % len(scales)][:, None]
    return x.to(dtype)


def qkv_views(gen, T, Hq, Hkv, D, dtype, layout: str, device="cpu"):
    """(q, k, buffer): q and k as the model gets them from a fused qkv GEMM output.

    "fused": [T, (Hq+2Hkv)·D]; "padded": extra columns after v; "interleaved": [T, H, 3, D], heads
    strided by 3·D."""
    if layout == "interleaved":
        shape = (T, max(Hq, Hkv), 3, D)
    else:
        shape = (T, (Hq + 2 * Hkv) * D + (5 if layout == "padded" else 0))
    buf = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return views_of(buf, T, Hq, Hkv, D, layout)


def views_of(buf, T, Hq, Hkv, D, layout):
    if layout == "interleaved":
        return buf[:, :Hq, 0], buf[:, :Hkv, 1], buf
    return buf[:, :Hq * D].view(T, Hq, D), buf[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D), buf


def random_positions(gen, T, dtype=torch.int64):
    pos = torch.randint(0, 131072, (T,), generator=gen)
    pos[:3] = torch.tensor([0, 1, 131071])[:T]
    return pos.to(dtype)


# ---------------------------------------------------------------------------------------------
# rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [72, 200, 1000])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("large", [False, True])
def test_rms_norm_reference_is_transformers(dtype, H, residual, large):
    gen = torch.Generator().manual_seed(stable_seed(str(dtype), H, residual, large))
    x = rows_with_scales(gen, 7, H, dtype, large)
    r = rows_with_scales(gen, 7, H, dtype, large) if residual else None
    w = (1 + 0.3 * torch.randn(H, generator=gen)).to(dtype)
    out, s = fused.rms_norm(x, w, 1e-5, residual=r, backend="reference")
    ref, ref_s = hf_rms_norm(x, w, 1e-5, r)
    assert torch.equal(s, ref_s) and torch.equal(out, ref)
    assert torch.isfinite(out).all()


def test_rms_norm_reference_with_fp32_weight_rounds_to_x_dtype():
    """transformers would return fp32 here (bf16 · fp32 promotes); the op rounds that product to x's dtype."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 96, generator=gen).bfloat16(), torch.randn(96, generator=gen)
    out, _ = fused.rms_norm(x, w, 1e-6, backend="reference")
    ref, _ = hf_rms_norm(x, w, 1e-6)
    assert ref.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert torch.equal(out, ref.bfloat16())


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm_without_residual_returns_x_itself(backend):
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(6))
    out, s = fused.rms_norm(x, torch.ones(40), 1e-6, backend=backend)
    assert s is x
    assert_ulps(out, hf_rms_norm(x, torch.ones(40), 1e-6)[0], *RMS_TOL[torch.float32])


# Triton vs reference. The kernel sums squares in another order than PyTorch (a tree over the row,
# not PyTorch's cascade), so the mean, hence rsqrt, can move by a few fp32 ulps; s is exact. In fp32
# every element of such a row moves with it, and the two rounded products on top: ≤ 8 ulps (5 seen
# over 300 rows). In 16 bits the rounding of n = v·rsqrt to the dtype hides that except next to a
# rounding boundary (~1e-5 of elements seen); n then moves by 1 ulp, and weight·n by ≤ 2.
RMS_TOL = {torch.float32: (8, 1.0), torch.float16: (2, 0.01), torch.bfloat16: (2, 0.01)}


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, max_block", [(72, 8192), (200, 8192), (1000, 8192), (200, 64), (1000, 256)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_kernel_matches_reference(dtype, H, max_block, residual):
    """One pass (the row in registers) and the tiled two-pass loop (forced with a small max_block)."""
    gen = torch.Generator().manual_seed(stable_seed(str(dtype), H, max_block, residual))
    T = 9
    x = rows_with_scales(gen, T, H + 3, dtype, large=True)[:, 3:]  # rows strided past their width
    r = rows_with_scales(gen, T, H, dtype, large=True) if residual else None
    w = (1 + 0.3 * torch.randn(H, generator=gen)).to(dtype)
    out = torch.full((T, H), float("nan"), dtype=dtype)
    s = torch.full((T, H), float("nan"), dtype=dtype) if residual else None
    fused_kernels.rms_norm(x, w, 1e-6, r, out, s, max_block=max_block)
    ref, ref_s = fused.rms_norm(x, w, 1e-6, residual=r, backend="reference")
    if residual:
        assert torch.equal(s, ref_s)
    assert_ulps(out, ref, *RMS_TOL[dtype], what=f"{dtype} H={H}")


@interpreted
def test_rms_norm_kernel_weight_in_another_dtype():
    gen = torch.Generator().manual_seed(4)
    x, r = torch.randn(4, 130, generator=gen).half(), torch.randn(4, 130, generator=gen).half()
    for w in (torch.randn(130, generator=gen), torch.randn(130, generator=gen).bfloat16()):
        out, s = fused.rms_norm(x, w, 1e-6, residual=r, backend="triton")
        ref, ref_s = fused.rms_norm(x, w, 1e-6, residual=r, backend="reference")
        assert out.dtype == torch.float16 and torch.equal(s, ref_s)
        assert_ulps(out, ref, *RMS_TOL[torch.float16], what=str(w.dtype))


# ---------------------------------------------------------------------------------------------
# silu_and_mul


def _gate_up(gen, T, I, dtype):
    gate = (4 * torch.randn(T, I, generator=gen)).to(dtype)
    gate[0, :6] = torch.tensor([0.0, -0.0, 20.0, -20.0, 88.0, -88.0])  # exp(-g) from 0 to overflow
    up = torch.randn(T, I, generator=gen).to(dtype)
    return gate, up, torch.cat((gate, up), dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("I", [72, 200, 3000])
def test_silu_and_mul_reference_is_transformers(dtype, I):
    gen = torch.Generator().manual_seed(stable_seed(str(dtype), I))
    gate, up, gate_up = _gate_up(gen, 6, I, dtype)
    out = torch.full((6, I), float("nan"), dtype=dtype)
    assert fused.silu_and_mul(gate_up, out=out, backend="reference") is out
    assert torch.equal(out, hf_silu_and_mul(gate, up))


# Triton vs reference: the interpreter's exp is numpy's (≤ 2 ulps from correctly rounded, measured),
# PyTorch's CPU one SLEEF's (≤ 1): they differ by ≤ 3 ulps, which silu(g) ≈ g·exp(g) keeps for very
# negative g; 1 + e, the division and the product with up round on top: fp32 ≤ 8 ulps (6 seen over
# 300k elements). In 16 bits a = silu(g) moves by 1 ulp only next to a rounding boundary (~2e-4 of
# elements seen), and a·up then by ≤ 2 ulps.
SILU_TOL = {torch.float32: (8, 1.0), torch.float16: (2, 0.01), torch.bfloat16: (2, 0.01)}


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("I, block", [(72, 1024), (200, 64), (3000, 1024)])
def test_silu_and_mul_kernel_matches_reference(dtype, I, block):
    gen = torch.Generator().manual_seed(stable_seed(str(dtype), I, block))
    _, _, gate_up = _gate_up(gen, 5, I, dtype)
    gate_up = torch.cat((gate_up, torch.randn(5, 3, generator=gen).to(dtype)), 1)[:, :2 * I]  # strided rows
    out = torch.full((5, I), float("nan"), dtype=dtype)
    fused_kernels.silu_and_mul(gate_up, out, block=block)
    assert_ulps(out, fused.silu_and_mul(gate_up, backend="reference"), *SILU_TOL[dtype], what=f"{dtype} I={I}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_silu_and_mul_into_the_gate_half(backend):
    """out may be gate_up[:, :I]: each element of the gate is read before its place is written."""
    gen = torch.Generator().manual_seed(5)
    _, _, gate_up = _gate_up(gen, 4, 100, torch.float16)
    expected = fused.silu_and_mul(gate_up, backend=backend)
    before = gate_up._version
    out = fused.silu_and_mul(gate_up, out=gate_up[:, :100], backend=backend)
    assert torch.equal(out, expected) and torch.equal(gate_up[:, :100], expected)
    assert gate_up._version > before


# ---------------------------------------------------------------------------------------------
# apply_rope


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq, Hkv, D", [(4, 4, 64), (6, 2, 128), (3, 1, 80)])
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_rope_reference_is_transformers(dtype, Hq, Hkv, D, scaling):
    gen = torch.Generator().manual_seed(stable_seed(str(dtype), Hq, Hkv, D, scaling))
    T = 11
    q, k, qkv = qkv_views(gen, T, Hq, Hkv, D, dtype, "fused")
    rotary = LlamaRotaryEmbedding(rope_config(Hq, Hkv, D, scaling))
    positions = random_positions(gen, T, torch.int32 if scaling == "linear" else torch.int64)
    ref_q, ref_k = hf_rope(q, k, positions, rotary)
    v = qkv[:, (Hq + Hkv) * D:].clone()
    fused.apply_rope(q, k, positions, rotary.inv_freq, backend="reference")
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(qkv[:, (Hq + Hkv) * D:], v)


def rope_error_bound(x: torch.Tensor, rel: float) -> torch.Tensor:
    """rel · (|x1| + |x2|) for each element of the rotated pair: the scale of the products it sums."""
    half = x.shape[-1] // 2
    scale = x[..., :half].double().abs() + x[..., half:].double().abs()
    return rel * torch.cat((scale, scale), -1)


# Triton vs reference, with u the dtype's unit roundoff (eps/2). cos and sin (numpy's in the
# interpreter, SLEEF's in PyTorch) each within ~1.2·2⁻²⁴ of exact. In 16 bits, rounded to the dtype,
# they rarely differ, by ≤ 1 ulp (2u relative) where they do: each product then moves by ≤ 2u·|x|
# plus ≤ 2u·|x| from its own rounding, the sum adds an ulp of its own: |Δ| ≤ 6u·(|x1| + |x2|). In
# fp32 cos/sin differ by < 2.5u on every element, and the same count gives ≤ 7u. Bound: 8u.
ROPE_REL = {dtype: 4 * torch.finfo(dtype).eps for dtype in DTYPES}


def test_rope_splits_decode_steps_of_many_heads():
    """A program per chunk of 16 heads (D = 128 in 1,024-element tiles) at a decode step of Llama-2-7B's 32 + 32
    heads; Llama-3-8B's 32 + 8 (3 chunks) and steps past 64 tokens keep a program a token."""
    assert fused_kernels.rope_splits(32, 32, 32, 16)
    assert not fused_kernels.rope_splits(32, 32, 8, 16)
    assert not fused_kernels.rope_splits(65, 32, 32, 16)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq, Hkv, D, layout, tile", [(4, 4, 64, "fused", 1024), (6, 2, 128, "padded", 1024),
                                                       (3, 1, 80, "interleaved", 1024), (6, 2, 128, "fused", 64),
                                                       (6, 2, 64, "fused", 128)])
@pytest.mark.parametrize("split", [False, True])
def test_rope_kernel_matches_reference(dtype, Hq, Hkv, D, layout, tile, split, monkeypatch):
    """Strided q/k views of one buffer; tile=64 makes the kernel loop over heads one at a time, or (`split`: a
    program a chunk of heads) gives each head a program; tile=128 at D=64 makes chunks of 4 heads, q's last one
    partial."""
    monkeypatch.setattr(fused_kernels, "ROPE_SPLIT_TOKENS", 64 if split else 0)
    monkeypatch.setattr(fused_kernels, "ROPE_SPLIT_CHUNKS", 1)
    gen = torch.Generator().manual_seed(stable_seed(str(dtype), Hq, Hkv, D, layout, tile))
    T = 13
    q, k, qkv = qkv_views(gen, T, Hq, Hkv, D, dtype, layout)
    positions = random_positions(gen, T, torch.int32 if layout == "padded" else torch.int64)
    inv_freq = LlamaRotaryEmbedding(rope_config(Hq, Hkv, D, "llama3")).inv_freq
    qkv_in = qkv.clone()
    q_ref, k_ref, _ = views_of(qkv_in.clone(), T, Hq, Hkv, D, layout)
    fused.apply_rope(q_ref, k_ref, positions, inv_freq, backend="reference")
    fused_kernels.apply_rope(q, k, positions, inv_freq, tile=tile)
    q_in, k_in, _ = views_of(qkv_in, T, Hq, Hkv, D, layout)
    for got, ref, x, name in ((q, q_ref, q_in, "q"), (k, k_ref, k_in, "k")):
        err = (got.double() - ref.double()).abs()
        bound = rope_error_bound(x, ROPE_REL[dtype])
        assert (err <= bound).all(), f"{name}: {(err / bound).max().item():.2f}× the bound"
        if dtype != torch.float32:
            assert (err > 0).float().mean().item() <= 0.01, f"{name}: too many elements differ"
    # Nothing outside q and k changed (v, the padding, the interleaved v slots).
    marks = torch.zeros(qkv.shape)
    for view in views_of(marks, T, Hq, Hkv, D, layout)[:2]:
        view.fill_(1)
    outside = marks == 0
    assert torch.equal(qkv[outside], qkv_in[outside])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_cos_sin_precision_at_large_positions(backend):
    """q = (1…1, 0…0) in fp32 rotates into exactly (cos, sin) of the op's fp32 angles; compare them
    with float64 cos/sin of the same fp32 angles, for positions up to 131071 (angles up to ~1.3e5 rad).
    Within 2⁻²³ (CUDA's cosf/sinf are within 2 ulps; numpy's and SLEEF's measured ≤ 1.2·2⁻²⁴)."""
    gen = torch.Generator().manual_seed(7)
    T, D = 64, 128
    positions = random_positions(gen, T)
    inv_freq = LlamaRotaryEmbedding(rope_config(1, 1, D)).inv_freq
    qk = torch.zeros(T, 2, D)
    qk[:, :, :D // 2] = 1
    fused.apply_rope(qk[:, :1], qk[:, 1:], positions, inv_freq, backend=backend)
    angles = (positions.float()[:, None] * inv_freq[None, :]).double()
    for head in range(2):
        assert (qk[:, head, :D // 2].double() - angles.cos()).abs().max().item() <= 2.0 ** -23
        assert (qk[:, head, D // 2:].double() - angles.sin()).abs().max().item() <= 2.0 ** -23


# ---------------------------------------------------------------------------------------------
# Every op: empty and one-token batches, the public entry points on both backends


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [0, 1])
def test_empty_and_single_token_batches(backend, T):
    gen = torch.Generator().manual_seed(T)
    x, r, w = torch.randn(T, 48, generator=gen).half(), torch.randn(T, 48, generator=gen).half(), torch.randn(48).half()
    out, s = fused.rms_norm(x, w, 1e-6, residual=r, backend=backend)
    ref, ref_s = hf_rms_norm(x, w, 1e-6, r)
    assert out.shape == (T, 48) and torch.equal(s, ref_s)
    assert_ulps(out, ref, *RMS_TOL[torch.float16])

    gate, up = torch.randn(T, 40, generator=gen).half(), torch.randn(T, 40, generator=gen).half()
    gate_up = torch.cat((gate, up), 1)
    y = fused.silu_and_mul(gate_up, backend=backend)
    assert y.shape == (T, 40)
    assert_ulps(y, hf_silu_and_mul(gate, up), *SILU_TOL[torch.float16])

    q, k, qkv = qkv_views(gen, T, 2, 1, 16, torch.float16, "fused")
    rotary = LlamaRotaryEmbedding(rope_config(2, 1, 16))
    positions = torch.full((T,), 77, dtype=torch.int32)
    ref_q, ref_k = hf_rope(q, k, positions, rotary)
    q_in, k_in = q.clone(), k.clone()
    fused.apply_rope(q, k, positions, rotary.inv_freq, backend=backend)
    for got, ref, x in ((q, ref_q, q_in), (k, ref_k, k_in)):
        assert ((got.double() - ref.double()).abs() <= rope_error_bound(x, ROPE_REL[torch.float16])).all()


@interpreted
def test_rope_bumps_the_version_of_q_and_k():
    q, k, _ = qkv_views(torch.Generator().manual_seed(8), 3, 2, 2, 8, torch.float32, "fused")
    before = q._version, k._version
    fused.apply_rope(q, k, torch.arange(3), torch.rand(4), backend="triton")
    assert q._version > before[0] and k._version > before[1]


@interpreted
def test_backend_from_the_environment(monkeypatch):
    calls = []
    for name in ("rms_norm", "silu_and_mul", "apply_rope"):
        monkeypatch.setattr(fused_kernels, name, lambda *a, _n=name, **kw: calls.append(_n))
    monkeypatch.setenv("LORAPLEX_OPS_BACKEND", "triton")
    fused.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
    fused.silu_and_mul(torch.randn(2, 8))
    fused.apply_rope(torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.arange(2), torch.rand(4))
    assert calls == ["rms_norm", "silu_and_mul", "apply_rope"]
    monkeypatch.setenv("LORAPLEX_OPS_BACKEND", "auto")  # CPU tensors: the reference
    fused.silu_and_mul(torch.randn(2, 8))
    assert len(calls) == 3


# ---------------------------------------------------------------------------------------------
# Bad arguments: ValueError naming the argument, raised from metadata (meta tensors have no data)


def meta(*shape, dtype=torch.float16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def _rms(**over):
    d = dict(x=meta(4, 32), weight=meta(32), eps=1e-6, residual=None, backend="reference")
    d.update(over)
    return fused.rms_norm(d.pop("x"), d.pop("weight"), d.pop("eps"), **d)


def _silu(**over):
    d = dict(gate_up=meta(4, 32), out=None, backend="reference")
    d.update(over)
    return fused.silu_and_mul(d.pop("gate_up"), **d)


def _rope(**over):
    d = dict(q=meta(4, 2, 8), k=meta(4, 1, 8), positions=meta(4, dtype=torch.int64),
             inv_freq=meta(4, dtype=torch.float32), backend="reference")
    d.update(over)
    return fused.apply_rope(d.pop("q"), d.pop("k"), d.pop("positions"), d.pop("inv_freq"), **d)


ERRORS = [
    (_rms, dict(x=[[1.0]]), "x must be a torch.Tensor"),
    (_rms, dict(x=meta(4, 32, 1)), r"x must be \[T, H\], got shape \[4, 32, 1\]"),
    (_rms, dict(x=meta(4, 32, dtype=torch.int32)), "x must be float16, bfloat16 or float32"),
    (_rms, dict(x=meta(32, 4).t()), "x must be contiguous along its last dimension"),
    (_rms, dict(x=meta(4, 0), weight=meta(0)), "x must have at least one column"),
    (_rms, dict(x=meta(4, 32).requires_grad_()), "x requires grad, but the fused ops are not differentiable"),
    (_rms, dict(weight=meta(31)), r"weight must be a contiguous float16, bfloat16 or float32 \[H=32\]"),
    (_rms, dict(weight=meta(32, dtype=torch.int8)), r"weight must be a contiguous .*got shape \[32\], int8"),
    (_rms, dict(weight=meta(64)[::2]), r"weight must be a contiguous"),
    (_rms, dict(weight=meta(1, 32)), r"weight must be \[H=32\]"),
    (_rms, dict(weight=torch.empty(32)), "weight is on cpu but x is on meta"),
    (_rms, dict(weight=meta(32).requires_grad_()), "weight requires grad"),
    (_rms, dict(eps=-1e-6), "eps must be a finite number ≥ 0, got -1e-06"),
    (_rms, dict(eps=float("nan")), "eps must be a finite number"),
    (_rms, dict(eps="1e-6"), "eps must be a finite number"),
    (_rms, dict(eps=True), "eps must be a finite number"),
    (_rms, dict(residual=meta(4, 31)), r"residual must match x \(shape \[4, 32\], float16 on meta\)"),
    (_rms, dict(residual=meta(4, 32, dtype=torch.float32)), "residual must match x"),
    (_rms, dict(residual=torch.empty(4, 32, dtype=torch.float16)), "residual is on cpu but x is on meta"),
    (_rms, dict(residual=meta(32, 4).t()), "residual must be contiguous along its last dimension"),
    (_rms, dict(residual=meta(4, 32, 1)), r"residual must be \[T=4, H=32\]"),
    (_rms, dict(backend="cuda"), "backend must be one of"),
    (_silu, dict(gate_up=meta(4, 33)), r"gate_up must be \[T, 2\*I\] with I ≥ 1"),
    (_silu, dict(gate_up=meta(4, 0)), r"gate_up must be \[T, 2\*I\] with I ≥ 1"),
    (_silu, dict(gate_up=meta(32)), r"gate_up must be \[T, 2\*I\], got shape \[32\]"),
    (_silu, dict(gate_up=meta(32, 4).t()), "gate_up must be contiguous along its last dimension"),
    (_silu, dict(out=meta(4, 32)), r"out must be \[T=4, I=16\] of gate_up's dtype"),
    (_silu, dict(out=meta(4, 16, dtype=torch.bfloat16)), r"out must be \[T=4, I=16\] of gate_up's dtype"),
    (_silu, dict(out=torch.empty(4, 16, dtype=torch.float16)), "out is on cpu but gate_up is on meta"),
    (_silu, dict(out=meta(1, 16).expand(4, 16)), "out has elements that share memory"),
    (_silu, dict(out=meta(4, 16).requires_grad_()), "out requires grad"),
    (_silu, dict(backend="fast"), "backend must be one of"),
    (_rope, dict(q=meta(4, 16)), r"q must be \[T, Hq, D\], got shape \[4, 16\]"),
    (_rope, dict(k=meta(4, 8)), r"k must be \[T, Hkv, D\]"),
    (_rope, dict(q=meta(4, 2, 8, dtype=torch.int16)), "q must be float16, bfloat16 or float32"),
    (_rope, dict(k=meta(4, 1, 8, dtype=torch.float32)), "k is torch.float32 but q is torch.float16"),
    (_rope, dict(k=meta(5, 1, 8)), r"k must be \[T=4, Hkv, D=8\] to match q"),
    (_rope, dict(k=meta(4, 1, 6)), r"k must be \[T=4, Hkv, D=8\] to match q"),
    (_rope, dict(k=torch.empty(4, 1, 8, dtype=torch.float16)), "k is on cpu but q is on meta"),
    (_rope, dict(q=meta(4, 2, 7), k=meta(4, 1, 7)), "the head dimension D must be even and positive"),
    (_rope, dict(q=meta(4, 8, 2).transpose(1, 2)), "q must be contiguous along its last dimension"),
    (_rope, dict(q=meta(1, 2, 8).expand(4, 2, 8)), "q has elements that share memory"),
    (_rope, dict(k=meta(4, 1, 8).requires_grad_()), "k requires grad"),
    (_rope, dict(positions=meta(4, dtype=torch.float32)), r"positions must be int32 or int64 \[T=4\]"),
    (_rope, dict(positions=meta(5, dtype=torch.int64)), r"positions must be int32 or int64 \[T=4\], got shape \[5\]"),
    (_rope, dict(positions=meta(4, 1, dtype=torch.int64)), r"positions must be \[T=4\]"),
    (_rope, dict(positions=torch.arange(4)), "positions is on cpu but q is on meta"),
    (_rope, dict(inv_freq=meta(4)), r"inv_freq must be contiguous float32 \[D/2=4\], got shape \[4\], float16"),
    (_rope, dict(inv_freq=meta(8, dtype=torch.float32)), r"inv_freq must be contiguous float32 \[D/2=4\]"),
    (_rope, dict(inv_freq=meta(8, dtype=torch.float32)[::2]), r"inv_freq must be contiguous float32"),
    (_rope, dict(inv_freq=[1.0] * 4), "inv_freq must be a torch.Tensor"),
    (_rms, dict(delta=meta(4, 32)), r"delta must be a contiguous float32 \[T=4, 32\] \(x is shape \[4, 32\]"),
    (_rms, dict(delta=meta(4, 31, dtype=torch.float32)), r"delta must be a contiguous float32 \[T=4, 32\]"),
    (_rms, dict(delta=meta(32, 4, dtype=torch.float32).t()), r"delta must be a contiguous float32"),
    (_rms, dict(delta=torch.empty(4, 32)), "delta is on cpu but x is on meta"),
    (_silu, dict(delta=meta(4, 16, dtype=torch.float32)), r"delta must be a contiguous float32 \[T=4, 32\]"),
    (_silu, dict(delta=meta(4, 32, 1, dtype=torch.float32)), r"delta must be float32 \[T=4, 32\]"),
    (_rope, dict(delta=meta(4, 32, dtype=torch.float32)), "delta covers q, k and v: pass v too"),
    (_rope, dict(v=meta(4, 1, 8)), "v is only taken with a delta"),
    (_rope, dict(v=meta(4, 2, 8), delta=meta(4, 32, dtype=torch.float32)), r"v must be torch.float16 \[T=4, Hkv=1"),
    (_rope, dict(v=meta(4, 1, 8, dtype=torch.float32), delta=meta(4, 32, dtype=torch.float32)), r"v must be"),
    (_rope, dict(v=meta(1, 1, 8).expand(4, 1, 8), delta=meta(4, 32, dtype=torch.float32)), "v has elements"),
    (_rope, dict(v=meta(4, 1, 8), delta=meta(4, 24, dtype=torch.float32)),
     r"delta must be a contiguous float32 \[T=4, 32\] \(q is"),
]


@pytest.mark.parametrize("op, over, match", ERRORS, ids=[f"{op.__name__[1:]}-{m[:40]}" for op, _, m in ERRORS])
def test_bad_argument_is_named(op, over, match):
    with pytest.raises(ValueError, match=match):
        op(**over)


def test_good_arguments_pass_the_checks():
    """The baseline of every case above, on real CPU tensors."""
    _rms(x=torch.randn(4, 32).half(), weight=torch.ones(32).half(), residual=torch.randn(4, 32).half())
    _silu(gate_up=torch.randn(4, 32).half(), out=torch.empty(4, 16).half())
    _rope(q=torch.randn(4, 2, 8).half(), k=torch.randn(4, 1, 8).half(), positions=torch.arange(4),
          inv_freq=torch.rand(4))
    _rms(x=torch.randn(4, 32).half(), weight=torch.ones(32).half(), delta=torch.randn(4, 32))
    _silu(gate_up=torch.randn(4, 32).half(), delta=torch.randn(4, 32))
    _rope(q=torch.randn(4, 2, 8).half(), k=torch.randn(4, 1, 8).half(), positions=torch.arange(4),
          inv_freq=torch.rand(4), v=torch.randn(4, 1, 8).half(), delta=torch.randn(4, 32))


# ---------------------------------------------------------------------------------------------
# LoRA deltas (ops/lora/overlap.py leaves a projection's fp32 LoRA product for its consumer to add).
# Documented semantics: the op runs on `(t.float() + delta)` rounded to t's dtype. Both backends
# must give, bit for bit, what they give on that sum computed here; t itself is never written.


def _plus(t: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return (t.float() + delta).to(t.dtype)


def _delta_like(gen, t: torch.Tensor) -> torch.Tensor:
    """An fp32 delta of the input's own size order, so the sum moves most elements."""
    return t.float().abs().mean().clamp(min=1e-3) * torch.randn(t.shape, generator=gen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual, max_block", [(True, 8192), (False, 8192), (True, 64)])
def test_rms_norm_with_a_delta_is_the_norm_of_the_sum(backend, dtype, residual, max_block, monkeypatch):
    gen = torch.Generator().manual_seed(stable_seed("rms-delta", str(dtype), residual, max_block))
    T, H = 7, 200
    x = rows_with_scales(gen, T, H, dtype, large=False)
    r = rows_with_scales(gen, T, H, dtype, large=False) if residual else None
    w = (1 + 0.3 * torch.randn(H, generator=gen)).to(dtype)
    d = _delta_like(gen, x)
    x_in = x.clone()
    monkeypatch.setattr(fused_kernels, "RMS_MAX_BLOCK", max_block)
    out, s = fused.rms_norm(x, w, 1e-6, residual=r, delta=d, backend=backend)
    want, want_s = fused.rms_norm(_plus(x, d), w, 1e-6, residual=r, backend=backend)
    assert torch.equal(out, want) and torch.equal(s, want_s)
    assert torch.equal(x, x_in) and s.data_ptr() != x.data_ptr()
    assert not torch.equal(out, fused.rms_norm(x, w, 1e-6, residual=r, backend=backend)[0])  # the delta counted


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_with_a_delta_is_silu_of_the_sum(backend, dtype):
    gen = torch.Generator().manual_seed(stable_seed("silu-delta", str(dtype)))
    _, _, gate_up = _gate_up(gen, 5, 300, dtype)
    d = _delta_like(gen, gate_up)
    gate_up_in = gate_up.clone()
    out = fused.silu_and_mul(gate_up, out=torch.full((5, 300), float("nan"), dtype=dtype), delta=d, backend=backend)
    assert torch.equal(out, fused.silu_and_mul(_plus(gate_up, d), backend=backend))
    assert torch.equal(gate_up, gate_up_in)
    assert not torch.equal(out, fused.silu_and_mul(gate_up, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq, Hkv, D, tile", [(4, 2, 64, 1024), (6, 2, 128, 64), (3, 1, 80, 1024), (6, 3, 64, 128)])
@pytest.mark.parametrize("split", [False, True])
def test_rope_with_a_delta_rotates_the_sum_and_adds_v(backend, dtype, Hq, Hkv, D, tile, split, monkeypatch):
    """q, k, v as views of one fused qkv output and its fp32 delta; tile=64 loops over heads, or (`split`) gives
    each head (of q, k and v) a program; tile=128 at D=64 makes chunks of 4 heads, q's and k's last ones partial."""
    if split and backend == "reference":
        pytest.skip("the torch reference has no programs to split")
    monkeypatch.setattr(fused_kernels, "ROPE_SPLIT_TOKENS", 64 if split else 0)
    monkeypatch.setattr(fused_kernels, "ROPE_SPLIT_CHUNKS", 1)
    gen = torch.Generator().manual_seed(stable_seed("rope-delta", str(dtype), Hq, Hkv, D, tile))
    T = 9
    q, k, qkv = qkv_views(gen, T, Hq, Hkv, D, dtype, "fused")
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    positions = random_positions(gen, T)
    inv_freq = LlamaRotaryEmbedding(rope_config(Hq, Hkv, D)).inv_freq
    d = _delta_like(gen, qkv)
    want = _plus(qkv, d)
    q_want, k_want, _ = views_of(want, T, Hq, Hkv, D, "fused")
    monkeypatch.setattr(fused_kernels, "ROPE_TILE", tile)
    fused.apply_rope(q_want, k_want, positions, inv_freq, backend=backend)
    fused.apply_rope(q, k, positions, inv_freq, v=v, delta=d, backend=backend)
    assert torch.equal(qkv, want)


def _lora_delta(gen, t: torch.Tensor) -> tuple[LoraDelta, torch.Tensor]:
    """A LoraDelta over t's rows, some without an adapter (row_slot -1: their values are NaN, as an
    unwritten buffer may hold), and t with the delta added where a row has one (the documented result)."""
    T = t.shape[0]
    row_slot = torch.randint(0, 5, (T,), generator=gen, dtype=torch.int32)
    row_slot[torch.randperm(T, generator=gen)[:max(1, T // 3)]] = -1
    values = _delta_like(gen, t.reshape(T, -1)).contiguous()
    want = torch.where((row_slot >= 0).view(-1, *[1] * (t.dim() - 1)), _plus(t, values.view(t.shape)), t)
    values[row_slot < 0] = float("nan")
    return LoraDelta(values, row_slot), want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual, max_block", [(True, 8192), (False, 64)])
def test_lora_delta_reaches_only_rows_with_an_adapter(backend, dtype, residual, max_block, monkeypatch):
    """A LoraDelta (ops/lora/delta.py, not zero-filled): each consumer runs on
    round(t + delta) in rows with an adapter and on t, bit for bit, in the others, whose delta values
    (here NaN) are never read."""
    gen = torch.Generator().manual_seed(stable_seed("lora-delta", str(dtype), residual, max_block))
    monkeypatch.setattr(fused_kernels, "RMS_MAX_BLOCK", max_block)
    x = rows_with_scales(gen, 9, 200, dtype, large=False)
    x[0, :4] = -0.0   # a row without an adapter keeps even the sign of its zeros (x + 0.0 would not)
    r = rows_with_scales(gen, 9, 200, dtype, large=False) if residual else None
    w = (1 + 0.3 * torch.randn(200, generator=gen)).to(dtype)
    d, x_want = _lora_delta(gen, x)
    d.row_slot[0] = -1
    x_want[0] = x[0]
    out, s = fused.rms_norm(x, w, 1e-6, residual=r, delta=d, backend=backend)
    want, want_s = fused.rms_norm(x_want, w, 1e-6, residual=r, backend=backend)
    assert torch.equal(out, want) and torch.equal(s, want_s)
    if not residual:
        assert torch.equal(s[0, :4].view(torch.int16 if dtype != torch.float32 else torch.int32),
                           x[0, :4].view(torch.int16 if dtype != torch.float32 else torch.int32))

    _, _, gate_up = _gate_up(gen, 7, 300, dtype)
    d, gu_want = _lora_delta(gen, gate_up)
    out = fused.silu_and_mul(gate_up, delta=d, backend=backend)
    assert torch.equal(out, fused.silu_and_mul(gu_want, backend=backend))

    Hq, Hkv, D, T = 4, 2, 64, 7
    inv_freq = LlamaRotaryEmbedding(rope_config(Hq, Hkv, D)).inv_freq
    for split in (False, True):   # a program a token; a program a chunk of 2 heads (tiles of 64: half D is 32)
        monkeypatch.setattr(fused_kernels, "ROPE_SPLIT_CHUNKS", 1 if split else 1 << 30)
        monkeypatch.setattr(fused_kernels, "ROPE_TILE", 64 if split else 1024)
        q, k, qkv = qkv_views(gen, T, Hq, Hkv, D, dtype, "fused")
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
        positions = random_positions(gen, T)
        d, want = _lora_delta(gen, qkv)
        q_want, k_want, _ = views_of(want, T, Hq, Hkv, D, "fused")
        fused.apply_rope(q_want, k_want, positions, inv_freq, backend=backend)
        fused.apply_rope(q, k, positions, inv_freq, v=v, delta=d, backend=backend)
        assert torch.equal(qkv, want)
