"""Compositions in the LoRA ops: segments that combine up to 4 adapters with weights (ops/lora/batch.py), through
the reference and the Triton kernels (in Triton's interpreter), against a float64 loop of the documented semantics
and against the "cat" merge (one adapter whose A and B stack the members'), on fresh random inputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex import ops
from loraplex.ops import LoraBatch
from loraplex.ops.lora import overlap

from lora_cases import make_case, rel_err, stable_seed

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")
BACKENDS = ["reference", pytest.param("triton", marks=interpreted)]


def compose_f64(y, x, lora_a, lora_b, ranks, scalings, seg_lens, members, y_offset=0):
    """float64 y + Σ_segments Σ_(slot, w) w · scalings[slot] · (x[rows] @ A[slot, :r]ᵀ) @ B[slot, :, :r]ᵀ."""
    out = y.double().clone()
    x64 = x.double()
    col = y_offset
    for a, b, rk, sc in zip(lora_a, lora_b, ranks, scalings):
        start = 0
        for length, pairs in zip(seg_lens, members):
            rows = slice(start, start + length)
            start += length
            for slot, w in pairs:
                r = int(rk[slot])
                out[rows, col:col + b.shape[1]] += w * float(sc[slot]) * (x64[rows] @ a[slot, :r].double().T) \
                    @ b[slot, :, :r].double().T
        col += b.shape[1]
    return out


def random_members(rng, n: int, num_slots: int, max_lanes: int = 4) -> list[list[tuple[int, float]]]:
    """Per segment: none, one adapter at weight 1, one weighted, or 2..max_lanes distinct adapters with weights
    (negative ones too)."""
    out = []
    for _ in range(n):
        kind = rng.integers(0, 4)
        if kind == 0:
            out.append([])
        elif kind == 1:
            out.append([(int(rng.integers(num_slots)), 1.0)])
        else:
            k = 1 if kind == 2 else int(rng.integers(2, max_lanes + 1))
            slots = rng.choice(num_slots, size=min(k, num_slots), replace=False)
            out.append([(int(s), float(rng.uniform(-1.0, 1.5))) for s in slots])
    return out


def _batch_args(members):
    slots = [[s for s, _ in m] if m else -1 for m in members]
    weights = [[w for _, w in m] if m else None for m in members]
    return slots, weights


def _case(rng, lens, dtype, num_slots=6, Ns=(48, 16, 16), R=16):
    case = make_case(rng, seg_lens=lens, popularity="uniform", K=64, Ns=Ns, R=R, ranks="mixed", dtype=dtype,
                     num_slots=num_slots)
    members = random_members(rng, len(lens), num_slots)
    members[0] = [(0, 0.7), (1, -0.4), (2, 1.2), (3, 0.5)][:min(4, num_slots)]   # a full composition, always
    return case, members


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("regime, R", [("decode", 16), ("decode", 32), ("prefill", 16)])
def test_compositions_follow_the_loop(backend, dtype, regime, R):
    """R = 32: the row-wise expand reads members' rank columns 16 a step (ops/lora/b_blocks.py), twice."""
    rng = np.random.default_rng(stable_seed("compose", backend, str(dtype), regime, R))
    lens = [1] * 12 if regime == "decode" else [int(v) for v in rng.integers(1, 70, size=7)]
    case, members = _case(rng, lens, dtype, R=R)
    slots, weights = _batch_args(members)
    batch = LoraBatch.from_lengths(lens, slots, weights=weights)
    assert batch.composed and batch.lanes == 4
    y = ops.add_lora(case.y0.clone(), case.x, case.lora_a, case.lora_b, batch, case.ranks, case.scalings,
                     backend=backend)
    want = compose_f64(case.y0, case.x, case.lora_a, case.lora_b, case.ranks, case.scalings, lens, members)
    assert rel_err(y, want, case.y0) <= TOL[dtype]
    start = 0
    for length, m in zip(lens, members):   # rows without adapters are untouched, bit for bit
        if not m:
            assert torch.equal(y[start:start + length], case.y0[start:start + length])
        start += length


def _ulp16(v: torch.Tensor) -> torch.Tensor:
    """The float16 spacing at each (normal) value of v."""
    return torch.ldexp(torch.ones_like(v), torch.frexp(v)[1] - 11)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_a_composed_row_rounds_once(backend, regime):
    """Every member of a row is summed in fp32 before the float16 y rounds: each element is the exact sum rounded
    to nearest (within fp32's error of it), where rounding after the first member and again after the others would
    miss by up to a whole spacing. y0 in the hundreds makes the spacing (0.125-0.5) comparable with the deltas."""
    rng = np.random.default_rng(stable_seed("round-once", backend, regime))
    lens = [1] * 12 if regime == "decode" else [int(v) for v in rng.integers(20, 70, size=4)]
    case, _ = _case(rng, lens, torch.float16, Ns=(64, 32), R=16)
    members = [[(0, 0.9), (1, -0.8), (2, 1.1)], [(3, 1.3), (4, 0.7)]] * (len(lens) // 2)
    slots, weights = _batch_args(members)
    y0 = (torch.randn(case.y0.shape, generator=torch.Generator().manual_seed(7)) * 64 + 300).half()
    batch = LoraBatch.from_lengths(lens, slots, weights=weights)
    y = ops.add_lora(y0.clone(), case.x, case.lora_a, case.lora_b, batch, case.ranks, case.scalings, backend=backend)
    exact = compose_f64(y0, case.x, case.lora_a, case.lora_b, case.ranks, case.scalings, lens, members)
    moved = (exact - y0.double()).abs() > _ulp16(exact)
    assert moved.float().mean() > 0.3   # the deltas are not lost below the spacing
    miss = (y.double() - exact).abs() / _ulp16(exact)
    assert miss.max() <= 0.5 + 1e-3, f"{(miss > 0.5 + 1e-3).sum()} elements rounded more than once"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_composition_equals_its_cat_merge(backend):
    """PEFT's add_weighted_adapter(combination_type="cat"): one adapter of rank Σr_i with A = [A_1; A_2] and
    B = [w_1·s_1·B_1, w_2·s_2·B_2] at scaling 1. Ranks differ; one member does not touch slice 1 (rank 0)."""
    rng = np.random.default_rng(stable_seed("cat", backend))
    dtype = torch.float32
    case = make_case(rng, seg_lens=[3, 1, 5], popularity="uniform", K=64, Ns=(40, 24), R=16, ranks="full",
                     dtype=dtype, num_slots=3)
    for rk in case.ranks:
        rk[1] = 8
    case.ranks[1][2] = 0
    pairs = [(1, 0.6), (2, -1.3)]
    batch = LoraBatch.from_lengths([3, 1, 5], [-1, [1, 2], -1], weights=[None, [0.6, -1.3], None])
    y = ops.add_lora(case.y0.clone(), case.x, case.lora_a, case.lora_b, batch, case.ranks, case.scalings,
                     backend=backend)
    merged_a, merged_b, merged_r = [], [], []
    for a, b, rk, sc in zip(case.lora_a, case.lora_b, case.ranks, case.scalings):
        parts_a = [a[s, :int(rk[s])] for s, _ in pairs]
        parts_b = [b[s, :, :int(rk[s])] * (w * float(sc[s])) for s, w in pairs]
        a_cat, b_cat = torch.cat(parts_a), torch.cat(parts_b, dim=1)   # padded to one width for every slice
        merged_a.append(torch.nn.functional.pad(a_cat, (0, 0, 0, 32 - a_cat.shape[0]))[None])
        merged_b.append(torch.nn.functional.pad(b_cat, (0, 32 - b_cat.shape[1]))[None])
        merged_r.append(torch.tensor([a_cat.shape[0]], dtype=torch.int32))
    one = LoraBatch.from_lengths([3, 1, 5], [-1, 0, -1])
    want = ops.add_lora(case.y0.clone(), case.x, merged_a, merged_b, one, merged_r,
                        [torch.ones(1)] * 2, backend="reference")
    assert torch.allclose(y, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(y, case.y0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_capacity_batches_take_compositions_like_built_ones(backend):
    rng = np.random.default_rng(stable_seed("capacity", backend))
    lens = [1] * 10
    case, members = _case(rng, lens, torch.float32)
    slots, weights = _batch_args(members)
    cap = LoraBatch.with_capacity(16, 12, "cpu", num_slots=6, max_members=4)
    assert cap.composed and cap.num_entries == 64
    x = torch.cat([case.x, torch.randn(6, case.x.shape[1])])
    y0 = torch.cat([case.y0, torch.randn(6, case.y0.shape[1])])
    cap.update_(lens, slots, weights)
    y = ops.add_lora(y0.clone(), x, case.lora_a, case.lora_b, cap, case.ranks, case.scalings, backend=backend)
    want = compose_f64(case.y0, case.x, case.lora_a, case.lora_b, case.ranks, case.scalings, lens, members)
    assert rel_err(y[:10], want, case.y0) <= TOL[torch.float32]
    assert torch.equal(y[10:], y0[10:])   # padding rows: no adapter
    cap.update_(lens, [m[0][0] if m else -1 for m in members])   # plain segments in a composed batch
    y = ops.add_lora(y0.clone(), x, case.lora_a, case.lora_b, cap, case.ranks, case.scalings, backend=backend)
    plain = [[(m[0][0], 1.0)] if m else [] for m in members]
    want = compose_f64(case.y0, case.x, case.lora_a, case.lora_b, case.ranks, case.scalings, lens, plain)
    assert rel_err(y[:10], want, case.y0) <= TOL[torch.float32]


@interpreted
@pytest.mark.parametrize("launcher", ["product", "delta"])
def test_decode_launchers_add_every_member(launcher):
    """The "decode" plan's launchers (ops/lora/overlap.py) on a composed batch: y (+ the product or the delta the
    consumer adds) is the loop's sum."""
    rng = np.random.default_rng(stable_seed("launchers", launcher))
    lens = [1] * 9
    case, members = _case(rng, lens, torch.float32)
    slots, weights = _batch_args(members)
    batch = LoraBatch.from_lengths(lens, slots, weights=weights)
    weight = torch.randn(80, 64) / 8
    base = torch.nn.functional.linear(case.x, weight)
    fn = overlap.linear_with_lora_product if launcher == "product" else overlap.linear_with_lora_delta
    y, pending = fn(case.x, weight, None, case.lora_a, case.lora_b, batch, case.ranks, case.scalings, side=False)
    got = y.double() + pending.dense().double()
    want = compose_f64(base, case.x, case.lora_a, case.lora_b, case.ranks, case.scalings, lens, members)
    assert rel_err(got, want, base) <= 1e-5


@pytest.mark.parametrize("slots, weights, match", [
    ([[0, 1, 2, 3, 4]], None, r"slot_ids\[0\] combines 5 adapters; at most 4"),
    ([[1, 1]], None, r"slot_ids\[0\] = \[1, 1\] names a slot twice"),
    ([[0, -1]], None, r"a composition's slots are >= 0"),
    ([[0, 1]], [[0.5]], r"weights\[0\] has 1 values for 2 slots"),
    ([[0, 1]], [[0.5, float("nan")]], r"weights\[0\] = .* must be finite"),
    ([2], [float("inf")], r"weights must be finite"),
    ([[0, 1], 2], [[0.5, 0.5]], "weights has 1 entries but slot_ids has 2"),
])
def test_bad_compositions_are_refused_by_name(slots, weights, match):
    with pytest.raises(ValueError, match=match):
        LoraBatch.from_lengths([1] * len(slots), slots, weights=weights)


def test_plain_capacity_batches_refuse_compositions():
    cap = LoraBatch.with_capacity(8, 4, "cpu", num_slots=4)
    assert not cap.composed and cap.shrink_entries is cap.sorted_rows
    with pytest.raises(ValueError, match="max_members > 1"):
        cap.update_([1, 1], [[0, 1], 2], [[0.5, 0.5], None])
    with pytest.raises(ValueError, match="max_members > 1"):
        cap.update_([1], [2], [0.5])
    with pytest.raises(ValueError, match="combines 3 adapters but this batch was made for 2"):
        LoraBatch.with_capacity(8, 4, "cpu", num_slots=4, max_members=2).update_([1], [[0, 1, 2]])


def test_split_ops_refuse_composed_batches():
    batch = LoraBatch.from_lengths([2], [[0, 1]], weights=[[0.5, 0.5]])
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="lora_shrink takes batches of one adapter"):
        ops.lora_shrink(x, torch.randn(2, 4, 8), batch, torch.tensor([4, 4], dtype=torch.int32))


def test_entries_layout():
    """Member l of row r is entry l·T + r; the shrink's tiles cover each entry once, grouped by slot."""
    batch = LoraBatch.from_lengths([2, 1, 3], [[4, 1], -1, [1, 0, 2]], weights=[[0.5, 2.0], None, [1, 1, -1]])
    T = 6
    assert batch.lanes == 3 and batch.num_entries == 18
    assert batch.row_slot.tolist() == [4, 4, -1, 1, 1, 1]
    assert batch.extra_slot.tolist() == [1, 1, -1, 0, 0, 0] + [-1, -1, -1, 2, 2, 2]
    ents, rows = batch.shrink_entries.tolist(), batch.shrink_rows.tolist()
    weights = batch.shrink_weights.tolist()
    got = sorted(zip(ents, rows, weights))
    want = sorted([(0, 0, 0.5), (1, 1, 0.5), (T, 0, 2.0), (T + 1, 1, 2.0),
                   (3, 3, 1.0), (4, 4, 1.0), (5, 5, 1.0), (T + 3, 3, 1.0), (T + 4, 4, 1.0), (T + 5, 5, 1.0),
                   (2 * T + 3, 3, -1.0), (2 * T + 4, 4, -1.0), (2 * T + 5, 5, -1.0)])
    assert got == want
    slot_of_entry = {r + l * T: s for l, lane in enumerate([[4, 4, -1, 1, 1, 1], [1, 1, -1, 0, 0, 0],
                                                              [-1, -1, -1, 2, 2, 2]]) for r, s in enumerate(lane)}
    covered = []
    for slot, start, end in zip(batch.shrink_work_slot.tolist(), batch.shrink_work_start.tolist(),
                                batch.shrink_work_end.tolist()):
        assert all(slot_of_entry[e] == slot for e in ents[start:end])
        covered += ents[start:end]
    assert sorted(covered) == sorted(ents)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expand_tiles_hold_one_member_list(backend):
    """Segments that share a first adapter but not the others fall into different expand tiles (each tile adds its
    first row's members to all its rows), single-adapter rows of that slot into a third; every row with an adapter
    lies in exactly one tile. Through the kernels, prompts of them sum like the loop, also in a slice where the
    tiles' first member has rank 0 and another member does not."""
    lens = [5, 3, 4, 2, 6]
    members = [[(2, 0.5), (0, 1.5)], [(2, 1.0)], [(2, 0.5), (1, -1.0)], [], [(2, 0.5), (0, 1.5)]]
    slots, weights = _batch_args(members)
    batch = LoraBatch.from_lengths(lens, slots, weights=weights, block_m=16)
    row_members = [tuple(m) for length, m in zip(lens, members) for _ in range(length)]
    rows = batch.sorted_rows.tolist()
    covered = []
    for slot, start, end in zip(batch.work_slot.tolist(), batch.work_start.tolist(), batch.work_end.tolist()):
        tile = rows[start:end]
        assert len({tuple(s for s, _ in row_members[r]) for r in tile}) == 1, tile
        assert row_members[tile[0]][0][0] == slot
        covered += tile
    assert sorted(covered) == [r for r, m in enumerate(row_members) if m]
    assert batch.num_work == 3

    rng = np.random.default_rng(stable_seed("member-tiles", backend))
    case = make_case(rng, seg_lens=lens, popularity="uniform", K=64, Ns=(40, 24), R=16, ranks="full",
                     dtype=torch.float32, num_slots=3)
    case.ranks[0][2] = 0   # slice 0: the tiles' first member adds nothing, the others do
    y = ops.add_lora(case.y0.clone(), case.x, case.lora_a, case.lora_b, batch, case.ranks, case.scalings,
                     backend=backend)
    want = compose_f64(case.y0, case.x, case.lora_a, case.lora_b, case.ranks, case.scalings, lens, members)
    assert rel_err(y, want, case.y0) <= TOL[torch.float32]
    assert torch.equal(y[12:14], case.y0[12:14])


def test_a_composed_graph_batch_splits_k_as_a_plain_one(monkeypatch):
    """A composed capacity batch (a CUDA graph's, room for 4 members a row) sizes its shrink's K split by its row
    tiles, as a plain batch of the same rows does, not by the room its entries keep (Llama-2-7B's q/k/v on an
    H100's 132 SMs: 8 splits, where counting the room took 4); a built composed batch by its own entries' tiles."""
    from loraplex.ops.lora import sgmv
    monkeypatch.setattr(sgmv, "num_sms", lambda device: 132)
    cfg = sgmv.config_for(16)
    x, qkv = torch.empty(32, 4096), [torch.empty(64, 16, 4096)] * 3
    plain = LoraBatch.with_capacity(32, 32, "cpu", num_slots=64)
    composed = LoraBatch.with_capacity(32, 32, "cpu", num_slots=64, max_members=4)
    assert composed.split_work == plain.split_work == plain.num_shrink_work < composed.num_shrink_work
    assert sgmv.new_partials(x, qkv, composed, cfg).shape[0] == sgmv.new_partials(x, qkv, plain, cfg).shape[0] == 8
    built = LoraBatch.from_lengths([1] * 32, [[2 * i, 2 * i + 1] for i in range(32)], weights=[[0.7, 0.3]] * 32)
    assert built.split_work == built.num_shrink_work == 64
