"""GPU tests (`pytest -m gpu`): the ops that expand a LoraProduct (ops/fused/lora_kernels.py and rms_split.py,
the decode LoRA path of ops/lora/overlap.py), compiled, against a float64 loop of ops/lora/product.py's semantics
and against the plain fused kernels (tests/test_fused_gpu.py) on the same sums.
"""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from loraplex.ops.fused import api as fused
from loraplex.ops.fused import lora_kernels as fused_lora_kernels
from loraplex.ops.lora.product import LoraProduct

from test_fused_gpu import CUDA, RMS_TOL, SILU_TOL, _gen
from test_lora_product import delta_f64
from test_fused_ops import ROPE_REL, assert_ulps, random_positions, rope_config, rope_error_bound

pytestmark = pytest.mark.gpu

# The consumers of a LoraProduct (ops/fused/lora_kernels.py: the decode LoRA path of ops/lora/overlap.py),
# compiled, at Llama-2-7B widths (H=4096, I=11008, 32 q heads, 32 or 8 kv heads, D=128), with the
# partials of a split-K shrink (8 splits) and rank-16 stacks: slot 1 has rank 8 (and rank 0 in the last
# slice: an adapter without that projection), row 1 has no adapter. Everything the kernels must not read
# is NaN: B past each slot's rank, the partials past a row's rank and all partials of rows without an
# adapter (the shrink leaves them unwritten).

LORA_T, LORA_R, LORA_SPLIT_K, LORA_SLOTS = 32, 16, 8, 4   # overlap.MAX_ROWS rows
LORA_H, LORA_I, LORA_HQ, LORA_D = 4096, 11008, 32, 128
LORA_DTYPES = [torch.bfloat16, torch.float16]
# Share of elements whose rounded sum `t + delta` may differ from the float64 sum rounded once (the
# kernel's fp32 product is off float64's by ~2⁻²⁴ relative; measured on an H200: ~1e-4 of the elements in
# bf16, ~3e-4 in fp16, a few ulps apart only where t and delta cancel), and of silu_and_mul's outputs
# that may then differ from the plain op on the float64 sums (measured ≤ 4e-4).
LORA_FLIP_FRAC = 5e-3
# The consumers' early reads (ops/pdl.py; LoraProduct.early_reads) off and on: the tests below set it (with it on,
# the compiled sums contract into FMAs differently: bits may differ from it off, within the same bounds)
EARLY = [pytest.param(False, id="plain"), pytest.param(True, id="early")]


def _lora_product(gen: torch.Generator, widths: tuple[int, ...], dtype: torch.dtype, exact: bool,
                  early: bool = True, lanes: int = 1) -> LoraProduct:
    """A LoraProduct on CUDA as the shrink leaves it (see the section's comment), read early by the consumers
    where one rank tile holds the rank if `early` (LoraProduct.early_reads). `exact`: every partial,
    B value and scaling a small dyadic number, so that each product, and each sum of products in any
    order, is exact in fp32 (the kernels' order and `dense()`'s agree to the bit); else Gaussian.
    Either way each delta is about as large as the unit-scale inputs, so sums move most elements. `lanes` > 1: a
    composed batch's product, most rows with an adapter combining it with more (lane by lane, as batches fill)."""
    T, R, S, K = LORA_T, LORA_R, LORA_SLOTS, LORA_SPLIT_K
    row_slot = torch.randint(-1, S, (T,), generator=gen, dtype=torch.int32)
    row_slot[0], row_slot[1] = 1, -1
    slots = torch.full((lanes, T), -1, dtype=torch.int32)
    slots[0] = row_slot
    for lane in range(1, lanes):
        more = (slots[lane - 1] >= 0) & (torch.rand(T, generator=gen) < 0.7)
        slots[lane] = torch.where(more, torch.randint(0, S, (T,), generator=gen, dtype=torch.int32), -1)
    entry_slot = slots.reshape(-1)   # entry l·T + m: row m's member l
    if exact:
        part = torch.randint(-8, 9, (K, len(widths), lanes * T, R), generator=gen).float() / 16
    else:
        part = torch.randn(K, len(widths), lanes * T, R, generator=gen) / K ** 0.5
    lora_b, ranks, scalings = [], [], []
    for i, n in enumerate(widths):
        rk = torch.full((S,), R, dtype=torch.int32)
        rk[1] = 0 if i == len(widths) - 1 and len(widths) > 1 else R // 2
        if exact:
            b = torch.randint(-8, 9, (S, n, R), generator=gen).float() / 16
            sc = 2.0 ** torch.randint(-2, 2, (S,), generator=gen).float()
        else:
            b = torch.randn(S, n, R, generator=gen) * rk.clamp_min(1).float().rsqrt()[:, None, None]
            sc = torch.rand(S, generator=gen) * 2 + 0.25
        for s in range(S):
            b[s, :, int(rk[s]):] = float("nan")
            part[:, i, entry_slot == s, int(rk[s]):] = float("nan")
        lora_b.append(b.to(CUDA, dtype))
        ranks.append(rk.to(CUDA))
        scalings.append(sc.to(CUDA))
    part[:, :, entry_slot < 0] = float("nan")
    extra = slots[1:].reshape(-1).contiguous().to(CUDA) if lanes > 1 else None
    return LoraProduct(part.to(CUDA), tuple(lora_b), tuple(ranks), tuple(scalings), row_slot.to(CUDA),
                       early_reads=early, extra_slot=extra, lanes=lanes)


def _delta_f64(p: LoraProduct, magnitude: bool = False) -> torch.Tensor:
    """tests/test_lora_product.py's float64 loop of product.py's docstring, on CUDA."""
    return delta_f64(p, magnitude).to(CUDA)


def _plus(t: torch.Tensor, p: LoraProduct, delta: torch.Tensor, fp32: bool) -> torch.Tensor:
    """t plus its product `delta` (float64 `[T, ...]`), rounded once to t's dtype: through an fp32 sum as
    the kernels add (`fp32`, for exact products) or from the float64 sum; rows without an adapter keep t."""
    d = delta.view(t.shape)
    summed = (t.float() + d.float()) if fp32 else (t.double() + d)
    return torch.where((p.row_slot < 0).view(-1, *[1] * (t.dim() - 1)), t, summed.to(t.dtype))


def _check_dense(p: LoraProduct, delta: torch.Tensor, exact: bool) -> None:
    """The reference backend's product (`dense()`, fp32) against the float64 loop: bit for bit when every
    sum is exact, else to fp32 rounding; rows without an adapter get exactly 0."""
    dense = p.dense()
    assert not torch.isnan(dense).any(), "dense() read a value past a rank or of a row without an adapter"
    assert torch.equal(dense[p.row_slot < 0], torch.zeros_like(dense[p.row_slot < 0]))
    if exact:
        assert torch.equal(dense.double(), delta)
    else:
        assert ((dense.double() - delta).norm() / delta.norm()).item() <= 1e-6


def _rope_inputs(gen: torch.Generator, Hkv: int, dtype: torch.dtype):
    """(qkv [T, (Hq+2·Hkv)·D] on CUDA, its q/k/v views, positions, inv_freq)."""
    T, Hq, D = LORA_T, LORA_HQ, LORA_D
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen).to(CUDA, dtype)
    positions = random_positions(gen, T).to(CUDA)
    inv_freq = LlamaRotaryEmbedding(rope_config(Hq, Hkv, D, "llama3")).inv_freq.to(CUDA)
    return qkv, _qkv_of(qkv, Hkv), positions, inv_freq


def _qkv_of(buf: torch.Tensor, Hkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, Hq, D = buf.shape[0], LORA_HQ, LORA_D
    return (buf[:, :Hq * D].view(T, Hq, D), buf[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D),
            buf[:, (Hq + Hkv) * D:].view(T, Hkv, D))


@pytest.mark.parametrize("dtype", LORA_DTYPES)
@pytest.mark.parametrize("Hkv", [32, 8])
@pytest.mark.parametrize("early", EARLY)
@pytest.mark.parametrize("lanes", [1, 3])
def test_lora_product_consumers_are_the_ops_on_the_exact_sum(dtype, Hkv, early, lanes):
    """Products exact in fp32 (dyadic data): each consumer with a LoraProduct gives, bit for bit, what the
    plain kernel gives on `round(t + delta)`, delta the float64 loop of product.py's docstring (equal
    to `dense()` here to the bit); rms_norm's output only to its own tolerance, since the LoRA kernel sums
    the squares tile by tile. Inputs that are only read stay unwritten; the reference backend, fed the
    same product, agrees within the ops' tolerances (RMS_TOL, SILU_TOL, the rope bound). lanes 3: a composed
    batch's product, every member of a row in the one sum."""
    gen = _gen("lora-exact", str(dtype), Hkv, lanes)
    T, H, I, Hq, D = LORA_T, LORA_H, LORA_I, LORA_HQ, LORA_D
    w = (1 + 0.3 * torch.randn(H, generator=gen)).to(CUDA, dtype)

    p = _lora_product(gen, (H,), dtype, exact=True, early=early, lanes=lanes)
    d = _delta_f64(p)
    _check_dense(p, d, exact=True)
    x = torch.randn(T, H, generator=gen).to(CUDA, dtype)
    want_x = _plus(x, p, d, fp32=True)
    assert (want_x != x).float().mean().item() > 0.5, "the product must move most elements"
    for r in (None, torch.randn(T, H, generator=gen).to(CUDA, dtype)):
        x_in = x.clone()
        out, s = fused.rms_norm(x, w, 1e-5, residual=r, delta=p)
        assert torch.equal(x, x_in) and s.data_ptr() != x.data_ptr()
        want, want_s = fused.rms_norm(want_x, w, 1e-5, residual=r)
        assert torch.equal(s, want_s), f"residual={r is not None}: s"
        assert_ulps(out, want, *RMS_TOL[dtype], what=f"rms_norm residual={r is not None}")
        ref, ref_s = fused.rms_norm(x, w, 1e-5, residual=r, delta=p, backend="reference")
        assert torch.equal(s, ref_s)
        assert_ulps(out, ref, *RMS_TOL[dtype], what=f"rms_norm vs reference, residual={r is not None}")

    p = _lora_product(gen, (I, I), dtype, exact=True, early=early, lanes=lanes)
    d = _delta_f64(p)
    _check_dense(p, d, exact=True)
    gate_up = (torch.randn(T, 2 * I, generator=gen) * torch.tensor([4.0, 1.0]).repeat_interleave(I)).to(CUDA, dtype)
    gate_up_in = gate_up.clone()
    out = fused.silu_and_mul(gate_up, out=torch.full((T, I), float("nan"), dtype=dtype, device=CUDA), delta=p)
    assert torch.equal(gate_up, gate_up_in)
    assert torch.equal(out, fused.silu_and_mul(_plus(gate_up, p, d, fp32=True)))
    ref = fused.silu_and_mul(gate_up, delta=p, backend="reference")
    assert_ulps(out, ref, *SILU_TOL[dtype], what="silu_and_mul vs reference")

    p = _lora_product(gen, (Hq * D, Hkv * D, Hkv * D), dtype, exact=True, early=early, lanes=lanes)
    d = _delta_f64(p)
    _check_dense(p, d, exact=True)
    qkv, (q, k, v), positions, inv_freq = _rope_inputs(gen, Hkv, dtype)
    sums = _plus(qkv, p, d, fp32=True)
    want, ref_buf = sums.clone(), qkv.clone()
    q_w, k_w, _ = _qkv_of(want, Hkv)
    fused.apply_rope(q_w, k_w, positions, inv_freq)
    fused.apply_rope(q, k, positions, inv_freq, v=v, delta=p)
    assert torch.equal(qkv, want)
    q_r, k_r, v_r = _qkv_of(ref_buf, Hkv)
    fused.apply_rope(q_r, k_r, positions, inv_freq, v=v_r, delta=p, backend="reference")
    assert torch.equal(v, v_r)
    q_s, k_s, _ = _qkv_of(sums, Hkv)
    for got, ref, x_in, name in ((q, q_r, q_s, "q"), (k, k_r, k_s, "k")):
        err = (got.double() - ref.double()).abs()
        bound = rope_error_bound(x_in, ROPE_REL[dtype])
        assert (err <= bound).all(), f"{name}: {(err / bound).max().item():.2f}× the bound"
        assert (err > 0).float().mean().item() <= 1e-3, name


def _assert_sum(got: torch.Tensor, t: torch.Tensor, p: LoraProduct, what: str) -> None:
    """`got`, the kernel's `round(t + delta)`, against the float64 sum: within the fp32 rounding of the
    kernel's product and sum (a split sum, a rank sum, the scaling and the add: ≤ (split_k + R + 2)·2⁻²⁴ of
    the magnitudes involved) plus half an ulp of the dtype; and off the float64 sum rounded once on few
    elements only. An ulp count would not do: where t and delta cancel, the product's fp32 error is
    several ulps of the small sum (measured: 2-3 ulps in fp16 on ~1e-4 of the elements)."""
    assert not torch.isnan(got).any(), f"{what}: NaN (a value that must not be read was)"
    exact = t.double() + _delta_f64(p).view(t.shape)
    fp32_err = (LORA_SPLIT_K + LORA_R + 2) * 2.0 ** -24 * (_delta_f64(p, magnitude=True).view(t.shape) + exact.abs())
    info = torch.finfo(t.dtype)
    bound = fp32_err * (1 + info.eps) + info.eps / 2 * exact.abs() + info.smallest_normal * info.eps
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"{what}: {(err / bound).max().item():.2f}× the bound"
    off = (got != exact.to(t.dtype)).float().mean().item()
    assert off <= LORA_FLIP_FRAC, f"{what}: {off:.2%} of the elements off the float64 sum rounded once"


@pytest.mark.parametrize("dtype", LORA_DTYPES)
@pytest.mark.parametrize("Hkv", [32, 8])
@pytest.mark.parametrize("early", EARLY)
def test_lora_product_consumers_match_float64_on_gaussian_data(dtype, Hkv, early):
    """Gaussian partials, B and scalings (fp32 rounding in every sum): the sums the kernels form (s of
    rms_norm; q, k and v of apply_rope at position 0, where the rotation is the identity) are the float64
    `t + delta` up to the fp32 rounding of the product and the dtype's, and off it rounded once on few
    elements; rows without an adapter keep their bits; rms_norm normalizes its own sum, and at other
    positions apply_rope rotates its own sums as the plain kernel does (bit for bit); silu_and_mul differs
    from the plain op on the float64 sums on few elements only, and not at all on rows without an adapter.
    (The exact-sum test above holds every element to the bit.)"""
    gen = _gen("lora-gaussian", str(dtype), Hkv)
    T, H, I, Hq, D = LORA_T, LORA_H, LORA_I, LORA_HQ, LORA_D

    p = _lora_product(gen, (H,), dtype, exact=False, early=early)
    keep = p.row_slot < 0
    d = _delta_f64(p)
    _check_dense(p, d, exact=False)
    x = torch.randn(T, H, generator=gen).to(CUDA, dtype)
    w = (1 + 0.3 * torch.randn(H, generator=gen)).to(CUDA, dtype)
    out, s = fused.rms_norm(x, w, 1e-5, delta=p)
    _assert_sum(s, x, p, "rms_norm s")
    assert torch.equal(s[keep], x[keep])
    want, _ = fused.rms_norm(s.clone(), w, 1e-5)
    assert_ulps(out, want, *RMS_TOL[dtype], what="rms_norm of its own sum")

    p = _lora_product(gen, (I, I), dtype, exact=False, early=early)
    keep = p.row_slot < 0
    d = _delta_f64(p)
    _check_dense(p, d, exact=False)
    gate_up = (torch.randn(T, 2 * I, generator=gen) * torch.tensor([4.0, 1.0]).repeat_interleave(I)).to(CUDA, dtype)
    out = fused.silu_and_mul(gate_up, out=torch.full((T, I), float("nan"), dtype=dtype, device=CUDA), delta=p)
    assert not torch.isnan(out).any()
    want = fused.silu_and_mul(_plus(gate_up, p, d, fp32=False))
    assert (out != want).float().mean().item() <= LORA_FLIP_FRAC
    assert torch.equal(out[keep], fused.silu_and_mul(gate_up)[keep])

    p = _lora_product(gen, (Hq * D, Hkv * D, Hkv * D), dtype, exact=False, early=early)
    keep = p.row_slot < 0
    d = _delta_f64(p)
    _check_dense(p, d, exact=False)
    qkv, (q, k, v), positions, inv_freq = _rope_inputs(gen, Hkv, dtype)
    sums = qkv.clone()
    q0, k0, v0 = _qkv_of(sums, Hkv)
    fused.apply_rope(q0, k0, torch.zeros_like(positions), inv_freq, v=v0, delta=p)   # cos 1, sin 0: the sums
    _assert_sum(sums, qkv, p, "apply_rope q | k | v at position 0")
    assert torch.equal(sums[keep], qkv[keep])
    want = sums.clone()
    q_w, k_w, _ = _qkv_of(want, Hkv)
    fused.apply_rope(q_w, k_w, positions, inv_freq)
    fused.apply_rope(q, k, positions, inv_freq, v=v, delta=p)
    assert torch.equal(qkv, want)


@pytest.mark.parametrize("dtype", LORA_DTYPES)
@pytest.mark.parametrize("early", EARLY)
def test_cuda_graph_of_the_lora_product_consumers(dtype, early):
    """rms_norm (+ residual), silu_and_mul and apply_rope with LoraProducts, captured once and replayed
    with new inputs, partials and row slots (other adapters, other rows without one) copied into the same
    buffers: each replay gives the eager kernels' bits. `early`: the products' early reads (ops/pdl.py, with
    PDL where the GPU has it)."""
    gen = _gen(str(dtype), "lora-graph")
    T, H, I, Hq, Hkv, D = LORA_T, LORA_H, LORA_I, LORA_HQ, 8, LORA_D
    products = [_lora_product(gen, widths, dtype, exact=False, early=early)
                for widths in ((H,), (I, I), (Hq * D, Hkv * D, Hkv * D))]
    w = (1 + 0.3 * torch.randn(H, generator=gen)).to(CUDA, dtype)
    inv_freq = LlamaRotaryEmbedding(rope_config(Hq, Hkv, D, "llama3")).inv_freq.to(CUDA)

    def fresh() -> list[torch.Tensor]:
        """New inputs, and for each product new partials and row slots (the B stacks stay)."""
        new = [torch.randn(T, H, generator=gen).to(CUDA, dtype), torch.randn(T, H, generator=gen).to(CUDA, dtype),
               torch.randn(T, 2 * I, generator=gen).to(CUDA, dtype),
               torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen).to(CUDA, dtype), random_positions(gen, T).to(CUDA)]
        for p in products:
            other = _lora_product(gen, tuple(b.shape[1] for b in p.lora_b), dtype, exact=False)
            new += [other.part, other.row_slot]
        return new

    def with_parts(p: LoraProduct, part: torch.Tensor, row_slot: torch.Tensor) -> LoraProduct:
        return LoraProduct(part, p.lora_b, p.ranks, p.scalings, row_slot, early_reads=early)

    def step(x, res, gate_up, qkv, positions, *parts) -> tuple[torch.Tensor, ...]:
        p_rms, p_mlp, p_qkv = (with_parts(p, parts[2 * i], parts[2 * i + 1]) for i, p in enumerate(products))
        out, s = fused.rms_norm(x, w, 1e-6, residual=res, delta=p_rms)
        y = fused.silu_and_mul(gate_up, delta=p_mlp)
        fused.apply_rope(*_qkv_of(qkv, Hkv)[:2], positions, inv_freq, v=_qkv_of(qkv, Hkv)[2], delta=p_qkv)
        return out, s, y

    bufs = fresh()
    qkv0 = bufs[3].clone()
    step(*bufs)  # compile outside the capture
    bufs[3].copy_(qkv0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(*bufs)
    for trial in range(3):
        new = fresh()
        for buf, value in zip(bufs, new):
            buf.copy_(value)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_in = [t.clone() for t in new]
        eager = step(*eager_in)
        for got, want, name in zip((*outs, bufs[3]), (*eager, eager_in[3]), ("out", "s", "silu", "qkv")):
            assert torch.equal(got, want), f"trial {trial}: {name}"


@pytest.mark.parametrize("dtype", LORA_DTYPES)
@pytest.mark.parametrize("split", [256, 512, 1024])
def test_rms_norm_with_rows_over_several_programs(dtype, split, monkeypatch):
    """lora_kernels.RMS_SPLIT (rms_split.py: each row over programs of `split` columns, two launches): s is
    the float64 `x + delta` as in the test above, rows without an adapter keep their bits, out is the plain
    RMSNorm of s (RMS_TOL: another order of the sum of squares), and a second call gives the same bits (the
    chunks' sums are added in a fixed order)."""
    monkeypatch.setattr(fused_lora_kernels, "RMS_SPLIT", split)
    gen = _gen("lora-rms-split", str(dtype), split)
    T, H = LORA_T, LORA_H
    p = _lora_product(gen, (H,), dtype, exact=False)
    x = torch.randn(T, H, generator=gen).to(CUDA, dtype)
    w = (1 + 0.3 * torch.randn(H, generator=gen)).to(CUDA, dtype)
    out, s = fused.rms_norm(x, w, 1e-5, delta=p)
    again, again_s = fused.rms_norm(x, w, 1e-5, delta=p)
    assert torch.equal(out, again) and torch.equal(s, again_s)
    _assert_sum(s, x, p, f"rms_norm s over programs of {split} columns")
    keep = p.row_slot < 0
    assert keep.any() and torch.equal(s[keep], x[keep])
    want, _ = fused.rms_norm(s.clone(), w, 1e-5)
    assert_ulps(out, want, *RMS_TOL[dtype], what=f"rms_norm over programs of {split} columns")
