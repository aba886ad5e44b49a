"""A LoRA product left unexpanded for the next op (ops/lora/product.py), on the CPU.

The consumers (rms_norm, silu_and_mul, apply_rope with `delta=LoraProduct`) are held to a float64
loop of product.py's documented semantics: each row with an adapter takes
`scaling · Σ_r (Σ_split part[split, slice, row, r]) · B[slot, n, r]`, rounded once onto the input;
rows without an adapter keep their bits. The partials of rows without an adapter, the partials past
each slot's rank and B's columns past it are NaN: reading any of them would show. The Triton
consumers run in Triton's interpreter; tests/test_fused_gpu.py runs them compiled.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from loraplex import ops
from loraplex.ops import LoraBatch
from loraplex.ops.fused import api as fused
from loraplex.ops.fused import lora_kernels as fused_lora_kernels
from loraplex.ops.fused import rope_lora
from loraplex.ops.lora.product import LoraProduct

from lora_cases import make_case, stable_seed
from oracle import add_lora_f64
from test_fused_ops import qkv_views, random_positions, rope_config, rows_with_scales, views_of

interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")
BACKENDS = ["reference", pytest.param("triton", marks=interpreted)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULPS = {torch.float32: 2.0 ** -20, torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -6}  # ~2 ulps, relative


def make_product(gen: torch.Generator, T: int, widths: tuple[int, ...], dtype: torch.dtype, *, R: int = 16,
                 split_k: int = 3, num_slots: int = 5, sizes: torch.Tensor | None = None,
                 lanes: int = 1) -> LoraProduct:
    """Random partials and B stacks; ranks 0..R per slot and slice (one slot of rank R), about a third of
    the rows without an adapter; every value that must not be read is NaN. `sizes`: the typical size
    of each row's input, so that deltas move most elements. `lanes` > 1: a composed batch's product, rows with an
    adapter combining it with up to lanes - 1 more (in lane order, as batches fill them; row T-1 with all)."""
    row_slot = torch.randint(-1, num_slots, (T,), generator=gen, dtype=torch.int32)
    row_slot[0], row_slot[-1] = -1, 0
    slots = torch.full((lanes, T), -1, dtype=torch.int32)
    slots[0] = row_slot
    for lane in range(1, lanes):
        more = (slots[lane - 1] >= 0) & (torch.rand(T, generator=gen) < 0.7)
        more[-1] = True
        slots[lane] = torch.where(more, torch.randint(0, num_slots, (T,), generator=gen, dtype=torch.int32), -1)
    part = torch.randn(split_k, len(widths), lanes * T, R, generator=gen)
    entry_slot = slots.reshape(-1)   # entry l·T + m: row m's member l
    lora_b, ranks, scalings = [], [], []
    for i, n in enumerate(widths):
        rk = torch.randint(0, R + 1, (num_slots,), generator=gen, dtype=torch.int32)
        rk[0], rk[1] = R, R + 7   # a rank past the stacks' width counts as the width
        b = torch.randn(num_slots, n, R, generator=gen)
        for s in range(num_slots):
            b[s, :, int(rk[s]):] = float("nan")
            part[:, i, entry_slot == s, int(rk[s]):] = float("nan")
        lora_b.append(b.to(dtype))
        ranks.append(rk)
        scalings.append((torch.rand(num_slots, generator=gen) + 0.5) / (R * split_k) ** 0.5)
    part[:, :, entry_slot < 0] = float("nan")
    if sizes is not None:
        scalings = [sc * float(sizes.mean()) for sc in scalings]
    extra = slots[1:].reshape(-1).contiguous() if lanes > 1 else None
    return LoraProduct(part, tuple(lora_b), tuple(ranks), tuple(scalings), row_slot, extra_slot=extra, lanes=lanes)


def delta_f64(p: LoraProduct, magnitude: bool = False) -> torch.Tensor:
    """The documented loop, float64 on the host: [T, Σwidths], rows without an adapter 0; a composed product's
    members after the first added to the same sum. `magnitude`: the same loop on absolute values (the scale of
    its fp32 rounding; tests/test_lora_product_gpu.py)."""
    part = p.part.cpu().double()
    out = torch.zeros(p.rows, p.width, dtype=torch.float64)
    R, T = part.shape[3], p.rows
    extra = p.extra_slot.cpu().view(p.lanes - 1, T) if p.lanes > 1 else torch.empty(0, T, dtype=torch.int32)
    for m in range(T):
        members = [(int(p.row_slot[m]), m)] + [(int(extra[l, m]), (l + 1) * T + m) for l in range(p.lanes - 1)]
        for s, e in members:
            if s < 0:
                continue
            col = 0
            for i, (b, rk, sc) in enumerate(zip(p.lora_b, p.ranks, p.scalings)):
                r = min(int(rk[s]), R)
                partials, b_s, scale = part[:, i, e, :r], b[s, :, :r].cpu().double(), float(sc[s])
                if magnitude:
                    partials, b_s, scale = partials.abs(), b_s.abs(), abs(scale)
                out[m, col:col + b.shape[1]] += scale * (b_s @ partials.sum(0))
                col += b.shape[1]
    return out


def plus_f64(t: torch.Tensor, p: LoraProduct) -> torch.Tensor:
    """t + the product, rounded once to t's dtype; rows without an adapter: t's own bits."""
    summed = (t.double() + delta_f64(p).view(t.shape)).to(t.dtype)
    return torch.where((p.row_slot < 0).view(-1, *[1] * (t.dim() - 1)), t, summed)


def assert_close_ulps(out: torch.Tensor, want: torch.Tensor, what: str, slack: torch.Tensor | float = 0.0) -> None:
    """Within ~2 ulps of the dtype: the kernel's fp32 product and the float64 one can round x + delta
    to neighbouring values. `slack`: more room where the fp32 product's own rounding, carried through
    the op, can exceed that (x + delta cancelling, then multiplied)."""
    assert not torch.isnan(out).any(), f"{what}: NaN (a value that must not be read was)"
    tol = ULPS[out.dtype] * want.double().abs() + 1e-6 + slack
    bad = (out.double() - want.double()).abs() > tol
    assert not bad.any(), \
        f"{what}: {int(bad.sum())} of {bad.numel()} elements off, e.g. {out[bad][:3]} vs {want[bad][:3]}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual, H, R, split, early, lanes", [
    (True, 200, 16, None, True, 1), (False, 200, 16, None, False, 1), (True, 96, 16, 32, True, 1),
    (True, 96, 40, None, True, 1), (True, 200, 16, 64, False, 1), (False, 96, 40, 32, True, 1),
    (True, 200, 16, 64, True, 3), (False, 96, 40, None, False, 2), (True, 200, 16, None, False, 4),
    (False, 200, 32, 64, True, 3), (True, 96, 40, None, False, 4)])
def test_rms_norm_expands_the_product(backend, dtype, residual, H, R, split, early, lanes, monkeypatch):
    """R=40: two rank tiles; split: each row over programs of `split` columns (rms_split.py; None: the default
    RMS_SPLIT, one chunk at these widths); early: the product's early reads (ops/pdl.py) where one rank tile
    holds the rank, else the plain loads; lanes > 1: a composed batch's product (rows combining adapters)."""
    gen = torch.Generator().manual_seed(stable_seed("rms-product", str(dtype), residual, H, R, split, lanes))
    if split:
        monkeypatch.setattr(fused_lora_kernels, "RMS_SPLIT", split)
    T = 9
    x = rows_with_scales(gen, T, H, dtype, large=False)
    r = rows_with_scales(gen, T, H, dtype, large=False) if residual else None
    w = (1 + 0.3 * torch.randn(H, generator=gen)).to(dtype)
    p = dataclasses.replace(make_product(gen, T, (H,), dtype, R=R, sizes=x.float().abs().mean(1), lanes=lanes),
                            early_reads=early)
    x_in = x.clone()
    out, s = fused.rms_norm(x, w, 1e-6, residual=r, delta=p, backend=backend)
    want, want_s = fused.rms_norm(plus_f64(x, p), w, 1e-6, residual=r, backend="reference")
    assert torch.equal(x, x_in) and s.data_ptr() != x.data_ptr()
    assert_close_ulps(s, want_s, "s")
    assert_close_ulps(out, want, "out")
    keep = p.row_slot < 0
    plain, plain_s = fused.rms_norm(x, w, 1e-6, residual=r, backend=backend)
    assert torch.equal(s[keep], plain_s[keep])   # rows without an adapter take nothing, not even +0
    if split is None:   # one chunk: the plain kernel sums the squares in one tile too, the same bits
        assert torch.equal(out[keep], plain[keep])
    assert not torch.equal(out[~keep], plain[~keep])   # the product counted


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("I, split_k, R, block, early, lanes", [
    (300, 3, 16, None, False, 1), (40, 1, 40, None, True, 1), (300, 2, 16, 64, False, 1), (300, 3, 16, None, True, 1),
    (300, 3, 16, 64, True, 3), (40, 2, 40, None, False, 2), (300, 2, 16, None, False, 4), (300, 2, 32, 64, True, 3),
    (40, 2, 40, None, False, 4)])
def test_silu_and_mul_expands_the_product(backend, dtype, I, split_k, R, block, early, lanes, monkeypatch):
    """R=40: rank columns in two tiles of the consumer's loop; block=64: several column blocks per row;
    early: the product's early reads (ops/pdl.py) where one rank tile holds the rank, else the plain loads;
    lanes > 1: a composed batch's product."""
    gen = torch.Generator().manual_seed(stable_seed("silu-product", str(dtype), I, split_k, R, block, lanes))
    if block:
        monkeypatch.setattr(fused_lora_kernels, "SILU_BLOCK", block)
    T = 7
    gate_up = (torch.randn(T, 2 * I, generator=gen) * 2).to(dtype)
    p = make_product(gen, T, (I, I), dtype, R=R, split_k=split_k, sizes=torch.full((T,), 2.0), lanes=lanes)
    p = dataclasses.replace(p, early_reads=early)
    gate_up_in = gate_up.clone()
    out = fused.silu_and_mul(gate_up, out=torch.full((T, I), float("nan"), dtype=dtype), delta=p, backend=backend)
    assert torch.equal(gate_up, gate_up_in)
    # The product's fp32 rounding (up to ~(split_k + R) ulps of its terms' magnitude) reaches the output
    # scaled by the other factor: where up + delta nearly cancels it is more than 2 ulps of the result
    # (seen on the CPU with R=40: 2.6e-6 off on 0.24, whatever BLAS sums first).
    mag = delta_f64(p, magnitude=True)
    g, u = (gate_up.double() + delta_f64(p)).split(I, dim=1)
    fp32_err = lanes * (split_k + R + 2) * 2.0 ** -24
    slack = fp32_err * (mag[:, I:] * (g * torch.sigmoid(g)).abs() + 1.1 * mag[:, :I] * u.abs())
    assert_close_ulps(out, fused.silu_and_mul(plus_f64(gate_up, p), backend="reference"), "out", slack)
    keep = p.row_slot < 0
    plain = fused.silu_and_mul(gate_up, backend=backend)
    assert torch.equal(out[keep], plain[keep]) and not torch.equal(out[~keep], plain[~keep])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq, Hkv, D, heads, R, lanes", [(4, 2, 64, None, 16, 1), (6, 2, 128, 4, 16, 1),
                                                         (3, 1, 80, 2, 16, 1), (4, 2, 64, 1, 40, 1),
                                                         (4, 2, 64, None, 16, 3), (6, 2, 128, 4, 40, 2),
                                                         (4, 2, 64, 1, 16, 4), (4, 2, 64, None, 32, 3),
                                                         (6, 2, 128, 4, 40, 4)])
def test_rope_expands_the_product_into_q_k_and_v(backend, dtype, Hq, Hkv, D, heads, R, lanes, monkeypatch):
    """q, k, v as views of one fused qkv output; `heads` per program below the head count: several
    head blocks per token (and k/v blocks past their heads, with GQA); R=40: two rank tiles; lanes > 1: a
    composed batch's product."""
    gen = torch.Generator().manual_seed(stable_seed("rope-product", str(dtype), Hq, Hkv, D, heads, R, lanes))
    T = 9
    q, k, qkv = qkv_views(gen, T, Hq, Hkv, D, dtype, "fused")
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    positions = random_positions(gen, T)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    inv_freq = LlamaRotaryEmbedding(rope_config(Hq, Hkv, D)).inv_freq
    p = make_product(gen, T, (Hq * D, Hkv * D, Hkv * D), dtype, R=R, sizes=qkv.float().abs().mean(1), lanes=lanes)
    if heads:
        monkeypatch.setattr(rope_lora, "ROPE_HEADS", heads)
    want = plus_f64(qkv, p)
    q_want, k_want, _ = views_of(want, T, Hq, Hkv, D, "fused")
    fused.apply_rope(q_want, k_want, positions, inv_freq, backend="reference")
    before = qkv.clone()
    fused.apply_rope(q, k, positions, inv_freq, v=v, delta=p, backend=backend)
    assert_close_ulps(qkv, want, "q|k|v")
    keep = p.row_slot < 0
    q0, k0, _ = views_of(before, T, Hq, Hkv, D, "fused")
    fused.apply_rope(q0, k0, positions, inv_freq, backend=backend)
    assert torch.equal(qkv[keep], before[keep])   # rows without an adapter: rotated only, v untouched
    assert not torch.equal(qkv[~keep], before[~keep])


@interpreted
@pytest.mark.parametrize("op, R, lanes", [("silu", 16, 1), ("rope", 16, 1), ("rope_gqa", 8, 1), ("rms_split", 16, 1),
                                          ("silu", 40, 1)])
def test_early_reads_give_the_same_bits(op, R, lanes, monkeypatch):
    """The consumers' early reads (ops/pdl.py: the rows' slots, ranks, scalings and B blocks read first, for a
    product with `early_reads`) give the bits the plain loads give (a product without it), which the tests above
    hold to the float64 loop. They apply where one rank tile holds the rank (R=40: two tiles, not taken); the
    launches' EARLY constexpr is checked, so the case cannot pass by not taking the path. (A composed product's
    variants run one code path, early or not: only where the PDL wait sits differs, tests/test_pdl.py's PTX check.)"""
    from loraplex.ops.fused import rms_split as fused_lora_rms_split
    gen = torch.Generator().manual_seed(stable_seed("early-reads", op, R, lanes))
    T, dtype = 9, torch.float16
    seen = []

    def spy(module, name):
        launcher = getattr(module, name)
        monkeypatch.setattr(module, name, lambda grid, args, consts, *rest: (seen.append(consts["EARLY"]),
                                                                             launcher(grid, args, consts, *rest)))

    if op == "silu":
        I = 300
        gate_up = (torch.randn(T, 2 * I, generator=gen) * 2).to(dtype)
        p = make_product(gen, T, (I, I), dtype, R=R, sizes=torch.full((T,), 2.0), lanes=lanes)
        spy(fused_lora_kernels, "_SILU")

        def run(p):
            return fused.silu_and_mul(gate_up, out=torch.full((T, I), float("nan"), dtype=dtype), delta=p,
                                      backend="triton")
    elif op == "rms_split":
        H = 200
        monkeypatch.setattr(fused_lora_kernels, "RMS_SPLIT", 64)
        x = rows_with_scales(gen, T, H, dtype, large=False)
        r = rows_with_scales(gen, T, H, dtype, large=False)
        w = (1 + 0.3 * torch.randn(H, generator=gen)).to(dtype)
        p = make_product(gen, T, (H,), dtype, R=R, sizes=x.float().abs().mean(1), lanes=lanes)
        spy(fused_lora_rms_split, "_SUMS")

        def run(p):
            return torch.cat(fused.rms_norm(x, w, 1e-6, residual=r, delta=p, backend="triton"), dim=1)
    else:   # RoPE of q, k and v; rope_gqa: 3 kv heads per 6 query heads, one head per program (k/v past theirs)
        Hq, Hkv, D = (4, 2, 64) if op == "rope" else (6, 3, 32)
        if op == "rope_gqa":
            monkeypatch.setattr(rope_lora, "ROPE_HEADS", 1)
        q, k, qkv = qkv_views(gen, T, Hq, Hkv, D, dtype, "fused")
        positions = random_positions(gen, T)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        inv_freq = LlamaRotaryEmbedding(rope_config(Hq, Hkv, D)).inv_freq
        p = make_product(gen, T, (Hq * D, Hkv * D, Hkv * D), dtype, R=R, sizes=qkv.float().abs().mean(1), lanes=lanes)
        qkv_in = qkv.clone()
        spy(rope_lora, "_ROPE")

        def run(p):
            qkv.copy_(qkv_in)
            fused.apply_rope(q, k, positions, inv_freq, v=qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D), delta=p,
                             backend="triton")
            return qkv.clone()
    assert p.early_reads
    plain = run(dataclasses.replace(p, early_reads=False))
    early = run(p)
    assert seen[0] is False and all(seen[1:]) is (R <= 32) and len(seen) == 2
    assert not torch.isnan(early).any() and torch.equal(early, plain)
    if op == "silu" and R <= 32:   # a product whose row slots the forward made (select): never read early
        selected = p.select(torch.arange(T))
        assert not selected.early_reads
        fused.silu_and_mul(gate_up, delta=selected, backend="triton")
        assert seen[-1] is False


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_linear_with_lora_product_leaves_the_shrink_for_the_next_op(dtype, regime):
    """ops/lora/overlap.py's `linear_with_lora_product` on one stream: y is the plain GEMM, and the product's
    dense form is add_lora's delta (rows without an adapter, and slices of rank 0, exactly 0)."""
    from loraplex.ops.lora import overlap
    rng = np.random.default_rng(stable_seed("product", str(dtype), regime))
    lens = [1] * 9 if regime == "decode" else [int(n) for n in rng.integers(1, 30, 5)]
    case = make_case(rng, seg_lens=lens, popularity="skewed", K=64, Ns=(48, 16, 16), R=16, ranks="mixed",
                     dtype=dtype, none_frac=0.3)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    weight = (torch.randn(80, 64, generator=gen) / 8).to(dtype)
    y, product = overlap.linear_with_lora_product(case.x, weight, None, case.lora_a, case.lora_b, case.batch(),
                                                  case.ranks, case.scalings, side=False)
    base = torch.nn.functional.linear(case.x, weight)
    assert torch.equal(y, base) and product.width == 80 and product.rows == base.shape[0]
    want = add_lora_f64(base, case.x, case.lora_a, case.lora_b, case.ranks, case.scalings, case.seg_lens,
                        case.slot_ids) - base.double()
    got = product.dense().double()
    zero = want == 0
    assert torch.equal(got[zero], torch.zeros(int(zero.sum()), dtype=torch.float64)) and zero.any() and not zero.all()
    err = (got - want).norm() / want.norm()
    assert err <= 1e-3, f"rel err {err:.2e}"


def test_row_slot_of_built_and_capacity_batches():
    b = LoraBatch.from_lengths([2, 0, 3, 1], [4, 1, -1, 0])
    assert b.row_slot.dtype == torch.int32 and b.row_slot.tolist() == [4, 4, -1, -1, -1, 0]
    cap = LoraBatch.with_capacity(8, 4, "cpu", num_slots=6)
    assert cap.row_slot.tolist() == [-1] * 8
    cap.update_([1, 2], [5, 3])
    assert cap.row_slot.tolist() == [5, 3, 3] + [-1] * 5   # padding rows: no adapter
    assert cap.num_work == -(-8 // cap.block_m) + 4


@pytest.mark.parametrize("lanes", [1, 3])
def test_select_keeps_the_rows_products(lanes):
    gen = torch.Generator().manual_seed(3)
    p = make_product(gen, 6, (10, 4), torch.float32, lanes=lanes)
    rows = torch.tensor([5, 0, 2])
    torch.testing.assert_close(p.dense().double(), delta_f64(p), rtol=1e-5, atol=1e-6)   # the reference's loop
    assert torch.equal(p.select(rows).dense(), p.dense()[rows])


def _meta_product(T=4, widths=(32,), dtype=torch.float16, **over) -> LoraProduct:
    parts = dict(part=torch.empty(2, len(widths), T, 8, device="meta"),
                 lora_b=tuple(torch.empty(3, n, 8, dtype=dtype, device="meta") for n in widths),
                 ranks=tuple(torch.empty(3, dtype=torch.int32, device="meta") for _ in widths),
                 scalings=tuple(torch.empty(3, device="meta") for _ in widths),
                 row_slot=torch.empty(T, dtype=torch.int32, device="meta"))
    parts.update(over)
    return LoraProduct(**parts)


def _meta(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("call, match", [
    (lambda: fused.rms_norm(_meta(4, 32), _meta(32), 1e-6, delta=_meta_product(widths=(16, 16))),
     r"delta expands to slices of widths \(16, 16\); x \(.*\) needs \(32,\)"),
    (lambda: fused.rms_norm(_meta(4, 32), _meta(32), 1e-6, delta=_meta_product(T=3)),
     r"delta.part must be float32 \[split_k, 1, T>=4, R\]"),
    (lambda: fused.rms_norm(_meta(4, 32), _meta(32), 1e-6, delta=_meta_product(row_slot=_meta(4, dtype=torch.int64))),
     r"delta.row_slot must be a contiguous int32"),
    (lambda: fused.rms_norm(_meta(4, 32), _meta(32), 1e-6, delta=_meta_product(dtype=torch.bfloat16)),
     r"delta.lora_b\[0\] must be a contiguous torch.float16"),
    (lambda: fused.rms_norm(_meta(4, 32), _meta(32), 1e-6,
                            delta=_meta_product(scalings=(_meta(3, dtype=torch.float16),))), r"scalings\[0\]"),
    (lambda: fused.rms_norm(_meta(4, 32), _meta(32), 1e-6, delta=_meta_product(part=torch.empty(2, 1, 4, 8))),
     "delta is on cpu but x is on meta"),
    (lambda: fused.rms_norm(_meta(4, 32), _meta(32), 1e-6,
                            delta=_meta_product(row_slot=torch.empty(4, 2, dtype=torch.int32, device="meta")[:, 0])),
     r"delta.row_slot must be a contiguous int32"),
    (lambda: fused.rms_norm(_meta(4, 32), _meta(32), 1e-6,
                            delta=_meta_product(ranks=(torch.empty(3, 2, dtype=torch.int32, device="meta")[:, 0],))),
     r"delta.ranks\[0\] / scalings\[0\] must be contiguous"),
    (lambda: fused.rms_norm(_meta(4, 32), _meta(32), 1e-6, delta=_meta_product(scalings=())),
     r"delta has 1 B stacks, 1 rank and 0 scaling tensors"),
    (lambda: fused.rms_norm(_meta(4, 32), _meta(32), 1e-6,
                            delta=_meta_product(ranks=(torch.empty(3, dtype=torch.int32),))),
     r"delta.ranks\[0\] is on cpu but x is on meta"),
    (lambda: fused.silu_and_mul(_meta(4, 32), delta=_meta_product(widths=(32,))),
     r"delta expands to slices of widths \(32,\); gate_up .* needs \(16, 16\)"),
    (lambda: fused.apply_rope(_meta(4, 2, 8), _meta(4, 1, 8), torch.empty(4, dtype=torch.int64, device="meta"),
                              torch.empty(4, device="meta"), v=_meta(4, 1, 8), delta=_meta_product(widths=(16, 8))),
     r"delta expands to slices of widths \(16, 8\); q .* needs \(16, 8, 8\)"),
    (lambda: fused.rms_norm(_meta(4, 32), _meta(32), 1e-6,
                            delta=_meta_product(part=_meta(2, 1, 8, 8, dtype=torch.float32), lanes=2,
                                                extra_slot=_meta(3, dtype=torch.int32))),
     r"delta.extra_slot must be a contiguous int32 \[\(lanes-1\)·T = 4\] on meta for 2 lanes"),
    (lambda: fused.rms_norm(_meta(4, 32), _meta(32), 1e-6, delta=_meta_product(lanes=2,
                                                                               extra_slot=_meta(4, dtype=torch.int32))),
     r"delta.part has 4 entries; 2 lanes of 4 rows need 8"),
    (lambda: fused.rms_norm(_meta(4, 32), _meta(32), 1e-6, delta=_meta_product(extra_slot=_meta(4, dtype=torch.int32))),
     r"delta.extra_slot is given for lanes = 1; it needs lanes > 1"),
])
def test_a_product_that_does_not_fit_is_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()
