"""GPU tests (`pytest -m gpu`): the fused-op kernels against transformers on CUDA at Llama widths,
row offsets past 2³¹ elements, the direct launcher, and CUDA-graph capture and replay.

The bounds are the ones tests/test_fused_ops.py derives, with CUDA's own math on both sides: the
kernels call libdevice's expf/cosf/sinf/rsqrtf, the functions PyTorch's CUDA kernels compile to.
Each comparison also prints the fraction of elements equal to transformers' bit for bit (run with
-s to see it): 100% is expected for s (the residual add), silu and rope; rms_norm can differ in the
last bit of rare elements because it sums squares in another order.
"""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from loraplex import ops
from loraplex.ops.fused import api as fused
from loraplex.ops.fused import kernels as fused_kernels
from loraplex.ops.lora.delta import LoraDelta

from lora_cases import stable_seed
from test_fused_ops import (ROPE_REL, assert_ulps, hf_rms_norm, hf_rope, hf_silu_and_mul, qkv_views, random_positions,
                            rope_config, rope_error_bound, rows_with_scales, ulps)

pytestmark = pytest.mark.gpu
CUDA = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (max ulps, max fraction of elements that differ). rms_norm: the mean can move by a few fp32 ulps
# (another summation order); fp32 elements follow it (≤ 8 ulps), 16-bit ones only next to a rounding
# boundary (n by 1 ulp, weight·n by ≤ 2). silu: same expf and IEEE division as PyTorch; only a
# different FMA contraction of 1 + exp(-g) could move silu by an ulp, a·up by ≤ 2.
RMS_TOL = {torch.float32: (8, 1.0), torch.float16: (2, 1e-3), torch.bfloat16: (2, 1e-3)}
SILU_TOL = {torch.float32: (2, 1e-3), torch.float16: (2, 1e-3), torch.bfloat16: (2, 1e-3)}


def _report(what: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    same = (ulps(got, ref) == 0).float().mean().item() if got.numel() else 1.0
    print(f"{what}: {same:.6%} of elements bit-identical to transformers")


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(stable_seed(*parts))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [4096, 5120, 3584, 8192, 16384])
def test_rms_norm_matches_transformers(dtype, H):
    """Llama-7B/13B/70B, Qwen2-7B widths; 16384 takes the tiled two-pass path."""
    gen = _gen(str(dtype), H)
    w = (1 + 0.3 * torch.randn(H, generator=gen)).to(CUDA, dtype)
    for T in (1, 7, 300):
        x = rows_with_scales(gen, T, H, dtype, large=True).to(CUDA)
        r = rows_with_scales(gen, T, H, dtype, large=True).to(CUDA)
        for residual in (None, r):
            out, s = fused.rms_norm(x, w, 1e-5, residual=residual)
            ref, ref_s = hf_rms_norm(x, w, 1e-5, residual)
            assert torch.equal(s, ref_s)
            _report(f"rms_norm {dtype} H={H} T={T} residual={residual is not None}", out, ref)
            assert_ulps(out, ref, *RMS_TOL[dtype], what=f"T={T}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("I", [11008, 14336, 28672])
def test_silu_and_mul_matches_transformers(dtype, I):
    gen = _gen(str(dtype), I)
    for T in (1, 33, 512):
        gate = (4 * torch.randn(T, I, generator=gen)).to(CUDA, dtype)
        up = torch.randn(T, I, generator=gen).to(CUDA, dtype)
        out = torch.full((T, I), float("nan"), dtype=dtype, device=CUDA)
        fused.silu_and_mul(torch.cat((gate, up), 1), out=out)
        ref = hf_silu_and_mul(gate, up)
        _report(f"silu_and_mul {dtype} I={I} T={T}", out, ref)
        assert_ulps(out, ref, *SILU_TOL[dtype], what=f"T={T}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq, Hkv", [(32, 32), (32, 8)])
@pytest.mark.parametrize("scaling", ["default", "llama3"])
def test_rope_matches_transformers(dtype, Hq, Hkv, scaling):
    """Llama-7B (MHA) and GQA heads, D=128, positions up to 131071, q/k as views of a fused qkv output."""
    gen = _gen(str(dtype), Hq, Hkv, scaling)
    rotary = LlamaRotaryEmbedding(rope_config(Hq, Hkv, 128, scaling)).to(CUDA)
    for T in (1, 64, 1024):
        q, k, qkv = qkv_views(gen, T, Hq, Hkv, 128, dtype, "fused", device=CUDA)
        positions = random_positions(gen, T).to(CUDA)
        q_in, k_in, v_in = q.clone(), k.clone(), qkv[:, (Hq + Hkv) * 128:].clone()
        ref_q, ref_k = hf_rope(q, k, positions, rotary)
        fused.apply_rope(q, k, positions, rotary.inv_freq)
        assert torch.equal(qkv[:, (Hq + Hkv) * 128:], v_in)
        for got, ref, x, name in ((q, ref_q, q_in, "q"), (k, ref_k, k_in, "k")):
            _report(f"rope {name} {dtype} Hq={Hq} Hkv={Hkv} {scaling} T={T}", got, ref)
            err = (got.double() - ref.double()).abs()
            bound = rope_error_bound(x, ROPE_REL[dtype])
            assert (err <= bound).all(), f"{name} T={T}: {(err / bound).max().item():.2f}× the bound"
            if dtype != torch.float32:  # in 16 bits a cos/sin an ulp apart rarely survives the rounding
                assert (err > 0).float().mean().item() <= 1e-3


def test_rope_cos_sin_precision_on_cuda():
    """cos/sin the kernel computes (read back through q = (1…1, 0…0) in fp32) against float64 of the
    same fp32 angles (≤ 2⁻²³: CUDA's cosf/sinf are within 2 ulps for any angle) and against torch.cos
    on CUDA, the same library function."""
    T, D = 4096, 128
    positions = random_positions(_gen("cos"), T).to(CUDA)
    inv_freq = LlamaRotaryEmbedding(rope_config(1, 1, D)).inv_freq.to(CUDA)
    qk = torch.zeros(T, 2, D, device=CUDA)
    qk[:, :, :D // 2] = 1
    fused.apply_rope(qk[:, :1], qk[:, 1:], positions, inv_freq)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = qk[:, 0, :D // 2], qk[:, 0, D // 2:]
    assert (cos.double() - angles.double().cos()).abs().max().item() <= 2.0 ** -23
    assert (sin.double() - angles.double().sin()).abs().max().item() <= 2.0 ** -23
    _report("cos vs torch.cos (fp32, CUDA)", cos, angles.cos())
    _report("sin vs torch.sin (fp32, CUDA)", sin, angles.sin())
    assert (cos - angles.cos()).abs().max().item() <= 2.0 ** -23


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_backend_on_cuda_is_transformers(dtype):
    gen = _gen(str(dtype), "reference")
    x, r = (torch.randn(9, 4096, generator=gen).to(CUDA, dtype) for _ in range(2))
    w = torch.randn(4096, generator=gen).to(CUDA, dtype)
    out, s = fused.rms_norm(x, w, 1e-6, residual=r, backend="reference")
    ref, ref_s = hf_rms_norm(x, w, 1e-6, r)
    assert torch.equal(out, ref) and torch.equal(s, ref_s)
    gate, up = (torch.randn(9, 11008, generator=gen).to(CUDA, dtype) for _ in range(2))
    assert torch.equal(fused.silu_and_mul(torch.cat((gate, up), 1), backend="reference"), hf_silu_and_mul(gate, up))
    rotary = LlamaRotaryEmbedding(rope_config(32, 8, 128, "llama3")).to(CUDA)
    q, k, _ = qkv_views(gen, 9, 32, 8, 128, dtype, "fused", device=CUDA)
    positions = random_positions(gen, 9).to(CUDA)
    ref_q, ref_k = hf_rope(q, k, positions, rotary)
    fused.apply_rope(q, k, positions, rotary.inv_freq, backend="reference")
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


def test_offsets_past_2_31_elements():
    """Row offsets are int64: the last rows of buffers with more than 2³¹ elements are right."""
    dtype, tail = torch.bfloat16, 4
    H = 8192
    T = (1 << 31) // H + 8
    x = torch.randn(T, H, dtype=dtype, device=CUDA)
    w = torch.randn(H, dtype=dtype, device=CUDA)
    out, _ = fused.rms_norm(x, w, 1e-6)
    ref, _ = hf_rms_norm(x[-tail:], w, 1e-6)
    assert_ulps(out[-tail:], ref, *RMS_TOL[dtype])
    del x, out
    I = 28672
    T = (1 << 31) // (2 * I) + 8
    gate_up = torch.randn(T, 2 * I, dtype=dtype, device=CUDA)
    y = fused.silu_and_mul(gate_up)
    assert_ulps(y[-tail:], hf_silu_and_mul(gate_up[-tail:, :I], gate_up[-tail:, I:]), *SILU_TOL[dtype])
    del gate_up, y
    Hq, Hkv, D = 32, 8, 128
    T = (1 << 31) // ((Hq + 2 * Hkv) * D) + 8
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, dtype=dtype, device=CUDA)
    q, k = qkv[:, :Hq * D].view(T, Hq, D), qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    positions = torch.randint(0, 131072, (T,), device=CUDA)
    rotary = LlamaRotaryEmbedding(rope_config(Hq, Hkv, D)).to(CUDA)
    q_in, k_in = q[-tail:].clone(), k[-tail:].clone()
    ref_q, ref_k = hf_rope(q_in, k_in, positions[-tail:], rotary)
    fused.apply_rope(q, k, positions, rotary.inv_freq)
    for got, ref, x_in in ((q[-tail:], ref_q, q_in), (k[-tail:], ref_k, k_in)):
        assert ((got.double() - ref.double()).abs() <= rope_error_bound(x_in, ROPE_REL[dtype])).all()


def test_direct_launch_matches_tritons_own_launch():
    """After the first call, ops/launch.py launches the compiled kernel directly; it must pick the same
    kernel Triton would (vary pointer alignment, widths divisible by 16 or not, dtypes) and pass the
    float arguments (eps, 1/H) through unchanged."""
    launchers = (fused_kernels._RMS, fused_kernels._SILU, fused_kernels._ROPE)
    assert all(launcher.enabled for launcher in launchers), "fast launch is expected on this Triton"
    gen = _gen("direct")
    for dtype, H, I, offset in ((torch.bfloat16, 4096, 11008, 0), (torch.float16, 200, 72, 1),
                                (torch.bfloat16, 5120, 13824, 3)):
        buf = torch.randn(5, H + offset, generator=gen).to(CUDA, dtype)
        x, r = buf[:, offset:], torch.randn(5, H, generator=gen).to(CUDA, dtype)  # x's rows unaligned
        w = torch.randn(H, generator=gen).to(CUDA, dtype)
        gate_up = torch.randn(5, 2 * I + offset, generator=gen).to(CUDA, dtype)[:, offset:]
        qkv_buf = torch.randn(5, 48 * 128 + offset, generator=gen).to(CUDA, dtype)
        positions = random_positions(gen, 5).to(CUDA)
        inv_freq = LlamaRotaryEmbedding(rope_config(32, 8, 128)).inv_freq.to(CUDA)

        def run():
            out, s = fused.rms_norm(x, w, 1e-5, residual=r)
            y = fused.silu_and_mul(gate_up)
            qkv = qkv_buf.clone()[:, offset:]  # q and k unaligned too
            fused.apply_rope(qkv[:, :4096].view(5, 32, 128), qkv[:, 4096:5120].view(5, 8, 128), positions, inv_freq)
            return out, s, y, qkv

        direct = [launcher.direct_launches for launcher in launchers]
        outs = []
        for fast in (True, True, False):  # first call compiles through Triton, the second launches directly
            for launcher in launchers:
                launcher.enabled = fast
            outs.append(run())
        for launcher in launchers:
            launcher.enabled = True
        assert all(launcher.direct_launches > d for launcher, d in zip(launchers, direct)), "direct path unused"
        for a, b, c in zip(*outs):
            assert torch.equal(a, c) and torch.equal(b, c)
        ref, _ = hf_rms_norm(x, w, 1e-5, r)
        assert_ulps(outs[1][0], ref, *RMS_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_graph_capture_and_replay(dtype):
    """A decode-step slice (add + norm, SiLU-and-mul, rope in place) captured once and replayed on new
    inputs copied into the same buffers: each replay gives the eager kernels' bits."""
    gen = _gen(str(dtype), "graph")
    T, H, I, Hq, Hkv, D = 48, 4096, 11008, 32, 8, 128

    def fresh():
        return (torch.randn(T, H, generator=gen).to(CUDA, dtype), torch.randn(T, H, generator=gen).to(CUDA, dtype),
                torch.randn(T, 2 * I, generator=gen).to(CUDA, dtype),
                torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen).to(CUDA, dtype),
                random_positions(gen, T).to(CUDA))

    x, res, gate_up, qkv, positions = fresh()
    w = torch.randn(H, generator=gen).to(CUDA, dtype)
    inv_freq = LlamaRotaryEmbedding(rope_config(Hq, Hkv, D, "llama3")).inv_freq.to(CUDA)
    q, k = qkv[:, :Hq * D].view(T, Hq, D), qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)

    def step():
        out, s = fused.rms_norm(x, w, 1e-6, residual=res)
        y = fused.silu_and_mul(gate_up)
        fused.apply_rope(q, k, positions, inv_freq)
        return out, s, y

    qkv0 = qkv.clone()
    step()  # compile outside the capture
    qkv.copy_(qkv0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for trial in range(3):
        new = fresh()
        for buf, value in zip((x, res, gate_up, qkv, positions), new):
            buf.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        x_e, res_e, gate_up_e, qkv_e, pos_e = (t.clone() for t in new)
        out_e, s_e = fused.rms_norm(x_e, w, 1e-6, residual=res_e)
        y_e = fused.silu_and_mul(gate_up_e)
        fused.apply_rope(qkv_e[:, :Hq * D].view(T, Hq, D), qkv_e[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D), pos_e,
                         inv_freq)
        for got, want in zip((*outs, qkv), (out_e, s_e, y_e, qkv_e)):
            assert torch.equal(got, want), f"trial {trial}"
        ref, _ = hf_rms_norm(x_e, w, 1e-6, res_e)
        assert_ulps(outs[0], ref, *RMS_TOL[dtype], what=f"trial {trial}")


def test_auto_backend_is_triton_on_cuda(monkeypatch):
    calls = []
    real = fused_kernels.silu_and_mul
    monkeypatch.setattr(fused_kernels, "silu_and_mul", lambda *a, **kw: (calls.append(1), real(*a, **kw)))
    monkeypatch.delenv("LORAPLEX_OPS_BACKEND", raising=False)
    fused.silu_and_mul(torch.randn(2, 64, device=CUDA))
    assert calls and ops.resolve_backend(None, torch.device(CUDA)) == "triton"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("Hkv", [8, 32])
def test_lora_deltas_are_added_before_each_op(dtype, rows, Hkv):
    """The compiled kernels with an fp32 LoRA delta (ops/lora/overlap.py) give, bit for bit, what they give
    on `(t.float() + delta)` rounded to the dtype, at Llama-2-7B widths; the inputs are not written.
    `rows`: the delta is a LoraDelta (ops/lora/delta.py) with rows without an adapter, whose values
    (NaN here, as an unwritten buffer may hold) are never read: those rows' t stays as it is. 32 kv heads: RoPE
    runs a program per chunk of heads (`rope_splits`), 8: a program a token."""
    gen = _gen("delta-gpu", str(dtype), rows, Hkv)
    T, H, I, Hq, D = 32, 4096, 11008, 32, 128
    row_slot = torch.randint(0, 8, (T,), generator=gen, dtype=torch.int32)
    row_slot[::3] = -1
    row_slot = row_slot.to(CUDA)

    def pair(*shape):
        t = torch.randn(*shape, generator=gen).to(dtype)
        d = (t.float().abs().mean() * torch.randn(*shape, generator=gen)).to(CUDA)
        if not rows:
            return t.to(CUDA), d
        return t.to(CUDA), LoraDelta(torch.where((row_slot < 0)[:, None], float("nan"), d), row_slot)

    def plus(t, d):
        if not rows:
            return (t.float() + d).to(t.dtype)
        return torch.where((row_slot < 0)[:, None], t, (t.float() + d.values).to(t.dtype))

    x, d = pair(T, H)
    r, w = torch.randn(T, H, generator=gen).to(dtype).to(CUDA), torch.rand(H, generator=gen).to(dtype).to(CUDA)
    x_in = x.clone()
    out, s = fused.rms_norm(x, w, 1e-5, residual=r, delta=d)
    want, want_s = fused.rms_norm(plus(x, d), w, 1e-5, residual=r)
    assert torch.equal(out, want) and torch.equal(s, want_s) and torch.equal(x, x_in)
    gate_up, d = pair(T, 2 * I)
    assert torch.equal(fused.silu_and_mul(gate_up, delta=d), fused.silu_and_mul(plus(gate_up, d)))
    qkv, d = pair(T, (Hq + 2 * Hkv) * D)
    want = plus(qkv, d)
    positions = torch.randint(0, 4096, (T,), generator=gen).to(CUDA)
    inv_freq = LlamaRotaryEmbedding(rope_config(Hq, Hkv, D)).inv_freq.to(CUDA)

    def views(buf):
        return (buf[:, :Hq * D].view(T, Hq, D), buf[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D),
                buf[:, (Hq + Hkv) * D:].view(T, Hkv, D))

    q, k, v = views(qkv)
    fused.apply_rope(q, k, positions, inv_freq, v=v, delta=d)
    q_w, k_w, _ = views(want)
    fused.apply_rope(q_w, k_w, positions, inv_freq)
    assert torch.equal(qkv, want)

