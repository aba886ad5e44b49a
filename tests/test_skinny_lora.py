"""ops/skinny_lora.py: the decode projection with its LoRA in one launch, against the float64 loop of its docstring
(Triton's interpreter on the CPU; the GPU at Llama-2-7B's shapes, in a CUDA graph too)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lora_cases import make_case, rel_err, stable_seed
from loraplex import ops
from loraplex.ops.gemm import skinny_lora
from loraplex.ops.lora.batch import LoraBatch
from loraplex.ops.gemm.skinny import SkinnyConfig

interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")
SMALL = SkinnyConfig(block_n=16, block_k=32, stages=1)
# beyond the one rounding of y, relative to the LoRA delta (lora_cases.rel_err); bf16: v in two halves
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def _case(rng, rows: int, Ns, popularity: str, dtype, device="cpu", K=64, R=16, none_frac=0.25):
    seg_lens = [1] * rows if popularity != "one" else [rows]
    case = make_case(rng, seg_lens=seg_lens, popularity="distinct" if popularity == "one" else popularity, K=K,
                     Ns=Ns, R=R, ranks="mixed", dtype=dtype, device=device, none_frac=none_frac)
    gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**31)))
    w = (torch.randn(sum(Ns), K, generator=gen, device=device) * K ** -0.5).to(dtype)
    bias = torch.randn(sum(Ns), generator=gen, device=device).to(dtype)
    return case, w, bias


def _expected(case, w, bias) -> torch.Tensor:
    """The float64 loop: x @ wᵀ + bias, plus each row's products (the cases' own oracle, over a zero y)."""
    base = case.x.double() @ w.double().t() + (bias.double() if bias is not None else 0.0)
    return base + (case.oracle() - case.y0.double()).to(base.device)


def _run(case, w, bias, config, block_m=None, out=None):
    batch = case.batch(block_m=block_m) if block_m else case.batch()
    return skinny_lora.skinny_lora_linear(case.x, w, bias, case.lora_a, case.lora_b, batch, case.ranks,
                                          case.scalings, out=out, config=config)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Ns, popularity, rows, with_bias", [
    ((48,), "distinct", 5, True), ((32, 16), "uniform", 9, False), ((32, 16, 16), "distinct", 32, True),
    ((16, 32, 16), "one", 7, False), ((32, 32, 16), "skewed", 3, False)])
def test_matches_float64_loop(dtype, Ns, popularity, rows, with_bias):
    """Rows each with its own adapter, several rows per adapter, one adapter for all (tiles of 64 rows), some
    rows without one; ranks 0..16 per slot and slice with NaN past each rank (never read); 1–3 slices; bias or
    not; the output poisoned with NaN first: every value written, within the dtype's tolerance of the loop."""
    rng = np.random.default_rng(stable_seed("skinny-lora", str(dtype), Ns, popularity, rows, with_bias))
    case, w, bias = _case(rng, rows, Ns, popularity, dtype)
    bias = bias if with_bias else None
    out = torch.full((rows, sum(Ns)), float("nan"), dtype=dtype)
    got = _run(case, w, bias, SMALL, out=out)
    assert got is out and not got.isnan().any()
    base = case.x.double() @ w.double().t() + (bias.double() if bias is not None else 0.0)
    assert rel_err(got, _expected(case, w, bias), base) <= (1e-5 if dtype == torch.float32 else TOL[dtype])


@interpreted
def test_rows_without_adapters_get_the_gemm_alone_and_counters_reset():
    """Rows without an adapter equal skinny_gemm's GEMM bit for bit; after a launch the counters are 0 again, and a
    second launch gives the same bits (K even in the shrink's steps here: 256)."""
    from loraplex.ops.gemm import skinny as skinny_gemm
    rng = np.random.default_rng(stable_seed("skinny-lora-none"))
    case, w, bias = _case(rng, 12, (32, 16), "distinct", torch.float32, K=256, none_frac=0.5)
    first = _run(case, w, bias, SMALL)
    count = skinny_lora._workspace(torch.device("cpu"), 16, 48)[2]
    assert count.tolist() == [0, 0, 0, 0]
    assert torch.equal(_run(case, w, bias, SMALL), first)
    plain = skinny_gemm.skinny_linear(case.x, w, bias, config=SMALL)
    none = [i for i, s in enumerate(case.slot_ids) if s < 0]
    assert none and torch.equal(first[none], plain[none])
    some = [i for i, s in enumerate(case.slot_ids) if s >= 0]
    assert not torch.equal(first[some], plain[some])


def test_applies_and_refusals():
    x = torch.randn(4, 64)
    w = torch.randn(64, 64)
    assert not skinny_lora.applies(x, w, [64])   # fp32 on the CPU: skinny_gemm's "auto" takes cuBLAS
    rng = np.random.default_rng(3)
    case, w, bias = _case(rng, 4, (32, 16), "distinct", torch.float32)
    with pytest.raises(ValueError, match="not multiples of the tiles' 32 columns"):
        _run(case, w, bias, SkinnyConfig(block_n=32, block_k=32, stages=1))
    with pytest.raises(ValueError, match="covers 5 rows, x has 4"):
        skinny_lora.skinny_lora_linear(case.x, w, bias, case.lora_a, case.lora_b,
                                       LoraBatch.from_lengths([5], [0]), case.ranks, case.scalings, config=SMALL)
    with pytest.raises(ValueError, match="do not add up"):
        skinny_lora.skinny_lora_linear(case.x, w[:40], None, case.lora_a, case.lora_b, case.batch(), case.ranks,
                                       case.scalings, config=SMALL)


def test_lora_programs_fill_what_the_tiles_leave():
    assert skinny_lora.lora_programs(96, SMALL, 32, torch.empty(0)) == 1   # the interpreter runs them in turn


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("popularity", ["distinct", "one"])
def test_gpu_7b_shapes_match_float64_loop_and_graph_replays(dtype, shape, popularity):
    """Llama-2-7B's projections at 32 decode rows with the tuned tiles (each its own adapter, or one for all),
    against the float64 loop; then captured in a CUDA graph and replayed on fresh inputs: the eager bits."""
    K, Ns = {"qkv": (4096, (4096, 4096, 4096)), "o": (4096, (4096,)), "gate_up": (4096, (11008, 11008)),
             "down": (11008, (4096,))}[shape]
    rng = np.random.default_rng(stable_seed("skinny-lora-gpu", str(dtype), shape, popularity))
    case, w, bias = _case(rng, 32, Ns, popularity, dtype, device="cuda", K=K, none_frac=0.1)
    batch = case.batch()
    out = torch.full((32, sum(Ns)), float("nan"), dtype=dtype, device="cuda")
    got = skinny_lora.skinny_lora_linear(case.x, w, None, case.lora_a, case.lora_b, batch, case.ranks,
                                         case.scalings, out=out)
    base = case.x.double() @ w.double().t()
    assert rel_err(got, _expected(case, w, None), base) <= TOL[dtype]
    x = case.x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = skinny_lora.skinny_lora_linear(x, w, None, case.lora_a, case.lora_b, batch, case.ranks,
                                                  case.scalings)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        eager = skinny_lora.skinny_lora_linear(x, w, None, case.lora_a, case.lora_b, batch, case.ranks,
                                               case.scalings)
        assert torch.equal(replayed, eager)


@interpreted
def test_warmup_launches_every_projection_variant(monkeypatch):
    """engine/warmup.compile_skinny_lora (LORAPLEX_SKINNY_LORA=on): forwards of 1 and 17 rows, 16- and 64-row work
    tiles, for each layer's four projections (of the first four layers); the slot it uses keeps its ranks."""
    from loraplex.adapters import AdapterPool
    from loraplex.engine.warmup import compile_skinny_lora
    from loraplex.models.config import ModelConfig
    from loraplex.ops.gemm import skinny as skinny_gemm
    config = ModelConfig(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64, name_or_path="tiny")
    pool = AdapterPool(config, 3, 16, torch.float32, "cpu")
    pool.ranks.fill_(5)
    monkeypatch.setattr(skinny_lora, "SETTING", "off")
    assert compile_skinny_lora(config, pool, torch.float32) == 0
    monkeypatch.setattr(skinny_lora, "SETTING", "on")
    monkeypatch.setattr(skinny_gemm, "SETTING", "on")
    monkeypatch.setattr(skinny_lora, "config_for", lambda w: SMALL)
    calls = []
    real = skinny_lora.skinny_lora_linear
    monkeypatch.setattr(skinny_lora, "skinny_lora_linear",
                        lambda x, w, *a, **kw: calls.append((x.shape[0], a[3].block_m, tuple(w.shape)))
                        or real(x, w, *a, config=SMALL, **kw))
    assert compile_skinny_lora(config, pool, torch.float32) == 2 * 2 * 2 * 4
    assert {c[:2] for c in calls} == {(1, 16), (1, 64), (17, 16), (17, 64)}
    assert {c[2] for c in calls} == {(64, 32), (32, 32), (96, 32), (32, 48)}
    assert (pool.ranks == 5).all()
