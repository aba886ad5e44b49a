"""A failed adapter load is not sticky: refused for a back-off that doubles with each failure in a
row, then read again, so files that vanished and came back serve again (loads.py)."""
import shutil
import time

import pytest
import torch
from adapter_fixtures import write_adapter

from loraplex.adapters import AdapterCache, AdapterError, AdapterState
from loraplex.models import ModelConfig

MODEL = ModelConfig(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64, name_or_path="tiny")


def wait_failed(cache, name, timeout=10.0):
    deadline = time.monotonic() + timeout
    while cache.error(name) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert cache.error(name) is not None


def test_a_failed_load_is_retried_after_a_doubling_back_off(tmp_path):
    folder = write_adapter(tmp_path / "a", MODEL, rank=4, projections=("q_proj", "v_proj"), seed=1)
    cache = AdapterCache(MODEL, max_gpu_adapters=1, max_lora_rank=8, max_cpu_adapters=0, dtype=torch.float32,
                         device="cpu")
    cache.retry_base_s, cache.retry_max_s = 0.4, 1.2   # (slack for a busy machine: checks need 0.4 s)
    try:
        cache.register("a", folder)
        hidden = tmp_path / "hidden"
        shutil.move(folder, hidden)
        cache.prefetch("a")
        wait_failed(cache, "a")
        assert cache.state("a") is AdapterState.FAILED and 0 < cache.retry_in("a") <= 0.4
        with pytest.raises(AdapterError, match="failed to load"):
            cache.acquire_if_resident("a")   # refused, with its error, during the back-off
        time.sleep(cache.retry_in("a") + 0.01)
        assert cache.error("a") is None and cache.retry_in("a") == 0   # due: the next look clears it
        cache.prefetch("a")                                           # ... and reads again: fails again
        wait_failed(cache, "a")
        assert 0.4 < cache.retry_in("a") <= 0.8                      # doubled
        time.sleep(cache.retry_in("a") + 0.01)
        cache.prefetch("a")
        wait_failed(cache, "a")
        assert 0.8 < cache.retry_in("a") <= 1.2                      # 1.6, capped at retry_max_s
        shutil.move(hidden, folder)                                   # the files are back
        time.sleep(cache.retry_in("a") + 0.01)
        assert cache.wait_resident("a", timeout=10), cache.error("a")
        assert cache.counters["failures"] == 3
        slot = cache.acquire("a")
        cache.release("a")
        assert slot == 0
    finally:
        cache.close()
