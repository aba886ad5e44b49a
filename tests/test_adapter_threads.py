"""Loader threads run their torch ops on one core, and leave every other thread's setting alone."""
import threading

import pytest
import torch

from conftest import TORCH_THREADS
from loraplex.adapters import AdapterCache
from loraplex.adapters.threads import _openmp_runtimes, one_core_per_thread
from loraplex.models.presets import preset_config

needs_openmp = pytest.mark.skipif(not _openmp_runtimes() or TORCH_THREADS < 2,
                                  reason="needs PyTorch's OpenMP runtime and at least 2 intra-op threads")


@pytest.fixture(autouse=True)
def torch_threads():
    """torch's own count of threads, which tests/conftest.py lowers in an xdist worker: the one core of a loader
    thread must differ from the count of every other thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    yield
    torch.set_num_threads(before)


def _in_new_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


@needs_openmp
def test_one_core_for_the_calling_thread_only():
    before = torch.get_num_threads()
    # an explicit process-wide count makes a thread's first parallel op reset its team to that count:
    # the setting must survive it
    torch.set_num_threads(before)

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


def test_the_runtimes_are_read_from_the_whole_path_field(monkeypatch, tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /opt/my venv/torch/lib/libgomp-a34b3233.so.1\n"
                    "7f02-7f03 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libgomp.so.1\n"
                    "7f04-7f05 r-xp 00000000 08:01 3 /usr/lib/libiomp5.so\n"
                    "7f06-7f07 r-xp 00000000 08:01 4 /usr/lib/libgompx_other.txt\n"
                    "7f08-7f09 rw-p 00000000 00:00 0\n")
    import loraplex.adapters.threads as threads
    real = threads.Path
    monkeypatch.setattr(threads, "Path", lambda p: maps if p == "/proc/self/maps" else real(p))
    threads._openmp_runtimes.cache_clear()
    try:
        assert threads._openmp_runtimes() == ("/opt/my venv/torch/lib/libgomp-a34b3233.so.1",
                                             "/usr/lib/x86_64-linux-gnu/libgomp.so.1", "/usr/lib/libiomp5.so")
    finally:
        threads._openmp_runtimes.cache_clear()


@needs_openmp
def test_a_failure_never_breaks_the_loader_pool(monkeypatch):
    import loraplex.adapters.threads as threads

    def broken():
        raise UnicodeDecodeError("utf-8", b"", 0, 1, "test")
    monkeypatch.setattr(threads, "_openmp_runtimes", broken)
    monkeypatch.setattr(threads, "_working", None)

    assert _in_new_thread(one_core_per_thread) is False   # a new thread's team is the default, > 1
