"""add_lora / lora_shrink / lora_expand on the CPU: the reference and the Triton kernels (in Triton's
interpreter) against the float64 loop of the documented semantics, on fresh random inputs."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from loraplex import ops
from loraplex.ops.lora import sgmv
from loraplex.ops.lora import expand_kernels, shrink_kernels
from loraplex.ops.lora.delta import LoraDelta
from loraplex.workloads import POPULARITIES

from lora_cases import make_case, rel_err, stable_seed
from oracle import add_lora_f64, shrink_f64

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
# These tests run the Triton kernels on CPU tensors, in Triton's interpreter; on a CUDA machine
# (no interpreter) they skip, and tests/test_ops_gpu.py runs the kernels for real.
interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")
BACKENDS = ["reference", pytest.param("triton", marks=interpreted)]


def _lens(regime: str, rng, n: int) -> list[int]:
    if regime == "decode":
        return [1] * n
    return [int(v) for v in rng.integers(1, 2049 if n <= 2 else 80, size=n)]


def _check(case, backend, dtype, single=False, **kw):
    y = case.run(single=single, backend=backend, **kw)
    untouched = case.untouched()
    assert torch.equal(y[untouched], case.y0[untouched]), "rows or columns outside the LoRA slices changed"
    err = rel_err(y, case.oracle(single), case.y0)
    assert err <= TOL[dtype], f"rel err {err:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_popularity_sweep(backend, dtype, popularity, regime):
    rng = np.random.default_rng(stable_seed(backend, str(dtype), popularity, regime))
    n = 2 if regime == "prefill" and popularity == "identical" else 24
    case = make_case(rng, seg_lens=_lens(regime, rng, n), popularity=popularity, K=96, Ns=(80,), R=16,
                     ranks="mixed", dtype=dtype, none_frac=0.25, y_offset=1, extra_cols=2)
    _check(case, backend, dtype, single=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", [0, 1, 7, 16, 64, 128, 256, "mixed"])
def test_ranks(backend, rank):
    rng = np.random.default_rng(rank if isinstance(rank, int) else 999)
    case = make_case(rng, seg_lens=[1, 5, 1, 33, 2], popularity="uniform", K=64, Ns=(48,), R=256, ranks=rank,
                     dtype=torch.float16)
    if rank == 0:
        assert torch.equal(case.run(single=True, backend=backend), case.y0)
    else:
        _check(case, backend, torch.float16, single=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("K, N", [(64, 1000), (1000, 64), (1024, 1024), (4096, 1000), (11008, 64), (64, 11008)])
def test_shapes(backend, K, N):
    rng = np.random.default_rng(K + N)
    case = make_case(rng, seg_lens=[1, 3, 1, 2], popularity="zipf", K=K, Ns=(N,), R=16, ranks="mixed",
                     dtype=torch.float32, none_frac=0.2)
    _check(case, backend, torch.float32, single=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Ns", [(64, 16, 16), (1000, 24, 7, 300), (40, 40)])
def test_multi_slice_unequal_widths_and_ranks(backend, Ns):
    rng = np.random.default_rng(len(Ns))
    case = make_case(rng, seg_lens=[1, 1, 20, 1, 3], popularity="distinct", K=64, Ns=Ns, R=32, ranks="mixed",
                     dtype=torch.float16, none_frac=0.2, y_offset=3, extra_cols=5)
    _check(case, backend, torch.float16)


@interpreted
@pytest.mark.parametrize("split_k", [1, 2, 8])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("rowwise", [False, True])
def test_kernel_split_k_and_tile_height(split_k, block_m, rowwise):
    """Split K, 16- and 64-row tiles, tiles of 1–16 rows (the row-wise kernels take those of up to
    sgmv.ROWWISE_MAX_ROWS rows when asked, the others keep the tile product)."""
    rng = np.random.default_rng(split_k * block_m)
    case = make_case(rng, seg_lens=[1, 70, 2, 15], popularity="skewed", K=640, Ns=(32, 16), R=16, ranks="mixed")
    y = case.y0.clone()
    cfg = sgmv.KernelConfig(split_k=split_k, shrink_block_k=64, n_chunks=2, expand_block_n=16, rowwise=rowwise)
    sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, case.batch(block_m=block_m), case.ranks, case.scalings,
                  0, cfg)
    assert rel_err(y, case.oracle(), case.y0) <= 1e-5


@interpreted
@pytest.mark.parametrize("n_chunks", [1, 2, 5])
@pytest.mark.parametrize("R", [16, 48, 128])
@pytest.mark.parametrize("rowwise", [False, True])
def test_expand_n_chunks_and_rank_tiles(n_chunks, R, rowwise):
    """One or several rank tiles (R ≤ 64 or not: the row-wise expand only takes one, R=128 keeps the tile
    product), N cut into chunks of several BLOCK_N steps, a rank tile wider than the rank (R=48)."""
    rng = np.random.default_rng(R + n_chunks)
    case = make_case(rng, seg_lens=[1, 1, 30, 2, 1], popularity="uniform", K=64, Ns=(80, 48), R=R, ranks="mixed")
    cfg = sgmv.KernelConfig(expand_block_n=16, n_chunks=n_chunks, shrink_block_k=32, rowwise=rowwise)
    for block_m in (16, 64):
        y = case.y0.clone()
        sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, case.batch(block_m=block_m), case.ranks, case.scalings,
                      0, cfg)
        assert rel_err(y, case.oracle(), case.y0) <= 1e-5


@interpreted
@pytest.mark.parametrize("R", [16, 128])
@pytest.mark.parametrize("accumulate", [True, False])
def test_prefetching_tile_expand_gives_the_plain_ones_bits(R, accumulate, monkeypatch):
    """KernelConfig.tile_prefetch (each step's y tile loaded a step ahead; the prompt tiles' config): prompts of
    1–70 rows in tiles of 16 and 64, N cut into chunks of several BLOCK_N steps
    whose last is partial (83 and 45 columns), one rank tile (R=16) or several (R=128); each path taken
    (counted), the same arithmetic in the same order as the plain tile expand, so the same bits, and the float64
    loop's values (accumulate=False: the products stored into an fp32 buffer, every adapter row's columns
    written)."""
    monkeypatch.setattr(expand_kernels, "_expand_tile", _count_expand_prefetch)
    rng = np.random.default_rng(stable_seed("tile-prefetch", R, accumulate))
    case = make_case(rng, seg_lens=[70, 1, 33, 5, 17], popularity="uniform", K=64, Ns=(83, 45), R=R, ranks="mixed",
                     dtype=torch.float16, y_offset=2, extra_cols=3)
    expected = case.oracle()
    for block_m in (16, 64):
        outs = []
        for prefetch in (False, True):
            _PATH_CALLS.clear()
            cfg = sgmv.KernelConfig(expand_block_n=16, n_chunks=2, shrink_block_k=32, tile_prefetch=prefetch)
            y = case.y0.clone() if accumulate else torch.full(case.y0.shape, float("nan"))
            sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, case.batch(block_m=block_m), case.ranks,
                          case.scalings, 2, cfg, accumulate=accumulate)
            assert set(_PATH_CALLS) == {f"expand_prefetch{int(prefetch)}"}, _PATH_CALLS
            outs.append(y)
        assert torch.equal(outs[0].nan_to_num(7.0), outs[1].nan_to_num(7.0)), block_m
        if accumulate:
            untouched = case.untouched()
            assert torch.equal(outs[1][untouched], case.y0[untouched])
            assert rel_err(outs[1], expected, case.y0) <= TOL[torch.float16]
        else:   # every row has an adapter ("uniform", none_frac 0): all its columns of the slices are products
            written = outs[1][:, 2:2 + 83 + 45]
            assert not written.isnan().any()
            delta = (expected - case.y0.double())[:, 2:2 + 83 + 45]
            assert (written.double() - delta).norm() <= 1e-2 * delta.norm()


def test_tuned_configs():
    """The tuned configs (ops/lora/tuned_h200.json): decode tiles row by row where they hold a few rows, prompt
    tiles with the y tile a step ahead over 64 columns; other tile heights take the prompt tiles' config."""
    decode, prompt = sgmv.config_for(16), sgmv.config_for(64)
    assert decode.rowwise and not decode.tile_prefetch and (decode.shrink_block_k, decode.expand_block_n) == (256, 256)
    assert prompt.tile_prefetch and not prompt.rowwise and prompt.expand_block_n == 64
    assert sgmv.config_for(32) is prompt


@interpreted
@pytest.mark.parametrize("split_k", [1, 4])
def test_rowwise_kernels_on_tiles_of_one_to_six_rows(split_k):
    """Distinct adapters on segments of 1–6 rows: the tiles of up to ROWWISE_MAX_ROWS rows go row by row and the
    5- and 6-row ones through the tile product; the row-wise expand's column step (ROWS_WIDE_BLOCK_N) wider than
    a program's share of N here, so its masks matter."""
    assert sgmv.ROWWISE_MAX_ROWS == 4
    rng = np.random.default_rng(stable_seed("rowwise", split_k, 1, "plain"))
    case = make_case(rng, seg_lens=[1, 2, 3, 4, 5, 6, 1, 1], popularity="distinct", K=200, Ns=(72, 40), R=16,
                     ranks="mixed", dtype=torch.float16, y_offset=2, extra_cols=3)
    assert all(s >= 0 for s in case.slot_ids)
    expected = case.oracle()
    cfg = sgmv.KernelConfig(split_k=split_k, shrink_block_k=32, expand_block_n=32, n_chunks=2, rowwise=True)
    y = case.y0.clone()
    sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, case.batch(block_m=16), case.ranks, case.scalings, 2, cfg)
    untouched = case.untouched()
    assert torch.equal(y[untouched], case.y0[untouched])
    assert rel_err(y, expected, case.y0) <= TOL[torch.float16]


@interpreted
def test_rowwise_rank_above_stack_width_counts_as_the_width():
    rng = np.random.default_rng(stable_seed("rowwise-rank", 1))
    # R=24: the rank tile is 32 wide, so a rank of 29 would reach into the next slot's rows if not clamped
    case = make_case(rng, seg_lens=[1, 3, 1, 9], popularity="distinct", K=64, Ns=(32,), R=24)
    expected = case.oracle()
    case.ranks[0].fill_(24 + 5)
    y = case.y0.clone()
    cfg = sgmv.KernelConfig(split_k=2, shrink_block_k=16, expand_block_n=16, rowwise=True)
    sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, case.batch(block_m=16), case.ranks, case.scalings, 0, cfg)
    assert rel_err(y, expected, case.y0) <= 1e-5


_PATH_CALLS: dict[str, int] = {}
_KERNEL_MODULE = {"_shrink_tile": shrink_kernels, "_shrink_tile_rows": shrink_kernels,
                  "_expand_tile": expand_kernels, "_expand_tile_rows": expand_kernels}
_REAL_TILES = {name: getattr(module, name) for name, module in _KERNEL_MODULE.items()}


# Counting stand-ins for the per-tile functions (Triton's interpreter runs a kernel as Python, looking its
# callees up in the module): which path each tile took.
def _counting(name: str, key: str):
    def count(*args):
        _PATH_CALLS[key] = _PATH_CALLS.get(key, 0) + 1
        return _REAL_TILES[name](*args)
    return count


_count_shrink_tile = _counting("_shrink_tile", "shrink_tile")
_count_shrink_rows = _counting("_shrink_tile_rows", "shrink_rows")
_count_expand_tile = _counting("_expand_tile", "expand_tile")
_count_expand_rows = _counting("_expand_tile_rows", "expand_rows")


def _count_expand_prefetch(*args):
    """The tile expand, counting its calls by their argument before the last, PREFETCH (False plain, True y a step
    ahead)."""
    key = f"expand_prefetch{int(getattr(args[-2], 'value', args[-2]))}"
    _PATH_CALLS[key] = _PATH_CALLS.get(key, 0) + 1
    return _REAL_TILES["_expand_tile"](*args)


@interpreted
@pytest.mark.parametrize("rowwise, expected", [
    (False, dict(shrink_tile=4, expand_tile=4)),
    (True, dict(shrink_rows=3, shrink_tile=1, expand_rows=3, expand_tile=1))])
def test_each_config_takes_the_path_it_says(rowwise, expected, monkeypatch):
    """Tiles of 1, 2, 6 and 1 rows (distinct adapters, one split, one N chunk, one rank tile): without `rowwise`
    the tile product runs on all, with it the row-wise path on the three of ≤ ROWWISE_MAX_ROWS rows."""
    for name, stand_in in (("_shrink_tile", _count_shrink_tile), ("_shrink_tile_rows", _count_shrink_rows),
                           ("_expand_tile", _count_expand_tile), ("_expand_tile_rows", _count_expand_rows)):
        monkeypatch.setattr(_KERNEL_MODULE[name], name, stand_in)
    _PATH_CALLS.clear()
    rng = np.random.default_rng(stable_seed("paths", int(rowwise)))
    case = make_case(rng, seg_lens=[1, 2, 6, 1], popularity="distinct", K=32, Ns=(16,), R=16, ranks="full",
                     dtype=torch.float16)
    cfg = sgmv.KernelConfig(split_k=1, n_chunks=1, shrink_block_k=32, expand_block_n=16, rowwise=rowwise)
    y = case.y0.clone()
    sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, case.batch(block_m=16), case.ranks, case.scalings, 0, cfg)
    assert _PATH_CALLS == expected
    assert rel_err(y, case.oracle(), case.y0) <= TOL[torch.float16]


def test_row_wise_expand_steps_512_columns_at_rank_16():
    decode = sgmv.CONFIGS[16]
    assert decode.rowwise
    assert [sgmv.rows_block_n_for(decode, sgmv._block_r(r)) for r in (4, 16, 32, 64)] == [512, 512, 256, 256]
    tiles_only = dataclasses.replace(decode, rowwise=False)   # the value goes unused: no variant of its own
    assert sgmv.rows_block_n_for(tiles_only, 16) == tiles_only.expand_block_n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("single", [True, False])
def test_shrink_and_expand_halves(backend, single):
    rng = np.random.default_rng(int(single))
    case = make_case(rng, seg_lens=[2, 1, 30, 4], popularity="uniform", K=80, Ns=(48, 24), R=16, ranks="mixed",
                     none_frac=0.3)
    a, b, rk, sc = case.args(single)
    batch = case.batch()
    out = torch.full((case.x.shape[0], 16) if single else (2, case.x.shape[0], 16), float("nan"))
    v = ops.lora_shrink(case.x, a, batch, rk, out=out, backend=backend)
    assert v is out
    for i in range(1 if single else 2):
        ref = shrink_f64(case.x, case.lora_a[i], case.seg_lens, case.slot_ids, case.ranks[i])
        got = v if single else v[i]
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)  # zeros where no adapter or rank
    y = ops.lora_expand(case.y0.clone(), v, b, batch, rk, sc, backend=backend)
    assert rel_err(y, case.oracle(single), case.y0) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_capacity_batch_updated_in_place(backend):
    rng = np.random.default_rng(8)
    base = make_case(rng, seg_lens=[1] * 24, K=64, Ns=(32, 16), R=16, ranks="mixed", num_slots=9)
    batch = ops.LoraBatch.with_capacity(24, 10, "cpu", num_slots=9)
    a, b, rk, sc = base.args(False)
    from oracle import add_lora_f64
    for lens, slots in [([1] * 10, [int(s) for s in rng.integers(-1, 9, 10)]), ([20, 4], [3, 3]), ([2], [-1])]:
        batch.update_(lens, slots)
        y = ops.add_lora(base.y0.clone(), base.x, a, b, batch, rk, sc, backend=backend)
        ref = add_lora_f64(base.y0, base.x, a, b, rk, sc, lens + [24 - sum(lens)], slots + [-1])
        assert rel_err(y, ref, base.y0) <= 1e-5


@interpreted
def test_auto_backend_and_env_setting(monkeypatch):
    assert ops.resolve_backend(None, torch.device("cpu")) == "reference"
    monkeypatch.setenv("LORAPLEX_OPS_BACKEND", "triton")
    assert ops.resolve_backend(None, torch.device("cpu")) == "triton"  # TRITON_INTERPRET=1 in these tests
    assert ops.resolve_backend("reference", torch.device("cpu")) == "reference"


def test_reference_module_has_the_same_ops():
    rng = np.random.default_rng(4)
    case = make_case(rng, seg_lens=[3, 1, 2], popularity="distinct", K=32, Ns=(16,), R=8)
    a, b, rk, sc = case.args(True)
    y = ops.reference.add_lora(case.y0.clone(), case.x, a, b, case.batch(), rk, sc)
    assert rel_err(y, case.oracle(True), case.y0) <= 1e-5
    v = ops.reference.lora_shrink(case.x, a, case.batch(), rk)
    y2 = ops.reference.lora_expand(case.y0.clone(), v, b, case.batch(), rk, sc)
    assert torch.allclose(y, y2)


@interpreted
def test_expand_keeps_the_intermediate_in_fp32():
    """fp16 weights, an fp32 intermediate with full mantissas, and an fp32 y: rounding v to fp16 on its
    way into the tensor cores would cost ~3e-4; the hi + lo split keeps ~22 bits (error ~1e-6)."""
    rng = np.random.default_rng(77)
    case = make_case(rng, seg_lens=[1, 9, 1, 40], popularity="uniform", K=64, Ns=(96,), R=32, ranks="mixed",
                     dtype=torch.float16)
    batch = case.batch()
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(1, 1, case.x.shape[0], 32, generator=gen)  # [split, slice, T, R], fp32
    y0 = torch.randn(case.x.shape[0], 96, generator=gen)
    y = y0.clone()
    sgmv.expand_from(y, v, case.lora_b, case.ranks, case.scalings, batch, 0,
                     sgmv.KernelConfig(expand_precision="split"))
    ref = y0.double().clone()
    start = 0
    rk, sc = case.ranks[0].tolist(), case.scalings[0].tolist()
    for length, slot in zip(case.seg_lens, case.slot_ids):
        rows = slice(start, start + length)
        start += length
        if slot >= 0:
            r = rk[slot]
            ref[rows] += sc[slot] * v[0, 0, rows, :r].double() @ case.lora_b[0][slot, :, :r].double().T
    assert rel_err(y, ref, y0) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_intermediate_past_fp16_range(backend):
    """v = x @ Aᵀ beyond 65504 (fp16's largest) must not turn into inf or NaN: it is fp32."""
    rng = np.random.default_rng(5)
    case = make_case(rng, seg_lens=[1, 3, 20], popularity="uniform", K=256, Ns=(64,), R=16, dtype=torch.float16)
    case.x.mul_(30)
    for a in case.lora_a:
        a.mul_(4000)  # entries ~ 4000 / √K; |v| ~ 30 · 4000 ≈ 1e5 on average
    for b in case.lora_b:
        b.mul_(1e-3)
    y = case.run(single=True, backend=backend)
    assert torch.isfinite(y).all()
    assert rel_err(y, case.oracle(True), case.y0) <= TOL[torch.float16]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_above_stack_width_counts_as_the_width(backend):
    rng = np.random.default_rng(6)
    case = make_case(rng, seg_lens=[1, 4, 1, 9], popularity="distinct", K=64, Ns=(32,), R=16)
    expected = case.oracle(True)
    case.ranks[0].fill_(16 + 5)
    assert rel_err(case.run(single=True, backend=backend), expected, case.y0) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_write_bumps_ys_version(backend):
    rng = np.random.default_rng(7)
    case = make_case(rng, seg_lens=[2, 1], popularity="distinct", K=32, Ns=(16,), R=8)
    y = case.y0.clone()
    before = y._version
    case.run(y, single=True, backend=backend)
    assert y._version > before


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_slice_lists_round_trip_through_the_halves(backend):
    rng = np.random.default_rng(8)
    case = make_case(rng, seg_lens=[2, 5, 1], popularity="uniform", K=48, Ns=(24,), R=8)
    batch = case.batch()
    v = ops.lora_shrink(case.x, case.lora_a, batch, case.ranks, backend=backend)
    assert v.shape == (1, case.x.shape[0], 8)
    y = ops.lora_expand(case.y0.clone(), v, case.lora_b, batch, case.ranks, case.scalings, backend=backend)
    assert rel_err(y, case.oracle(), case.y0) <= 1e-5


@interpreted
def test_y_in_xs_storage():
    """add_lora(y, y, …) is allowed: the shrink reads all of x before the expand writes y."""
    rng = np.random.default_rng(62)
    case = make_case(rng, seg_lens=[1] * 6, popularity="distinct", K=64, Ns=(64,), R=16)
    y = case.x.clone()
    expected = ops.add_lora(y.clone(), y.clone(), case.lora_a[0], case.lora_b[0], case.batch(), case.ranks[0],
                            case.scalings[0], backend="reference")
    sgmv.add_lora(y, y, case.lora_a, case.lora_b, case.batch(), case.ranks, case.scalings, 0,
                  sgmv.KernelConfig(expand_block_n=16, n_chunks=2))
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rowwise, R", [(False, 16), (True, 16), (False, 80)])   # 80: two rank tiles (their loop)
def test_expand_can_store_the_product_instead_of_adding_it(dtype, rowwise, R):
    """accumulate=False: y is an fp32 buffer; rows with an adapter get scaling · v @ Bᵀ (zeros in slices of
    rank 0: the buffer is not zero-filled, ops/lora/delta.py), every other element keeps what it held (NaN)."""
    rng = np.random.default_rng(stable_seed("store", str(dtype), R))
    case = make_case(rng, seg_lens=[1, 3, 1, 1, 20, 1, 2], popularity="uniform", K=96, Ns=(40, 24), R=R,
                     dtype=dtype, none_frac=0.3, ranks="mixed")
    case.slot_ids[3] = -1     # a row without an adapter
    used = next(s for s in case.slot_ids if s >= 0)
    case.ranks[0][used] = 0   # a slot used by rows has a slice of rank 0 (lowering a rank reads less)
    batch = case.batch()
    cfg = sgmv.KernelConfig(split_k=2, n_chunks=2, expand_block_n=16, rowwise=rowwise)
    part = sgmv.new_partials(case.x, case.lora_a, batch, cfg)
    sgmv.shrink_into(part, case.x, case.lora_a, case.ranks, batch, cfg)
    delta = torch.full(case.y0.shape, float("nan"))
    sgmv.expand_from(delta, part, case.lora_b, case.ranks, case.scalings, batch, 0, cfg, accumulate=False)
    untouched = case.untouched()
    assert untouched.any() and not untouched.all()
    assert torch.isnan(delta[untouched]).all()
    expected = case.oracle() - case.y0.double()
    zero = (expected == 0) & ~untouched   # rank-0 slices of rows with an adapter: stored zeros
    assert zero.any() and torch.equal(delta[zero], torch.zeros(int(zero.sum())))
    err = (delta.double() - expected)[~untouched].norm() / expected[~untouched].norm()
    assert err <= TOL[dtype], f"rel err {err:.2e}"


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_linear_with_lora_delta_leaves_the_product_for_the_next_op(dtype, regime):
    """ops/lora/overlap.py's `linear_with_lora_delta` on one stream: y is the plain GEMM; y + delta is
    add_lora's sum; the delta (a LoraDelta) is exactly 0 in slices of rank 0 and not written in rows without an
    adapter, which its row_slot marks -1 (its dense view: 0)."""
    from loraplex.ops.lora import overlap
    rng = np.random.default_rng(stable_seed("delta", str(dtype), regime))
    case = make_case(rng, seg_lens=_lens(regime, rng, 9), popularity="skewed", K=64, Ns=(48, 16, 16), R=16,
                     ranks="mixed", dtype=dtype, none_frac=0.3)
    case.ranks[1][max(case.slot_ids)] = 0   # a slot used by rows has a slice of rank 0 (lowering reads less)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    weight = (torch.randn(80, 64, generator=gen) / 8).to(dtype)
    bias = torch.randn(80, generator=gen).to(dtype)
    y, delta = overlap.linear_with_lora_delta(case.x, weight, bias, case.lora_a, case.lora_b, case.batch(),
                                              case.ranks, case.scalings, side=False)
    base = torch.nn.functional.linear(case.x, weight, bias)
    assert isinstance(delta, LoraDelta) and delta.rows == base.shape[0]
    assert torch.equal(y, base) and delta.values.dtype == torch.float32 and delta.values.shape == base.shape
    row_slot = torch.tensor([s for n, s in zip(case.seg_lens, case.slot_ids) for _ in range(n)], dtype=torch.int32)
    assert torch.equal(delta.row_slot, row_slot) and (row_slot < 0).any()
    want = add_lora_f64(base, case.x, case.lora_a, case.lora_b, case.ranks, case.scalings, case.seg_lens,
                        case.slot_ids) - base.double()
    written = (row_slot >= 0)[:, None].expand_as(want)
    zero = (want == 0) & written
    assert torch.equal(delta.values[zero], torch.zeros(int(zero.sum()))) and zero.any()
    delta = delta.dense()
    err = (delta.double() - want).norm() / want.norm()
    assert err <= TOL[dtype], f"rel err {err:.2e}"


def test_side_stream_that_is_the_captured_stream_falls_back_and_says_so(monkeypatch, caplog):
    """overlap._usable_side: where PyTorch's stream pool handed the capture the side stream itself, the LoRA
    kernels run in the plain order (None), with one warning, not one per projection."""
    from loraplex.ops.lora import overlap
    same, other = object(), object()
    monkeypatch.setattr(overlap, "_warned_same_stream", False)
    monkeypatch.setattr(overlap, "_side_stream", lambda device: same)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: other)
    assert overlap._usable_side(torch.device("cpu")) is same and not caplog.records
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: same)
    with caplog.at_level("WARNING", logger="loraplex.ops"):
        assert overlap._usable_side(torch.device("cpu")) is None
        assert overlap._usable_side(torch.device("cpu")) is None
    assert [r.getMessage() for r in caplog.records] == [
        "the LoRA side stream is the stream being captured: that graph runs its LoRA kernels in the plain order, "
        "without the overlap"]


def test_the_shrink_goes_after_the_gemm_only_with_pdl_and_the_triton_gemm(monkeypatch):
    """overlap.shrink_order: "after" (the default) only where PDL is on and the projection's GEMM is skinny_gemm's
    Triton kernel, which releases the shrink only after its own wait (ops/pdl.py); elsewhere (cuBLAS's GEMMs of more
    rows or other dtypes, GPUs without PDL) the side stream."""
    from loraplex.ops import pdl
    from loraplex.ops.lora import overlap
    from loraplex.ops.gemm import skinny as skinny_gemm
    import triton.language as tl
    w = torch.randn(64, 32)
    few, many = torch.randn(8, 32), torch.randn(skinny_gemm.DECODE_MAX_ROWS + 1, 32)
    monkeypatch.setattr(skinny_gemm, "takes", lambda dtype, device: True)   # as on a GPU with 16-bit weights
    for on, rows, want in ((True, few, "after"), (True, many, "side"), (False, few, "side")):
        monkeypatch.setattr(pdl, "PDL", tl.constexpr(on))
        assert overlap.shrink_order(rows, w) == want, (on, rows.shape)
    monkeypatch.setattr(skinny_gemm, "takes", lambda dtype, device: False)   # cuBLAS at any rows
    assert overlap.shrink_order(few, w) == "side"
