"""The scheduler with requests that combine adapters (adapters/composition.py): each member counts against the
GPU slots, a request pins all of its members or none, and preemption and failures release every pin.

The fake adapter cache of test_scheduler.py counts acquires and releases per adapter, so every pin can be checked
to have exactly one release.
"""
from __future__ import annotations

from collections import Counter

from loraplex.adapters.composition import Composition
from test_scheduler import (
    FINISHED,
    RUNNING,
    WAITING,
    FakeAdapters,
    chunk_ids,
    ids,
    make_scheduler,
    make_seq,
    postprocess,
    run_to_completion,
    step,
)

MIX = {"a": 0.7, "b": -0.3}


def test_a_composition_waits_until_every_member_is_resident_then_pins_them_all():
    ad = FakeAdapters(resident=["a"])
    sched = make_scheduler(adapters=ad, max_num_seqs=8, max_num_batched_tokens=64, max_queue_skip_ms=10_000)
    mix = make_seq("mix", 4, arrival=0.0, adapter=MIX)
    alone = make_seq("alone", 4, arrival=1.0, adapter="a")
    for s in (mix, alone):
        sched.add(s)
    assert mix.adapter == Composition((("a", 0.7), ("b", -0.3))) and mix.adapter_names == ("a", "b")
    out = step(sched, now=2.0)
    assert chunk_ids(out) == ["alone"] and ids(sched.waiting) == ["mix"]   # b is not resident: others go ahead
    assert mix.adapter_slots == () and mix.block_table == []
    assert ad.pins == Counter({"a": 1})                 # mix's pin of a was given back
    assert ad.acquired["a"] == 2 and ad.released["a"] == 1
    assert "b" in ad.prefetched, "the missing member must start loading"
    ad.make_resident("b")
    out = step(sched, now=2.1)
    assert "mix" in chunk_ids(out) and mix.status is RUNNING
    assert mix.adapter_slots == (ad.slot_of["a"], ad.slot_of["b"])   # in the composition's order
    assert ad.pins == Counter({"a": 2, "b": 1})
    run_to_completion(sched, [mix, alone], now=3.0)
    ad.assert_balanced()


def test_the_plan_wants_every_member_in_queue_order_and_not_those_pinned():
    ad = FakeAdapters(resident=["a"])
    sched = make_scheduler(adapters=ad, max_num_seqs=8, max_num_batched_tokens=64, max_gpu_adapters=8,
                           max_queue_skip_ms=10_000)
    runner = make_seq("runner", 4, arrival=0.0, adapter="a", max_tokens=50)
    sched.add(runner)
    step(sched, now=0.0)
    for i, adapter in enumerate([{"a": 1.0, "c": 2.0}, {"d": 0.5, "b": 1.0, "c": 1.0}, "e"]):
        sched.add(make_seq(f"w{i}", 4, arrival=1.0 + i, adapter=adapter))
    sched.plan_adapter_loads()
    assert ad.wanted == ["c", "d", "b", "e"]   # a is pinned by runner; c once


def test_preempting_a_composition_releases_every_pin():
    ad = FakeAdapters(resident=["a", "b", "c"])
    sched = make_scheduler(num_blocks=3, block_size=4, adapters=ad, max_num_seqs=3, max_num_batched_tokens=32)
    x = make_seq("x", 4, arrival=0.0, adapter={"a": 1.0, "c": 0.5}, max_tokens=5)
    y = make_seq("y", 3, arrival=1.0, adapter=MIX, max_tokens=3)
    sched.add(x)
    sched.add(y)
    preempted = []

    def on_step(out):
        preempted.extend(out.preempted)
        for seq in out.preempted:
            assert seq.adapter_slots == () and seq.status is WAITING
        assert +ad.pins == Counter(n for s in sched.running for n in s.adapter_names)
    run_to_completion(sched, [x, y], now=2.0, on_step=on_step)
    assert ids(preempted) == ["y"], "the scenario must preempt y once"
    assert x.status is FINISHED and y.status is FINISHED
    ad.assert_balanced()


def test_a_failed_member_fails_the_request_alone_and_pins_nothing():
    ad = FakeAdapters(resident=["a", "ok"], failed=["bad"])
    sched = make_scheduler(adapters=ad, max_num_seqs=8, max_num_batched_tokens=64)
    bad = make_seq("bad", 4, arrival=0.0, adapter={"a": 0.5, "bad": 1.0})   # a is acquired before bad fails
    ok = make_seq("ok", 4, arrival=1.0, adapter={"ok": 2.0, "a": 1.0})
    for s in (bad, ok):
        sched.add(s)
    out = sched.schedule(now=2.0)
    assert ids(out.failed) == ["bad"] and "'bad'" in bad.error and "corrupt" in bad.error
    assert chunk_ids(out) == ["ok"] and bad.adapter_slots == ()
    assert ad.pins == Counter({"ok": 1, "a": 1})   # ok's pins only
    for seq in out.failed:
        sched.finish(seq)
    postprocess(sched, out)
    run_to_completion(sched, [ok], now=3.0)
    ad.assert_balanced()


def test_would_admit_answers_as_schedule_would_for_compositions():
    ad = FakeAdapters(resident=["a", "b"], failed=["bad"])
    sched = make_scheduler(num_blocks=16, block_size=4, adapters=ad, max_num_seqs=4, max_queue_skip_ms=1000)
    runner = make_seq("runner", 8, arrival=0.0, max_tokens=20)
    sched.add(runner)
    step(sched, now=0.0)
    sched.add(make_seq("cold", 4, arrival=1.0, adapter={"a": 1.0, "cold": 1.0}))
    assert not sched.would_admit(now=1.5)          # a member still loading: passed over
    assert chunk_ids(sched.schedule(now=1.5)) == ["runner"]
    assert not sched.would_admit(now=2.5)          # aged: it holds the queue
    sched.add(make_seq("mix", 4, arrival=1.2, adapter=MIX))
    assert sched.would_admit(now=1.6) and chunk_ids(sched.schedule(now=1.6)) == ["runner", "mix"]
    sched.add(make_seq("half-bad", 4, arrival=1.3, adapter={"b": 1.0, "bad": 1.0}))
    assert sched.would_admit(now=1.7)              # schedule() would end it
    assert ids(sched.schedule(now=1.7).failed) == ["half-bad"]
    assert ad.pins == Counter({"a": 1, "b": 1})    # mix's; would_admit pinned nothing


def test_a_composition_needs_a_slot_per_member_beside_the_running_requests():
    """Two slots: while a request pins one for its adapter, a composition of two others cannot be resident; it
    runs once that request ends, and the slots never hold more adapters than they have."""
    ad = FakeAdapters(num_slots=2, load_steps=1)
    sched = make_scheduler(adapters=ad, max_num_seqs=4, max_num_batched_tokens=64, max_gpu_adapters=2,
                           max_queue_skip_ms=0)   # aged at once: nothing overtakes the composition
    first = make_seq("first", 4, arrival=0.0, adapter="c", max_tokens=6)
    mix = make_seq("mix", 4, arrival=1.0, adapter=MIX, max_tokens=3)
    later = make_seq("later", 4, arrival=2.0, adapter="c", max_tokens=2)
    seqs = [first, mix, later]
    for s in seqs:
        sched.add(s)
    order = []

    def on_step(out):
        ad.tick()
        assert len(ad.slot_of) <= 2
        order.extend(c.seq.request_id for c in out.chunks if c.start == 0)
    run_to_completion(sched, seqs, now=3.0, on_step=on_step)
    assert order == ["first", "mix", "later"], order
    assert all(s.status is FINISHED for s in seqs)
    ad.assert_balanced()
