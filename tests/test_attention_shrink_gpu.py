"""ops/attention_shrink.py compiled at Llama widths on the GPU: `out` the plain decode attention's bits, and
partials (one per kv head) that sum to the float64 shrink of that output. A's rows past each rank are NaN
(the epilogue must not read them)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex import ops
from loraplex.ops.attention import kernels as ak
from loraplex.ops.attention.attention_shrink import decode_attention_shrink

from test_attention import make_case, stable_seed

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hq, Hkv, R, longest, prefetch", [(32, 32, 16, 900, True), (32, 32, 16, 900, False),
                                                           (32, 32, 64, 900, True), (32, 8, 16, 250, True),
                                                           (32, 8, 64, 250, True), (32, 8, 16, 900, True)])
def test_o_shrink_in_decode_attention_at_llama_widths(dtype, Hq, Hkv, R, longest, prefetch, monkeypatch):
    """Llama-2-7B's heads (A's tile loaded before the key walk, or after it), Llama-3-8B's; at batch 32 the latter's
    contexts past 512 tokens split (no epilogue)."""
    monkeypatch.setattr(ak, "LORA_PREFETCH_A", prefetch)
    rng = np.random.default_rng(stable_seed("o-shrink-gpu", Hq, Hkv, R, longest, prefetch, str(dtype)))
    seqs = [(int(c), 1) for c in rng.integers(longest // 4, longest, 32)]
    case = make_case(rng, seqs, Hq=Hq, Hkv=Hkv, D=128, bs=16, dtype=dtype, device="cuda", pad_rows=0)
    T = case.q.shape[0]
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    slots = 40
    lora_a = (torch.randn(slots, R, Hq * 128, generator=gen) * (Hq * 128) ** -0.5).to(dtype)
    ranks = torch.randint(1, R + 1, (slots,), generator=gen, dtype=torch.int32)
    ranks[3] = R + 7   # counts as R
    for s in range(slots):
        lora_a[s, min(int(ranks[s]), R):] = float("nan")
    row_slot = torch.randperm(slots, generator=gen)[:T].to(torch.int32)
    row_slot[::5] = -1
    row_slot[1] = 3   # the rank past R
    lora_a, ranks, row_slot = lora_a.cuda(), ranks.cuda(), row_slot.cuda()
    out, part = decode_attention_shrink(*case.args(), max_seq_len=case.max_seq_len, scale=case.scale, lora_a=lora_a,
                                        ranks=ranks, row_slot=row_slot)
    splits = ak.plan_decode(len(seqs), Hkv, case.max_seq_len, 0, case.q.device, ak.decode_config(128, dtype))[0]
    assert (part is None) == (splits > 1)
    plain = ops.paged_attention(*case.args(), **case.kwargs(max_query_len=1))
    assert torch.equal(out, plain)
    if part is None:
        return
    flat = out.reshape(T, -1).double().cpu()
    got = part[:, 0].double().sum(0).cpu()
    a = lora_a.double().cpu()
    for m in range(T):
        s = int(row_slot[m])
        if s < 0:
            continue
        rank = min(int(ranks[s]), R)
        want = a[s, :rank] @ flat[m]
        assert torch.allclose(got[m, :rank], want, rtol=1e-5, atol=1e-5), (m, (got[m, :rank] - want).abs().max())
