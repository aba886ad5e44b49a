"""GPU tests (`pytest -m gpu`) of the paged-attention kernels.

- At Llama shapes (head_dim 128, 32 query heads over 32 or 8 kv heads) in bf16 and fp16, against
  PyTorch's scaled_dot_product_attention run in fp32 on the same values, one sequence at a time
  (is_causal for a whole prefill, an explicit mask for chunks, decode rows and sliding windows).
- On small cases against the float64 loop of the documented semantics (make_case's NaN-poisoned
  slots and garbage block-table entries included), fp32 too.
- Split-KV decode at 4k+ contexts, a cache past 2^31 elements, and a decode step (store_kv +
  paged_attention) captured in a CUDA graph and replayed over new batches written in place.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from loraplex import ops
from loraplex.ops.attention import launchers as ak

from test_attention import AttnCase, make_case, max_err, stable_seed

pytestmark = pytest.mark.gpu

# Max abs error against an fp32 SDPA of the same values (|out| ≲ 3 for unit-normal V): out is
# rounded once to the 16-bit type (half an ulp: 2^-9 · 4 ≈ 8e-3 in bf16, 2^-11 · 4 ≈ 2e-3 in
# fp16 at |out| < 4) and P enters the PV product rounded to the same type.
TOL = {torch.bfloat16: 2.5e-2, torch.float16: 5e-3, torch.float32: 2e-5}
# Relative error norm: bf16 keeps 8 bits (~4e-3 per rounding), fp16 11 bits (~5e-4).
REL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
LLAMA2, LLAMA3 = (32, 32), (32, 8)  # (Hq, Hkv) at head_dim 128

# (cached, new rows): full prefills (2000, 512 rows), chunks over cached prefixes, decode rows at
# short and long contexts, a q_len-0 sequence, a 129-row chunk (one row into a second tile).
MIXED = [(0, 2000), (0, 512), (700, 300), (1500, 1), (30, 1), (900, 0), (200, 129), (0, 2), (1999, 1)]


def sdpa_f32(case: AttnCase) -> torch.Tensor:
    """fp32 [T, Hq, D]: torch's SDPA per sequence on the gathered pages (NaN for unowned rows)."""
    q, kc, vc = case.q, case.k_cache, case.v_cache
    T, Hq, D = q.shape
    bs, Hkv = kc.shape[1], kc.shape[2]
    out = torch.full((T, Hq, D), float("nan"), dtype=torch.float32, device=q.device)
    starts, lens = case.query_start.tolist(), case.seq_lens.tolist()
    for s, L in enumerate(lens):
        begin, end = starts[s], starts[s + 1]
        n = end - begin
        if n == 0:
            continue
        blocks = case.block_tables[s, :-(-L // bs)].long()
        K = kc[blocks].reshape(-1, Hkv, D)[:L].float().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        V = vc[blocks].reshape(-1, Hkv, D)[:L].float().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        Q = q[begin:end].float().transpose(0, 1)  # [Hq, n, D]
        if n == L and case.window == 0:
            o = F.scaled_dot_product_attention(Q, K, V, is_causal=True, scale=case.scale)
        else:
            pos = torch.arange(L - n, L, device=q.device)[:, None]
            j = torch.arange(L, device=q.device)[None, :]
            mask = j <= pos
            if case.window:
                mask &= j > pos - case.window
            o = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, scale=case.scale)
        out[begin:end] = o.transpose(0, 1)
    return out


def _run(case: AttnCase, **kw) -> torch.Tensor:
    out = torch.full(case.q.shape, float("nan"), dtype=case.q.dtype, device=case.q.device)
    assert ops.paged_attention(*case.args(), **case.kwargs(), out=out, **kw) is out
    return out


def _check(case: AttnCase, out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    rows = case.owned_rows()
    assert torch.isnan(out[~rows]).all(), "rows no sequence owns were written"
    err = max_err(out, ref, rows)
    rel = ((out[rows].double() - ref[rows].double()).norm() / ref[rows].double().norm()).item()
    assert err <= TOL[dtype] and rel <= REL[dtype], f"max abs err {err:.2e}, rel err {rel:.2e}"


def _llama_case(seed, seqs, heads, dtype, **kw) -> AttnCase:
    Hq, Hkv = heads
    return make_case(np.random.default_rng(seed), seqs, Hq=Hq, Hkv=Hkv, D=128, bs=kw.pop("bs", 16), dtype=dtype,
                     device="cuda", **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [LLAMA2, LLAMA3], ids=["llama2", "llama3"])
@pytest.mark.parametrize("window", [0, 256])
def test_mixed_batch_vs_sdpa(dtype, heads, window):
    case = _llama_case(stable_seed("mixed", str(dtype), heads, window), MIXED, heads, dtype, window=window)
    _check(case, _run(case), sdpa_f32(case), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [LLAMA2, LLAMA3], ids=["llama2", "llama3"])
@pytest.mark.parametrize("window", [0, 1000])
def test_long_context_decode_splits_vs_sdpa(dtype, heads, window):
    """A small decode batch at 4k-6k tokens: the heuristic splits the context across programs."""
    seqs = [(4099, 1), (6000, 1), (4096, 0), (5000, 1)]
    case = _llama_case(stable_seed("decode", str(dtype), heads, window), seqs, heads, dtype, window=window)
    splits, _ = ak.plan_decode(len(seqs), heads[1], case.max_seq_len, window, case.q.device,
                               ak.decode_config(128, dtype))
    assert splits > 1
    _check(case, _run(case), sdpa_f32(case), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 16, 64])
def test_forced_splits(num_splits):
    seqs = [(4200, 1), (17, 1), (3000, 1), (4300, 0)]
    case = _llama_case(num_splits, seqs, LLAMA3, torch.bfloat16)
    out = torch.full(case.q.shape, float("nan"), dtype=case.q.dtype, device="cuda")
    ak.decode(*case.args(), out, max_seq_len=case.max_seq_len, scale=case.scale, window=0, num_splits=num_splits)
    _check(case, out, sdpa_f32(case), torch.bfloat16)


@pytest.mark.parametrize("heads", [LLAMA2, LLAMA3], ids=["llama2", "llama3"])
@pytest.mark.parametrize("window", [0, 1000])
def test_even_splits_planned_for_the_models_length(heads, window):
    """DecodeConfig.even_split_tokens with the splits planned for 8,192 tokens (as a CUDA graph plans for the model's
    length) over contexts of 18-2,501: each sequence's context shared among the splits (kernels.py's split_span)."""
    seqs = [(400, 1), (17, 1), (1000, 1), (300, 0), (2500, 1), (64, 1)]
    case = _llama_case(stable_seed("even", heads, window), seqs, heads, torch.bfloat16, window=window)
    cfg = replace(ak.decode_config(128, torch.bfloat16), even_split_tokens=128)
    assert ak.plan_decode(len(seqs), heads[1], 8192, window, case.q.device, cfg, 8)[1] == 128
    out = torch.full(case.q.shape, float("nan"), dtype=case.q.dtype, device="cuda")
    ak.decode(*case.args(), out, max_seq_len=8192, scale=case.scale, window=window, num_splits=8, cfg=cfg)
    _check(case, out, sdpa_f32(case), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", [(8, 2, 64, 8), (4, 4, 128, 32), (6, 2, 256, 16), (16, 1, 32, 16)])
@pytest.mark.parametrize("window", [0, 21])
def test_small_cases_vs_float64_loop(dtype, layout, window):
    """The CPU suite's mixed batch, run for real: every head_dim family, GQA 1-16, fp32 via tf32x3."""
    Hq, Hkv, D, bs = layout
    seqs = [(0, 37), (20, 1), (45, 0), (0, 1), (70, 19), (5, 64), (130, 1), (3, 2), (300, 200)]
    case = make_case(np.random.default_rng(stable_seed("f64", str(dtype), layout, window)), seqs, Hq=Hq, Hkv=Hkv,
                     D=D, bs=bs, dtype=dtype, window=window, device="cuda")
    _check(case, _run(case), case.oracle(), dtype)


@pytest.mark.parametrize("block_size", [8, 16, 64, 256])
def test_block_sizes(block_size):
    case = _llama_case(block_size, MIXED[:5], LLAMA3, torch.bfloat16, bs=block_size)
    _check(case, _run(case), sdpa_f32(case), torch.bfloat16)


def test_cache_past_int32_offsets():
    """Pages beyond 2^31 elements of the cache (4 GiB of bf16): offsets must be 64-bit."""
    per_block = 16 * 8 * 128
    first = 2**31 // per_block + 100
    case = _llama_case(5, [(300, 200), (1000, 1), (50, 0)], LLAMA3, torch.bfloat16, first_block=first, spare_blocks=1)
    assert case.k_cache.numel() > 2**31
    _check(case, _run(case), sdpa_f32(case), torch.bfloat16)
    del case
    torch.cuda.empty_cache()
    dec = _llama_case(6, [(1000, 1), (3000, 1)], LLAMA3, torch.bfloat16, first_block=first, spare_blocks=1)
    _check(dec, _run(dec), sdpa_f32(dec), torch.bfloat16)
    # store_kv into those pages
    slots = torch.tensor([(first + 1) * 16 + 3, -1, first * 16], dtype=torch.int64, device="cuda")
    k = torch.randn(3, 8, 128, dtype=torch.bfloat16, device="cuda")
    ops.store_kv(k, k * 2, dec.k_cache, dec.v_cache, slots)
    assert torch.equal(dec.k_cache[first + 1, 3], k[0]) and torch.equal(dec.v_cache[first, 0], 2 * k[2])


def test_store_kv_matches_a_loop():
    rng = np.random.default_rng(7)
    T, Hq, Hkv, D, nb, bs = 300, 32, 8, 128, 64, 16
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, dtype=torch.bfloat16, device="cuda")
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    slots = rng.choice(nb * bs, size=T, replace=False)
    slots[::7] = -1
    k_cache = torch.randn(nb, bs, Hkv, D, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // bs, slot % bs] = k[t]
            want_v[slot // bs, slot % bs] = v[t]
    ops.store_kv(k, v, k_cache, v_cache, torch.tensor(slots, dtype=torch.int32, device="cuda"))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_auto_backend_is_triton_on_cuda():
    assert ops.resolve_backend(None, torch.device("cuda")) == "triton"


def test_repeated_calls_launch_directly_and_agree():
    """The direct launcher (ops/launch.py) must run the same compiled kernels as Triton's own launch."""
    case = _llama_case(8, MIXED[:6], LLAMA3, torch.bfloat16)
    outs = [_run(case) for _ in range(3)]
    launchers = (ak._PREFILL, ak._DECODE)
    assert all(launcher.enabled for launcher in launchers), "fast launch is expected on this Triton"
    assert all(launcher.direct_launches > 0 for launcher in launchers)
    for launcher in launchers:
        launcher.enabled = False
    try:
        outs.append(_run(case))
    finally:
        for launcher in launchers:
            launcher.enabled = True
    # bit-identical, NaN (rows no sequence owns stay poisoned) included: torch.equal says NaN != NaN
    assert all(torch.allclose(outs[0], o, rtol=0, atol=0, equal_nan=True) for o in outs[1:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [LLAMA2, LLAMA3], ids=["llama2", "llama3"])
def test_cuda_graph_decode_step(dtype, heads):
    """One captured decode step (store_kv + paged_attention with fixed max values), replayed over new
    batches written into the same buffers: seq_lens, block tables, query_start (with idle q_len-0
    sequences and padding rows at slot -1). Each replay equals an eager call and SDPA."""
    Hq, Hkv = heads
    D, bs, S, max_seq_len = 128, 16, 12, 4096
    max_blocks = -(-max_seq_len // bs)
    num_blocks = S * max_blocks + 4
    rng = np.random.default_rng(stable_seed("graph", str(dtype), heads))
    k_cache = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = torch.zeros(S, max_blocks, dtype=torch.int32, device="cuda")
    seq_lens = torch.ones(S, dtype=torch.int32, device="cuda")
    query_start = torch.arange(S + 1, dtype=torch.int32, device="cuda")
    slots = torch.full((S,), -1, dtype=torch.int64, device="cuda")
    qkv = torch.randn(S, (Hq + 2 * Hkv) * D, dtype=dtype, device="cuda")
    q = qkv[:, :Hq * D].view(S, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(S, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(S, Hkv, D)
    out = torch.empty(S, Hq, D, dtype=dtype, device="cuda")

    def step():
        ops.store_kv(k, v, k_cache, v_cache, slots)
        ops.paged_attention(q, k_cache, v_cache, tables, seq_lens, query_start, max_query_len=1,
                            max_seq_len=max_seq_len, scale=D ** -0.5, out=out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(4):
        active = int(rng.integers(1, S + 1))
        lens = [int(n) for n in rng.integers(1, max_seq_len + 1, size=active)]
        if trial == 0:
            lens[0] = max_seq_len
        q_lens = [1] * active + [0] * (S - active)  # idle sequences after the active ones
        perm = rng.permutation(num_blocks)[:S * max_blocks].reshape(S, max_blocks)
        new_tables = torch.tensor(perm, dtype=torch.int32)
        new_slots = torch.full((S,), -1, dtype=torch.int64)
        for s, L in enumerate(lens):
            new_tables[s, -(-L // bs):] = 2**31 - 1  # garbage past the last block
            new_slots[s] = int(perm[s, (L - 1) // bs]) * bs + (L - 1) % bs
        tables.copy_(new_tables)
        seq_lens.copy_(torch.tensor(lens + [1] * (S - active), dtype=torch.int32))
        query_start.copy_(torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32))
        slots.copy_(new_slots)
        qkv.copy_(torch.randn_like(qkv))
        out.fill_(float("nan"))
        graph.replay()
        replayed = out.clone()
        out.fill_(float("nan"))
        step()  # eager, same inputs (store_kv writes the same values again)
        assert torch.equal(replayed[:active], out[:active]), f"trial {trial}: replay differs from eager"
        assert torch.isnan(replayed[active:]).all(), "padding rows were written"
        case = AttnCase(q, k, v, k_cache, v_cache, tables, seq_lens, query_start, q_lens, 1, max_seq_len,
                        D ** -0.5, 0)
        _check(case, replayed, sdpa_f32(case), dtype)
