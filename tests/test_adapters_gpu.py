"""The GPU tier: asynchronous loads on a side stream, readiness only after the copy, safe slot reuse."""
import pytest
import torch
from adapter_fixtures import write_adapter

from loraplex import ops
from loraplex.adapters import AdapterCache
from loraplex.adapters.peft_format import inspect_peft_adapter, read_peft_adapter
from loraplex.adapters.synthetic import read_synthetic, synthetic_spec
from loraplex.models import ModelConfig

pytestmark = pytest.mark.gpu

MODEL = ModelConfig(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=64)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_adapters")
    return {f"a{i}": write_adapter(root / f"a{i}", MODEL, rank=4 * (i + 1), projections=ALL, seed=i)
            for i in range(3)}


def make_cache(folders, slots=1):
    cache = AdapterCache(MODEL, max_gpu_adapters=slots, max_lora_rank=16, max_cpu_adapters=2,
                         dtype=torch.bfloat16, device="cuda")
    for name, folder in folders.items():
        cache.register(name, folder)
    return cache


def host_adapter(folder):
    return read_peft_adapter(inspect_peft_adapter(folder, MODEL), torch.bfloat16)


def fused_qkv_oracle(x, adapter):
    """float64 x @ (scaling · B @ A)ᵀ for q, k, v side by side (k, v narrower under GQA)."""
    outs = []
    for proj in ("q_proj", "k_proj", "v_proj"):
        m = adapter.modules[(0, proj)]
        outs.append(m.scaling * (x.double() @ m.a.double().T) @ m.b.double().T)
    return torch.cat(outs, dim=1)


def run_qkv(cache, slot, x, y):
    a, b, r, s = cache.pool.stacks(0, ("q_proj", "k_proj", "v_proj"))
    batch = ops.LoraBatch.from_lengths([x.shape[0]], [slot], x.device)
    return ops.add_lora(y, x, a, b, batch, r, s)


def test_load_is_asynchronous_and_ready_only_after_the_copy(folders):
    """The copy queues behind ~0.5 s of work on the side stream: meanwhile the adapter is LOADING."""
    import time
    cache = make_cache(folders)
    with torch.cuda.stream(cache._stream):
        torch.cuda._sleep(1_000_000_000)
    cache.prefetch("a0")
    deadline = time.monotonic() + 5
    while cache.state("a0").value in ("disk", "reading", "cpu") and time.monotonic() < deadline:
        time.sleep(0.001)
    assert cache.state("a0").value == "loading" and not cache.is_resident("a0")
    assert cache.wait_resident("a0", timeout=30)
    adapter = host_adapter(folders["a0"])
    slot = cache.acquire("a0")
    x = torch.randn(5, MODEL.hidden_size, device="cuda", dtype=torch.bfloat16)
    y0 = torch.randn(5, 256 + 64 + 64, device="cuda", dtype=torch.bfloat16)
    y = run_qkv(cache, slot, x, y0.clone())
    want = y0.double() + fused_qkv_oracle(x.cpu(), adapter).cuda()
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)
    cache.release("a0")
    cache.close()


def test_host_copies_are_pinned_on_cuda(folders):
    cache = make_cache(folders)
    cache.wait_resident("a1", timeout=30)
    assert all(b.is_pinned() for b in cache._cpu_lru["a1"].buffers)
    cache.close()


def test_slot_is_not_overwritten_before_queued_work_has_read_it(folders):
    """One slot: a batch using a0 is queued behind a long kernel, a0 is released, a1 is loaded into the
    same slot at once. The queued batch must still see a0's weights."""
    cache = make_cache(folders, slots=1)
    cache.wait_resident("a0", timeout=30)
    slot = cache.acquire("a0")
    x = torch.randn(7, MODEL.hidden_size, device="cuda", dtype=torch.bfloat16)
    y0 = torch.randn(7, 384, device="cuda", dtype=torch.bfloat16)
    torch.cuda._sleep(400_000_000)  # the main stream is busy for a while
    y = run_qkv(cache, slot, x, y0.clone())
    cache.release("a0")
    cache.wait_resident("a1", timeout=30)  # a1 evicts a0 and is copied into the same slot
    assert cache.acquire("a1") == slot
    torch.cuda.synchronize()
    want = y0.double() + fused_qkv_oracle(x.cpu(), host_adapter(folders["a0"])).cuda()
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)
    y1 = run_qkv(cache, slot, x, y0.clone())
    want1 = y0.double() + fused_qkv_oracle(x.cpu(), host_adapter(folders["a1"])).cuda()
    torch.testing.assert_close(y1.double(), want1, rtol=2e-2, atol=2e-2)
    cache.release("a1")
    cache.close()


def test_release_events_do_not_pile_up_and_a_use_on_another_stream_still_holds_the_slot(folders):
    """A resident adapter's releases keep one event per stream (each covers the ones before it on its stream),
    not one per release: a server's popular adapter would otherwise gather an event per request until its slot
    is next loaded. A use queued on a side stream behind a long kernel, released there, still holds the slot
    against a load that evicts it, whatever releases follow on the default stream."""
    cache = make_cache(folders, slots=1)
    cache.wait_resident("a0", timeout=30)
    for _ in range(50):
        slot = cache.acquire("a0")
        cache.release("a0")
    assert len(cache._last_use[slot]) == 1
    x = torch.randn(7, MODEL.hidden_size, device="cuda", dtype=torch.bfloat16)
    y0 = torch.randn(7, 384, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    assert side.cuda_stream not in (cache._stream.cuda_stream, torch.cuda.current_stream().cuda_stream)
    side.wait_stream(torch.cuda.current_stream())
    assert cache.acquire("a0") == slot
    with torch.cuda.stream(side):
        torch.cuda._sleep(400_000_000)   # the side stream is busy for a while
        y = run_qkv(cache, slot, x, y0.clone())
        cache.release("a0")
    for _ in range(5):   # releases on the default stream must not drop the side stream's event
        cache.acquire("a0")
        cache.release("a0")
    assert len(cache._last_use[slot]) == 2
    cache.wait_resident("a1", timeout=30)   # a1 evicts a0 into the same slot: its copy waits for both streams
    assert cache._last_use[slot] == {}
    torch.cuda.synchronize()
    want = y0.double() + fused_qkv_oracle(x.cpu(), host_adapter(folders["a0"])).cuda()
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)
    cache.close()


def test_pinned_host_copy_wastes_little_memory():
    """A 7B-shaped layer's worth of rank-16 modules: pinned chunks hold at most ~10% more than the weights
    (one buffer would be rounded up to a power of two by PyTorch's host allocator)."""
    from loraplex.adapters.spec import AdapterSpec, ModuleSpec, pack_host_adapter
    big = ModelConfig(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=4,
                      num_attention_heads=32, num_key_value_heads=32, head_dim=128, vocab_size=32000)
    modules, tensors = {}, {}
    for layer in range(4):
        for proj in ALL:
            in_f, out_f = big.projection_shape(proj)
            modules[(layer, proj)] = ModuleSpec(16, 2.0)
            tensors[(layer, proj)] = (torch.randn(16, in_f), torch.randn(out_f, 16))
    adapter = pack_host_adapter(AdapterSpec("x", "mem", modules), tensors, torch.bfloat16, pin=True)
    assert all(b.is_pinned() for b in adapter.buffers)
    assert adapter.host_bytes <= 1.1 * adapter.nbytes + (8 << 20)
    for key, (a, b) in tensors.items():
        assert torch.equal(adapter.modules[key].a, a.to(torch.bfloat16))
        assert torch.equal(adapter.modules[key].b, b.to(torch.bfloat16))


def test_reserved_pinned_memory_serves_the_first_reads():
    """adapters/pinned_reserve.py: after reserve_host_memory, as many full-rank reads as it reserved for (the CPU
    tier plus the loader threads) page-lock no fresh memory (PyTorch's host allocator counts its CUDA calls)."""
    torch.cuda.init()   # host_memory_stats is empty before CUDA is initialised
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or "num_host_alloc" not in stats():
        pytest.skip("this torch does not count pinned allocations")
    big = ModelConfig(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=6,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=64)
    cache = AdapterCache(big, max_gpu_adapters=1, max_lora_rank=16, max_cpu_adapters=3, dtype=torch.bfloat16,
                         device="cuda", loader_threads=2)
    try:
        reserved = cache.reserve_host_memory(None)
        before = stats()["num_host_alloc"]
        held = [read_synthetic(synthetic_spec(f"s{i}", big, 16, seed=i), torch.bfloat16, True) for i in range(5)]
        assert all(b.is_pinned() for h in held for b in h.buffers)
        assert stats()["num_host_alloc"] == before
        from loraplex.adapters.pinned_reserve import pinned_bytes   # rounded up as the allocator rounds
        assert reserved == 5 * pinned_bytes([b.numel() for b in held[0].buffers], torch.bfloat16)
        # a graph capture hands the cached blocks back (why the engine reserves after capturing its graphs)
        del held
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass
        before = stats()["num_host_alloc"]
        read_synthetic(synthetic_spec("after", big, 16, seed=9), torch.bfloat16, True)
        assert stats()["num_host_alloc"] > before
    finally:
        cache.close()
