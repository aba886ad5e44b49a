"""The registry and its tiers: LRU order, pinning under threads, unregistering in use, failed reads."""
import random
import threading
import time

import pytest
import torch
from adapter_fixtures import write_adapter

from loraplex.adapters import AdapterCache, AdapterError, AdapterState
from loraplex.adapters.peft_format import inspect_peft_adapter, read_peft_adapter
from loraplex.models import ModelConfig
from loraplex.models.config import PROJECTIONS

MODEL = ModelConfig(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64, name_or_path="tiny")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Eight adapters, each with its own rank (1..8) so a slot's rank table says who is in it."""
    root = tmp_path_factory.mktemp("adapters")
    projs = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]
    return {f"a{i}": write_adapter(root / f"a{i}", MODEL, rank=i + 1, projections=projs[i % 2], seed=i)
            for i in range(8)}


def make_cache(folders, names, *, slots=2, cpu=0, **kw):
    cache = AdapterCache(MODEL, max_gpu_adapters=slots, max_lora_rank=8, max_cpu_adapters=cpu,
                         dtype=torch.float32, device="cpu", **kw)
    for name in names:
        cache.register(name, folders[name])
    return cache


def load(cache, name):
    assert cache.wait_resident(name, timeout=10), cache.error(name)
    return cache.acquire(name)


def expected_deltas(folder, name):
    adapter = read_peft_adapter(inspect_peft_adapter(folder, MODEL, name=name), torch.float32)
    return {key: m.scaling * m.b.double() @ m.a.double() for key, m in adapter.modules.items()}


def assert_slot_holds(cache, slot, folder, name):
    want = expected_deltas(folder, name)
    for layer in range(MODEL.num_hidden_layers):
        for p, proj in enumerate(PROJECTIONS):
            if (layer, proj) in want:
                torch.testing.assert_close(cache.pool.delta(slot, layer, proj), want[(layer, proj)],
                                           rtol=1e-6, atol=1e-6)
            else:
                rank = int(cache.pool.ranks[layer, p, slot])
                assert rank == 0, f"{name}: slot {slot} layer {layer} {proj} has rank {rank}, should be 0"


def test_gpu_slots_evict_least_recently_used(folders):
    """With two slots: a, b loaded; a used again; loading c evicts b, the least recently used."""
    cache = make_cache(folders, ["a0", "a1", "a2"])
    for name in ("a0", "a1"):
        cache.release(name) if load(cache, name) is not None else None
    cache.acquire("a0")
    cache.release("a0")
    slot_c = load(cache, "a2")
    assert not cache.is_resident("a1") and cache.is_resident("a0")
    assert cache.state("a1") == AdapterState.DISK  # no CPU tier here: back to disk
    assert_slot_holds(cache, slot_c, folders["a2"], "a2")
    assert cache.counters["gpu_evictions"] == 1
    cache.close()


def test_cpu_tier_keeps_most_recent_host_copies(folders):
    """One GPU slot, two CPU copies: after a0, a1, a2, only a1 and a2 are still on the host."""
    cache = make_cache(folders, ["a0", "a1", "a2"], slots=1, cpu=2)
    for name in ("a0", "a1", "a2"):
        load(cache, name)
        cache.release(name)
    assert cache.state("a2") == AdapterState.GPU
    assert cache.state("a1") == AdapterState.CPU and cache.state("a0") == AdapterState.DISK
    reads = cache.counters["disk_reads"]
    slot = load(cache, "a1")  # from the CPU tier: no disk read
    assert cache.counters["disk_reads"] == reads
    assert_slot_holds(cache, slot, folders["a1"], "a1")
    cache.close()


def test_pinned_slot_is_never_evicted(folders):
    """Both slots pinned: a third adapter waits (on the host) and gets a slot only once one is released."""
    cache = make_cache(folders, ["a0", "a1", "a2"], cpu=1)
    slots = {name: load(cache, name) for name in ("a0", "a1")}
    assert cache.try_acquire("a2") is None
    assert not cache.wait_resident("a2", timeout=0.3)
    assert cache.state("a2") == AdapterState.CPU
    for name, slot in slots.items():
        assert cache.slot_owner(slot) == name
        assert_slot_holds(cache, slot, folders[name], name)
    cache.release("a1")
    slot = load(cache, "a2")
    assert slot == slots["a1"]
    assert_slot_holds(cache, slots["a0"], folders["a0"], "a0")
    assert_slot_holds(cache, slot, folders["a2"], "a2")
    cache.close()


def test_reused_slot_has_no_leftovers_from_previous_tenant(folders):
    """a1 touches every projection; a0 (q, v only) in the same slot must leave the others at rank 0."""
    cache = make_cache(folders, ["a1", "a0"], slots=1)
    load(cache, "a1")
    cache.release("a1")
    slot = load(cache, "a0")
    assert_slot_holds(cache, slot, folders["a0"], "a0")
    cache.close()


def test_concurrent_acquire_release_never_shares_or_overwrites_a_pinned_slot(folders):
    """Six threads acquire, check, hold and release eight adapters over three slots."""
    names = sorted(folders)
    cache = make_cache(folders, names, slots=3, cpu=3, loader_threads=3)
    ranks = {name: int(name[1:]) + 1 for name in names}
    errors, held = [], {}
    held_lock = threading.Lock()

    def worker(seed):
        rng = random.Random(seed)
        deadline = time.monotonic() + 3.0
        done = 0
        while time.monotonic() < deadline and done < 25:
            name = rng.choice(names)
            slot = cache.try_acquire(name)
            if slot is None:
                time.sleep(0.001)
                continue
            with held_lock:
                other = held.get(slot)
                if other is not None and other != name:
                    errors.append(f"slot {slot} pinned by {other} and {name}")
                held.setdefault(slot, name)
                held[(slot, "count")] = held.get((slot, "count"), 0) + 1
            try:
                for _ in range(2):  # the slot's contents must stay this adapter's while pinned
                    if int(cache.pool.ranks[0, 0, slot]) != ranks[name]:
                        errors.append(f"slot {slot} lost {name} while pinned")
                    time.sleep(0.0005)
            finally:
                with held_lock:
                    held[(slot, "count")] -= 1
                    if held[(slot, "count")] == 0:
                        del held[slot]
                cache.release(name)
            done += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert all(cache.pins(n) == 0 for n in names)
    assert cache.counters["gpu_evictions"] > 0  # the slots really did churn
    cache.close()  # let background reads and copies still queued finish before looking at the pool
    for name in cache.resident():
        slot = [s for s in range(3) if cache.slot_owner(s) == name][0]
        assert_slot_holds(cache, slot, folders[name], name)


def test_unregister_in_use_takes_effect_on_release(folders):
    cache = make_cache(folders, ["a0", "a1"])
    slot = load(cache, "a0")
    cache.unregister("a0")
    assert "a0" not in cache and cache.names() == ["a1"]
    with pytest.raises(AdapterError, match="unknown adapter 'a0'"):
        cache.try_acquire("a0")
    assert cache.slot_owner(slot) == "a0"  # still serving the running request
    assert_slot_holds(cache, slot, folders["a0"], "a0")
    cache.release("a0")
    assert cache.slot_owner(slot) is None
    cache.register("a0", folders["a2"])  # the name is free again
    assert_slot_holds(cache, load(cache, "a0"), folders["a2"], "a0")
    cache.close()


def test_unregister_idle_frees_its_slot(folders):
    cache = make_cache(folders, ["a0"])
    slot = load(cache, "a0")
    cache.release("a0")
    cache.unregister("a0")
    assert cache.slot_owner(slot) is None and cache.names() == []
    cache.close()


def test_failed_read_marks_only_that_adapter(folders, tmp_path):
    """A file that breaks after registration fails its own requests with a message; others load."""
    import shutil
    broken = shutil.copytree(folders["a0"], tmp_path / "broken")
    cache = make_cache(folders, ["a1"])
    cache.register("broken", broken)
    data = (broken / "adapter_model.safetensors").read_bytes()
    (broken / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="broken.*adapter_model.safetensors"):
        cache.wait_resident("broken", timeout=10)
    assert cache.state("broken") == AdapterState.FAILED
    with pytest.raises(AdapterError, match="failed to load"):
        cache.try_acquire("broken")
    assert cache.counters["failures"] == 1
    assert_slot_holds(cache, load(cache, "a1"), folders["a1"], "a1")
    cache.close()


def test_misuse_is_refused_with_clear_errors(folders):
    cache = make_cache(folders, ["a0"])
    with pytest.raises(AdapterError, match="unknown adapter 'nope'"):
        cache.prefetch("nope")
    with pytest.raises(AdapterError, match="without a matching acquire"):
        cache.release("a0")
    with pytest.raises(AdapterError, match="already registered"):
        cache.register("a0", folders["a1"])
    with pytest.raises(AdapterError, match="not allowed"):
        cache.register("has space", folders["a1"])
    with pytest.raises(AdapterError, match="max_lora_rank=8"):
        make_cache(folders, [], slots=1).register("big", write_adapter(folders["a0"].parent / "big", MODEL, rank=9))
    cache.prefetch("a0")
    cache.wait_resident("a0", timeout=10)
    with pytest.raises(ValueError, match="max_gpu_adapters"):
        AdapterCache(MODEL, max_gpu_adapters=0, max_lora_rank=8, max_cpu_adapters=0, device="cpu")
    with pytest.raises(ValueError, match="max_cpu_adapters"):
        AdapterCache(MODEL, max_gpu_adapters=1, max_lora_rank=8, max_cpu_adapters=-1, device="cpu")
    cache.close()


def test_acquire_of_a_non_resident_adapter_raises(folders):
    cache = make_cache(folders, ["a0"])
    with pytest.raises(AdapterError, match="not on the GPU yet"):
        cache.acquire("a0")
    cache.close()


def test_pinned_chunk_layout_packs_without_overlap():
    """Host buffers: tensors placed in order into chunks, never across one, never overlapping."""
    from loraplex.adapters.spec import _layout
    sizes = [5, 3, 8, 1, 7, 2, 8, 8]
    places, chunks = _layout(sizes, 8)
    assert all(c <= 8 for c in chunks) and sum(chunks) == sum(sizes)
    spans = sorted((c, off, off + n) for (c, off), n in zip(places, sizes))
    for (c0, _, end0), (c1, start1, _) in zip(spans, spans[1:]):
        assert c0 != c1 or end0 <= start1
    assert places[:3] == [(0, 0), (0, 5), (1, 0)]


def test_a_finished_load_nobody_asked_about_can_still_be_evicted(folders):
    """b is prefetched into the only slot and finishes unobserved; a's load must still get that slot."""
    cache = make_cache(folders, ["a0", "a1"], slots=1, cpu=0, loader_threads=1)
    cache.prefetch("a1")
    time.sleep(0.3)  # a1's read and copy finish; nothing polls it
    deadline = time.monotonic() + 5
    slot = None
    while slot is None and time.monotonic() < deadline:
        slot = cache.try_acquire("a0")
        time.sleep(0.005)
    assert slot is not None, "a0 never got the slot a1 finished loading into"
    assert_slot_holds(cache, slot, folders["a0"], "a0")
    cache.close()


def test_prefetching_a_long_queue_holds_few_host_copies(folders):
    """Every slot pinned, no CPU tier: prefetching seven adapters reads at most max(slots, threads) of
    them into host memory; the rest wait on disk until a slot frees."""
    cache = make_cache(folders, sorted(folders), slots=1, cpu=0, loader_threads=1)
    load(cache, "a0")
    for name in sorted(folders)[1:]:
        cache.prefetch(name)
    time.sleep(0.3)
    for name in sorted(folders)[1:]:
        cache.prefetch(name)
    states = [cache.state(n) for n in sorted(folders)[1:]]
    held = sum(s in (AdapterState.READING, AdapterState.CPU) for s in states)
    assert held == 1 and states.count(AdapterState.DISK) == 6, states
    cache.release("a0")
    for name in reversed(sorted(folders)[1:]):  # the queue drains once slots free, in any order
        load(cache, name)
        cache.release(name)
    cache.close()


def test_an_abandoned_prefetch_does_not_block_later_loads(folders):
    """b is prefetched while the only slot is pinned, then nobody asks for it again (its request went
    away). Once the slot frees, b takes it and later loads (c) still proceed."""
    cache = make_cache(folders, ["a0", "a1", "a2"], slots=1, cpu=0, loader_threads=1)
    load(cache, "a0")
    cache.prefetch("a1")
    time.sleep(0.2)
    cache.release("a0")
    slot = load(cache, "a2")
    assert_slot_holds(cache, slot, folders["a2"], "a2")
    cache.close()


def test_unregister_during_a_load_then_reuse_the_name(folders):
    """A read or copy still in flight for an unregistered adapter never lands under the new owner."""
    cache = make_cache(folders, ["a0"], slots=2, loader_threads=2)
    for _ in range(5):
        cache.prefetch("a0")
        cache.unregister("a0")
        cache.register("a0", folders["a3"])
        slot = load(cache, "a0")
        assert_slot_holds(cache, slot, folders["a3"], "a0")
        cache.release("a0")
        cache.unregister("a0")
        cache.register("a0", folders["a0"])
    cache.close()
    assert all(cache.slot_owner(s) in (None, "a0") for s in range(2))


# ---- the scheduler's wishes: want / acquire_if_resident -----------------------------------------------------
def until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_acquire_if_resident_starts_no_load(folders):
    cache = make_cache(folders, ["a0"])
    assert cache.acquire_if_resident("a0") is None
    time.sleep(0.1)
    assert cache.state("a0") == AdapterState.DISK and cache.counters["disk_reads"] == 0
    cache.close()


def test_wanted_adapters_load_and_are_never_evicted_for_another_load(folders):
    cache = make_cache(folders, ["a0", "a1", "a2"], slots=2)
    cache.want(["a0", "a1", "a2"], 2)     # a2 beyond the slots: no CPU tier, so nothing for it
    until(lambda: cache.is_resident("a0") and cache.is_resident("a1"))
    cache.prefetch("a2")                   # a load from elsewhere finds only wanted adapters: it waits
    time.sleep(0.2)
    assert cache.is_resident("a0") and cache.is_resident("a1") and not cache.is_resident("a2")
    assert cache.counters["gpu_evictions"] == 0
    cache.want(["a2", "a0"], 2)            # a1 no longer wanted: the waiting a2 may take its slot
    until(lambda: cache.is_resident("a2"))
    assert cache.is_resident("a0") and not cache.is_resident("a1")
    for name in ("a0", "a2"):
        slot = cache.acquire_if_resident(name)
        assert_slot_holds(cache, slot, folders[name], name)
        cache.release(name)
    cache.close()


def test_a_withdrawn_wish_gives_up_its_slot_request_and_host_copy(folders):
    cache = make_cache(folders, ["a0", "a1"], slots=1)
    load(cache, "a0")                      # pinned: a1 can only wait for the slot
    cache.want(["a1"], 1)
    until(lambda: cache.state("a1") == AdapterState.CPU)
    cache.want([], 0)                      # its request went
    assert cache.state("a1") == AdapterState.DISK
    loads = cache.counters["gpu_loads"]
    cache.release("a0")
    time.sleep(0.2)
    assert cache.is_resident("a0") and cache.counters["gpu_loads"] == loads, "a withdrawn wish was loaded"
    cache.close()


def test_names_past_the_slots_are_read_ahead_into_the_cpu_tier_only(folders):
    cache = make_cache(folders, ["a0", "a1", "a2", "a3", "a4"], slots=1, cpu=3)
    cache.want(["a0", "a1", "a2", "a3", "a4"], 1)   # tier of 3: a0 (wanted) + a1, a2 read ahead
    until(lambda: cache.is_resident("a0") and cache.state("a1") == cache.state("a2") == AdapterState.CPU)
    time.sleep(0.1)
    assert cache.state("a3") == cache.state("a4") == AdapterState.DISK
    assert cache.counters["gpu_loads"] == 1 and cache.counters["disk_reads"] == 3
    cache.want(["a1"], 1)                  # now wanted: from host memory, no disk read
    until(lambda: cache.is_resident("a1"))
    assert cache.counters["disk_reads"] == 3
    cache.close()


def test_a_prefetch_past_the_host_memory_limit_starts_when_room_frees(folders):
    # one slot, one loader thread: at most one host copy held for the GPU outside the CPU tier
    cache = make_cache(folders, ["a0", "a1", "a2"], slots=1, loader_threads=1)
    load(cache, "a0")
    cache.prefetch("a1")
    until(lambda: cache.state("a1") == AdapterState.CPU)
    cache.prefetch("a2")                   # over the limit: deferred, and nobody asks again
    time.sleep(0.1)
    assert cache.state("a2") == AdapterState.DISK
    cache.release("a0")
    until(lambda: cache.is_resident("a2"))  # a1's copy landed, then a2 was read and took the slot
    cache.close()


def test_failed_names_are_skipped_by_want(folders, tmp_path):
    import shutil
    broken = shutil.copytree(folders["a0"], tmp_path / "broken")
    cache = make_cache(folders, ["a1"], slots=1)
    cache.register("broken", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AdapterError):
        cache.wait_resident("broken", timeout=10)
    cache.want(["broken", "nope", "a1"], 1)   # the one slot goes to the first usable name
    until(lambda: cache.is_resident("a1"))
    cache.close()


def test_the_scheduler_s_wishes_poll_finished_loads_so_their_gpu_time_is_taken_then(folders):
    """A load nobody asks about is seen finished by the next `want` (every engine step), so its "gpu"
    time (take_load_times) is taken then, not when a request first asks for the adapter."""
    cache = make_cache(folders, ["a0"], slots=1, loader_threads=1)
    cache.take_load_times()
    cache.prefetch("a0")
    deadline = time.monotonic() + 5
    while cache._entries["a0"].ready_event is None and time.monotonic() < deadline:   # read and copy queued
        time.sleep(0.005)
    assert cache._entries["a0"].ready_event is not None, "the copy into a slot was never queued"
    # each stage once, in order; nothing polled the copy yet, so no "gpu" time
    stages = cache.take_load_times()
    assert [s for s, _ in stages] == ["disk", "slot_wait", "copy_issue"] and all(t >= 0 for _, t in stages)
    cache.want([], 0)
    assert [s for s, _ in cache.take_load_times()] == ["gpu"]
    cache.close()
