"""ops/silu_lora_tiles.py: SiLU-and-mul expanding gate/up's LoRA product over the SGMV work tiles.

Against the float64 loop of add_lora's semantics followed by SiLU-and-mul, and bit for bit against what it
replaces (the tile expand into gate_up, then SiLU-and-mul), through the Triton kernels (the interpreter on the
CPU), with the output poisoned and weights past each rank NaN."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex import ops
from loraplex.ops import LoraBatch
from loraplex.ops.fused import api as fused
from loraplex.ops.lora import sgmv
from loraplex.ops.fused import silu_lora_tiles_kernels
from loraplex.ops.lora.product import LoraProduct
from lora_cases import make_case, stable_seed
from oracle import add_lora_f64

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not ops.triton_interpreted(),
                                reason="the Triton kernels need CUDA or TRITON_INTERPRET=1")


def _product(case, batch: LoraBatch) -> LoraProduct:
    """The real shrink over `batch`, as models/llama.py runs it, as a LoraProduct carrying the batch."""
    cfg = sgmv.config_for(batch.block_m)
    part = sgmv.new_partials(case.x, case.lora_a, batch, cfg)
    part.fill_(float("nan"))   # what the shrink does not write must not be read
    sgmv.shrink_into(part, case.x, case.lora_a, case.ranks, batch, cfg)
    return LoraProduct(part, tuple(case.lora_b), tuple(case.ranks), tuple(case.scalings), batch.row_slot,
                       tiles=batch)


def _tiles_consumer(gate_up: torch.Tensor, product: LoraProduct) -> torch.Tensor:
    out = torch.full((gate_up.shape[0], gate_up.shape[1] // 2), float("nan"), dtype=gate_up.dtype,
                     device=gate_up.device)
    launched = []
    real = silu_lora_tiles_kernels.silu_and_mul
    silu_lora_tiles_kernels.silu_and_mul = lambda *a, **k: launched.append(1) or real(*a, **k)
    try:
        fused.silu_and_mul(gate_up, out=out, delta=product, backend="triton")
    finally:
        silu_lora_tiles_kernels.silu_and_mul = real
    assert launched == [1]   # the tile consumer ran, not the row-wise one
    return out


def _oracle(case, T: int) -> torch.Tensor:
    """gate_up + the product in float64, rounded once to the dtype (the expand's one rounding), then
    SiLU-and-mul's reference (transformers' op order)."""
    summed = add_lora_f64(case.y0[:T], case.x[:T], case.lora_a, case.lora_b, case.ranks, case.scalings,
                          case.seg_lens, case.slot_ids)
    summed = summed.to(case.y0.dtype)
    return fused.silu_and_mul(summed, backend="reference")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seg_lens, block_m, popularity, R, none_frac", [
    ([23, 1, 17, 1, 9, 40], 64, "distinct", 8, 0.0),      # prompts and decode rows, each its own adapter
    ([70, 5, 1, 1, 33], 16, "skewed", 8, 0.4),            # rows without an adapter between them
    ([50, 3, 20], 64, "uniform", 48, 0.0),                # two rank tiles (R > 32)
])
def test_matches_float64_loop(dtype, seg_lens, block_m, popularity, R, none_frac):
    rng = np.random.default_rng(stable_seed("silu-tiles", str(dtype), seg_lens, block_m, R))
    I = 72   # not a multiple of the 64-column block
    case = make_case(rng, seg_lens=seg_lens, popularity=popularity, K=40, Ns=(I, I), R=R, ranks="mixed",
                     dtype=dtype, device=DEVICE, none_frac=none_frac)
    batch = case.batch(block_m=block_m)
    assert batch.all_rows_have_adapters == (-1 not in case.slot_ids)
    out = _tiles_consumer(case.y0, _product(case, batch))
    expected = _oracle(case, case.x.shape[0])
    assert not out.isnan().any()
    plain = fused.silu_and_mul(case.y0, backend="reference")
    assert (expected.double() - plain.double()).norm() > 0.3 * expected.double().norm()   # LoRA matters
    assert (out.double() - expected.double()).norm() <= TOL[dtype] * expected.double().norm()
    # rows without an adapter: plain SiLU-and-mul, exactly
    start = 0
    for length, slot in zip(case.seg_lens, case.slot_ids):
        if slot < 0:
            torch.testing.assert_close(out[start:start + length], fused.silu_and_mul(
                case.y0[start:start + length].contiguous(), backend="triton"), rtol=0, atol=0)
        start += length


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("programs_per_sm, prefetch", [(4.0, True), (1e-3, True), (1e-3, False)])
def test_gives_the_bits_of_the_expand_then_silu(dtype, programs_per_sm, prefetch, monkeypatch):
    """The same product (the tile expand's dot, split and precision) and the same rounding: the same bits as
    sgmv.expand_from into gate_up followed by SiLU-and-mul. 64-row tiles: the 16-row config's expand takes its
    one-row tiles row by row (KernelConfig.expand_rowwise), another summation order. A small program target
    leaves one program a tile, whose loop then takes several column steps (the last one partial)."""
    monkeypatch.setattr(silu_lora_tiles_kernels, "PROGRAMS_PER_SM", programs_per_sm)
    monkeypatch.setattr(silu_lora_tiles_kernels, "PREFETCH", prefetch)
    block_m = 64
    rng = np.random.default_rng(stable_seed("silu-tiles-bits", str(dtype), block_m))
    case = make_case(rng, seg_lens=[37, 1, 1, 66, 2], popularity="distinct", K=40, Ns=(150, 150), R=16,
                     ranks="mixed", dtype=dtype, device=DEVICE, none_frac=0.2)
    batch = case.batch(block_m=block_m)
    product = _product(case, batch)
    out = _tiles_consumer(case.y0, product)
    y = case.y0.clone()
    sgmv.expand_from(y, product.part, case.lora_b, case.ranks, case.scalings, batch, 0,
                     sgmv.config_for(block_m))
    assert torch.equal(out, fused.silu_and_mul(y, backend="triton"))


def test_capacity_batch_covers_its_padding_rows():
    """A CUDA-graph batch (with_capacity + update_): the rows past its segments have no adapter and take
    plain SiLU-and-mul; the unused work tiles write nothing."""
    rng = np.random.default_rng(5)
    seg_lens = [19, 1, 30]
    case = make_case(rng, seg_lens=seg_lens + [14], popularity="distinct", K=40, Ns=(64, 64), R=8,
                     ranks="mixed", dtype=torch.float16, device=DEVICE)
    case.slot_ids[-1] = -1   # the padding segment
    num_slots = case.lora_a[0].shape[0]
    batch = LoraBatch.with_capacity(64, 6, DEVICE, num_slots=num_slots, block_m=16)
    batch.update_(seg_lens, case.slot_ids[:3])
    assert not batch.all_rows_have_adapters
    out = _tiles_consumer(case.y0, _product(case, batch))
    expected = _oracle(case, 64)
    assert not out.isnan().any()
    assert (out.double() - expected.double()).norm() <= TOL[torch.float16] * expected.double().norm()
    torch.testing.assert_close(out[50:], fused.silu_and_mul(case.y0[50:].contiguous(), backend="triton"),
                               rtol=0, atol=0)


def test_a_product_for_other_rows_is_refused():
    rng = np.random.default_rng(3)
    case = make_case(rng, seg_lens=[10, 6], popularity="distinct", K=16, Ns=(16, 16), R=4, device=DEVICE)
    product = _product(case, case.batch(block_m=16))
    other = LoraBatch.from_lengths([10, 7], case.slot_ids, DEVICE, block_m=16)
    bad = LoraProduct(product.part, product.lora_b, product.ranks, product.scalings, product.row_slot, tiles=other)
    with pytest.raises(ValueError, match=r"delta\.tiles must be a LoraBatch of T=16 rows"):
        fused.silu_and_mul(case.y0, delta=bad, backend="triton")
