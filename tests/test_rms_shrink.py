"""ops/rms_shrink.py on the CPU (the reference, and the Triton kernels through TRITON_INTERPRET=1): the split
RMSNorm expanding a projection's product gives fused.rms_norm's outputs, and its partials sum to the next
projection's shrink of them (float64 loop)."""
from __future__ import annotations

import pytest
import torch

from loraplex import ops
from loraplex.ops.fused import api as fused
from loraplex.ops.fused import lora_kernels as fused_lora_kernels
from loraplex.ops.fused.rms_shrink import rms_norm_shrink

from lora_cases import stable_seed
from test_fused_ops import rows_with_scales
from test_lora_product import make_product

interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")
BACKENDS = ["reference", pytest.param("triton", marks=interpreted)]


def _next_adapters(gen, slices: int, slots: int, R: int, H: int, dtype):
    lora_a, ranks = [], []
    for _ in range(slices):
        rk = torch.randint(0, R + 1, (slots,), generator=gen, dtype=torch.int32)
        rk[0], rk[1] = R, R + 5    # a rank past the stack's width counts as R
        a = (torch.randn(slots, R, H, generator=gen) * H ** -0.5).to(dtype)
        for s in range(slots):     # nothing past a slot's rank may be read
            a[s, min(int(rk[s]), R):] = float("nan")
        lora_a.append(a)
        ranks.append(rk)
    return lora_a, ranks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H, block, slices, R, residual", [(200, 64, 3, 16, True), (96, 32, 2, 40, False),
                                                          (256, 256, 1, 8, True)])
def test_outputs_are_the_split_norms_and_part_sums_to_the_next_shrink(backend, dtype, H, block, slices, R, residual,
                                                                      monkeypatch):
    gen = torch.Generator().manual_seed(stable_seed("rms-shrink", str(dtype), H, block, slices, R, residual))
    T, slots = 9, 5
    x = rows_with_scales(gen, T, H, dtype, large=False)
    r = rows_with_scales(gen, T, H, dtype, large=False) if residual else None
    w = (1 + 0.3 * torch.randn(H, generator=gen)).to(dtype)
    product = make_product(gen, T, (H,), dtype, num_slots=slots, sizes=x.float().abs().mean(1))
    lora_a, ranks = _next_adapters(gen, slices, slots, R, H, dtype)
    x_in = x.clone()
    out, s, part = rms_norm_shrink(x, w, 1e-6, residual=r, delta=product, lora_a=lora_a, ranks=ranks,
                                   row_slot=product.row_slot, block=block, backend=backend)
    monkeypatch.setattr(fused_lora_kernels, "RMS_SPLIT", block)   # the same split through the plain op
    want, want_s = fused.rms_norm(x, w, 1e-6, residual=r, delta=product, backend=backend)
    assert torch.equal(out, want) and torch.equal(s, want_s) and torch.equal(x, x_in)
    assert part.dtype == torch.float32 and part.shape[1:] == (slices, T, R)
    if backend == "triton":
        assert part.shape[0] == -(-H // block)
    v = part.sum(0)
    checked = 0
    for m, slot in enumerate(product.row_slot.tolist()):
        if slot < 0:
            continue
        for i in range(slices):
            rank = min(int(ranks[i][slot]), R)
            if rank:
                want_v = lora_a[i][slot, :rank].double() @ out[m].double()
                err = ((v[i, m, :rank].double() - want_v).norm() / want_v.norm()).item()
                assert err <= 1e-5, f"row {m} slot {slot} slice {i}: rel err {err:.2e}"
                checked += 1
    assert checked >= 3


def test_bad_arguments_name_what_is_wrong():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32).half()
    w = torch.ones(32).half()
    product = make_product(gen, 4, (32,), torch.float16)
    lora_a, ranks = _next_adapters(gen, 2, 5, 16, 32, torch.float16)
    ok = dict(residual=None, delta=product, lora_a=lora_a, ranks=ranks, row_slot=product.row_slot, block=16,
              backend="reference")
    for change, message in [(dict(delta=torch.zeros(4, 32)), "delta must be a LoraProduct"),
                            (dict(block=24), "block must be a power of two"),
                            (dict(lora_a=lora_a * 2, ranks=ranks * 2), "lists of 1 to 3 slices"),
                            (dict(lora_a=[lora_a[0], lora_a[1].float()]), r"lora_a\[1\] must be a torch.float16"),
                            (dict(ranks=[ranks[0], ranks[1].long()]), r"ranks\[1\] must be a contiguous int32"),
                            (dict(row_slot=product.row_slot[:3]), r"row_slot must be a contiguous int32 \[4\]"),
                            (dict(lora_a=[lora_a[0], lora_a[1][:, :8]]),
                             r"lora_a\[1\] must be shaped and strided as lora_a\[0\]"),
                            (dict(lora_a=[lora_a[0], lora_a[1][:, :, :16]]), r"lora_a\[1\] must be a .*H=32"),
                            (dict(residual=torch.zeros(4, 32)), "residual must match x")]:
        with pytest.raises(ValueError, match=message):
            rms_norm_shrink(x, w, 1e-6, **{**ok, **change})
