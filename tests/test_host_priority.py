"""Adapter loads step aside while the engine issues an eager forward (adapters/priority.py)."""
import threading
import time

import pytest
import torch
from adapter_fixtures import write_adapter

from loraplex.adapters import AdapterCache, PackedFile, convert
from loraplex.adapters.peft_format import inspect_peft_adapter, read_peft_adapter
from loraplex.adapters.priority import HOST_PRIORITY, HostPriority
from loraplex.adapters.synthetic import read_synthetic, synthetic_spec
from loraplex.models import ModelConfig
from loraplex.models.config import PROJECTIONS

MODEL = ModelConfig(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64, name_or_path="tiny")
MODULES = MODEL.num_hidden_layers * len(PROJECTIONS)


def test_a_checkpoint_passes_at_once_when_the_engine_is_idle():
    hp = HostPriority(max_wait_s=1.0)
    start = time.perf_counter()
    for _ in range(1000):
        hp.checkpoint()
    assert time.perf_counter() - start < 0.5
    assert not hp.is_busy


def test_a_checkpoint_waits_while_busy_but_no_longer_than_its_bound():
    hp = HostPriority(max_wait_s=0.05)
    with hp.busy():
        assert hp.is_busy
        start = time.perf_counter()
        hp.checkpoint()
        waited = time.perf_counter() - start
    assert 0.04 <= waited < 1.0
    assert not hp.is_busy


def test_a_waiting_checkpoint_goes_on_as_soon_as_the_engine_is_done():
    hp = HostPriority(max_wait_s=30.0)
    started, done = threading.Event(), threading.Event()
    with hp.busy():
        worker = threading.Thread(target=lambda: (started.set(), hp.checkpoint(), done.set()))
        worker.start()
        assert started.wait(5.0)
        time.sleep(0.05)
        assert not done.is_set(), "the checkpoint did not wait for the busy engine"
    assert done.wait(5.0), "the checkpoint kept waiting after the engine was done"
    worker.join()


def test_busy_nests_and_ends_on_errors():
    hp = HostPriority()
    with pytest.raises(RuntimeError):
        with hp.busy():
            with hp.busy():
                pass
            assert hp.is_busy, "the outer stretch ended with the inner one"
            raise RuntimeError("boom")
    assert not hp.is_busy


def test_max_wait_must_be_positive():
    with pytest.raises(ValueError, match="max_wait_s"):
        HostPriority(max_wait_s=0)


@pytest.fixture
def checkpoints(monkeypatch):
    calls = []
    monkeypatch.setattr(HOST_PRIORITY, "checkpoint", lambda: calls.append(threading.current_thread().name))
    return calls


def test_every_reader_and_the_pool_write_check_in_per_module_or_layer(checkpoints, tmp_path):
    """Synthetic, PEFT-folder and packed-file reads and the host packing each let a busy engine go first at
    least once per module, the slot copy once per layer (one copy call for its modules), so no load runs
    long stretches without a checkpoint."""
    folder = write_adapter(tmp_path / "a", MODEL, rank=4, projections=PROJECTIONS, seed=1)
    spec = inspect_peft_adapter(folder, MODEL)
    packed = PackedFile(convert(MODEL, [("a", folder)], tmp_path / "packed", progress=False), MODEL)
    cache = AdapterCache(MODEL, max_gpu_adapters=1, max_lora_rank=8, max_cpu_adapters=0, dtype=torch.float32,
                         device="cpu")
    try:
        reads = {"synthetic": lambda: read_synthetic(synthetic_spec("s", MODEL, 4, seed=1), torch.float32, False),
                 "peft": lambda: read_peft_adapter(spec, torch.float32),
                 "packed": lambda: packed.read(0, torch.float32, False)}
        for what, read in reads.items():
            checkpoints.clear()
            adapter = read()
            # the reader's loop, then the packing's (every other tensor: once per module)
            assert len(checkpoints) >= 2 * MODULES, what
        checkpoints.clear()
        cache.pool.write(0, adapter)
        assert len(checkpoints) == MODEL.num_hidden_layers
    finally:
        cache.close()
        packed.close()


def test_loads_finish_while_the_engine_stays_busy(tmp_path):
    """The bound on each wait keeps loads going through a long run of eager steps."""
    cache = AdapterCache(MODEL, max_gpu_adapters=2, max_lora_rank=8, max_cpu_adapters=0, dtype=torch.float32,
                         device="cpu")
    cache.register("a", write_adapter(tmp_path / "a", MODEL, rank=4, projections=PROJECTIONS, seed=2))
    cache.register_synthetic("s", 4, seed=3)
    try:
        with HOST_PRIORITY.busy():
            start = time.perf_counter()
            cache.prefetch("a")
            cache.prefetch("s")
            assert cache.wait_resident("a", timeout=30) and cache.wait_resident("s", timeout=30)
            # each module waited (up to 5 ms) at least once per reader loop
            assert time.perf_counter() - start >= MODULES * HOST_PRIORITY.max_wait_s
    finally:
        cache.close()
