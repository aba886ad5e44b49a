"""ops/stored_lora.py: the expand stores each row's LoRA product into the output, then the GEMM adds x @ Wᵀ to it.

Against the float64 loop of add_lora's semantics on x @ Wᵀ, through the Triton kernels (the interpreter on the
CPU), with the output poisoned where it is allocated so that an element the expand leaves unwritten shows."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from loraplex.ops import LoraBatch
from loraplex.ops.lora import sgmv
from loraplex.ops.lora import stored_lora
from lora_cases import make_case, stable_seed
from oracle import add_lora_f64

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _poisoned_output(monkeypatch, shape: tuple[int, int]) -> list[torch.Tensor]:
    """Make the op's output allocation (`torch.empty` of `shape`) NaN-filled; returns the tensors handed out."""
    real, handed = torch.empty, []

    def empty(*size, **kw):
        t = real(*size, **kw)
        if tuple(t.shape) == shape and t.is_floating_point():
            t.fill_(float("nan"))
            handed.append(t)
        return t
    monkeypatch.setattr(stored_lora.torch, "empty", empty)
    return handed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("Ns, block_m, popularity", [((40, 24, 24), 64, "distinct"), ((72,), 16, "uniform"),
                                                     ((36, 36), 64, "skewed")])
def test_matches_float64_loop(dtype, Ns, block_m, popularity, monkeypatch):
    """Prompt-like segments (and decode rows), every row with an adapter, ranks from 0 (the slice's product is
    0: stored as zeros) to R; one to three output slices; both tile heights."""
    rng = np.random.default_rng(stable_seed("stored", str(dtype), Ns, block_m, popularity))
    case = make_case(rng, seg_lens=[23, 1, 17, 1, 9, 40], popularity=popularity, K=48, Ns=Ns, R=8,
                     ranks="mixed", dtype=dtype, device=DEVICE)
    T, N = case.x.shape[0], sum(Ns)
    gen = torch.Generator(device=DEVICE).manual_seed(int(rng.integers(2**31)))
    weight = (torch.randn(N, case.x.shape[1], generator=gen, device=DEVICE) * case.x.shape[1] ** -0.5).to(dtype)
    batch = case.batch(block_m=block_m)
    handed = _poisoned_output(monkeypatch, (T, N))
    y = stored_lora.linear_with_lora_stored(case.x, weight, case.lora_a, case.lora_b, batch, case.ranks,
                                            case.scalings)
    assert len(handed) == 1 and y.data_ptr() == handed[0].data_ptr() and y.dtype == dtype
    base = case.x.double() @ weight.double().T
    expected = add_lora_f64(base, case.x, case.lora_a, case.lora_b, case.ranks, case.scalings, case.seg_lens,
                            case.slot_ids)
    assert not y.isnan().any()
    delta = expected - base
    assert delta.norm() > 0.3 * base.norm()   # the adapters' products are about as large as x @ Wᵀ
    # the GEMM's own rounding is part of the error (the float64 loop has none): relative to the whole output
    assert (y.double() - expected).norm() <= TOL[dtype] * expected.norm()


def test_agrees_with_the_expand_after_the_gemm():
    """The stored order and sgmv.add_lora after the GEMM give the same values up to rounding (fp32)."""
    rng = np.random.default_rng(11)
    case = make_case(rng, seg_lens=[30, 7, 12], popularity="distinct", K=32, Ns=(20, 12), R=4, ranks="mixed",
                     device=DEVICE)
    weight = torch.randn(32, 32, device=DEVICE)
    batch = case.batch(block_m=64)
    stored = stored_lora.linear_with_lora_stored(case.x, weight, case.lora_a, case.lora_b, batch, case.ranks,
                                                 case.scalings)
    after = sgmv.add_lora(case.x @ weight.T, case.x, case.lora_a, case.lora_b, batch, case.ranks, case.scalings, 0)
    assert torch.allclose(stored, after, rtol=1e-5, atol=1e-5)
    assert (after - case.x @ weight.T).abs().max() > 0.1   # the adapters change the output


def test_refuses_a_row_without_an_adapter():
    rng = np.random.default_rng(2)
    case = make_case(rng, seg_lens=[30, 7], popularity="distinct", K=16, Ns=(16,), R=4, device=DEVICE)
    batch = LoraBatch.from_lengths([30, 7], [case.slot_ids[0], -1], DEVICE, block_m=64)
    assert not stored_lora.applies(batch)
    with pytest.raises(ValueError, match="adapter on every row: 30 of 37 rows"):
        stored_lora.linear_with_lora_stored(case.x, torch.randn(16, 16, device=DEVICE), case.lora_a, case.lora_b,
                                            batch, case.ranks, case.scalings)


@pytest.mark.parametrize("block_m", [16, 64])
def test_applies_only_to_covered_batches_over_the_skinny_rows_with_the_setting(block_m, monkeypatch):
    for store in (False, True):
        monkeypatch.setitem(sgmv.CONFIGS, block_m, dataclasses.replace(sgmv.CONFIGS[block_m], store_first=store))
        assert stored_lora.applies(LoraBatch.from_lengths([20, 13], [0, 3], block_m=block_m)) is store
        assert not stored_lora.applies(LoraBatch.from_lengths([20, 12], [0, 3], block_m=block_m))   # ≤ 32 rows
        assert not stored_lora.applies(LoraBatch.from_lengths([20, 13, 1], [0, 3, -1], block_m=block_m))
        assert stored_lora.applies(LoraBatch.from_lengths([20, 13, 0], [0, 3, -1], block_m=block_m)) is store


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Ns, K", [((4096, 4096, 4096), 4096), ((11008, 11008), 4096), ((4096,), 11008)])
def test_prompt_step_shapes_on_the_gpu(dtype, Ns, K):
    """Llama-2-7B's projections over six prompts (1,920 rows, rank 16, distinct adapters, mixed ranks): the
    float64 loop's values, and within rounding of cuBLAS's GEMM followed by sgmv.add_lora."""
    rng = np.random.default_rng(stable_seed("stored-gpu", str(dtype), Ns, K))
    case = make_case(rng, seg_lens=[320, 128, 512, 260, 411, 289], popularity="distinct", K=K, Ns=Ns, R=16,
                     ranks="mixed", dtype=dtype, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    weight = (torch.randn(sum(Ns), K, generator=gen, device="cuda") * K ** -0.5).to(dtype)
    batch = case.batch(block_m=64)
    y = stored_lora.linear_with_lora_stored(case.x, weight, case.lora_a, case.lora_b, batch, case.ranks,
                                            case.scalings)
    base = case.x.double() @ weight.double().T
    expected = add_lora_f64(base, case.x, case.lora_a, case.lora_b, case.ranks, case.scalings, case.seg_lens,
                            case.slot_ids)
    after = sgmv.add_lora(case.x @ weight.T, case.x, case.lora_a, case.lora_b, batch, case.ranks, case.scalings, 0)
    err, err_after = ((t.double() - expected).norm() / expected.norm() for t in (y, after))
    assert err <= TOL[dtype] and err <= 1.5 * err_after + 1e-4, (err, err_after)
