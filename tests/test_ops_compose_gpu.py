"""GPU tests (`pytest -m gpu`) of compositions in the LoRA ops: bf16/fp16 kernels against the float64 loop, the
decode launchers beside the GEMM on a side stream, and CUDA-graph replays of a composed capacity batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex import ops
from loraplex.ops import LoraBatch
from loraplex.ops.lora import overlap

from lora_cases import make_case, rel_err, stable_seed
from test_ops_compose import _batch_args, compose_f64, random_members

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _case(rng, lens, dtype, K=4096, Ns=(4096, 1024, 1024), R=64, num_slots=40):
    case = make_case(rng, seg_lens=lens, popularity="uniform", K=K, Ns=Ns, R=R, ranks="mixed", dtype=dtype,
                     device="cuda", num_slots=num_slots)
    members = random_members(rng, len(lens), num_slots)
    members[0] = [(0, 0.7), (1, -0.4), (2, 1.2), (3, 0.5)]
    return case, members


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_compositions_match_float64_loop(dtype, regime):
    rng = np.random.default_rng(stable_seed("compose-gpu", str(dtype), regime))
    lens = [1] * 32 if regime == "decode" else [int(v) for v in rng.integers(1, 700, size=6)]
    case, members = _case(rng, lens, dtype)
    slots, weights = _batch_args(members)
    batch = LoraBatch.from_lengths(lens, slots, "cuda", weights=weights)
    y = ops.add_lora(case.y0.clone(), case.x, case.lora_a, case.lora_b, batch, case.ranks, case.scalings)
    want = compose_f64(case.y0, case.x, case.lora_a, case.lora_b, case.ranks, case.scalings, lens, members)
    assert rel_err(y, want, case.y0) <= TOL[dtype]


@pytest.mark.parametrize("launcher", ["product", "delta"])
@pytest.mark.parametrize("side", [False, True])
def test_decode_launchers_with_compositions(launcher, side):
    """Captured in a CUDA graph when `side` (the side stream exists only then), else eager."""
    rng = np.random.default_rng(stable_seed("compose-launch", launcher, side))
    lens = [1] * 24
    case, members = _case(rng, lens, torch.bfloat16, Ns=(1024, 256, 256))
    slots, weights = _batch_args(members)
    batch = LoraBatch.from_lengths(lens, slots, "cuda", weights=weights)
    weight = (torch.randn(1536, 4096, device="cuda") / 64).to(torch.bfloat16)
    fn = overlap.linear_with_lora_product if launcher == "product" else overlap.linear_with_lora_delta
    call = lambda: fn(case.x, weight, None, case.lora_a, case.lora_b, batch, case.ranks, case.scalings,  # noqa: E731
                      side=side)
    if side:
        call()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = call()
        g.replay()
        torch.cuda.synchronize()
    else:
        out = call()
    y, pending = out
    base = torch.nn.functional.linear(case.x, weight)
    got = y.double() + pending.dense().double()
    want = compose_f64(base, case.x, case.lora_a, case.lora_b, case.ranks, case.scalings, lens, members)
    assert rel_err(got, want, base) <= 2e-2


def test_graph_replays_of_a_composed_capacity_batch():
    rng = np.random.default_rng(stable_seed("compose-graph"))
    case, _ = _case(rng, [1] * 48, torch.bfloat16, Ns=(1024,))
    cap = LoraBatch.with_capacity(48, 48, "cuda", num_slots=40, max_members=4)
    y = case.y0.clone()
    cap.update_([1] * 48, [-1] * 48)
    ops.add_lora(y, case.x, case.lora_a, case.lora_b, cap, case.ranks, case.scalings)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.add_lora(y, case.x, case.lora_a, case.lora_b, cap, case.ranks, case.scalings)
    for trial in range(3):
        lens = [1] * int(rng.integers(1, 49))
        members = random_members(rng, len(lens), 40)
        slots, weights = _batch_args(members)
        y.copy_(case.y0)
        cap.update_(lens, slots, weights)
        g.replay()
        torch.cuda.synchronize()
        T = len(lens)
        want = compose_f64(case.y0[:T], case.x[:T], case.lora_a, case.lora_b, case.ranks, case.scalings, lens,
                           members)
        assert rel_err(y[:T], want, case.y0[:T]) <= TOL[torch.bfloat16], f"trial {trial}"
        assert torch.equal(y[T:], case.y0[T:])
