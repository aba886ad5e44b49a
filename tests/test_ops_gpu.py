"""GPU tests (`pytest -m gpu`): the full sweep in bf16 and fp16 against the float64 loop, and graph capture."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from loraplex import ops
from loraplex.ops.lora import sgmv
from loraplex.workloads import POPULARITIES

from lora_cases import make_case, rel_err, stable_seed
from oracle import add_lora_f64, shrink_f64

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
RANKS = [0, 1, 7, 16, 64, 128, 256, "mixed"]
SHAPES = [(64, 64), (1000, 1000), (4096, 1024), (4096, 4096), (4096, 11008), (11008, 4096), (1024, 1000)]


def _seg_lens(regime: str, rng) -> list[int]:
    if regime == "decode":
        return [1] * int(rng.choice([1, 3, 16, 64, 200, 256]))
    return [int(v) for v in rng.integers(1, 2049, size=int(rng.integers(1, 7)))]


def _check(case, dtype, single=True):
    y = case.run(single=single)
    untouched = case.untouched()
    assert torch.equal(y[untouched], case.y0[untouched]), "rows or columns outside the LoRA slices changed"
    return rel_err(y, case.oracle(single), case.y0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_sweep_matches_float64_loop(dtype, popularity, regime):
    rng = np.random.default_rng(stable_seed(str(dtype), popularity, regime))
    for i, rank in enumerate(RANKS):
        K, N = SHAPES[(i + len(popularity)) % len(SHAPES)]
        case = make_case(rng, seg_lens=_seg_lens(regime, rng), popularity=popularity, K=K, Ns=(N,), R=256
                         if rank in (128, 256, "mixed") else 64, ranks=rank, dtype=dtype, device="cuda",
                         none_frac=0.2 if i % 2 else 0.0, extra_cols=3, y_offset=i % 3)
        err = _check(case, dtype)
        if rank == 0:
            assert err == 0, "rank 0 must leave y untouched"
        else:
            assert err <= TOL[dtype], f"rank={rank} K={K} N={N}: rel err {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("regime", ["decode", "prefill"])
@pytest.mark.parametrize("Ns", [(4096, 1024, 1024), (11008, 11008), (1000, 24, 7, 300)])
def test_multi_slice(dtype, regime, Ns):
    rng = np.random.default_rng(len(Ns) * 7 + (regime == "decode"))
    case = make_case(rng, seg_lens=_seg_lens(regime, rng), popularity="zipf", K=4096, Ns=Ns, R=64, ranks="mixed",
                     dtype=dtype, device="cuda", none_frac=0.1, y_offset=5, extra_cols=2)
    assert _check(case, dtype, single=False) <= TOL[dtype]


@pytest.mark.parametrize("split_k", [1, 3, 8])
def test_forced_split_k(split_k):
    rng = np.random.default_rng(split_k)
    case = make_case(rng, seg_lens=[1] * 64, popularity="uniform", K=4096, Ns=(4096,), R=16,
                     dtype=torch.bfloat16, device="cuda")
    cfg = sgmv.KernelConfig(split_k=split_k)
    y = case.y0.clone()
    sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, case.batch(), case.ranks, case.scalings, 0, cfg)
    assert rel_err(y, case.oracle(), case.y0) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("popularity", ["distinct", "uniform", "identical"])
@pytest.mark.parametrize("Ns", [(4096,), (4096, 4096, 4096), (11008, 11008)])
def test_rowwise_kernels_match_float64_loop(dtype, popularity, Ns):
    """The decode config's row-wise shrink and expand on Llama-2-7B's decode shapes, with mixed ranks and rows
    without an adapter: tiles of up to sgmv.ROWWISE_MAX_ROWS rows ("distinct" is all such tiles, "uniform" and
    "identical" larger ones that keep the tile product)."""
    rng = np.random.default_rng(stable_seed("rowwise", str(dtype), popularity, Ns, 1, []))
    case = make_case(rng, seg_lens=[1] * 160, popularity=popularity, K=11008 if len(Ns) == 1 else 4096, Ns=Ns,
                     R=16, ranks="mixed", dtype=dtype, device="cuda", none_frac=0.1, y_offset=2, extra_cols=3)
    cfg = sgmv.config_for(16)
    assert cfg.rowwise
    y = case.y0.clone()
    sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, case.batch(block_m=16), case.ranks, case.scalings, 2, cfg)
    untouched = case.untouched()
    assert torch.equal(y[untouched], case.y0[untouched])
    assert rel_err(y, case.oracle(), case.y0) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Ns", [(4096, 4096, 4099), (11008, 11011)])
@pytest.mark.parametrize("pair", ["noprefetch:default", "default:rows"])
def test_prefill_expand_matches_float64_loop(dtype, Ns, pair):
    """The large tiles' config (sgmv.config_for(64): the y tile a step ahead over 64 columns) on prompt-sized
    segments of Llama-2-7B's shapes (and widths 3 past them, so that a step's columns are cut short): the float64
    loop's values, and the bits of the same config without the y tile a step ahead. With the row-wise path as
    well ("rows": tiles of up to ROWWISE_MAX_ROWS rows, here a 1-row and a 3-row segment and a 129-row segment's
    last row, go row by row) the other tiles' bits are the tile product's."""
    default = sgmv.config_for(64)
    base, cfg = {"noprefetch:default": (dataclasses.replace(default, tile_prefetch=False), default),
                 "default:rows": (default, dataclasses.replace(default, rowwise=True))}[pair]
    rng = np.random.default_rng(stable_seed("prefill-options", str(dtype), Ns, pair))
    case = make_case(rng, seg_lens=[320, 1, 511, 64, 129, 3], popularity="distinct", K=4096, Ns=Ns, R=16,
                     ranks="mixed", dtype=dtype, device="cuda", none_frac=0.2, y_offset=2, extra_cols=3)
    outs = []
    for c in (base, cfg):
        y = case.y0.clone()
        sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, case.batch(block_m=64), case.ranks, case.scalings, 2, c)
        outs.append(y)
    untouched = case.untouched()
    assert torch.equal(outs[1][untouched], case.y0[untouched])
    assert rel_err(outs[1], case.oracle(), case.y0) <= TOL[dtype]
    same = torch.ones(len(case.y0), dtype=torch.bool, device="cuda")   # rows the same path takes in both
    if cfg.rowwise:
        start = 0
        for length in case.seg_lens:   # distinct: a segment a slot, cut into tiles of 64 rows
            for tile in range(start, start + length, 64):
                if min(64, start + length - tile) <= sgmv.ROWWISE_MAX_ROWS.value:
                    same[tile:start + length] = False
            start += length
        assert int((~same).sum()) == 5   # the 1- and 3-row segments, and the 129-row one's last tile
    if cfg.expand_block_n == base.expand_block_n:
        assert torch.equal(outs[0][same], outs[1][same])


def test_halves_match_float64():
    rng = np.random.default_rng(5)
    case = make_case(rng, seg_lens=[3, 700, 1, 1, 90], popularity="uniform", K=4096, Ns=(11008,), R=64,
                     ranks="mixed", dtype=torch.bfloat16, device="cuda", none_frac=0.3)
    batch = case.batch()
    v = ops.lora_shrink(case.x, case.lora_a[0], batch, case.ranks[0])
    ref_v = shrink_f64(case.x, case.lora_a[0], case.seg_lens, case.slot_ids, case.ranks[0])
    assert (v.double() - ref_v).norm() / ref_v.norm() < 1e-5
    y = ops.lora_expand(case.y0.clone(), v, case.lora_b[0], batch, case.ranks[0], case.scalings[0])
    assert rel_err(y, case.oracle(single=True), case.y0) <= 1e-2


def test_auto_backend_is_triton_on_cuda():
    assert ops.resolve_backend(None, torch.device("cuda")) == "triton"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_graph_replay_with_updated_batches(dtype):
    """One capture, replayed over different segment mixes written in place: results stay exact."""
    rng = np.random.default_rng(11)
    max_rows, max_segs, num_slots, K, Ns = 64, 64, 40, 1024, (1024, 256, 256)
    base = make_case(rng, seg_lens=[1] * max_rows, K=K, Ns=Ns, R=32, ranks="mixed", dtype=dtype, device="cuda",
                     num_slots=num_slots)
    batch = ops.LoraBatch.with_capacity(max_rows, max_segs, "cuda", num_slots=num_slots)
    x = base.x.clone()
    y = base.y0.clone()
    a, b, rk, sc = base.args(False)
    ops.add_lora(y, x, a, b, batch, rk, sc)  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.add_lora(y, x, a, b, batch, rk, sc)
    for trial in range(4):
        n = int(rng.integers(1, max_segs))
        lens = [1] * n if trial % 2 else [int(v) for v in rng.multinomial(max_rows - n, [1 / n] * n) + 1]
        slots = [int(s) if rng.random() > 0.2 else -1 for s in rng.integers(0, num_slots, size=len(lens))]
        batch.update_(lens, slots)
        x.copy_(torch.randn_like(x))
        y0 = torch.randn_like(y)
        y.copy_(y0)
        graph.replay()
        ref = add_lora_f64(y0, x, a, b, rk, sc, lens + [max_rows - sum(lens)], slots + [-1])
        assert rel_err(y, ref, y0) <= TOL[dtype], f"trial {trial}"


def test_fast_launch_matches_tritons_own_launch():
    """The direct launcher (ops/launch.py) must pick the same compiled kernel Triton would: vary every
    property Triton specializes on (pointer alignment, ints equal to 1 or divisible by 16, dtype)."""
    rng = np.random.default_rng(21)
    launchers = (sgmv._SHRINK, sgmv._EXPAND)
    assert all(launcher.enabled for launcher in launchers), "fast launch is expected on this Triton"
    variants = [(64, (64,), 0, 0, torch.bfloat16), (17, (1, 33), 3, 1, torch.float16),
                (4096, (1024, 1, 16), 1, 8, torch.bfloat16), (48, (48,), 5, 3, torch.float16)]
    for K, Ns, y_offset, x_pad, dtype in variants:
        case = make_case(rng, seg_lens=[1, 5, 1, 40], popularity="uniform", K=K, Ns=Ns, R=16, ranks="mixed",
                         dtype=dtype, device="cuda", y_offset=y_offset, extra_cols=1)
        x = torch.empty(case.x.shape[0], K + x_pad, dtype=dtype, device="cuda")[:, x_pad:]  # unaligned rows
        x.copy_(case.x)
        a, b, rk, sc = case.args(False)
        batch = case.batch()
        outs = []
        direct = [launcher.direct_launches for launcher in launchers]
        for fast in (True, True, False):  # first call compiles through Triton, the second launches directly
            for launcher in launchers:
                launcher.enabled = fast
            outs.append(ops.add_lora(case.y0.clone(), x, a, b, batch, rk, sc, y_offset=y_offset))
        for launcher in launchers:
            launcher.enabled = True
        assert all(launcher.direct_launches > d for launcher, d in zip(launchers, direct)), "direct path unused"
        assert torch.equal(outs[1], outs[2]) and torch.equal(outs[0], outs[2])
        assert rel_err(outs[1], case.oracle(), case.y0) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("side", [False, True])
def test_lora_delta_beside_the_gemm(dtype, side):
    """ops/lora/overlap.py's `linear_with_lora_delta`, at 7B widths (q/k/v slices), on one stream and on the side
    stream: y is the plain GEMM, y + delta matches the float64 loop; the delta (a LoraDelta, not zero-filled)
    marks rows without an adapter -1 and holds exact zeros in the rank-0 slices of rows with one."""
    from loraplex.ops.gemm import skinny as skinny_gemm
    from loraplex.ops.lora import overlap
    rng = np.random.default_rng(stable_seed("delta-gpu", str(dtype), side))
    case = make_case(rng, seg_lens=[1] * 32, popularity="distinct", K=4096, Ns=(4096, 1024, 1024), R=16,
                     dtype=dtype, device="cuda", none_frac=0.2, ranks="mixed")
    used = [s for s in case.slot_ids if s >= 0]
    case.ranks[1][used[0]] = 0   # k's slice of rank 0 for a slot rows use (lowering a rank reads less)
    gen = torch.Generator(device="cuda").manual_seed(3)
    weight = (torch.randn(6144, 4096, generator=gen, device="cuda") / 64).to(dtype)
    y, lora_delta = overlap.linear_with_lora_delta(case.x, weight, None, case.lora_a, case.lora_b, case.batch(),
                                                   case.ranks, case.scalings, side=side)
    torch.cuda.synchronize()
    base = skinny_gemm.linear(case.x, weight, None)   # the projections' GEMM (Triton's at 32 rows)
    assert torch.equal(y, base)
    without = torch.tensor(case.slot_ids, device="cuda") < 0
    assert without.any() and torch.equal(lora_delta.row_slot < 0, without)
    delta = lora_delta.dense()
    want = add_lora_f64(base, case.x, case.lora_a, case.lora_b, case.ranks, case.scalings, case.seg_lens,
                        case.slot_ids) - base.double()
    zero = (want == 0) & ~without[:, None]   # rank-0 slices of rows with an adapter: stored zeros
    assert zero.any() and torch.equal(lora_delta.values[zero], torch.zeros_like(lora_delta.values[zero]))
    err = ((delta.double() - want).norm() / want.norm()).item()
    assert err <= TOL[dtype], f"rel err {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("side", [False, True, "after"])
@pytest.mark.parametrize("Ns", [(4096, 4096, 4099), (11008, 11011)])
def test_lora_product_beside_the_gemm(dtype, side, Ns, monkeypatch):
    """ops/lora/overlap.py's `linear_with_lora_product` at 7B widths (q/k/v, gate/up slices), the shrink in the
    "side" order on one stream or on the side stream (forked eagerly here; the model forks only while capturing);
    "after" (the order where PDL is on): the shrink on the current stream after the GEMM, its programs beside the
    GEMM's: y is the plain GEMM bit for bit, each row carries its segment's slot, and the product the consumers
    expand (`dense()`) matches the float64 loop; rows without an adapter get exactly 0."""
    from loraplex.ops import pdl
    from loraplex.ops.gemm import skinny as skinny_gemm
    from loraplex.ops.lora import overlap
    if side == "after" and not pdl.PDL:
        pytest.skip("the shrink goes after the GEMM only with PDL (overlap.shrink_order): elsewhere the side stream")
    monkeypatch.setattr(overlap, "_SIDE_STREAMS", {})
    after = side == "after"
    if not after:
        monkeypatch.setattr(overlap, "shrink_order", lambda x, weight: "side")
    side = bool(side)
    rng = np.random.default_rng(stable_seed("product-gpu", str(dtype), side, Ns))
    case = make_case(rng, seg_lens=[1] * 32, popularity="distinct", K=4096, Ns=Ns, R=16, ranks="mixed",
                     dtype=dtype, device="cuda", none_frac=0.2)
    case.slot_ids[1] = -1   # at least one row without an adapter
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("product-weight", Ns))
    weight = (torch.randn(sum(Ns), 4096, generator=gen, device="cuda") / 64).to(dtype)
    y, product = overlap.linear_with_lora_product(case.x, weight, None, case.lora_a, case.lora_b, case.batch(),
                                                  case.ranks, case.scalings, side=side)
    torch.cuda.synchronize()
    assert bool(overlap._SIDE_STREAMS) == (side and not after), "side=True forks to the side stream (\"side\" order)"
    assert torch.equal(y, skinny_gemm.linear(case.x, weight, None))   # the projections' GEMM (Triton's at 32 rows)
    assert product.row_slot.tolist() == np.repeat(case.slot_ids, case.seg_lens).tolist()
    dense = product.dense()
    want = add_lora_f64(torch.zeros_like(dense), case.x, case.lora_a, case.lora_b, case.ranks, case.scalings,
                        case.seg_lens, case.slot_ids)
    none = product.row_slot < 0
    assert torch.equal(dense[none], torch.zeros_like(dense[none]))
    err = ((dense.double() - want).norm() / want.norm()).item()
    assert err <= TOL[dtype], f"rel err {err:.2e}"
