"""paged_attention and store_kv on the CPU: the reference and the Triton kernels (in Triton's
interpreter) against a float64 loop of the documented semantics, on fresh random inputs.

Cases are built so that mistakes show: pages of all sequences are shuffled together, table
entries past a sequence's last block are garbage (a NaN-filled spare block, then ids far past
the cache), cache slots past each context hold NaN, q/k/v are strided views of a fused qkv
buffer, and `out` arrives filled with NaN so rows no sequence owns must come back untouched.
The helpers here (make_case, attention_f64) are shared with test_attention_gpu.py.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from loraplex import ops
from loraplex.ops.attention import launchers as ak

GARBAGE_BLOCK = 2**31 - 8  # a block id far past any cache: dereferencing it would fault, not pass


def attention_f64(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale: float, window: int = 0):
    """float64 [T, Hq, D]: the documented loop; rows no sequence owns are NaN."""
    T, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    out = torch.full((T, Hq, D), float("nan"), dtype=torch.float64, device=q.device)
    starts, lens, tables = query_start.tolist(), seq_lens.tolist(), block_tables.tolist()
    q64 = q.double()
    for s in range(len(lens)):
        q_len = starts[s + 1] - starts[s]
        if q_len == 0:
            continue
        L = lens[s]
        # the sequence's tokens j = 0..L-1, each looked up through its block table entry
        blocks = torch.tensor([tables[s][j // bs] for j in range(L)], device=q.device)
        offsets = torch.tensor([j % bs for j in range(L)], device=q.device)
        keys, values = k_cache[blocks, offsets].double(), v_cache[blocks, offsets].double()  # [L, Hkv, D]
        for i in range(q_len):
            row, p = starts[s] + i, L - q_len + i
            lo = max(0, p - window + 1) if window > 0 else 0
            for h in range(Hq):
                K, V = keys[lo:p + 1, h // G], values[lo:p + 1, h // G]
                out[row, h] = torch.softmax(scale * (K @ q64[row, h]), dim=0) @ V
    return out


@dataclass
class AttnCase:
    q: torch.Tensor             # [T, Hq, D], a strided view of a fused qkv buffer unless fused=False
    k: torch.Tensor             # [T, Hkv, D] views of the same buffer (for store_kv)
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [S, width], garbage past each sequence's blocks
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    q_lens: list[int]
    max_query_len: int
    max_seq_len: int
    scale: float
    window: int

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start)

    def kwargs(self, **over):
        kw = dict(max_query_len=self.max_query_len, max_seq_len=self.max_seq_len, scale=self.scale,
                  sliding_window=self.window)
        kw.update(over)
        return kw

    def owned_rows(self) -> torch.Tensor:
        """bool [T]: rows some sequence owns (the only rows the op may write)."""
        mask = torch.zeros(self.q.shape[0], dtype=torch.bool)
        start = 0
        for n in self.q_lens:
            mask[start:start + n] = True
            start += n
        return mask.to(self.q.device)

    def oracle(self) -> torch.Tensor:
        return attention_f64(*self.args(), self.scale, self.window)


def make_case(rng: np.random.Generator, seqs, *, Hq: int, Hkv: int, D: int, bs: int, dtype=torch.float32,
              window: int = 0, pad_rows: int = 2, fused: bool = True, spare_blocks: int = 3, scale: float | None = None,
              device="cpu", first_block: int = 0, head_major: bool = False) -> AttnCase:
    """`seqs`: (cached tokens, query rows) per sequence; its context is their sum.

    Pages of all sequences are dealt from one shuffled list (interleaved across sequences); the
    first table entry past a sequence's last block names a NaN-filled spare block and the rest
    GARBAGE_BLOCK; `pad_rows` extra rows at the end of q belong to no sequence. `first_block`
    puts that many unused (NaN) blocks before the used ones, to reach large cache offsets.
    `head_major`: caches laid out `[num_blocks, Hkv, bs, D]` in memory and viewed in the ops' order
    (as `KVCache` keeps them).
    """
    gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**31)))
    q_lens = [int(n) for _, n in seqs]
    lens = [int(c) + int(n) for c, n in seqs]
    need = [-(-L // bs) for L in lens]
    num_blocks = sum(need) + spare_blocks
    order = (rng.permutation(num_blocks) + first_block).tolist()
    spare = order[sum(need):]
    owner = [[] for _ in seqs]
    s_cycle = [s for s in range(len(seqs)) for _ in range(need[s])]
    rng.shuffle(s_cycle)  # hand pages out in random sequence order: tables interleave
    for s, b in zip(s_cycle, order):
        owner[s].append(b)
    width = max(need + [1]) + 2
    tables = torch.full((len(seqs), width), GARBAGE_BLOCK, dtype=torch.int32)
    for s, blocks in enumerate(owner):
        tables[s, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        tables[s, len(blocks)] = spare[0] if spare else GARBAGE_BLOCK

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    def cache() -> torch.Tensor:
        if head_major:
            c = torch.empty((first_block + num_blocks, Hkv, bs, D), dtype=dtype, device=device).transpose(1, 2)
        else:
            c = torch.empty((first_block + num_blocks, bs, Hkv, D), dtype=dtype, device=device)
        c[:first_block] = float("nan")
        c[first_block:] = randn(num_blocks, bs, Hkv, D)
        return c

    k_cache, v_cache = cache(), cache()
    for c in (k_cache, v_cache):
        c[spare] = float("nan")
        for s, L in enumerate(lens):
            if L % bs:
                c[owner[s][-1], L % bs:] = float("nan")  # slots past the context in its last page
    T = sum(q_lens) + pad_rows
    width_qkv = (Hq + 2 * Hkv) * D
    qkv = randn(T, width_qkv) if fused else None
    if fused:
        q = qkv[:, :Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    else:
        q, k, v = randn(T, Hq, D), randn(T, Hkv, D), randn(T, Hkv, D)
    query_start = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    return AttnCase(q, k, v, k_cache, v_cache, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device),
                    query_start.to(device), q_lens, max(q_lens + [0]), max(lens + [0]),
                    D ** -0.5 if scale is None else scale, window)


def max_err(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor) -> float:
    """Largest |out - ref| over the given rows (inf if any is NaN)."""
    rows = rows.to(out.device)
    diff = (out[rows].double() - ref.to(out.device)[rows]).abs()
    return float("inf") if torch.isnan(diff).any() else diff.max().item() if diff.numel() else 0.0


def stable_seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


# ---------------------------------------------------------------------------------------------
# Tests

# Max abs error against the float64 loop. Outputs are convex combinations of unit-normal V rows
# (|out| ≲ 3). fp32: a few fp32 roundings per output (worst seen: 1.0e-6). fp16: out is rounded
# to fp16 once (half an ulp: 2^-11 · 2 ≈ 1e-3 at |out| < 2) and the kernels feed the softmax
# weights P to the PV product as fp16 (another ≤ 2^-11 relative each; worst seen: 9.5e-4).
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
# These run the Triton kernels on CPU tensors, in Triton's interpreter; on a CUDA machine they
# skip, and tests/test_attention_gpu.py runs the kernels for real.
interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")
BACKENDS = ["reference", pytest.param("triton", marks=interpreted)]
DTYPES = [torch.float32, torch.float16]

# (cached tokens, new rows): prefills from scratch and over cached prefixes of several lengths,
# decode tokens at different positions, a q_len-0 sequence, a 2-row chunk.
MIXED = [(0, 37), (20, 1), (45, 0), (0, 1), (70, 19), (5, 64), (130, 1), (3, 2)]
DECODE = [(0, 1), (8, 1), (30, 1), (63, 1), (100, 0), (120, 1), (150, 1)]
LAYOUTS = {  # Hq, Hkv, head_dim, block_size
    "mha-d64-bs16": (4, 4, 64, 16),
    "gqa2-d32-bs8": (8, 4, 32, 8),
    "gqa4-d16-bs32": (8, 2, 16, 32),
    "gqa3-d32-bs16": (6, 2, 32, 16),   # G = 3: padded to 4 rows per query row
    "mqa16-d16-bs8": (16, 1, 16, 8),   # G = 16: one tile row per head of a query row
}
ONE_KV_HEAD = (2, 1, 16, 8)  # the fewest programs, for the interpreter-heavy tile sweeps


def _case(rng, seqs, layout: str, dtype, **kw) -> AttnCase:
    Hq, Hkv, D, bs = LAYOUTS[layout]
    return make_case(rng, seqs, Hq=Hq, Hkv=Hkv, D=D, bs=bs, dtype=dtype, **kw)


def _run(case: AttnCase, backend: str, **kw) -> torch.Tensor:
    out = torch.full(case.q.shape, float("nan"), dtype=case.q.dtype)
    got = ops.paged_attention(*case.args(), **case.kwargs(), out=out, backend=backend, **kw)
    assert got is out
    return out


def _check(case: AttnCase, out: torch.Tensor, dtype, ref: torch.Tensor | None = None) -> None:
    rows = case.owned_rows()
    assert torch.isnan(out[~rows]).all(), "rows no sequence owns were written"
    err = max_err(out, case.oracle() if ref is None else ref, rows)
    assert err <= TOL[dtype], f"max abs err {err:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window", [0, 21])
def test_mixed_batch(backend, dtype, layout, window):
    rng = np.random.default_rng(stable_seed("mixed", backend, str(dtype), layout, window))
    case = _case(rng, MIXED, layout, dtype, window=window)
    _check(case, _run(case, backend), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["mha-d64-bs16", "gqa3-d32-bs16", "mqa16-d16-bs8"])
@pytest.mark.parametrize("window", [0, 40])
def test_decode_batch(backend, dtype, layout, window):
    """max_query_len == 1: the decode kernel (one split at these sizes)."""
    rng = np.random.default_rng(stable_seed("decode", backend, str(dtype), layout, window))
    case = _case(rng, DECODE, layout, dtype, window=window)
    assert case.max_query_len == 1
    _check(case, _run(case, backend), dtype)


@interpreted
@pytest.mark.parametrize("num_splits", [2, 7])
@pytest.mark.parametrize("layout", ["mha-d64-bs16", "gqa4-d16-bs32", "gqa3-d32-bs16"])
@pytest.mark.parametrize("window", [0, 40])
def test_decode_splits(num_splits, layout, window):
    """Split-KV decode forced on small contexts: 16-token steps, so 7 splits of a 150-token context
    are real; short sequences use fewer splits than the grid has (the reduce must skip the rest)."""
    rng = np.random.default_rng(stable_seed("splits", num_splits, layout, window))
    case = _case(rng, DECODE, layout, torch.float32, window=window)
    cfg = ak.DecodeConfig(block_n=16, num_warps=4, num_stages=1)
    splits, chunk = ak.plan_decode(len(DECODE), case.k_cache.shape[2], case.max_seq_len, window,
                                   case.q.device, cfg, num_splits)
    assert splits > 1 and splits * chunk >= min(case.max_seq_len, window or case.max_seq_len)
    out = torch.full(case.q.shape, float("nan"))
    ak.decode(*case.args(), out, max_seq_len=case.max_seq_len, scale=case.scale, window=window,
              num_splits=num_splits, cfg=cfg)
    _check(case, out, torch.float32)


@interpreted
@pytest.mark.parametrize("layout", ["mha-d64-bs16", "gqa3-d32-bs16"])
@pytest.mark.parametrize("window", [0, 100])
def test_decode_even_splits_of_each_context(layout, window, monkeypatch):
    """DecodeConfig.even_split_tokens: a launch planned for contexts of up to 4,096 tokens (as a CUDA graph plans for
    the model's length) shares each sequence's own 1-151 tokens among its splits in whole 16-token steps (kernels.py's
    split_span: 151 tokens as 48 + 48 + 48 + 7, 65 as 32 + 32 + 1 and no fourth; a window of 100, 32-token splits from
    the window's start), where a share of the longest context (1,024 tokens a split; 32 under the window) would leave
    every split but the first empty; the reduce reads the splits written and no other (the partials' buffer starts
    as NaN)."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    rng = np.random.default_rng(stable_seed("even-splits", layout, window))
    case = _case(rng, DECODE + [(64, 1), (80, 1)], layout, torch.float32, window=window)
    cfg = ak.DecodeConfig(block_n=16, num_warps=4, num_stages=1, even_split_tokens=16)
    plan = ak.plan_decode(len(DECODE) + 2, case.k_cache.shape[2], 4096, window, case.q.device, cfg, 4)
    assert plan == (4, 16)
    assert ak.plan_decode(len(DECODE) + 2, case.k_cache.shape[2], 4096, 0, case.q.device,
                          replace(cfg, even_split_tokens=0), 4) == (4, 1024)
    with pytest.raises(ValueError, match="even_split_tokens"):
        replace(cfg, even_split_tokens=-1)
    out = torch.full(case.q.shape, float("nan"))
    ak.decode(*case.args(), out, max_seq_len=4096, scale=case.scale, window=window, num_splits=4, cfg=cfg)
    _check(case, out, torch.float32)


@interpreted
def test_decode_splits_chosen_for_a_small_batch_with_long_contexts():
    """The default heuristic: 2 sequences × 1 kv head are few programs for the interpreter's pretend
    4 SMs, and 600 tokens allow 2 splits of ≥ 256 tokens; the public op then takes the split path."""
    rng = np.random.default_rng(3)
    case = make_case(rng, [(599, 1), (400, 1), (50, 0)], Hq=2, Hkv=1, D=64, bs=16)
    cfg = ak.decode_config(64, torch.float32)
    assert ak.plan_decode(3, 1, case.max_seq_len, 0, case.q.device, cfg)[0] == 2
    _check(case, _run(case, "triton"), torch.float32)


@pytest.mark.parametrize("max_seq_len, splits", [(100, 1), (512, 2), (4096, 8), (10**6, 8)])
def test_split_plan(max_seq_len, splits):
    """One sequence × one kv head on the interpreter's 4 pretend SMs wants 2 · 4 = 8 programs; each
    split keeps ≥ 256 tokens, whole 64-token steps, and together they cover the context."""
    cfg = ak.DecodeConfig(block_n=64, num_warps=4, num_stages=3)
    got, chunk = ak.plan_decode(1, 1, max_seq_len, 0, torch.device("cpu"), cfg)
    assert got == splits
    assert got == 1 or (chunk % 64 == 0 and chunk >= 256 and got * chunk >= max_seq_len)
    assert ak.plan_decode(64, 8, max_seq_len, 0, torch.device("cpu"), cfg)[0] == 1  # a full GPU: no split
    # a sliding window bounds the keys one query reads, and so the splits
    assert ak.plan_decode(1, 1, max_seq_len, 300, torch.device("cpu"), cfg)[0] == 1


@interpreted
@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("window", [0, 1, 5, 21, 1000])
def test_prefill_tiles_and_window_edges(block_m, block_n, window):
    """Small tiles: several query tiles per sequence and all three key ranges (masked left edge,
    unmasked middle, masked diagonal) on short contexts; window 1 attends to itself only, 1000
    covers every context. The prefill kernel leaves one-row sequences alone; the decode kernel,
    split in 3, fills them in (what a mixed batch launches)."""
    rng = np.random.default_rng(stable_seed("tiles", block_m, block_n, window))
    Hq, Hkv, D, bs = ONE_KV_HEAD
    case = make_case(rng, MIXED, Hq=Hq, Hkv=Hkv, D=D, bs=bs, window=window)
    out = torch.full(case.q.shape, float("nan"))
    ak.prefill(*case.args(), out, scale=case.scale, window=window,
               cfg=ak.PrefillConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=1))
    decode_rows = torch.zeros(case.q.shape[0], dtype=torch.bool)
    starts = case.query_start.tolist()
    for s, n in enumerate(case.q_lens):
        decode_rows[starts[s]:starts[s + 1]] = n == 1
    assert torch.isnan(out[decode_rows]).all(), "the prefill kernel must leave one-row sequences to decode"
    ak.decode(*case.args(), out, max_seq_len=case.max_seq_len, scale=case.scale, window=window, num_splits=3,
              cfg=ak.DecodeConfig(block_n=16, num_warps=4, num_stages=1))  # split decode rows of a mixed batch
    _check(case, out, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_peaked_softmax(backend, seqs):
    """scale 1.5 at head_dim 32: scores of std ≈ 8.5, so the running max moves by large steps."""
    rng = np.random.default_rng(11 + len(seqs))
    case = _case(rng, seqs, "gqa2-d32-bs8", torch.float32, scale=1.5)
    _check(case, _run(case, backend), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("layout", ["mha-d64-bs16", "gqa3-d32-bs16"])
def test_head_major_caches(backend, seqs, layout):
    """Caches `[num_blocks, Hkv, block_size, D]` in memory, viewed in the ops' order (KVCache's layout)."""
    rng = np.random.default_rng(stable_seed("head-major", backend, layout, len(seqs)))
    case = _case(rng, seqs, layout, torch.float32, head_major=True)
    assert not case.k_cache.is_contiguous() and case.k_cache.stride(1) == case.k_cache.shape[3]
    _check(case, _run(case, backend), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_allocated_contiguous_inputs_and_strided_out(backend):
    rng = np.random.default_rng(12)
    case = _case(rng, MIXED, "gqa4-d16-bs32", torch.float32, fused=False, pad_rows=0)
    ref = case.oracle()
    got = ops.paged_attention(*case.args(), **case.kwargs(), backend=backend)
    assert got.shape == case.q.shape and got.dtype == case.q.dtype and got.is_contiguous()
    assert max_err(got, ref, case.owned_rows()) <= TOL[torch.float32]
    wide = torch.full((case.q.shape[0], case.q.shape[1], 24), float("nan"))
    out = wide[:, :, 4:20]  # last stride 1, others not q's
    assert ops.paged_attention(*case.args(), **case.kwargs(), out=out, backend=backend) is out
    _check(case, out, torch.float32, ref)
    assert torch.isnan(wide[:, :, :4]).all() and torch.isnan(wide[:, :, 20:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_to_do(backend):
    rng = np.random.default_rng(13)
    case = _case(rng, [(5, 0), (9, 0)], "gqa2-d32-bs8", torch.float32)
    assert case.max_query_len == 0
    out = _run(case, backend)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_loose_upper_bounds(backend):
    """max_query_len / max_seq_len are upper bounds (fixed for a CUDA graph), not exact maxima."""
    rng = np.random.default_rng(14)
    case = _case(rng, MIXED, "gqa2-d32-bs8", torch.float32)
    out = torch.full(case.q.shape, float("nan"))
    ops.paged_attention(*case.args(), **case.kwargs(max_query_len=500, max_seq_len=4000), out=out, backend=backend)
    _check(case, out, torch.float32)


# ---------------------------------------------------------------------------------------------
# store_kv


def _slots_from_tables(case: AttnCase, bs: int) -> torch.Tensor:
    """The cache slot of every new token (as the model runner computes it); -1 for padding rows."""
    slots = torch.full((case.q.shape[0],), -1, dtype=torch.int64)
    tables, lens, starts = case.block_tables.tolist(), case.seq_lens.tolist(), case.query_start.tolist()
    for s in range(len(lens)):
        for row in range(starts[s], starts[s + 1]):
            p = lens[s] - (starts[s + 1] - starts[s]) + row - starts[s]
            slots[row] = tables[s][p // bs] * bs + p % bs
    return slots


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("Hkv, D", [(3, 32), (20, 256), (2, 24)])
@pytest.mark.parametrize("head_major", [False, True])
def test_store_kv_writes_exactly_its_slots(backend, dtype, slot_dtype, Hkv, D, head_major):
    """Rows land in their slots, -1 rows are skipped, every other cache entry is unchanged.
    k and v are strided views of a fused qkv buffer; 20 heads of 256 take two head groups.
    `head_major`: the caches are `[nb, Hkv, bs, D]` in memory, viewed as `[nb, bs, Hkv, D]` (KVCache's)."""
    rng = np.random.default_rng(stable_seed("store", backend, str(dtype), str(slot_dtype), Hkv, D, head_major))
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    nb, bs, T, Hq = 7, 8, 13, 4
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen).to(dtype)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    slots = rng.choice(nb * bs, size=T, replace=False)
    slots[[1, 5, 6]] = -1
    if head_major:
        k_cache = torch.randn(nb, Hkv, bs, D, generator=gen).to(dtype).transpose(1, 2)
        v_cache = torch.randn(nb, Hkv, bs, D, generator=gen).to(dtype).transpose(1, 2)
    else:
        k_cache = torch.randn(nb, bs, Hkv, D, generator=gen).to(dtype)
        v_cache = torch.randn(nb, bs, Hkv, D, generator=gen).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // bs, slot % bs] = k[t]
            want_v[slot // bs, slot % bs] = v[t]
    ops.store_kv(k, v, k_cache, v_cache, torch.tensor(slots, dtype=slot_dtype), backend=backend)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_major", [False, True])
def test_store_then_attend(backend, head_major):
    """The model's order: store this step's k and v (padding rows at slot -1), then attend over
    the cache, new tokens included; in contiguous caches and in head-major ones (KVCache's)."""
    rng = np.random.default_rng(21)
    case = _case(rng, MIXED, "gqa2-d32-bs8", torch.float32, pad_rows=3, head_major=head_major)
    assert case.k_cache.is_contiguous() != head_major
    slots = _slots_from_tables(case, 8)
    before = case.k_cache.clone()
    ops.store_kv(case.k, case.v, case.k_cache, case.v_cache, slots.to(torch.int32), backend=backend)
    written = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    written.view(-1)[slots[slots >= 0]] = True
    flat = case.k_cache.reshape(-1, *case.k_cache.shape[2:])  # a copy when head-major
    assert torch.equal(flat[slots[slots >= 0]], case.k[slots >= 0])
    assert torch.equal(case.k_cache[~written].nan_to_num(7.0), before[~written].nan_to_num(7.0))
    _check(case, _run(case, backend), torch.float32)


# ---------------------------------------------------------------------------------------------
# Dispatch and argument errors


@interpreted
def test_backend_from_environment_and_kernel_choice(monkeypatch):
    """LORAPLEX_OPS_BACKEND picks the backend; max_query_len == 1 takes the decode kernel."""
    calls = []
    for name in ("prefill", "decode"):
        real = getattr(ak, name)
        monkeypatch.setattr(ak, name, lambda *a, _real=real, _name=name, **kw: (calls.append(_name), _real(*a, **kw)))
    rng = np.random.default_rng(22)
    case = _case(rng, MIXED[:4], "gqa2-d32-bs8", torch.float32)
    assert ops.resolve_backend(None, torch.device("cpu")) == "reference"
    ops.paged_attention(*case.args(), **case.kwargs())
    assert calls == []
    monkeypatch.setenv("LORAPLEX_OPS_BACKEND", "triton")
    out = torch.empty(case.q.shape)
    version = out._version
    ops.paged_attention(*case.args(), **case.kwargs(), out=out)
    assert calls == ["prefill", "decode"] and out._version > version  # a mixed batch: both kernels
    dec = _case(rng, DECODE, "gqa2-d32-bs8", torch.float32)
    _check(dec, _run(dec, None), torch.float32)
    assert calls == ["prefill", "decode", "decode"]


@interpreted
def test_triton_needs_a_power_of_two_head_dim():
    rng = np.random.default_rng(23)
    case = make_case(rng, [(3, 2)], Hq=2, Hkv=1, D=48, bs=8)
    with pytest.raises(ValueError, match=r"head_dim in \(16, 32, 64, 128, 256\), got 48"):
        ops.paged_attention(*case.args(), **case.kwargs(), backend="triton")
    _check(case, _run(case, "reference"), torch.float32)  # the reference takes any head_dim


META = "meta"
T_, HQ, HKV, D_, NB, BS, S_, W_ = 6, 8, 2, 64, 5, 16, 3, 4


def _h(*shape, dtype=torch.float16, device=META):
    return torch.empty(*shape, device=device, dtype=dtype)


def _attn_args(**over):
    d = dict(q=_h(T_, HQ, D_), k_cache=_h(NB, BS, HKV, D_), v_cache=_h(NB, BS, HKV, D_),
             block_tables=_h(S_, W_, dtype=torch.int32), seq_lens=_h(S_, dtype=torch.int32),
             query_start=_h(S_ + 1, dtype=torch.int32), max_query_len=4, max_seq_len=40, scale=0.125,
             sliding_window=0, out=None, backend="reference")
    d.update(over)
    return d


def _call_attention(**over):
    d = _attn_args(**over)
    return ops.paged_attention(d.pop("q"), d.pop("k_cache"), d.pop("v_cache"), d.pop("block_tables"),
                               d.pop("seq_lens"), d.pop("query_start"), **d)


ATTENTION_ERRORS = [
    (dict(q=[[1.0]]), "q must be a torch.Tensor"),
    (dict(q=_h(T_, HQ * D_)), r"q must have 3 dimensions, got shape \[6, 512\]"),
    (dict(q=_h(T_, HQ, D_, dtype=torch.int32)), "q must be float16, bfloat16 or float32"),
    (dict(q=_h(T_, D_, HQ).transpose(1, 2)), "q's last dimension must have stride 1"),
    (dict(q=_h(T_, HQ, D_).requires_grad_()), "q requires grad"),
    (dict(k_cache=_h(NB, BS, HKV, D_, dtype=torch.bfloat16), v_cache=_h(NB, BS, HKV, D_, dtype=torch.bfloat16)),
     "k_cache is torch.bfloat16 but q is torch.float16"),
    (dict(k_cache=_h(NB, BS, D_, HKV).transpose(2, 3)), r"k_cache \[num_blocks, block_size, Hkv, D\] must have D "
     "innermost"),
    (dict(k_cache=_h(NB, 1, HKV, D_).expand(NB, BS, HKV, D_)), "k_cache .* the other dimensions apart"),
    (dict(v_cache=_h(NB, HKV, BS, D_).transpose(1, 2)), r"v_cache's strides \(2048, 64, 1024, 1\) differ from "
     r"k_cache's \(2048, 128, 64, 1\)"),
    (dict(k_cache=_h(NB, BS * HKV * D_)), "k_cache must have 4 dimensions"),
    (dict(v_cache=_h(NB + 1, BS, HKV, D_)), "v_cache must match k_cache"),
    (dict(v_cache=_h(NB, BS, HKV, D_, dtype=torch.float32)), "v_cache must match k_cache"),
    (dict(k_cache=_h(NB, BS, HKV, 32), v_cache=_h(NB, BS, HKV, 32)), "k_cache has head_dim 32 but q has 64"),
    (dict(k_cache=_h(NB, BS, 3, D_), v_cache=_h(NB, BS, 3, D_)), "q's 8 heads are not a multiple of the cache's 3"),
    (dict(k_cache=_h(NB, BS, HKV, D_, device="cpu"), v_cache=_h(NB, BS, HKV, D_, device="cpu")),
     "k_cache is on cpu but q is on meta"),
    (dict(block_tables=_h(S_, W_, dtype=torch.int64)), "block_tables must be int32"),
    (dict(block_tables=_h(S_ * W_, dtype=torch.int32)), "block_tables must have 2 dimensions"),
    (dict(block_tables=_h(W_, S_, dtype=torch.int32).t()), "block_tables must be int32 .* stride 1"),
    (dict(seq_lens=_h(S_ + 1, dtype=torch.int32)), r"seq_lens must be contiguous int32 \[3\] \(block_tables has S=3"),
    (dict(seq_lens=_h(S_, dtype=torch.int64)), r"seq_lens must be contiguous int32 \[3\]"),
    (dict(query_start=_h(S_, dtype=torch.int32)), r"query_start must be contiguous int32 \[4\]"),
    (dict(query_start=_h(S_ + 1, dtype=torch.int32, device="cpu")), "query_start is on cpu but q is on meta"),
    (dict(max_query_len=-1), "max_query_len must be an int >= 0, got -1"),
    (dict(max_seq_len=40.0), "max_seq_len must be an int >= 0, got 40.0"),
    (dict(sliding_window=-3), "sliding_window must be an int >= 0"),
    (dict(sliding_window=True), "sliding_window must be an int >= 0"),
    (dict(scale=float("nan")), "scale must be a finite float"),
    (dict(scale="0.1"), "scale must be a finite float"),
    (dict(out=_h(T_, HQ, D_, dtype=torch.float32)), r"out must be \[6, 8, 64\] torch.float16 like q"),
    (dict(out=_h(T_ + 1, HQ, D_)), r"out must be \[6, 8, 64\]"),
    (dict(out=_h(T_, D_, HQ).transpose(1, 2)), "out's last dimension must have stride 1"),
    (dict(out=_h(1, HQ, D_).expand(T_, HQ, D_)), "out has elements that share memory"),
    (dict(out=_h(T_, HQ, D_, device="cpu")), "out is on cpu but q is on meta"),
    (dict(backend="cuda"), "backend must be one of"),
]


@pytest.mark.parametrize("over, match", ATTENTION_ERRORS, ids=[m[:40] for _, m in ATTENTION_ERRORS])
def test_bad_attention_argument_is_named(over, match):
    """Tensors on the meta device have no data: the error must come from metadata alone."""
    with pytest.raises(ValueError, match=match):
        _call_attention(**over)


def test_good_meta_arguments_pass_the_checks():
    out = _h(T_, HQ, D_)
    assert _call_attention(max_query_len=0, out=out) is out  # nothing to attend: returns before reading data


def _store_args(**over):
    d = dict(k=_h(T_, HKV, D_), v=_h(T_, HKV, D_), k_cache=_h(NB, BS, HKV, D_), v_cache=_h(NB, BS, HKV, D_),
             slot_mapping=_h(T_, dtype=torch.int32), backend="reference")
    d.update(over)
    return d


STORE_ERRORS = [
    (dict(k="k"), "k must be a torch.Tensor"),
    (dict(k=_h(T_, HKV * D_)), "k must have 3 dimensions"),
    (dict(k=_h(T_, D_, HKV).transpose(1, 2), v=_h(T_, D_, HKV).transpose(1, 2)),
     "k's last dimension must have stride 1"),
    (dict(v=_h(T_, HKV, D_, dtype=torch.float32)), "v must match k"),
    (dict(v=_h(T_ + 1, HKV, D_)), "v must match k"),
    (dict(v=_h(T_, HKV, D_, device="cpu")), "v is on cpu but k is on meta"),
    (dict(k=_h(T_, HKV, D_, dtype=torch.bfloat16), v=_h(T_, HKV, D_, dtype=torch.bfloat16)),
     "k_cache is torch.float16 but k is torch.bfloat16"),
    (dict(k=_h(T_, HKV + 1, D_), v=_h(T_, HKV + 1, D_)), r"does not fit the cache's \[num_blocks, block_size, Hkv=3"),
    (dict(v_cache=_h(NB, BS, HKV, D_, dtype=torch.bfloat16)), "v_cache must match k_cache"),
    (dict(k_cache=_h(NB, BS, HKV, D_, device="cpu"), v_cache=_h(NB, BS, HKV, D_, device="cpu")),
     "k_cache is on cpu but k is on meta"),
    (dict(slot_mapping=_h(T_, dtype=torch.float32)), r"slot_mapping must be int32 or int64 \[T=6\]"),
    (dict(slot_mapping=_h(T_ + 1, dtype=torch.int64)), r"slot_mapping must be int32 or int64 \[T=6\], got shape \[7\]"),
    (dict(slot_mapping=_h(T_, dtype=torch.int32, device="cpu")), "slot_mapping is on cpu but k is on meta"),
    (dict(backend="gpu"), "backend must be one of"),
]


@pytest.mark.parametrize("over, match", STORE_ERRORS, ids=[m[:40] for _, m in STORE_ERRORS])
def test_bad_store_argument_is_named(over, match):
    with pytest.raises(ValueError, match=match):
        ops.store_kv(**_store_args(**over))


def _small_case(seed: int) -> AttnCase:
    return make_case(np.random.default_rng(seed), [(4, 3), (10, 1), (0, 0)], Hq=2, Hkv=1, D=16, bs=8)


def _set(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


VALUE_ERRORS = [  # the reference reads the batch metadata, so it checks the values too
    (lambda c: dict(seq_lens=_set(c.seq_lens, 0, 2)), r"seq_lens\[0\]=2 is below the sequence's 3 query rows"),
    (lambda c: dict(max_seq_len=10), r"seq_lens\[1\]=11 exceeds max_seq_len=10"),
    (lambda c: dict(max_query_len=2), "sequence 0 has 3 query rows but max_query_len=2"),
    (lambda c: dict(block_tables=_set(c.block_tables, (1, 0), c.k_cache.shape[0])), r"block ids outside \[0, "),
    (lambda c: dict(block_tables=_set(c.block_tables, (0, 0), -1)), r"block_tables\[0\] holds block ids outside"),
    (lambda c: dict(block_tables=c.block_tables[:, :1]), "sequence 1 needs 2 blocks .* block_tables has 1 columns"),
    (lambda c: dict(query_start=_set(c.query_start, 1, 5)), r"query_start\[1:3\] = \[5, 4\] must be non-decreasing"),
    (lambda c: dict(query_start=_set(c.query_start, 3, 99)), r"query_start\[2:4\] = \[4, 99\] .* within q's 6 rows"),
]


@pytest.mark.parametrize("make, match", VALUE_ERRORS, ids=[m[:40] for _, m in VALUE_ERRORS])
def test_reference_checks_values(make, match):
    case = _small_case(31)
    kw = dict(zip(("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start"), case.args()))
    kw.update(case.kwargs())
    kw.update(make(case))
    with pytest.raises(ValueError, match=match):
        ops.paged_attention(**kw, backend="reference")


@pytest.mark.parametrize("slots, match", [([0, 1, 2, 99, -1, 3], "slot_mapping holds slot 99 but the cache has"),
                                          ([0, 1, 2, 1, -1, 3], "writes one slot twice")])
def test_reference_store_checks_slots(slots, match):
    case = _small_case(32)
    with pytest.raises(ValueError, match=match):
        ops.store_kv(case.k, case.v, case.k_cache, case.v_cache, torch.tensor(slots), backend="reference")
