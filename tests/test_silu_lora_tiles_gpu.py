"""GPU tests (`pytest -m gpu`): ops/silu_lora_tiles.py compiled, at Llama-2-7B's gate/up widths, against the
float64 loop and against the path it replaces (the tile expand into gate_up, then SiLU-and-mul), eager and
replayed from a CUDA graph on a capacity batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex.ops import LoraBatch
from loraplex.ops.fused import api as fused
from loraplex.ops.lora import sgmv
from lora_cases import make_case
from test_silu_lora_tiles import _oracle, _product, _tiles_consumer

pytestmark = pytest.mark.gpu

# six 300-token prompts and 20 decode rows, each its own rank-16 adapter (the engine's mixed steps), and one
# 2,048-token prompt; K = 4096 (the hidden size), I = 11008
CASES = {"mixed": [300] * 6 + [1] * 20, "one-prompt": [2048]}


def _errors(out, expected):
    return (out.double() - expected.double()).norm().item() / expected.double().norm().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", list(CASES))
def test_matches_float64_loop_at_7b_widths(dtype, which):
    rng = np.random.default_rng(17)
    case = make_case(rng, seg_lens=CASES[which], popularity="distinct", K=4096, Ns=(11008, 11008), R=16,
                     ranks="full", dtype=dtype, device="cuda")
    case.ranks[1][0] = 8   # a smaller rank in up's slice of one adapter
    batch = case.batch()
    product = _product(case, batch)
    out = _tiles_consumer(case.y0, product)
    expected = _oracle(case, case.x.shape[0])
    y = case.y0.clone()
    sgmv.expand_from(y, product.part, case.lora_b, case.ranks, case.scalings, batch, 0,
                     sgmv.config_for(batch.block_m))
    before = fused.silu_and_mul(y)
    assert not out.isnan().any()
    # as close to the float64 loop as the expand-then-SiLU path it replaces (compiled, the two round `gate +
    # delta` where FMA contraction differs, so not always to the same bits)
    ours, theirs = _errors(out, expected), _errors(before, expected)
    assert ours <= 1.05 * theirs + 1e-4, (ours, theirs)
    same = (out == before).float().mean().item()
    assert same > 0.99, same


def test_graph_replay_on_a_capacity_batch_gives_the_eager_bits():
    """Captured on a capacity batch (the mixed-step graphs' LoraBatch.with_capacity), replayed with new
    segments, rows without an adapter and padding rows among them: the eager launch's bits."""
    rng = np.random.default_rng(23)
    T = 288
    case = make_case(rng, seg_lens=[T], popularity="distinct", K=4096, Ns=(11008, 11008), R=16, ranks="full",
                     dtype=torch.bfloat16, device="cuda", num_slots=6)
    batch = LoraBatch.with_capacity(T, 40, "cuda", num_slots=6, block_m=64)
    batch.update_([200, 30], [0, 1])
    out = torch.empty(T, 11008, dtype=torch.bfloat16, device="cuda")
    cfg = sgmv.config_for(64)
    part = sgmv.new_partials(case.x, case.lora_a, batch, cfg)
    from loraplex.ops.lora.product import LoraProduct
    product = LoraProduct(part, tuple(case.lora_b), tuple(case.ranks), tuple(case.scalings), batch.row_slot,
                          tiles=batch)

    def step():
        sgmv.shrink_into(part, case.x, case.lora_a, case.ranks, batch, cfg)
        fused.silu_and_mul(case.y0, out=out, delta=product)

    step()   # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens, slots in (([100, 1, 1, 150], [2, 3, -1, 4]), ([1] * 30 + [250], list(range(5)) * 6 + [-1]),
                        ([288], [5])):
        batch.update_(lens, slots)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        eager_batch = LoraBatch.from_lengths(lens + ([T - sum(lens)] if sum(lens) < T else []),
                                             slots + ([-1] if sum(lens) < T else []), "cuda", block_m=64)
        eager_part = sgmv.new_partials(case.x, case.lora_a, eager_batch, cfg)
        sgmv.shrink_into(eager_part, case.x, case.lora_a, case.ranks, eager_batch, cfg)
        eager = fused.silu_and_mul(case.y0, delta=LoraProduct(eager_part, tuple(case.lora_b), tuple(case.ranks),
                                                              tuple(case.scalings), eager_batch.row_slot,
                                                              tiles=eager_batch))
        assert not replayed.isnan().any()
        if eager_part.shape[0] == part.shape[0]:   # the same K split: the same sums
            assert torch.equal(replayed, eager), (lens, slots)
        else:
            assert (replayed.double() - eager.double()).abs().max() <= 2e-2 * eager.double().abs().max()
