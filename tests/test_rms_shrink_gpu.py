"""ops/rms_shrink.py compiled at Llama-2-7B's widths: the split RMSNorm's bits (as fused.rms_norm with the same
RMS_SPLIT), and partials that sum to the float64 shrink of its output for q/k/v's three slices."""
from __future__ import annotations

import pytest
import torch

from loraplex.ops.fused import api as fused
from loraplex.ops.fused import lora_kernels as fused_lora_kernels
from loraplex.ops.fused.rms_shrink import rms_norm_shrink

from test_lora_product import make_product

pytestmark = pytest.mark.gpu
CUDA = "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H, block, R", [(4096, 512, 16), (4096, 1024, 16), (5120, 1024, 64), (4096, 2048, 16)])
def test_rms_shrink_at_7b_widths(dtype, H, block, R, monkeypatch):
    """R=64: four rank tiles, a rank past R, NaN past each rank; H=5120 at 1,024 columns: a partial chunk."""
    gen = torch.Generator().manual_seed(5)
    T, slots = 32, 8
    x = torch.randn(T, H, generator=gen).to(dtype)
    r = torch.randn(T, H, generator=gen).to(dtype)
    w = (1 + 0.3 * torch.randn(H, generator=gen)).to(dtype)
    product = make_product(gen, T, (H,), dtype, num_slots=slots, split_k=8, sizes=x.float().abs().mean(1))
    lora_a, ranks = [], []
    for _ in range(3):
        rk = torch.randint(1, R + 1, (slots,), generator=gen, dtype=torch.int32)
        rk[1] = R + 5   # counts as R
        a = (torch.randn(slots, R, H, generator=gen) * H ** -0.5).to(dtype)
        for s in range(slots):   # nothing past a slot's rank may be read
            a[s, min(int(rk[s]), R):] = float("nan")
        lora_a.append(a.to(CUDA))
        ranks.append(rk.to(CUDA))
    cuda = lambda t: t.to(CUDA)  # noqa: E731
    p = type(product)(cuda(product.part), tuple(map(cuda, product.lora_b)), tuple(map(cuda, product.ranks)),
                      tuple(map(cuda, product.scalings)), cuda(product.row_slot))
    out, s, part = rms_norm_shrink(cuda(x), cuda(w), 1e-5, residual=cuda(r), delta=p, lora_a=lora_a, ranks=ranks,
                                   row_slot=p.row_slot, block=block)
    monkeypatch.setattr(fused_lora_kernels, "RMS_SPLIT", block)
    want, want_s = fused.rms_norm(cuda(x), cuda(w), 1e-5, residual=cuda(r), delta=p)
    assert torch.equal(out, want) and torch.equal(s, want_s)
    v = part.sum(0).double().cpu()
    out64 = out.double().cpu()
    checked = 0
    for m, slot in enumerate(product.row_slot.tolist()):
        if slot < 0:
            continue
        for i in range(3):
            k = min(int(ranks[i][slot]), R)
            want_v = lora_a[i][slot, :k].double().cpu() @ out64[m]
            assert ((v[i, m, :k] - want_v).norm() / want_v.norm()).item() <= 1e-5
            checked += 1
    assert checked >= 30
