"""The FP8 (e4m3) KV cache: `--kv-cache-dtype fp8`.

- `store_kv` into an e4m3 cache against a float64 search of the e4m3 grid (the nearest value to
  float32(k) / k_scale, ties to even, saturated at ±448), in the reference and in the Triton kernel (Triton's
  interpreter on the CPU), ties, mantissa carries and subnormals included;
- `paged_attention` over e4m3 caches against test_attention's float64 loop on the dequantized values
  (e4m3 · scale), both backends, prefill tiles, decode splits and head-major caches; the Triton kernels
  against the reference on the same cache;
- the engine end to end on the CPU: the cache's blocks per memory budget, and greedy tokens and logprobs
  against transformers + PEFT whose attention reads the same e4m3 keys and values (a registered attention
  function that rounds them through torch's cast), which plain transformers misses by far more;
- compressed-tensors checkpoints with a `kv_cache_scheme`: the scales land in the cache (kv_cache_dtype fp8)
  or go unused (auto); refusals name the field or tensor; the settings and the flag;
- on GPUs (`-m gpu`): the kernels in bf16 against the reference.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_fixtures import GenerateOracle, make_served_model, random_prompts
from fp8_fixtures import ct_config, quantize_folder
from fp8_kv_fixtures import ENGINE, LOGPROB_TOL, Fp8KvOracle, generate_fp8, logprob_errors
from loraplex import ops
from loraplex.ops.attention import KV_FP8
from loraplex.ops.attention import launchers as ak
from loraplex.ops.attention import store_kernel
from test_attention import BACKENDS, TOL, interpreted, make_case, attention_f64, max_err, stable_seed

E4M3_MAX = 448.0
# every non-negative finite e4m3fn value, ascending with its code (codes 0..126; 127 is NaN): the grid
POSITIVE = torch.arange(127, dtype=torch.uint8).view(KV_FP8).double()
K_SCALE, V_SCALE = 0.0123, 0.0071   # nonzero, not 1: unit-normal keys reach ~300, values clamp past ±3.2


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float64: the e4m3 value nearest to each element of `x`, ties to the even code, clamped to ±448."""
    a = x.double().abs().clamp(max=E4M3_MAX)
    hi = torch.searchsorted(POSITIVE, a).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - POSITIVE[lo], POSITIVE[hi] - a
    r = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), POSITIVE[hi], POSITIVE[lo])
    return torch.where(x < 0, -r, r)


def quantize(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """An e4m3 cache from a float one by the documented rule (NaN poison stays NaN), same strides."""
    q = torch.empty_strided(cache.shape, cache.stride(), dtype=KV_FP8, device=cache.device)
    q.copy_((cache.float() / torch.tensor(scale)).clamp(-E4M3_MAX, E4M3_MAX))
    return q


# ---------------------------------------------------------------------------------------------
# store_kv


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("narrow", [False, True])
def test_store_into_e4m3_is_the_nearest_value_of_k_over_its_scale(backend, dtype, head_major, narrow, monkeypatch):
    """Magnitudes over five decades: subnormal quotients (< 2^-6), normal ones, and ones past 448 that saturate;
    padding rows skipped, every other slot untouched; k and v strided views of one fused buffer. The kernel's wide
    programs (all 9 heads) and its narrow ones (2 heads at a time, then 1), picked by the SM count it is told."""
    monkeypatch.setattr(store_kernel, "num_sms", lambda device: 10_000 if narrow else 1)
    rng = np.random.default_rng(stable_seed("fp8-store", backend, str(dtype), head_major))
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    nb, bs, T, Hkv, D = 6, 8, 19, 9, 256
    assert store_kernel.narrow_programs(T, Hkv, D, True, store_kernel.num_sms(None)) == narrow
    qkv = torch.randn(T, 5 * Hkv * D, generator=gen) * 10 ** (torch.rand(T, 5 * Hkv * D, generator=gen) * 5 - 4)
    qkv = qkv.to(dtype)
    k, v = qkv[:, 3 * Hkv * D:4 * Hkv * D].view(T, Hkv, D), qkv[:, 4 * Hkv * D:].view(T, Hkv, D)
    slots = rng.choice(nb * bs, size=T, replace=False)
    slots[[2, 11]] = -1
    shape = (nb, Hkv, bs, D) if head_major else (nb, bs, Hkv, D)
    caches = [torch.randn(shape, generator=gen).to(KV_FP8) for _ in range(2)]
    if head_major:
        caches = [c.transpose(1, 2) for c in caches]
    want = [c.double() for c in caches]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:   # the documented loop: fp32 quotient, then the nearest e4m3 by search
            want[0][slot // bs, slot % bs] = nearest_e4m3(k[t].float() / torch.tensor(K_SCALE))
            want[1][slot // bs, slot % bs] = nearest_e4m3(v[t].float() / torch.tensor(V_SCALE))
    ops.store_kv(k, v, *caches, torch.tensor(slots), k_scale=K_SCALE, v_scale=V_SCALE, backend=backend)
    for got, expect in zip(caches, want):
        assert torch.equal(got.double(), expect)
    quotients = (k.float() / K_SCALE).abs()
    assert (quotients > E4M3_MAX).any() and (quotients < 2 ** -6).any()   # both ends were exercised


def test_the_store_takes_narrow_programs_where_wide_ones_would_leave_sms_idle():
    """Into an e4m3 cache a decode step's tokens (Llama-2-7B's 32 kv heads: one wide program a token) take programs of
    512 elements; prompt steps, batches that fill the GPU and tokens of fewer than 2,048 elements (Llama-3-8B's 8 kv
    heads) keep whole-head programs of up to 4,096; a 16-bit cache always does."""
    sk = store_kernel
    assert sk.narrow_programs(32, 32, 128, True, 132) and sk.narrow_programs(1, 16, 128, True, 132)
    assert not sk.narrow_programs(32, 8, 128, True, 132) and not sk.narrow_programs(32, 32, 128, False, 132)
    assert not sk.narrow_programs(132, 32, 128, True, 132) and not sk.narrow_programs(2048, 32, 128, True, 132)
    assert sk.store_kv_constexprs(32, 128, True, narrow=True)["BLOCK_H"] == 4
    assert sk.store_kv_constexprs(32, 128, True)["BLOCK_H"] == 32


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_rounds_ties_to_even_carries_into_the_exponent_and_saturates(backend):
    """k_scale 0.5: the quotients are exactly 2k. Ties between e4m3 neighbours go to the even code, a round-up
    that carries the mantissa into the exponent lands on the next power of two, subnormals are multiples of
    2^-9, values past ±448 (and ±inf-free e4m3's largest) saturate."""
    quotients = [1.0625, 1.1875, 7.75, 15.5, 3 * 2 ** -10, 5 * 2 ** -10, 2 ** -10, 2 ** -11, 432.0, 447.9, 449.0,
                 1e6, -7.75, -3 * 2 ** -10, -1e6, 0.0, 0.01550, 240.5]
    expect = [1.0, 1.25, 8.0, 16.0, 2 ** -8, 2 ** -8, 0.0, 0.0, 448.0, 448.0, 448.0, 448.0, -8.0, -2 ** -8, -448.0,
              0.0, 2 ** -6, 240.0]
    T = len(quotients)
    k = (torch.tensor(quotients, dtype=torch.float32) * 0.5).view(T, 1, 1).expand(T, 1, 16).contiguous()
    caches = [torch.zeros(4, 8, 1, 16, dtype=KV_FP8) for _ in range(2)]
    ops.store_kv(k, k.clone(), *caches, torch.arange(T), k_scale=0.5, v_scale=torch.tensor([0.5]), backend=backend)
    got = caches[0].view(-1, 16)[:T, 0].double()
    assert got.tolist() == expect
    assert torch.equal(nearest_e4m3(torch.tensor(quotients)), torch.tensor(expect, dtype=torch.float64))
    assert torch.equal(caches[1].double(), caches[0].double())
    # the bytes: signs included (-0.0 and the negative values' underflow to zero keep theirs, as torch's cast does)
    signed = torch.tensor([-0.0, 0.0, -2 ** -12, 2 ** -12, -1.0, 1.0]).view(-1, 1, 1).expand(-1, 1, 16).contiguous()
    ops.store_kv(signed, signed.clone(), *caches, torch.arange(6), k_scale=1.0, v_scale=1.0, backend=backend)
    assert torch.equal(caches[0].view(-1, 16)[:6].view(torch.uint8), signed.view(6, 16).to(KV_FP8).view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# paged_attention


MIXED = [(0, 37), (20, 1), (45, 0), (0, 1), (70, 19), (5, 64), (130, 1), (3, 2)]
DECODE = [(0, 1), (8, 1), (30, 1), (63, 1), (100, 0), (120, 1), (150, 1)]


def _fp8_case(seed, seqs, dtype, *, Hq=8, Hkv=4, D=32, bs=8, window=0, head_major=False):
    """make_case's poisoned layout with e4m3 caches (keys / K_SCALE, values / V_SCALE) and the float64 loop over
    their dequantized values."""
    case = make_case(np.random.default_rng(seed), seqs, Hq=Hq, Hkv=Hkv, D=D, bs=bs, dtype=dtype, window=window,
                     head_major=head_major)
    case.k_cache, case.v_cache = quantize(case.k_cache, K_SCALE), quantize(case.v_cache, V_SCALE)
    oracle = attention_f64(case.q, case.k_cache.double() * K_SCALE, case.v_cache.double() * V_SCALE,
                           case.block_tables, case.seq_lens, case.query_start, case.scale, window)
    return case, oracle


def _attend(case, backend, **kw) -> torch.Tensor:
    out = torch.full(case.q.shape, float("nan"), dtype=case.q.dtype, device=case.q.device)
    kw = dict(dict(k_scale=K_SCALE, v_scale=V_SCALE), **kw)
    ops.paged_attention(*case.args(), **case.kwargs(), out=out, backend=backend, **kw)
    assert torch.isnan(out[~case.owned_rows()]).all(), "rows no sequence owns were written"
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seqs, window", [(MIXED, 0), (MIXED, 21), (DECODE, 40)], ids=["mixed", "window", "decode"])
def test_attention_over_e4m3_caches_matches_the_float64_loop(backend, dtype, seqs, window):
    """Prefill tiles and decode rows of queries in fp32 or fp16 over e4m3 keys and values scaled by K_SCALE and
    V_SCALE: the tolerances of the 16/32-bit caches (test_attention.TOL) hold, since dequantizing is exact."""
    case, oracle = _fp8_case(stable_seed("fp8-attn", backend, str(dtype), window, len(seqs)), seqs, dtype,
                             window=window)
    err = max_err(_attend(case, backend), oracle, case.owned_rows())
    assert err <= TOL[dtype], f"max abs err {err:.2e}"


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_matches_the_reference_on_the_same_e4m3_cache(num_splits):
    """The split decode scales each split's partial sum by v_scale (the reduce then divides as before); a head-major
    cache with G = 3 (padded to 4 rows)."""
    case, oracle = _fp8_case(stable_seed("fp8-split", num_splits), DECODE, torch.float32, Hq=6, Hkv=2, D=32,
                             bs=16, head_major=True)
    reference = _attend(case, "reference")
    out = torch.full(case.q.shape, float("nan"))
    ak.decode(*case.args(), out, max_seq_len=case.max_seq_len, scale=case.scale, window=0, num_splits=num_splits,
              cfg=ak.DecodeConfig(16, 4, 2), k_scale=torch.tensor([K_SCALE]), v_scale=torch.tensor([V_SCALE]))
    rows = case.owned_rows()
    assert max_err(out, reference.double(), rows) <= 1e-5
    assert max_err(out, oracle, rows) <= TOL[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_then_attend_with_tensor_scales_as_the_model_does(backend):
    """The model's order through KVCache's per-layer scale tensors: the stored bytes equal the reference's, and the
    output the float64 loop's on what was stored."""
    case, _ = _fp8_case(stable_seed("fp8-model-order", backend), MIXED, torch.float32)
    ks, vs = torch.tensor([K_SCALE]), torch.tensor([V_SCALE])
    bs, tables, lens, starts = 8, case.block_tables.tolist(), case.seq_lens.tolist(), case.query_start.tolist()
    slots = torch.full((case.q.shape[0],), -1, dtype=torch.int32)
    for s in range(len(lens)):
        for i, row in enumerate(range(starts[s], starts[s + 1])):
            p = lens[s] - (starts[s + 1] - starts[s]) + i
            slots[row] = tables[s][p // bs] * bs + p % bs
    ref_caches = [case.k_cache.clone(), case.v_cache.clone()]
    ops.store_kv(case.k, case.v, *ref_caches, slots, k_scale=K_SCALE, v_scale=V_SCALE, backend="reference")
    ops.store_kv(case.k, case.v, case.k_cache, case.v_cache, slots, k_scale=ks, v_scale=vs, backend=backend)
    for got, ref in zip((case.k_cache, case.v_cache), ref_caches):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    oracle = attention_f64(case.q, case.k_cache.double() * K_SCALE, case.v_cache.double() * V_SCALE,
                           case.block_tables, case.seq_lens, case.query_start, case.scale)
    err = max_err(_attend(case, backend, k_scale=ks, v_scale=vs), oracle, case.owned_rows())
    assert err <= TOL[torch.float32]
    # scales matter: read as 1.0 the same cache gives another answer
    assert max_err(_attend(case, "reference", k_scale=None, v_scale=None), oracle, case.owned_rows()) > 0.1


META = "meta"


def _h(*shape, dtype=torch.float16, device=META):
    return torch.empty(*shape, device=device, dtype=dtype)


SCALE_ERRORS = [
    (dict(k_scale=0.5), "k_scale scales a float8_e4m3fn cache, but the cache is torch.float16"),
    (dict(cache=KV_FP8, v_scale=-1.0), "v_scale must be a positive finite float"),
    (dict(cache=KV_FP8, k_scale=float("inf")), "k_scale must be a positive finite float"),
    (dict(cache=KV_FP8, k_scale=True), "k_scale must be a positive finite float"),
    (dict(cache=KV_FP8, k_scale=_h(1, dtype=torch.float64)), "k_scale must be a float32 tensor of one element"),
    (dict(cache=KV_FP8, v_scale=_h(2, dtype=torch.float32)), "v_scale must be a float32 tensor of one element"),
    (dict(cache=KV_FP8, k_scale=_h(1, dtype=torch.float32, device="cpu")), "k_scale must be .* on meta"),
    (dict(cache=torch.float8_e5m2), "k_cache must be float16, bfloat16, float32 or float8_e4m3fn"),
]


@pytest.mark.parametrize("over, match", SCALE_ERRORS, ids=[m[:40] for _, m in SCALE_ERRORS])
def test_bad_scales_and_cache_dtypes_are_named(over, match):
    """From metadata alone (meta tensors), for both ops."""
    over = dict(over)
    cache = over.pop("cache", torch.float16)
    caches = dict(k_cache=_h(5, 16, 2, 64, dtype=cache), v_cache=_h(5, 16, 2, 64, dtype=cache))
    with pytest.raises(ValueError, match=match):
        ops.paged_attention(_h(6, 8, 64), **caches, block_tables=_h(3, 4, dtype=torch.int32),
                            seq_lens=_h(3, dtype=torch.int32), query_start=_h(4, dtype=torch.int32), max_query_len=4,
                            max_seq_len=40, scale=0.125, backend="reference", **over)
    with pytest.raises(ValueError, match=match):
        ops.store_kv(_h(6, 2, 64), _h(6, 2, 64), **caches, slot_mapping=_h(6, dtype=torch.int32),
                     backend="reference", **over)


def test_reference_reads_tensor_scales_and_refuses_nonpositive_ones():
    case, _ = _fp8_case(5, [(3, 2)], torch.float32)
    with pytest.raises(ValueError, match="v_scale must be positive and finite, got 0.0"):
        _attend(case, "reference", v_scale=torch.zeros(1))
    with pytest.raises(ValueError, match="k_scale must be positive and finite, got nan"):
        ops.store_kv(case.k, case.v, case.k_cache, case.v_cache, torch.zeros(case.k.shape[0], dtype=torch.int32) - 1,
                     k_scale=torch.full((1,), float("nan")), backend="reference")


# ---------------------------------------------------------------------------------------------
# KVCache


def test_kv_cache_counts_one_byte_a_value_and_keeps_a_scale_per_layer():
    from loraplex.models import KVCache
    from loraplex.models.presets import preset_config
    c = preset_config("llama-2-7b", 3)
    per = {dtype: KVCache.bytes_per_block(c, 16, dtype) for dtype in (torch.float32, torch.bfloat16, KV_FP8)}
    assert per[KV_FP8] * 2 == per[torch.bfloat16] and per[KV_FP8] * 4 == per[torch.float32]
    assert per[KV_FP8] == 2 * 3 * 32 * 128 * 16
    budget = 10 * per[torch.bfloat16] + 5
    assert KVCache.for_memory(c, budget, dtype=KV_FP8).num_blocks == 20
    kv = KVCache(c, 4, 16, dtype=KV_FP8, k_scale=[0.5, 0.25, 2.0], v_scale=torch.tensor([1.0, 3.0, 0.125]))
    assert kv.data.dtype == KV_FP8 and kv.data.element_size() == 1
    assert kv.k_scale.tolist() == [0.5, 0.25, 2.0] and kv.v_scale.tolist() == [1.0, 3.0, 0.125]
    k1, v1 = kv.scales(1)
    assert (k1.item(), v1.item()) == (0.25, 3.0) and k1.dtype == torch.float32
    assert all(kv.scales(i)[j].data_ptr() % 16 == 0 for i in range(3) for j in range(2))   # one compile class
    assert "float8_e4m3fn (k_scale 0.25–2, v_scale 0.125–3)" in kv.describe()
    plain = KVCache(c, 4, 16, dtype=KV_FP8)
    assert plain.k_scale.tolist() == [1.0] * 3 and "k_scale 1, v_scale 1" in plain.describe()
    assert KVCache(c, 4, 16, dtype=torch.bfloat16).scales(0) == (None, None)
    for kwargs, match in [(dict(dtype=torch.bfloat16, k_scale=[1.0] * 3), "k_scale and v_scale scale a float8"),
                          (dict(dtype=KV_FP8, k_scale=[1.0] * 2), r"k_scale must hold one scale per layer, \[3\]"),
                          (dict(dtype=KV_FP8, v_scale=[1.0, 0.0, 1.0]), "v_scale must be positive and finite"),
                          (dict(dtype=torch.float8_e5m2), "dtype must be float32, float16, bfloat16 or float8_e4m3fn")]:
        with pytest.raises(ValueError, match=match):
            KVCache(c, 4, 16, **kwargs)


# ---------------------------------------------------------------------------------------------
# The engine, against transformers + PEFT reading the same e4m3 keys and values

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return make_served_model(tmp_path_factory.mktemp("fp8kv"))


def test_engine_fp8_kv_matches_transformers_peft_on_the_same_e4m3_keys_and_values(served):
    """No checkpoint scales: 1.0 (as vLLM). Greedy tokens of the base model and two adapters side by side equal the
    oracle's, logprobs within LOGPROB_TOL; plain transformers + PEFT is further off (the test can fail)."""
    base, adapters = served
    prompts = random_prompts(6, 128, (3, 20), seed=2)
    which = [[None, "all-r8", "qv-r4"][i % 3] for i in range(len(prompts))]
    kv, outs = generate_fp8(base, adapters, prompts, which, kv_cache_dtype="fp8", num_kv_blocks=64)
    assert kv.dtype == KV_FP8 and kv.k_scale.tolist() == [1.0, 1.0] and kv.v_scale.tolist() == [1.0, 1.0]
    oracle = Fp8KvOracle(base, adapters, [1.0, 1.0], [1.0, 1.0])
    for prompt, adapter, out in zip(prompts, which, outs):
        assert out.token_ids == oracle.greedy(prompt, adapter, 8), (adapter, len(prompt))
    assert max(logprob_errors(oracle, prompts, which, outs)) <= LOGPROB_TOL
    plain = GenerateOracle(base, adapters)
    assert min(logprob_errors(plain, prompts, which, outs)) > 10 * LOGPROB_TOL


def test_fp8_kv_cache_holds_more_blocks_in_the_same_memory(served):
    """Sized from cpu_kv_cache_gib: an e4m3 cache of a float32 model holds 4× the blocks (2× against bf16), and the
    scheduler's block manager counts them."""
    from loraplex import LLM
    base, _ = served
    blocks = {}
    for kv_dtype in ("auto", "fp8_e4m3"):
        with LLM(str(base), kv_cache_dtype=kv_dtype, cpu_kv_cache_gib=2**-10, **ENGINE) as llm:
            kv = llm.engine.runner.kv
            assert llm.engine.blocks.num_blocks == kv.num_blocks
            blocks[kv_dtype] = kv.num_blocks
            per_value = 1 if kv_dtype != "auto" else 4
            assert kv.num_blocks == 2**20 // (2 * 2 * 2 * 16 * 8 * per_value)   # layers × k/v × heads × D × tokens
            assert kv.data.nbytes <= 2**20
    assert blocks["fp8_e4m3"] == 4 * blocks["auto"]


# ---------------------------------------------------------------------------------------------
# Checkpoint scales (compressed-tensors kv_cache_scheme)

KV_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "tensor",
             "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}
CKPT_K, CKPT_V = [0.0125, 0.02], [0.015, 0.011]


def _with_kv_scales(folder, scheme=KV_SCHEME, tensors=None, groups=True):
    """Add a kv_cache_scheme and per-layer k_scale/v_scale tensors (layer 0 as [1] float32, layer 1 as [] bfloat16,
    both forms compressed-tensors writes) to a compressed-tensors checkpoint folder, in place."""
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg.setdefault("quantization_config", ct_config("channel", False, ["lm_head"]))
    qc["kv_cache_scheme"] = scheme
    if not groups:
        qc["config_groups"] = {}
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(folder / "model.safetensors"))
    if tensors is None:
        tensors = {}
        for i, (ks, vs) in enumerate(zip(CKPT_K, CKPT_V)):
            as_tensor = (lambda x: torch.tensor([x])) if i == 0 else (lambda x: torch.tensor(x, dtype=torch.bfloat16))
            tensors[f"model.layers.{i}.self_attn.k_scale"] = as_tensor(ks)
            tensors[f"model.layers.{i}.self_attn.v_scale"] = as_tensor(vs)
    save_file(dict(weights, **tensors), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_checkpoint_kv_scales_land_in_the_fp8_cache_and_auto_ignores_them(served, tmp_path):
    """FP8 weights and a kv_cache_scheme, as llm-compressor writes them: with kv_cache_dtype fp8 the cache takes the
    checkpoint's scales and the tokens equal the oracle's (dequantized weights, e4m3 keys and values at those
    scales); with auto the cache stays float32 and the scales are unused."""
    base, adapters = served
    quantize_folder(base, tmp_path / "fp8", tmp_path / "oracle", ct_config("channel", False, ["lm_head"]))
    folder = _with_kv_scales(tmp_path / "fp8")
    prompts = random_prompts(3, 128, (4, 16), seed=4)
    which = [None, "all-r8", "mlp-r2-rslora"]
    kv, outs = generate_fp8(folder, adapters, prompts, which, kv_cache_dtype="fp8", num_kv_blocks=64)
    bf16 = [torch.tensor(x, dtype=torch.bfloat16).item() for x in (CKPT_K[1], CKPT_V[1])]
    assert kv.k_scale.tolist() == [pytest.approx(CKPT_K[0], rel=1e-7), bf16[0]]
    assert kv.v_scale.tolist() == [pytest.approx(CKPT_V[0], rel=1e-7), bf16[1]]
    scales = ([kv.k_scale[0].item(), bf16[0]], [kv.v_scale[0].item(), bf16[1]])
    oracle = Fp8KvOracle(tmp_path / "oracle", adapters, *scales)
    for prompt, adapter, out in zip(prompts, which, outs):
        assert out.token_ids == oracle.greedy(prompt, adapter, 8), (adapter, len(prompt))
    assert max(logprob_errors(oracle, prompts, which, outs)) <= LOGPROB_TOL
    kv, _ = generate_fp8(folder, adapters, prompts[:1], [None], max_tokens=1, num_kv_blocks=64)
    assert kv.dtype == torch.float32 and kv.k_scale is None


def test_a_kv_cache_only_checkpoint_keeps_dense_weights(served, tmp_path):
    """A compressed-tensors config with a kv_cache_scheme and no config_groups: dense weights, scales read."""
    from loraplex.models import load_model
    from loraplex.models.fp8 import fp8_scheme
    base, _ = served
    folder = tmp_path / "kvonly"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((base / name).read_bytes())
    _with_kv_scales(folder, groups=False)
    raw = json.loads((folder / "config.json").read_text())
    assert fp8_scheme(raw, None) is None and fp8_scheme(raw, "fp8").source == "quantize"
    model = load_model(folder, dtype=torch.float32)
    assert isinstance(model.layers[0].qkv_proj.weight, torch.Tensor)
    assert model.kv_scales.k.tolist()[0] == pytest.approx(CKPT_K[0]) and model.kv_scales.v.shape == (2,)


def test_older_output_scale_names_are_read_as_kv_scales(served, tmp_path):
    """Older llm-compressor checkpoints store `self_attn.k_proj.output_scale` / `v_proj.output_scale` (vLLM maps
    them to k_scale / v_scale): read the same; one layer's scale under both names is refused, naming it."""
    from loraplex.models import load_model
    base, _ = served
    old = {f"model.layers.{i}.self_attn.{kind}_proj.output_scale": torch.tensor([0.25 + i + (kind == "v")])
           for i in range(2) for kind in "kv"}
    for name, tensors in (("old", old), ("both", dict(old, **{"model.layers.1.self_attn.k_scale": torch.ones(1)}))):
        folder = tmp_path / name
        folder.mkdir()
        for file in ("config.json", "model.safetensors"):
            (folder / file).write_bytes((base / file).read_bytes())
        _with_kv_scales(folder, tensors=tensors, groups=False)
        if name == "old":
            model = load_model(folder, dtype=torch.float32)
            assert model.kv_scales.k.tolist() == [0.25, 1.25] and model.kv_scales.v.tolist() == [1.25, 2.25]
        else:
            with pytest.raises(ValueError, match="under both of its names, 'model.layers.1.self_attn.k_scale'"):
                load_model(folder, dtype=torch.float32)


@pytest.mark.parametrize("over, field", [
    (dict(strategy="channel"), "quantization_config.kv_cache_scheme.strategy='channel'"),
    (dict(strategy="attn_head"), "kv_cache_scheme.strategy='attn_head'"),
    (dict(dynamic=True), "kv_cache_scheme.dynamic=True"),
    (dict(num_bits=4), "kv_cache_scheme.num_bits=4"),
    (dict(type="int"), "kv_cache_scheme.type='int'"),
    (dict(symmetric=False), "kv_cache_scheme.symmetric=False"),
])
def test_unsupported_kv_cache_schemes_are_refused_naming_the_field(over, field):
    from loraplex.models.fp8 import fp8_scheme
    qc = dict(ct_config("channel", False, ["lm_head"]), kv_cache_scheme=dict(KV_SCHEME, **over))
    with pytest.raises(ValueError, match="quantization_config") as info:
        fp8_scheme({"quantization_config": qc}, None, " in /m")
    assert field in str(info.value) and "/m" in str(info.value)


def test_bad_kv_scale_tensors_are_refused_naming_the_tensor(served, tmp_path):
    from loraplex.models import load_model
    base, _ = served
    good = {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor([0.5]) for i in range(2) for kind in "kv"}
    key = "model.layers.1.self_attn.v_scale"
    cases = [({k: v for k, v in good.items() if k != key}, f"no tensor '{key}', which its quantization_config"),
             (dict(good, **{key: torch.ones(2)}), f"'{key}' is torch.float32 of shape [2]"),
             (dict(good, **{key: torch.tensor([-1.0])}), f"'{key}' is -1.0; KV-cache scales are finite and positive"),
             (dict(good, **{key: torch.ones(1, dtype=torch.int32)}), f"'{key}' is torch.int32"),
             (dict(good, **{"model.layers.2.self_attn.k_scale": torch.ones(1)}), "names layer 2; the config has 2")]
    for n, (tensors, message) in enumerate(cases):
        folder = tmp_path / f"bad{n}"
        folder.mkdir()
        for name in ("config.json", "model.safetensors"):
            (folder / name).write_bytes((base / name).read_bytes())
        _with_kv_scales(folder, tensors=tensors, groups=False)
        with pytest.raises(ValueError, match=re.escape(message)):
            load_model(folder, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Settings and flags


def test_engine_config_and_flags_take_kv_cache_dtype(capsys):
    from loraplex import LLM
    from loraplex.cli import build_parser, main
    from loraplex.cli_flags import given
    from loraplex.config import EngineConfig
    assert EngineConfig(model="m", device="cpu").kv_cache_dtype == "auto"
    for value in ("fp8", "fp8_e4m3"):
        assert EngineConfig.from_kwargs("m", device="cpu", kv_cache_dtype=value).fp8_kv_cache
    for bad in ("fp8_e5m2", "int8", None):
        with pytest.raises(ValueError, match=f"EngineConfig.kv_cache_dtype must be one of auto, fp8, fp8_e4m3, "
                                             f"got {re.escape(repr(bad))}"):
            EngineConfig(model="m", device="cpu", kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="EngineConfig.kv_cache_dtype"):
        LLM("no/such/model", device="cpu", kv_cache_dtype="e4m3")   # refused before anything loads
    for command in (["serve"], ["generate", "hi"]):
        args = build_parser().parse_args([command[0], "--model", "m", "--kv-cache-dtype", "fp8", *command[1:]])
        assert given(args, "engine")["kv_cache_dtype"] == "fp8"
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "m", "--device", "cpu", "--kv-cache-dtype", "fp8_e5m2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "invalid choice" in err


def test_decode_over_an_e4m3_cache_takes_its_own_tiles(monkeypatch):
    """An e4m3 cache's decode launch takes FP8_DECODE_CONFIGS (the 16-bit tiles' keys at 2 warps, splits of at least
    512 tokens, each context shared evenly in splits of 256+); a bf16 cache keeps DECODE_CONFIGS; fp32 its own."""
    for D in ak.DECODE_CONFIGS:
        fp8, bf16 = ak.decode_config(D, torch.bfloat16, fp8_kv=True), ak.decode_config(D, torch.bfloat16)
        assert bf16 == ak.DECODE_CONFIGS[D] and fp8.block_n == bf16.block_n and fp8.num_warps == 2 != bf16.num_warps
        assert (fp8.min_split_tokens, fp8.even_split_tokens, bf16.even_split_tokens) == (512, 256, 0)
    assert ak.decode_config(32, torch.float32, fp8_kv=True) == ak.FP32_DECODE_CONFIG
    launched = []
    monkeypatch.setattr(ak, "_DECODE", lambda grid, args, consts, warps, stages: launched.append(warps))
    monkeypatch.setattr(ak, "_REDUCE", lambda *a: None)
    case, _ = _fp8_case(stable_seed("fp8-tiles"), DECODE, torch.float32, Hq=4, Hkv=2, D=32, bs=16)
    q = case.q.to(torch.bfloat16)
    out = torch.empty_like(q)
    one = torch.tensor([1.0])
    ak.decode(q, *case.args()[1:], out, max_seq_len=case.max_seq_len, scale=case.scale, window=0, k_scale=one,
              v_scale=one)
    bf16_cache = case.k_cache.to(torch.bfloat16)
    ak.decode(q, bf16_cache, bf16_cache, *case.args()[3:], out, max_seq_len=case.max_seq_len, scale=case.scale,
              window=0)
    assert launched == [2, ak.DECODE_CONFIGS[32].num_warps]


# ---------------------------------------------------------------------------------------------
# GPUs: the kernels in bf16 against the reference on the same e4m3 cache


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp16_dots_over_an_e4m3_cache_match_the_float64_loop(num_splits):
    """F16_DOTS (decode, bf16 q, the launchers' choice): tiles to fp16, q scaled into fp16 by a power of two a program
    (its rows here from 1e-3 to 1e6, past fp16's range), fp16 dots: within bf16's output rounding of the loop."""
    assert ak.decode_constexprs(2, 32, 16, False, torch.bfloat16, ak.decode_config(32, torch.bfloat16), True)["F16_DOTS"]
    assert not ak.decode_constexprs(2, 32, 16, False, torch.float16, ak.decode_config(32, torch.float16), True)["F16_DOTS"]
    case, _ = _fp8_case(stable_seed("fp8-f16", num_splits), DECODE, torch.float32, Hq=6, Hkv=2, D=32, bs=16)
    case.q = (case.q * torch.logspace(-3, 6, case.q.shape[0])[:, None, None]).to(torch.bfloat16)
    oracle = attention_f64(case.q, case.k_cache.double() * K_SCALE, case.v_cache.double() * V_SCALE,
                           case.block_tables, case.seq_lens, case.query_start, case.scale, 0)
    out = torch.full(case.q.shape, float("nan"), dtype=torch.bfloat16)
    ak.decode(*case.args(), out, max_seq_len=case.max_seq_len, scale=case.scale, window=0, num_splits=num_splits,
              cfg=ak.DecodeConfig(16, 4, 2), k_scale=torch.tensor([K_SCALE]), v_scale=torch.tensor([V_SCALE]))
    assert max_err(out, oracle, case.owned_rows()) <= 2.5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("seqs, window", [([(0, 300), (40, 1), (700, 129), (1500, 1), (0, 2)], 0),
                                          ([(0, 1), (900, 1), (2500, 1), (63, 1)], 0),
                                          ([(100, 64), (600, 1), (1000, 1)], 256)], ids=["mixed", "decode", "window"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernels_match_the_reference_on_an_e4m3_cache(seqs, window, dtype):
    """Llama-3 heads (32 over 8, head_dim 128), bf16 and fp16 models: the store's bytes equal the reference's (IEEE
    division, rounding done before the cast), attention within bf16's output rounding of the reference (fp32 on the
    same cache). fp16 q takes the fp16 tiles with V converted in place in both kernels; bf16 q, in decode. The decode
    batch again in even splits planned for 8,192 tokens (DecodeConfig.even_split_tokens)."""
    rng = np.random.default_rng(stable_seed("fp8-gpu", len(seqs), window, str(dtype)))
    case = make_case(rng, seqs, Hq=32, Hkv=8, D=128, bs=16, dtype=dtype, window=window, device="cuda")
    case.k_cache, case.v_cache = quantize(case.k_cache, K_SCALE), quantize(case.v_cache, V_SCALE)
    ks, vs = torch.tensor([K_SCALE], device="cuda"), torch.tensor([V_SCALE], device="cuda")
    slots = torch.randperm(case.k_cache.shape[0] * 16, device="cuda")[:case.k.shape[0]]
    caches = {b: [c.clone() for c in (case.k_cache, case.v_cache)] for b in ("reference", "triton")}
    for backend, (kc, vc) in caches.items():
        ops.store_kv(case.k, case.v, kc, vc, slots, k_scale=ks, v_scale=vs, backend=backend)
    for got, ref in zip(caches["triton"], caches["reference"]):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    # the reference in fp32 on the same cache (q exact in fp32): the bf16 tolerance of test_attention_gpu.py
    reference = ops.paged_attention(case.q.float(), *case.args()[1:], **case.kwargs(), k_scale=ks, v_scale=vs,
                                    backend="reference")
    out = _attend(case, "triton", k_scale=ks, v_scale=vs)   # decode rows through the fp16 dots, prompts through bf16
    assert max_err(out, reference.double(), case.owned_rows()) <= 2.5e-2
    if window == 0 and len(seqs) == 4:   # decode rows alone: again in even splits planned for 8,192 tokens
        cfg = replace(ak.decode_config(128, dtype, fp8_kv=True), even_split_tokens=128)
        out = torch.full(case.q.shape, float("nan"), dtype=dtype, device="cuda")
        ak.decode(case.q, case.k_cache, case.v_cache, *case.args()[3:6], out, max_seq_len=8192, scale=case.scale,
                  window=0, num_splits=8, cfg=cfg, k_scale=ks, v_scale=vs)
        assert max_err(out, reference.double(), case.owned_rows()) <= 2.5e-2


@interpreted
def test_bench_fp8_attention_smoke(monkeypatch, tmp_path):
    """benchmarks/bench_fp8_attention.py --smoke (the interpreter, toy heads): every candidate tile's decode over
    the e4m3 cache against the reference path, for both models' heads; the markdown is written."""
    from benchmark_modules import load_benchmark
    bench = load_benchmark(monkeypatch, "bench_fp8_attention")
    out, md = tmp_path / "a.json", tmp_path / "a.md"
    bench.main(["--smoke", "--out", str(out), "--md", str(md)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(bench.HEAD_SHAPES)
    for r in rows:
        every = bench.candidates(r["D"])   # (no longer context: those that differ from today in even shares alone go)
        tiles = {k for k, c in every.items() if k == "today" or replace(c, even_split_tokens=256) != every["today"]}
        assert set(r["max_abs_err"]) == tiles and max(r["max_abs_err"].values()) <= 0.05, r
    tiles = bench.candidates(128)
    assert tiles["16-bit tiles"] == ak.DECODE_CONFIGS[128]
    assert tiles["today"] == ak.decode_config(128, torch.bfloat16, fp8_kv=True)
    assert tiles["2x keys, 4 warps"].block_n == 2 * tiles["today"].block_n   # the former e4m3 tiles
    assert md.read_text().startswith("# Decode attention over an e4m3 KV cache")
    assert set(bench.candidates(128, ["half keys", "1 warp"])) == {
        "today", "half keys", "1 warp", "half keys, 1 warp", "half keys, 4 stages"}
    bench.main(["--smoke", "--planned-len", "4096", "--only", "even;longest", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]   # splits planned as a graph for a 4,096-token model plans them
    assert {r["planned_len"] for r in rows} == {4096}
    assert set(rows[0]["max_abs_err"]) == {"today", "even splits of 128+", "splits of the longest"}
    assert max(e for r in rows for e in r["max_abs_err"].values()) <= 0.05
    assert all(0 < r["bf16_even_err"] <= 0.05 for r in rows)   # the 16-bit cache's tiles with even shares
    with pytest.raises(SystemExit, match="'3 warps'") as stop:   # --only's word that names no candidate
        bench.candidates(128, ["2 stages", "3 warps"])
    assert "'2 stages'" not in str(stop.value).split("the labels")[0]
