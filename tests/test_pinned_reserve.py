"""adapters/pinned_reserve.py: the pinned chunks reserved at start-up are exactly those adapter reads take."""
from __future__ import annotations

import pytest
import torch

from loraplex.adapters import AdapterCache, pinned_reserve
from loraplex.adapters.synthetic import read_synthetic, synthetic_spec
from loraplex.config import EngineConfig
from loraplex.models.config import ModelConfig

# 7B widths with few layers: chunks of 8 MiB fill and a last one is partial
BIG = ModelConfig(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=8,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=100)


def without_pinning(monkeypatch, log: list | None = None):
    """torch.empty ignoring pin_memory (this machine has no CUDA), recording each pinned request's numel."""
    real = torch.empty

    def empty(*shape, pin_memory=False, **kw):
        t = real(*shape, **kw)
        if pin_memory and log is not None:
            log.append(t.numel())
        return t
    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("rank, dtype", [(16, torch.bfloat16), (64, torch.float16), (8, torch.float32)])
def test_full_adapter_chunks_are_what_a_pinned_read_allocates(rank, dtype, monkeypatch):
    allocated = []
    without_pinning(monkeypatch, allocated)
    adapter = read_synthetic(synthetic_spec("full", BIG, rank, seed=1), dtype, True)
    want = [b.numel() for b in adapter.buffers]
    assert allocated == want and len(want) > 1
    assert pinned_reserve.full_adapter_chunks(BIG, rank, dtype) == want


def test_pinned_bytes_round_each_chunk_up_to_a_power_of_two():
    assert pinned_reserve.pinned_bytes([4 << 20, 3, 1], torch.bfloat16) == (8 << 20) + 8 + 2
    chunks = pinned_reserve.full_adapter_chunks(BIG, 16, torch.bfloat16)
    assert sum(chunks) * 2 < pinned_reserve.pinned_bytes(chunks, torch.bfloat16) <= 2 * sum(chunks) * 2


def test_reserve_count_bounds():
    per = pinned_reserve.pinned_bytes(pinned_reserve.full_adapter_chunks(BIG, 16, torch.bfloat16), torch.bfloat16)
    assert pinned_reserve.reserve_count(BIG, 16, torch.bfloat16, 5, None) == 5
    assert pinned_reserve.reserve_count(BIG, 16, torch.bfloat16, 5, 3.5 * per / 2**30) == 3
    assert pinned_reserve.reserve_count(BIG, 16, torch.bfloat16, 5, 0) == 0
    assert pinned_reserve.reserve_count(BIG, 16, torch.bfloat16, 0, None) == 0
    # the default bound: DEFAULT_MAX_GIB and a quarter of the host's memory
    many = pinned_reserve.reserve_count(BIG, 16, torch.bfloat16, 10**6, None)
    memory = pinned_reserve.host_memory_bytes()
    bound = min(pinned_reserve.DEFAULT_MAX_GIB * 2**30, memory / 4 if memory else float("inf"))
    assert many == int(bound // per)
    for bad in (-1, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="non-negative number of GiB"):
            pinned_reserve.reserve_count(BIG, 16, torch.bfloat16, 5, bad)


def test_reserve_pinned_holds_every_chunk_at_once(monkeypatch):
    """All `count` sets are alive together (freed one by one, PyTorch's cache would hand the same block back and
    reserve one set), and the bytes are reported."""
    alive, peak = [0], [0]
    real = torch.empty

    class Counted:
        def __init__(self, t):
            self.t = t
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])

        def __del__(self):
            alive[0] -= 1

        def numel(self):
            return self.t.numel()

        def element_size(self):
            return self.t.element_size()

    monkeypatch.setattr(torch, "empty", lambda n, dtype, pin_memory: Counted(real(n, dtype=dtype)))
    nbytes = pinned_reserve.reserve_pinned([5, 7], 3, torch.float16)
    assert nbytes == 3 * (16 + 16) and peak[0] == 6 and alive[0] == 0   # 10 and 14 bytes, rounded up


def test_a_failed_pinned_allocation_stops_the_reserve_with_a_warning(monkeypatch, caplog):
    real, made = torch.empty, []   # the sixth allocation fails: two whole adapters are reserved

    def empty(n, dtype, pin_memory):
        if len(made) == 5:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        made.append(n)
        return real(n, dtype=dtype)
    monkeypatch.setattr(torch, "empty", empty)
    with caplog.at_level("WARNING", logger="loraplex.adapters"):
        nbytes = pinned_reserve.reserve_pinned([4, 4], 10, torch.float32)
    assert nbytes == 2 * 2 * 16 and "for 2 of 10 adapter reads only" in caplog.text and "cudaHostAlloc" in caplog.text


def test_host_memory_is_the_containers_limit_where_lower(tmp_path, monkeypatch):
    limit, unlimited = tmp_path / "memory.max", tmp_path / "v1_limit"
    limit.write_text("1048576\n")
    unlimited.write_text("max\n")
    monkeypatch.setattr(pinned_reserve, "_CGROUP_LIMITS", (str(unlimited), str(tmp_path / "missing")))
    physical = pinned_reserve.host_memory_bytes()
    assert physical is not None and physical > 1 << 30
    monkeypatch.setattr(pinned_reserve, "_CGROUP_LIMITS", (str(limit), str(unlimited)))
    assert pinned_reserve.host_memory_bytes() == 1 << 20


def test_cache_reserves_nothing_off_cuda_and_checks_the_setting():
    cache = AdapterCache(BIG, max_gpu_adapters=2, max_lora_rank=8, max_cpu_adapters=2, dtype=torch.float32,
                         device="cpu")
    try:
        assert cache.reserve_host_memory(None) == 0 and cache.reserve_host_memory(1.0) == 0
        with pytest.raises(ValueError, match="non-negative number of GiB"):
            cache.reserve_host_memory(-2)
    finally:
        cache.close()
    assert EngineConfig(model="dummy:llama-2-7b", device="cpu").adapter_host_reserve_gib is None
    assert EngineConfig(model="dummy:llama-2-7b", device="cpu",
                        adapter_host_reserve_gib=0).adapter_host_reserve_gib == 0
    for bad in (-1.0, float("inf"), "4", True):
        with pytest.raises(ValueError, match="adapter_host_reserve_gib"):
            EngineConfig(model="dummy:llama-2-7b", device="cpu", adapter_host_reserve_gib=bad)
