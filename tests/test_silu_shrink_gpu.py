"""ops/silu_shrink.py compiled, at Llama-2-7B's MLP width: out is fused.silu_and_mul's bits (after a LoraDelta
whose rows without an adapter hold NaN), and the partials sum to the float64 shrink of out."""
from __future__ import annotations

import pytest
import torch

from loraplex.ops.fused import api as fused
from loraplex.ops.lora.delta import LoraDelta
from loraplex.ops.fused.silu_shrink import silu_and_mul_shrink

pytestmark = pytest.mark.gpu
CUDA = "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_shrink_at_7b_width(dtype):
    gen = torch.Generator().manual_seed(11)
    T, I, R, slots = 32, 11008, 16, 40
    gate_up = torch.randn(T, 2 * I, generator=gen).to(dtype).to(CUDA)
    ranks = torch.randint(1, R + 1, (slots,), generator=gen, dtype=torch.int32)
    ranks[3] = 0
    lora_a = (torch.randn(slots, R, I, generator=gen) * I ** -0.5).to(dtype)
    row_slot = torch.randperm(slots, generator=gen)[:T].to(torch.int32)
    row_slot[::5] = -1
    row_slot[1] = 3
    values = torch.randn(T, 2 * I, generator=gen).to(CUDA)
    values[row_slot.to(CUDA) < 0] = float("nan")
    delta = LoraDelta(values, row_slot.to(CUDA))
    out, part = silu_and_mul_shrink(gate_up, lora_a.to(CUDA), ranks.to(CUDA), row_slot.to(CUDA), delta=delta)
    assert torch.equal(out, fused.silu_and_mul(gate_up, delta=delta))
    v = part.sum(0)[0].double().cpu()
    out64 = out.double().cpu()
    for m, s in enumerate(row_slot.tolist()):
        if s < 0:
            continue
        r = int(ranks[s])
        assert torch.isfinite(v[m, :r]).all()
        if r:
            want = lora_a[s, :r].double() @ out64[m]
            assert ((v[m, :r] - want).norm() / want.norm()).item() <= 1e-5
