"""ops/attention_shrink.py: decode attention whose kernel also computes the o projection's LoRA shrink.

Oracles: `out` is the plain op's bit for bit (and within the float64 attention loop's tolerance), and the
partials summed over kv heads are the documented sum in float64 over the op's own rounded `out`. Partials
are checked only where they are defined (rows a sequence owns with an adapter, columns below the rank).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_attention import BACKENDS, DECODE, TOL, _case, interpreted, make_case, max_err, stable_seed

from loraplex import ops
from loraplex.ops.attention import kernels as ak
from loraplex.ops.attention.attention_shrink import MAX_RANK, decode_attention_shrink


def shrink_f64(out: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, row_slot: torch.Tensor,
               rows: torch.Tensor) -> torch.Tensor:
    """float64 [T, R]: Σ_c out[m, c] · A[s, r, c] for owned rows m with s = row_slot[m] ≥ 0, r < rank; NaN elsewhere."""
    T, R = out.shape[0], lora_a.shape[1]
    flat = out.reshape(T, -1).double()
    want = torch.full((T, R), float("nan"), dtype=torch.float64)
    for m in range(T):
        s = int(row_slot[m])
        if not rows[m] or s < 0:
            continue
        for r in range(min(int(ranks[s]), R)):
            want[m, r] = (flat[m] * lora_a[s, r].double()).sum()
    return want


def _adapters(gen: torch.Generator, T: int, width: int, R: int, dtype, slots: int = 4):
    lora_a = (torch.randn(slots, R, width, generator=gen) * 0.3).to(dtype)
    ranks = torch.tensor([R + 5, 0, R // 2, 3][:slots], dtype=torch.int32)   # past R (counts as R), none, half, odd
    for s in range(slots):   # nothing past a slot's rank may be read
        lora_a[s, min(int(ranks[s]), R):] = float("nan")
    row_slot = torch.randint(-1, slots, (T,), generator=gen, dtype=torch.int32)
    row_slot[0], row_slot[1] = 0, 2   # at least two rows with an adapter
    return lora_a, ranks, row_slot


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["mha-d64-bs16", "gqa4-d16-bs32", "gqa3-d32-bs16", "mqa16-d16-bs8"])
@pytest.mark.parametrize("R", [16, 32])
@pytest.mark.parametrize("prefetch", [True, False])
def test_matches_the_attention_and_the_documented_sum(backend, dtype, layout, R, prefetch, monkeypatch):
    """`prefetch`: attention_kernels.LORA_PREFETCH_A (G = 1: A's tile loaded before the key walk, or after it)."""
    if not prefetch and (backend == "reference" or layout != "mha-d64-bs16"):
        pytest.skip("the setting only changes the Triton kernel with one head per program")
    monkeypatch.setattr(ak, "LORA_PREFETCH_A", prefetch)
    rng = np.random.default_rng(stable_seed("o-shrink", layout, R, dtype))
    case = _case(rng, DECODE, layout, dtype, window=0)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    T, Hq, D = case.q.shape
    lora_a, ranks, row_slot = _adapters(gen, T, Hq * D, R, dtype)
    out, part = decode_attention_shrink(*case.args(), max_seq_len=case.max_seq_len, scale=case.scale,
                                        lora_a=lora_a, ranks=ranks, row_slot=row_slot, backend=backend)
    rows = case.owned_rows()
    plain = torch.full_like(out, float("nan"))
    ops.paged_attention(*case.args(), **case.kwargs(max_query_len=1), out=plain, backend=backend)
    assert torch.equal(out[rows], plain[rows]), "out must be the plain attention's, bit for bit"
    assert max_err(out, case.oracle(), rows) <= TOL[dtype]
    assert part is not None and part.shape == (case.k_cache.shape[2], 1, T, R) and part.dtype == torch.float32
    want = shrink_f64(out, lora_a, ranks, row_slot, rows)
    defined = ~torch.isnan(want)
    assert int(defined.sum()) >= 3
    got = part[:, 0].double().sum(0)
    err = (got[defined] - want[defined]).abs().max().item()
    assert err <= 1e-5 * max(1.0, want[defined].abs().max().item()), f"max abs err {err:.2e}"


@interpreted
def test_split_contexts_leave_the_shrink_to_the_caller():
    """A small batch of long contexts takes the split kernel: no epilogue there, so part is None."""
    rng = np.random.default_rng(3)
    case = make_case(rng, [(599, 1), (400, 1)], Hq=2, Hkv=1, D=64, bs=16)
    assert ak.plan_decode(2, 1, case.max_seq_len, 0, case.q.device, ak.decode_config(64, torch.float32))[0] > 1
    lora_a, ranks, row_slot = _adapters(torch.Generator().manual_seed(0), case.q.shape[0], 128, 16, torch.float32)
    out, part = decode_attention_shrink(*case.args(), max_seq_len=case.max_seq_len, scale=case.scale,
                                        lora_a=lora_a, ranks=ranks, row_slot=row_slot, backend="triton")
    assert part is None
    assert max_err(out, case.oracle(), case.owned_rows()) <= TOL[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_past_the_epilogue_tile_leave_the_shrink_to_the_caller(backend):
    rng = np.random.default_rng(5)
    case = _case(rng, DECODE, "gqa4-d16-bs32", torch.float32)
    T, Hq, D = case.q.shape
    lora_a, ranks, row_slot = _adapters(torch.Generator().manual_seed(1), T, Hq * D, MAX_RANK * 2, torch.float32)
    out, part = decode_attention_shrink(*case.args(), max_seq_len=case.max_seq_len, scale=case.scale,
                                        lora_a=lora_a, ranks=ranks, row_slot=row_slot, backend=backend)
    assert part is None
    assert max_err(out, case.oracle(), case.owned_rows()) <= TOL[torch.float32]


@pytest.mark.parametrize("what, change, message", [
    ("lora_a width", lambda a, r, s: (a[:, :, :-1], r, s), "lora_a must be"),
    ("lora_a dtype", lambda a, r, s: (a.double(), r, s), "lora_a must be"),
    ("lora_a 2-D", lambda a, r, s: (a[0], r, s), "lora_a must be"),
    ("ranks length", lambda a, r, s: (a, r[:-1], s), "ranks must be"),
    ("ranks dtype", lambda a, r, s: (a, r.long(), s), "ranks must be"),
    ("row_slot length", lambda a, r, s: (a, r, s[:-1]), "row_slot must be"),
    ("row_slot dtype", lambda a, r, s: (a, r, s.long()), "row_slot must be"),
])
def test_bad_arguments_are_named(what, change, message):
    case = _case(np.random.default_rng(7), DECODE, "gqa4-d16-bs32", torch.float32)
    T, Hq, D = case.q.shape
    a, r, s = change(*_adapters(torch.Generator().manual_seed(2), T, Hq * D, 16, torch.float32))
    with pytest.raises(ValueError, match=message):
        decode_attention_shrink(*case.args(), max_seq_len=case.max_seq_len, scale=case.scale, lora_a=a, ranks=r,
                                row_slot=s, backend="reference")
    with pytest.raises(ValueError, match="max_seq_len"):   # and the attention's own checks
        decode_attention_shrink(*case.args(), max_seq_len=-1, scale=case.scale,
                                lora_a=_adapters(torch.Generator().manual_seed(2), T, Hq * D, 16, torch.float32)[0],
                                ranks=torch.zeros(4, dtype=torch.int32), row_slot=torch.zeros(T, dtype=torch.int32))


@interpreted
@pytest.mark.parametrize("layout", ["mha-d64-bs16", "gqa3-d32-bs16"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_the_kernel_writes_only_the_defined_partials(layout, prefetch, monkeypatch):
    """The launcher into a NaN-filled part: each kv head's partial of every row with an adapter, below its rank,
    is written (and equals that head's share of the sum); nothing else changes."""
    monkeypatch.setattr(ak, "LORA_PREFETCH_A", prefetch)
    rng = np.random.default_rng(stable_seed("o-shrink-only", layout, prefetch))
    case = _case(rng, DECODE, layout, torch.float32)
    T, Hq, D = case.q.shape
    Hkv, R = case.k_cache.shape[2], 16
    lora_a, ranks, row_slot = _adapters(torch.Generator().manual_seed(3), T, Hq * D, R, torch.float32)
    part = torch.full((Hkv, 1, T, R), float("nan"))
    out = torch.full(case.q.shape, float("nan"))
    assert ak.decode(*case.args(), out, max_seq_len=case.max_seq_len, scale=case.scale, window=0,
                     lora=(lora_a, ranks, row_slot, part))
    rows = case.owned_rows()
    written = ~torch.isnan(part[:, 0])                                            # [Hkv, T, R]
    rank = torch.where(row_slot >= 0, ranks[row_slot.clamp(min=0).long()].clamp(max=R), 0)
    defined = rows[:, None] & (torch.arange(R)[None, :] < rank[:, None])         # [T, R]
    assert torch.equal(written, defined[None].expand_as(written))
    G = Hq // Hkv
    for h in range(Hkv):   # each kv head's share: its G heads' columns
        cols = slice(h * G * D, (h + 1) * G * D)
        for m in torch.nonzero(defined.any(1)).flatten().tolist():
            r = int(rank[m])
            want = lora_a[int(row_slot[m]), :r, cols].double() @ out[m].reshape(-1)[cols].double()
            assert torch.allclose(part[h, 0, m, :r].double(), want, rtol=1e-5, atol=1e-6), (h, m)

