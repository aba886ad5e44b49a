"""RoPE that also stores k and v into the paged cache (`apply_rope(..., kv=KvSlots(...))`), on the CPU.

Its documented semantics: the op without `kv`, then `store_kv(k, v, ...)` with the same cache, slots and scales.
Each case runs both on one backend and asks for the same bits in q, k, v and both caches: rope and store_kv are
each held to their own oracles (test_fused_ops.py, test_lora_product.py, test_attention*.py). Every delta kind
(none, a dense fp32 delta, a LoraDelta, a LoraProduct with one rank tile, two, and a composed one), GQA, both
cache layouts (contiguous and KVCache's head-major), 16-bit and e4m3 caches with scales other than 1, and padding
rows (slot -1) whose cache slots must keep what they held. The Triton kernels run in Triton's interpreter;
tests/test_fused_gpu.py runs them compiled.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex import ops
from loraplex.ops.attention.paged import KV_FP8, KvSlots, store_kv
from loraplex.ops.fused import api as fused
from loraplex.ops.fused import rope_lora
from loraplex.ops.lora.delta import LoraDelta

from lora_cases import stable_seed
from test_fused_ops import qkv_views, random_positions, rope_config
from test_lora_product import make_product

interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")
BACKENDS = ["reference", pytest.param("triton", marks=interpreted)]
BLOCKS, PAGE = 6, 16


def _caches(gen, Hkv, D, dtype, head_major):
    """k and v caches holding random values (what earlier steps wrote), as KVCache lays them out or contiguous."""
    shape = (BLOCKS, Hkv, PAGE, D) if head_major else (BLOCKS, PAGE, Hkv, D)
    made = [(torch.randn(shape, generator=gen) * 3).to(dtype) for _ in range(2)]
    return [c.transpose(1, 2) if head_major else c for c in made]


def _inputs(gen, T, Hq, Hkv, D, dtype, delta_kind, R=16, lanes=1):
    q, k, qkv = qkv_views(gen, T, Hq, Hkv, D, dtype, "fused")
    positions = random_positions(gen, T)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    inv_freq = LlamaRotaryEmbedding(rope_config(Hq, Hkv, D)).inv_freq
    widths = (Hq * D, Hkv * D, Hkv * D)
    if delta_kind == "none":
        delta = None
    elif delta_kind == "dense":
        delta = qkv.float().abs().mean() * torch.randn(T, sum(widths), generator=gen)
    elif delta_kind == "lora_delta":
        row_slot = torch.randint(0, 5, (T,), generator=gen, dtype=torch.int32)
        row_slot[::3] = -1
        values = qkv.float().abs().mean() * torch.randn(T, sum(widths), generator=gen)
        values[row_slot < 0] = float("nan")   # never read
        delta = LoraDelta(values, row_slot)
    else:
        delta = make_product(gen, T, widths, dtype, R=R, sizes=qkv.float().abs().mean(1), lanes=lanes)
    slots = torch.randperm(BLOCKS * PAGE, generator=gen)[:T].to(torch.int32)
    slots[1] = -1   # a padding row
    return qkv, positions, inv_freq, delta, slots


def _split(buf, T, Hq, Hkv, D):
    return (buf[:, :Hq * D].view(T, Hq, D), buf[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D),
            buf[:, (Hq + Hkv) * D:(Hq + 2 * Hkv) * D].view(T, Hkv, D))


def _bits(t):
    return t.view(torch.uint8) if t.dtype == KV_FP8 else t


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float32),
                                                (torch.float16, KV_FP8), (torch.bfloat16, KV_FP8)])
@pytest.mark.parametrize("delta_kind, R, lanes, heads", [("none", 16, 1, None), ("dense", 16, 1, None),
                                                         ("lora_delta", 16, 1, None), ("product", 16, 1, None),
                                                         ("product", 40, 1, 1), ("product", 16, 2, 2)])
@pytest.mark.parametrize("Hq, Hkv, D, head_major", [(4, 2, 64, True), (3, 3, 32, False)])
def test_rope_with_kv_is_rope_then_store_kv(backend, dtype, cache_dtype, delta_kind, R, lanes, heads, Hq, Hkv, D,
                                            head_major, monkeypatch):
    """R=40: two rank tiles (no early reads); lanes 2: a composed product; heads: head blocks per program of the
    product's kernel (k/v blocks past their heads with GQA)."""
    _check_rope_then_store(backend, "cpu", dtype, cache_dtype, delta_kind, R, lanes, heads, Hq, Hkv, D, head_major,
                           monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, KV_FP8])
@pytest.mark.parametrize("delta_kind, R, lanes, heads", [("none", 16, 1, None), ("lora_delta", 16, 1, None),
                                                         ("product", 16, 1, None), ("product", 40, 1, 1),
                                                         ("product", 16, 2, 2)])
def test_compiled_rope_with_kv_is_rope_then_store_kv(cache_dtype, delta_kind, R, lanes, heads, monkeypatch):
    """The compiled kernels, bf16 activations, Llama-2-7B's heads (and 8 kv heads: Llama-3's GQA) in KVCache's
    layout."""
    for Hq, Hkv in ((32, 32), (32, 8)):
        _check_rope_then_store("triton", "cuda", torch.bfloat16, cache_dtype, delta_kind, R, lanes, heads, Hq, Hkv,
                               128, True, monkeypatch)


def _check_rope_then_store(backend, device, dtype, cache_dtype, delta_kind, R, lanes, heads, Hq, Hkv, D, head_major,
                           monkeypatch):
    gen = torch.Generator().manual_seed(stable_seed("rope-store", str(dtype), str(cache_dtype), delta_kind, R, lanes,
                                                    Hq, Hkv, D, head_major))
    if heads:
        monkeypatch.setattr(rope_lora, "ROPE_HEADS", heads)
    T = 7
    qkv, positions, inv_freq, delta, slots = _inputs(gen, T, Hq, Hkv, D, dtype, delta_kind, R, lanes)
    k_cache, v_cache = _caches(gen, Hkv, D, cache_dtype, head_major)
    scales = (torch.tensor([0.37]), torch.tensor([2.5])) if cache_dtype == KV_FP8 else (None, None)
    if device != "cpu":
        qkv, positions, inv_freq, slots, k_cache, v_cache = (t.to(device) for t in (qkv, positions, inv_freq, slots,
                                                                                  k_cache, v_cache))
        delta = _to(delta, device)
        scales = tuple(None if x is None else x.to(device) for x in scales)

    fused_buf, want_buf = qkv.clone(), qkv.clone()
    fused_k, fused_v = k_cache.clone(), v_cache.clone()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q, k, v = _split(fused_buf, T, Hq, Hkv, D)
    fused.apply_rope(q, k, positions, inv_freq, v=v, delta=delta, kv=KvSlots(fused_k, fused_v, slots, *scales),
                     backend=backend)
    q, k, v = _split(want_buf, T, Hq, Hkv, D)
    fused.apply_rope(q, k, positions, inv_freq, v=None if delta is None else v, delta=delta, backend=backend)
    store_kv(k, v, want_k, want_v, slots, k_scale=scales[0], v_scale=scales[1], backend=backend)

    assert torch.equal(fused_buf, want_buf)
    assert torch.equal(_bits(fused_k), _bits(want_k)) and torch.equal(_bits(fused_v), _bits(want_v))
    written = torch.zeros(BLOCKS * PAGE, dtype=torch.bool, device=slots.device)
    written[slots[slots >= 0].long()] = True
    for cache, before in ((fused_k, k_cache), (fused_v, v_cache)):
        flat, old = _bits(cache).flatten(0, 1), _bits(before).flatten(0, 1)
        assert torch.equal(flat[~written], old[~written])   # the padding row's slot and every other keep theirs
        assert not torch.equal(flat[written], old[written])


def _to(delta, device):
    """A delta of any kind on `device`."""
    if delta is None or isinstance(delta, torch.Tensor):
        return None if delta is None else delta.to(device)
    if isinstance(delta, LoraDelta):
        return LoraDelta(delta.values.to(device), delta.row_slot.to(device))
    moved = {}
    for f in dataclasses.fields(delta):   # a LoraProduct: its tensors and tuples of tensors
        value = getattr(delta, f.name)
        if isinstance(value, torch.Tensor):
            moved[f.name] = value.to(device)
        elif isinstance(value, tuple):
            moved[f.name] = tuple(t.to(device) for t in value)
    return dataclasses.replace(delta, **moved)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_with_kv_on_no_rows_writes_nothing(backend):
    gen = torch.Generator().manual_seed(stable_seed("rope-store-empty"))
    q, k, qkv = qkv_views(gen, 0, 4, 2, 32, torch.float32, "fused")
    v = qkv[:, 6 * 32:].view(0, 2, 32)
    k_cache, v_cache = _caches(gen, 2, 32, torch.float32, True)
    before = k_cache.clone()
    fused.apply_rope(q, k, torch.zeros(0, dtype=torch.int64), torch.ones(16), v=v,
                     kv=KvSlots(k_cache, v_cache, torch.zeros(0, dtype=torch.int32)), backend=backend)
    assert torch.equal(k_cache, before)


def test_rope_with_kv_refuses_what_store_kv_refuses():
    gen = torch.Generator().manual_seed(stable_seed("rope-store-errors"))
    T, Hq, Hkv, D = 3, 4, 2, 32
    q, k, qkv = qkv_views(gen, T, Hq, Hkv, D, torch.float32, "fused")
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    positions, inv_freq = torch.arange(T), torch.ones(D // 2)
    k_cache, v_cache = _caches(gen, Hkv, D, torch.float32, True)
    slots = torch.arange(T, dtype=torch.int32)
    with pytest.raises(ValueError, match="pass v too"):
        fused.apply_rope(q, k, positions, inv_freq, kv=KvSlots(k_cache, v_cache, slots), backend="reference")
    with pytest.raises(ValueError, match="only taken with a delta or kv"):
        fused.apply_rope(q, k, positions, inv_freq, v=v, backend="reference")
    wide, _ = _caches(gen, Hkv + 1, D, torch.float32, True)
    with pytest.raises(ValueError, match="does not fit the cache"):
        fused.apply_rope(q, k, positions, inv_freq, v=v, kv=KvSlots(wide, wide, slots), backend="reference")
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        fused.apply_rope(q, k, positions, inv_freq, v=v, kv=KvSlots(k_cache, v_cache, slots[:2]),
                         backend="reference")
    e4m3 = [c.to(KV_FP8) for c in (k_cache, v_cache)]
    with pytest.raises(ValueError, match="scale"):
        fused.apply_rope(q, k, positions, inv_freq, v=v, kv=KvSlots(*e4m3, slots, k_scale=-1.0),
                         backend="reference")
