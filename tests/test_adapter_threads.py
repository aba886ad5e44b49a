"""Loader threads run their torch ops on one core, and leave every other thread's setting alone."""
import threading

import pytest
import torch

from loraplex.adapters import AdapterCache
from loraplex.adapters.threads import _openmp_runtime, one_core_per_thread
from loraplex.models.presets import preset_config

needs_openmp = pytest.mark.skipif(_openmp_runtime() is None or torch.get_num_threads() < 2,
                                  reason="needs PyTorch's OpenMP runtime and at least 2 intra-op threads")


def _in_new_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


@needs_openmp
def test_one_core_for_the_calling_thread_only():
    before = torch.get_num_threads()

    def loader():
        ok = one_core_per_thread()
        x = torch.randn(1 << 20)
        torch.empty_like(x).copy_(x)   # a parallel-sized op: the setting must survive it
        return ok, torch.get_num_threads()

    assert _in_new_thread(loader) == (True, 1)
    assert torch.get_num_threads() == before                     # this thread's team is untouched
    assert _in_new_thread(torch.get_num_threads) == before       # and a thread started later gets the default


@needs_openmp
def test_the_cache_loader_threads_run_on_one_core():
    cache = AdapterCache(preset_config("llama-2-7b", 1), max_gpu_adapters=1, max_lora_rank=4,
                         max_cpu_adapters=0, device="cpu", loader_threads=2)
    try:
        for executor in (cache._executor, cache._copier, cache._ahead_executor):
            assert executor.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() > 1
    finally:
        cache.close()
