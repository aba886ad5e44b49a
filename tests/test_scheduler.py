"""The scheduler and block manager without a model: budgets, chunked prefill, KV accounting,
preemption, adapter residency and aging, the latency ↔ throughput wait, FCFS for memory.

The engine's postprocess is simulated: each scheduled chunk is cached, a chunk that reaches the
end of its sequence samples one token, and a sequence that has its `max_tokens` is finished.
Adapters are a fake with the scheduler's three calls, whose residency each test controls and
which counts pins, so every acquire can be checked to have exactly one release.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest

from loraplex.adapters import AdapterError
from loraplex.config import EngineConfig
from loraplex.engine.block_manager import BlockManager
from loraplex.engine.scheduler import Scheduler, SchedulerOutput
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.sampling import SamplingParams

WAITING, RUNNING, FINISHED = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED


# ---- helpers ---------------------------------------------------------------------------------------
class FakeAdapters:
    """The scheduler's view of the adapter cache: acquire_if_resident / release / want, and the queries
    `would_admit` makes (in / error / is_resident).

    Residency is set by the test (`make_resident`, `evict`), or, with `load_steps`, an adapter
    wanted becomes resident that many `tick()`s later once a slot is free or held by an adapter
    neither pinned nor wanted. A pinned adapter is never evicted; `release` without a pin fails the test.
    """

    def __init__(self, resident=(), failed=(), *, num_slots: int | None = None, load_steps: int | None = None):
        self.slot_of: dict[str, int] = {}
        self.failed = set(failed)
        self.num_slots = num_slots
        self.load_steps = load_steps
        self.loading: dict[str, int] = {}
        self.pins: Counter = Counter()
        self.acquired: Counter = Counter()
        self.released: Counter = Counter()
        self.prefetched: list[str] = []     # every name ever wanted on the GPU, in order
        self.wanted: list[str] = []         # the latest wishes
        self.read_ahead: list[str] = []
        self.loads: Counter = Counter()     # times each adapter was put in a slot
        self.tried: list[str] = []
        for name in resident:
            assert self.make_resident(name)

    # what the scheduler calls
    def acquire_if_resident(self, name: str) -> int | None:
        self.tried.append(name)
        if name in self.failed:
            raise AdapterError(f"adapter {name!r} failed to load: corrupt")
        if name in self.slot_of:
            self.pins[name] += 1
            self.acquired[name] += 1
            return self.slot_of[name]
        return None

    def release(self, name: str) -> None:
        assert self.pins[name] > 0, f"release({name!r}) without a matching acquire"
        self.pins[name] -= 1
        self.released[name] += 1

    def want(self, names: list[str], num_gpu: int) -> None:
        assert len(set(names)) == len(names), f"duplicate wishes {names}"
        usable = [n for n in names if n not in self.failed]
        self.wanted, self.read_ahead = usable[:num_gpu], usable[num_gpu:]
        self.loading = {n: left for n, left in self.loading.items() if n in self.wanted}   # withdrawn wishes
        for name in self.wanted:
            self.prefetched.append(name)
            self._start_load(name)

    def __contains__(self, name: str) -> bool:
        return True   # every name is registered

    def error(self, name: str) -> str | None:
        return "corrupt" if name in self.failed else None

    def is_resident(self, name: str) -> bool:
        return name in self.slot_of

    # what tests call
    def make_resident(self, name: str) -> bool:
        if name in self.slot_of:
            return True
        used = set(self.slot_of.values())
        if self.num_slots is None:
            slot = max(used, default=-1) + 1
        elif len(used) < self.num_slots:
            slot = min(set(range(self.num_slots)) - used)
        else:
            victims = [n for n in self.slot_of if self.pins[n] == 0 and n not in self.wanted]
            if not victims:
                return False
            slot = self.slot_of.pop(victims[0])
        self.slot_of[name] = slot
        self.loads[name] += 1
        self.loading.pop(name, None)
        return True

    def evict(self, name: str) -> None:
        assert self.pins[name] == 0, f"evicting pinned adapter {name!r}"
        self.slot_of.pop(name, None)

    def tick(self) -> None:
        for name in list(self.loading):
            self.loading[name] -= 1
            if self.loading[name] <= 0:
                self.make_resident(name)   # stays loading if every slot is pinned

    def _start_load(self, name: str) -> None:
        if name in self.failed:
            return
        if self.load_steps is not None and name not in self.slot_of and name not in self.loading:
            self.loading[name] = self.load_steps

    def assert_balanced(self) -> None:
        assert not +self.pins, f"adapters still pinned: {dict(+self.pins)}"
        assert self.acquired == self.released, f"acquires {dict(self.acquired)} != releases {dict(self.released)}"


def make_scheduler(num_blocks: int = 64, block_size: int = 4, adapters=None, **settings) -> Scheduler:
    # admission by the tokens a request has now (the tests of preemption need it to happen); the
    # admission lookahead has tests of its own
    settings.setdefault("admission_lookahead", 0)
    config = EngineConfig(model="dummy:x", device="cpu", **settings)
    return Scheduler(config, BlockManager(num_blocks, block_size), adapters)


def make_seq(request_id: str, prompt_len: int, arrival: float, adapter: str | None = None,
             max_tokens: int = 4) -> Sequence:
    seq = Sequence(request_id, [(7 * i + 3) % 100 for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens), adapter=adapter)
    seq.times.arrival = arrival
    return seq


def postprocess(sched: Scheduler, out: SchedulerOutput, token: int = 5) -> list[Sequence]:
    """What Engine._postprocess does to the host state; returns the sequences it finished."""
    finished = []
    for chunk in out.chunks:
        seq = chunk.seq
        needs_logits = chunk.needs_logits   # (before num_cached moves, as the engine does)
        seq.num_cached += chunk.num_tokens
        if not needs_logits:
            continue
        seq.token_ids.append(token)
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq)
            finished.append(seq)
    return finished


def step(sched: Scheduler, now: float) -> SchedulerOutput:
    out = sched.schedule(now=now)
    postprocess(sched, out)
    return out


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def chunk_ids(out: SchedulerOutput) -> list[str]:
    return [c.seq.request_id for c in out.chunks]


def check_blocks(sched: Scheduler, all_seqs) -> None:
    """Every block is either free or held by exactly one running sequence; waiting ones hold none."""
    bm = sched.blocks
    held: list[int] = []
    for seq in all_seqs:
        if seq.status is RUNNING:
            held.extend(seq.block_table)
        else:
            assert seq.block_table == [], f"{seq} is not running but holds blocks"
    assert len(held) == len(set(held)), f"a block is held twice: {sorted(held)}"
    free = list(bm._free)
    assert len(free) == len(set(free)) == bm.num_free, "the free list holds a block twice"
    assert not set(held) & set(free), f"blocks both held and free: {set(held) & set(free)}"
    assert set(held) | set(free) == set(range(bm.num_blocks)), "a block leaked"


def run_to_completion(sched: Scheduler, seqs, *, now: float = 0.0, dt: float = 0.001, max_steps: int = 2000,
                      on_step=None) -> list[SchedulerOutput]:
    outs = []
    for i in range(max_steps):
        if not sched.has_work():
            return outs
        out = sched.schedule(now=now + i * dt)
        outs.append(out)
        if on_step is not None:
            on_step(out)
        postprocess(sched, out)
        check_blocks(sched, seqs)
    raise AssertionError(f"not done after {max_steps} steps: running {sched.running}, waiting {sched.waiting}")


# ---- budgets and chunked prefill -----------------------------------------------------------------------
def test_token_budget_and_seat_cap_hold_every_step():
    sched = make_scheduler(num_blocks=200, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    seqs = [make_seq(f"r{i}", 3 + 5 * (i % 4), arrival=i, max_tokens=6) for i in range(12)]
    for s in seqs:
        sched.add(s)
    seen_full = []

    def on_step(out):
        assert out.num_tokens <= 16
        assert len(sched.running) <= 4
        assert len(set(map(id, (c.seq for c in out.chunks)))) == len(out.chunks), "a sequence scheduled twice"
        assert all(c.num_tokens >= 1 for c in out.chunks)
        seen_full.append(len(sched.running) == 4)

    run_to_completion(sched, seqs, on_step=on_step)
    assert all(s.status is FINISHED and s.num_output_tokens == 6 for s in seqs)
    assert any(seen_full), "the seat cap was never reached: the test did not exercise it"
    assert sched.blocks.num_free == 200


def test_long_prompt_is_prefilled_in_chunks_and_only_the_last_samples():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    seq = make_seq("long", 50, arrival=0.0, max_tokens=2)
    sched.add(seq)
    sizes, logits = [], []
    for i in range(4):
        out = sched.schedule(now=1.0 + i)
        assert len(out.chunks) == 1 and out.chunks[0].seq is seq
        chunk = out.chunks[0]
        sizes.append(chunk.num_tokens)
        logits.append(chunk.needs_logits)
        # the block table covers what is cached plus what runs now, and no more
        assert len(seq.block_table) == sched.blocks.blocks_for(seq.num_cached + chunk.num_tokens)
        postprocess(sched, out)
    assert sizes == [16, 16, 16, 2]
    assert logits == [False, False, False, True]
    assert seq.num_output_tokens == 1 and seq.num_cached == 50
    out = sched.schedule(now=10.0)
    assert [(c.num_tokens, c.needs_logits) for c in out.chunks] == [(1, True)]   # now decoding
    postprocess(sched, out)
    assert seq.status is FINISHED and sched.blocks.num_free == 64


def test_decodes_are_scheduled_before_prefill_chunks_whatever_the_running_order():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    shorts = [make_seq(f"s{i}", 2, arrival=i, max_tokens=20) for i in range(3)]
    long = make_seq("long", 40, arrival=3, max_tokens=2)
    for s in shorts + [long]:
        sched.add(s)
    out = step(sched, now=10.0)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("s0", 2), ("s1", 2), ("s2", 2), ("long", 2)]
    # the long prompt first in `running`: the decodes must still come first and all get a token
    sched.running.remove(long)
    sched.running.insert(0, long)
    for i in range(3):
        out = sched.schedule(now=11.0 + i)
        assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == \
            [("s0", 1), ("s1", 1), ("s2", 1), ("long", 5)]
        assert [c.needs_logits for c in out.chunks] == [True, True, True, False]
        postprocess(sched, out)


def test_a_new_request_is_admitted_in_the_same_step_as_running_decodes():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    a = make_seq("a", 5, arrival=0.0, max_tokens=10)
    sched.add(a)
    step(sched, now=1.0)
    b = make_seq("b", 30, arrival=1.5, max_tokens=1)
    sched.add(b)
    out = sched.schedule(now=2.0)
    assert [(c.seq.request_id, c.num_tokens, c.needs_logits) for c in out.chunks] == \
        [("a", 1, True), ("b", 15, False)]


def test_admitting_beside_queued_decodes_takes_their_budget_and_the_seats_of_those_leaving():
    """Scheduler.admit_beside (the engine's step queued while another runs): the decodes' tokens come out of
    the budget, sequences ending with the step in flight give their seats (not yet their blocks), and the
    admitted prompts are chunked like schedule()'s."""
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    running = [make_seq(f"d{i}", 4, arrival=float(i), max_tokens=10) for i in range(3)]
    for s in running:
        sched.add(s)
    step(sched, now=5.0)
    assert ids(sched.running) == ["d0", "d1", "d2"]
    waiting = [make_seq("w0", 20, arrival=6.0), make_seq("w1", 5, arrival=7.0)]
    for s in waiting:
        sched.add(s)
    assert sched.admit_beside(num_decodes=3, now=8.0).chunks == []   # every seat taken
    out = sched.admit_beside(num_decodes=2, leaving=1, now=8.0)   # d2 ends with the step in flight
    assert [(c.seq.request_id, c.num_tokens, c.needs_logits) for c in out.chunks] == [("w0", 14, False)]
    assert ids(sched.running) == ["d0", "d1", "d2", "w0"] and ids(sched.waiting) == ["w1"]
    assert sched.blocks.num_free == 64 - 3 - 4   # d0..d2 hold their 4 prompt tokens' block each, w0 its 14
    assert sched.admit_beside(num_decodes=16, leaving=3, now=8.0).chunks == []   # no budget left


def test_would_admit_answers_as_schedule_would_without_pinning_or_taking_blocks():
    """Scheduler.would_admit (the engine asks it before queuing decodes without scheduling): True where
    schedule() would admit the first request it reaches, or end one whose adapter failed."""
    ad = FakeAdapters(resident=["hot"], failed=["bad"])
    sched = make_scheduler(num_blocks=16, block_size=4, adapters=ad, max_num_seqs=2, max_queue_skip_ms=1000)
    a = make_seq("a", 8, arrival=0.0, max_tokens=20)
    sched.add(a)
    step(sched, now=0.0)
    assert not sched.would_admit(now=1.0)                     # nothing waits
    sched.add(make_seq("cold", 4, arrival=1.0, adapter="cold"))
    assert not sched.would_admit(now=1.5)                     # passed over while its adapter loads
    sched.add(make_seq("hot", 16, arrival=1.2, adapter="hot"))
    assert sched.would_admit(now=1.5)                         # 4 blocks of the 14 free (1 kept back)
    assert not sched.would_admit(extra_blocks=10, now=1.5)    # not beside 10 more
    assert not sched.would_admit(now=2.5)                     # cold has aged: it holds the queue
    assert ad.pins["hot"] == 0 and sched.blocks.num_free == 14
    assert chunk_ids(sched.schedule(now=1.5)) == ["a", "hot"]
    sched.add(make_seq("bad", 2, arrival=1.3, adapter="bad"))
    assert not sched.would_admit(now=1.6)                     # every seat taken
    sched.finish(a)
    assert sched.would_admit(now=1.6)                         # schedule() would end bad
    assert [s.request_id for s in sched.schedule(now=1.6).failed] == ["bad"]


# ---- block accounting ----------------------------------------------------------------------------------
def test_block_manager_grows_exactly_and_refuses_double_free():
    bm = BlockManager(5, 4)
    s = make_seq("s", 3, arrival=0)
    t = make_seq("t", 3, arrival=0)
    assert bm.blocks_for(0) == 0 and bm.blocks_for(4) == 1 and bm.blocks_for(5) == 2
    bm.grow(s, 9)
    assert len(s.block_table) == 3 and bm.num_free == 2
    bm.grow(s, 12)   # still 3 blocks
    assert len(s.block_table) == 3
    assert not bm.can_grow(t, 12)
    with pytest.raises(RuntimeError):
        bm.grow(t, 12)
    assert t.block_table == [] and bm.num_free == 2   # a refused grow takes nothing
    bm.grow(t, 8)
    assert not set(s.block_table) & set(t.block_table)
    table = list(t.block_table)
    bm.free(t)
    assert t.block_table == [] and bm.num_free == 2
    t.block_table = table                    # pretend t still held them
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(t)
    with pytest.raises(ValueError):
        BlockManager(0, 4)


def test_all_blocks_are_free_after_everything_finishes():
    sched = make_scheduler(num_blocks=30, block_size=2, max_num_seqs=5, max_num_batched_tokens=12)
    seqs = [make_seq(f"r{i}", 1 + (5 * i) % 13, arrival=i, max_tokens=1 + i % 5) for i in range(15)]
    for s in seqs:
        sched.add(s)
    run_to_completion(sched, seqs)
    assert all(s.status is FINISHED for s in seqs)
    assert sched.blocks.num_free == 30 and not sched.running and not sched.waiting


# ---- preemption ------------------------------------------------------------------------------------------
def test_newest_by_arrival_is_preempted_not_the_last_admitted():
    ad = FakeAdapters()
    sched = make_scheduler(num_blocks=4, block_size=4, adapters=ad, max_num_seqs=4, max_num_batched_tokens=32,
                           max_queue_skip_ms=10_000)
    x = make_seq("x", 2, arrival=0.0, adapter="lora", max_tokens=8)   # arrives first, admitted last
    a = make_seq("a", 2, arrival=1.0, max_tokens=8)
    b = make_seq("b", 2, arrival=2.0, max_tokens=8)
    for s in (x, a, b):
        sched.add(s)
    out = step(sched, now=3.0)
    assert chunk_ids(out) == ["a", "b"] and ids(sched.waiting) == ["x"]
    ad.make_resident("lora")
    out = step(sched, now=3.1)
    assert chunk_ids(out) == ["a", "b", "x"]
    assert sched.blocks.num_free == 1 and [s.num_tokens for s in (a, b, x)] == [4, 4, 3]
    out = step(sched, now=3.15)
    assert not out.preempted and [s.num_tokens for s in (a, b, x)] == [5, 5, 4]
    # a and b now need a second block, one is free: the newest by arrival (b) gives way, not x
    b_tokens = list(b.token_ids)
    out = sched.schedule(now=3.2)
    assert ids(out.preempted) == ["b"]
    assert sorted(chunk_ids(out)) == ["a", "x"]
    assert b.status is WAITING and b.block_table == [] and b.num_cached == 0
    assert b.token_ids == b_tokens and b.num_preemptions == 1 and sched.num_preemptions == 1
    assert ids(sched.waiting) == ["b"] and b not in sched.running
    assert ad.pins["lora"] == 1   # x kept its pin
    postprocess(sched, out)
    run_to_completion(sched, [x, a, b], now=4.0)
    assert all(s.status is FINISHED and s.num_output_tokens == 8 for s in (x, a, b))
    assert b.token_ids[:len(b_tokens)] == b_tokens
    assert sched.blocks.num_free == 4
    ad.assert_balanced()


def test_preemption_frees_blocks_requeues_in_arrival_order_and_admits_nobody_that_step():
    ad = FakeAdapters()
    sched = make_scheduler(num_blocks=5, block_size=4, adapters=ad, max_num_seqs=4, max_num_batched_tokens=32,
                           max_queue_skip_ms=10_000)
    a = make_seq("a", 4, arrival=0.0, max_tokens=4)
    d = make_seq("d", 1, arrival=1.0, adapter="late", max_tokens=1)   # small; its adapter is not loaded yet
    c = make_seq("c", 11, arrival=2.0, max_tokens=6)
    e = make_seq("e", 1, arrival=5.0, max_tokens=1)
    for s in (a, d, c):
        sched.add(s)
    out = step(sched, now=3.0)
    assert chunk_ids(out) == ["a", "c"]
    out = step(sched, now=3.1)       # a grows to 2 blocks, c still fits in 3
    assert sched.blocks.num_free == 0 and not out.preempted and chunk_ids(out) == ["a", "c"]
    sched.add(e)
    ad.make_resident("late")        # d could now run, if there were room
    c_tokens = list(c.token_ids)
    out = sched.schedule(now=3.2)   # c needs a 4th block: c, the newest, gives its blocks back
    assert ids(out.preempted) == ["c"]
    assert c.status is WAITING and c.block_table == [] and c.num_cached == 0 and c.token_ids == c_tokens
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert ids(sched.waiting) == ["d", "c", "e"], "the preempted sequence goes back in arrival order"
    # d fits in the freed blocks, but nothing is admitted in a step that preempted
    assert sched.blocks.num_free - sched.watermark >= sched.blocks.blocks_for(d.num_tokens)
    assert chunk_ids(out) == ["a"] and ad.pins["late"] == 0
    postprocess(sched, out)
    check_blocks(sched, [a, c, d, e])
    out = step(sched, now=3.3)
    assert chunk_ids(out) == ["a", "d"], "d is admitted the step after"
    run_to_completion(sched, [a, c, d, e], now=4.0)
    assert [s.status for s in (a, c, d, e)] == [FINISHED] * 4
    assert c.num_output_tokens == 6 and c.token_ids[:len(c_tokens)] == c_tokens
    assert sched.blocks.num_free == 5
    ad.assert_balanced()


def test_a_preempted_sequence_recomputes_all_its_tokens_then_samples_the_next():
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    a = make_seq("a", 4, arrival=0.0, max_tokens=5)
    b = make_seq("b", 3, arrival=1.0, max_tokens=3)
    sched.add(a)
    sched.add(b)
    step(sched, now=2.0)       # a: 5 tokens, b: 4 tokens, one block each, 1 free
    out = step(sched, now=2.1)  # a grows to 2 blocks; b decodes in its block
    assert not out.preempted and sched.blocks.num_free == 0
    out = sched.schedule(now=2.2)  # b needs a 2nd block: b is preempted
    assert ids(out.preempted) == ["b"]
    postprocess(sched, out)
    tokens_before = b.num_tokens
    recompute = None
    for i in range(20):
        out = sched.schedule(now=3.0 + i)
        for c in out.chunks:
            if c.seq is b and recompute is None:
                recompute = (c.num_tokens, c.needs_logits)
        postprocess(sched, out)
        if not sched.has_work():
            break
    assert recompute == (tokens_before, True), "re-admission feeds every kept token and samples the next"
    assert b.status is FINISHED and b.num_output_tokens == 3


# ---- adapters --------------------------------------------------------------------------------------------
def test_a_request_whose_adapter_is_not_resident_waits_and_others_go_ahead():
    ad = FakeAdapters(resident=["hot"])
    sched = make_scheduler(adapters=ad, max_num_seqs=8, max_num_batched_tokens=64, max_queue_skip_ms=10_000)
    cold = make_seq("cold", 4, arrival=0.0, adapter="cold")
    hot = make_seq("hot", 4, arrival=1.0, adapter="hot")
    base = make_seq("base", 4, arrival=2.0)
    for s in (cold, hot, base):
        sched.add(s)
    out = step(sched, now=3.0)
    assert chunk_ids(out) == ["hot", "base"]
    assert ids(sched.waiting) == ["cold"] and cold.block_table == []
    assert "cold" in ad.prefetched, "the skipped request's adapter must start loading"
    assert ad.pins == Counter({"hot": 1})
    assert hot.adapter_slots == (ad.slot_of["hot"],) and base.adapter_slots == ()
    out = step(sched, now=3.1)
    assert chunk_ids(out) == ["hot", "base"]    # still not resident: still waiting
    ad.make_resident("cold")
    out = step(sched, now=3.2)
    assert chunk_ids(out) == ["hot", "base", "cold"]
    assert cold.status is RUNNING and cold.adapter_slots == (ad.slot_of["cold"],)
    run_to_completion(sched, [cold, hot, base], now=4.0)
    ad.assert_balanced()
    assert ad.acquired == Counter({"hot": 1, "cold": 1})


def test_an_aged_request_blocks_everything_behind_it():
    ad = FakeAdapters()
    sched = make_scheduler(adapters=ad, max_num_seqs=8, max_num_batched_tokens=64, max_queue_skip_ms=100)
    cold = make_seq("cold", 4, arrival=0.0, adapter="cold")
    sched.add(cold)
    early = make_seq("early", 4, arrival=0.01)
    sched.add(early)
    out = step(sched, now=0.05)        # cold waited 50 ms < 100 ms: skipped
    assert chunk_ids(out) == ["early"]
    late = make_seq("late", 4, arrival=0.06)
    sched.add(late)
    out = step(sched, now=0.0999)      # 99.9 ms: still skipped
    assert "late" in chunk_ids(out)
    late2 = make_seq("late2", 4, arrival=0.1)
    sched.add(late2)
    for now in (0.1, 0.2, 1.0):       # from 100 ms on nothing behind it is admitted
        out = step(sched, now=now)
        assert "late2" not in chunk_ids(out) and "cold" not in chunk_ids(out)
        assert ids(sched.waiting) == ["cold", "late2"]
    assert "cold" in ad.prefetched
    ad.make_resident("cold")
    out = step(sched, now=1.1)
    assert [c for c in chunk_ids(out) if c in ("cold", "late2")] == ["cold", "late2"]
    run_to_completion(sched, [cold, early, late, late2], now=2.0)
    ad.assert_balanced()


def test_a_failed_adapter_fails_its_request_and_the_rest_go_on():
    ad = FakeAdapters(resident=["ok"], failed=["bad"])
    sched = make_scheduler(adapters=ad, max_num_seqs=8, max_num_batched_tokens=64)
    first = make_seq("first", 4, arrival=0.0)
    bad = make_seq("bad", 4, arrival=1.0, adapter="bad")
    ok = make_seq("ok", 4, arrival=2.0, adapter="ok")
    for s in (first, bad, ok):
        sched.add(s)
    out = sched.schedule(now=3.0)
    assert ids(out.failed) == ["bad"]
    assert bad.error and "corrupt" in bad.error
    assert chunk_ids(out) == ["first", "ok"]
    assert bad not in sched.running and bad.block_table == [] and bad.adapter_slots == ()
    assert ad.pins["bad"] == 0
    for seq in out.failed:     # what the engine does: Engine._finish(seq, ERROR) → Scheduler.finish(seq)
        sched.finish(seq)
    assert bad.status is FINISHED and bad not in sched.waiting and bad not in sched.running
    postprocess(sched, out)
    out = sched.schedule(now=3.1)        # reported once, not again
    assert out.failed == []
    postprocess(sched, out)
    run_to_completion(sched, [first, ok], now=4.0)
    assert first.status is FINISHED and ok.status is FINISHED
    ad.assert_balanced()


def test_an_adapter_acquired_for_a_request_that_does_not_fit_is_released():
    ad = FakeAdapters(resident=["a"])
    sched = make_scheduler(num_blocks=4, block_size=4, adapters=ad, max_num_seqs=4, max_num_batched_tokens=64)
    runner = make_seq("runner", 2, arrival=0.0, max_tokens=3)
    sched.add(runner)
    step(sched, now=1.0)
    big = make_seq("big", 12, arrival=1.5, adapter="a", max_tokens=1)
    sched.add(big)
    # 3 blocks free, big needs 3: it would fit, but not with the watermark kept free for running decodes
    assert sched.blocks.num_free == 3 == sched.blocks.blocks_for(big.num_tokens) and sched.watermark == 1
    for i in range(2):
        out = step(sched, now=2.0 + i)
        assert chunk_ids(out) == ["runner"]
        assert ad.pins["a"] == 0 and ad.acquired["a"] == ad.released["a"] == i + 1
        assert big.adapter_slots == () and big.status is WAITING
    run_to_completion(sched, [runner, big], now=5.0)
    assert big.status is FINISHED
    ad.assert_balanced()


def test_an_idle_engine_admits_a_request_that_needs_every_block():
    sched = make_scheduler(num_blocks=4, block_size=4)
    big = make_seq("big", 16, arrival=0.0, max_tokens=1)
    sched.add(big)
    out = sched.schedule(now=1.0)
    assert chunk_ids(out) == ["big"] and sched.blocks.num_free == 0
    postprocess(sched, out)
    assert big.status is FINISHED and sched.blocks.num_free == 4


def test_every_acquire_is_released_once_on_finish_and_on_preemption():
    ad = FakeAdapters(resident=["a", "b"])
    sched = make_scheduler(num_blocks=3, block_size=4, adapters=ad, max_num_seqs=3, max_num_batched_tokens=32)
    x = make_seq("x", 4, arrival=0.0, adapter="a", max_tokens=5)
    y = make_seq("y", 3, arrival=1.0, adapter="b", max_tokens=3)
    sched.add(x)
    sched.add(y)
    preempted = []
    run_to_completion(sched, [x, y], now=2.0, on_step=lambda out: preempted.extend(out.preempted))
    assert ids(preempted) == ["y"], "the scenario must preempt y once"
    assert ad.acquired["a"] == 1
    # y acquires once to run, again on each admission attempt (released when it did not fit), and to re-run
    assert ad.acquired["b"] >= 2
    ad.assert_balanced()


# ---- latency ↔ throughput --------------------------------------------------------------------------------
def _one_running(**settings) -> Scheduler:
    sched = make_scheduler(num_blocks=100, block_size=4, **settings)
    a = make_seq("a", 4, arrival=0.0, max_tokens=1000)
    sched.add(a)
    step(sched, now=0.0)
    assert sched.running == [a]
    return sched


def test_with_a_batch_wait_a_lone_new_request_waits_that_long():
    sched = _one_running(max_num_seqs=4, max_num_batched_tokens=64, max_batch_wait_ms=50)
    b = make_seq("b", 4, arrival=1.0)
    sched.add(b)
    for now in (1.0, 1.02, 1.0499):
        out = step(sched, now=now)
        assert chunk_ids(out) == ["a"], f"admitted after {now - 1.0:.4f}s < 50 ms"
    out = step(sched, now=1.05)
    assert chunk_ids(out) == ["a", "b"]


def test_with_a_batch_wait_enough_requests_to_fill_the_seats_go_at_once():
    sched = _one_running(max_num_seqs=3, max_num_batched_tokens=64, max_batch_wait_ms=50)
    b = make_seq("b", 4, arrival=1.0)
    sched.add(b)
    assert chunk_ids(step(sched, now=1.001)) == ["a"]
    c = make_seq("c", 4, arrival=1.002)
    sched.add(c)
    out = step(sched, now=1.003)     # two seats, two waiting: full
    assert chunk_ids(out) == ["a", "b", "c"]


def test_with_a_batch_wait_enough_tokens_to_fill_the_budget_go_at_once():
    sched = _one_running(max_num_seqs=8, max_num_batched_tokens=16, max_batch_wait_ms=50)
    b = make_seq("b", 8, arrival=1.0)
    sched.add(b)
    assert chunk_ids(step(sched, now=1.001)) == ["a"]      # 8 < 15 tokens of budget left
    c = make_seq("c", 8, arrival=1.002)
    sched.add(c)
    out = step(sched, now=1.003)                             # 16 >= 15: the step is full
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 8), ("c", 7)]


def test_without_a_batch_wait_a_new_request_is_admitted_at_once():
    sched = _one_running(max_num_seqs=4, max_num_batched_tokens=64, max_batch_wait_ms=0)
    b = make_seq("b", 4, arrival=1.0)
    sched.add(b)
    assert chunk_ids(step(sched, now=1.0)) == ["a", "b"]


def test_with_a_batch_wait_an_idle_engine_admits_at_once():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_batch_wait_ms=50)
    b = make_seq("b", 4, arrival=1.0)
    sched.add(b)
    assert chunk_ids(step(sched, now=1.0)) == ["b"]


# ---- FCFS for memory ---------------------------------------------------------------------------------------
def test_a_large_oldest_request_is_not_overtaken_by_smaller_ones():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    runner = make_seq("runner", 16, arrival=0.0, max_tokens=3)   # 4 blocks, then a 5th
    sched.add(runner)
    step(sched, now=1.0)
    big = make_seq("big", 16, arrival=1.0, max_tokens=2)      # 4 blocks: 4 free, 1 is the watermark
    small = make_seq("small", 2, arrival=2.0, max_tokens=2)   # 1 block would fit
    sched.add(big)
    sched.add(small)
    out = step(sched, now=3.0)
    assert chunk_ids(out) == ["runner"]
    assert sched.blocks.num_free - sched.watermark >= 1   # small would have fit
    assert ids(sched.waiting) == ["big", "small"]
    out = step(sched, now=4.0)   # runner finishes
    assert runner.status is FINISHED
    out = step(sched, now=5.0)
    assert chunk_ids(out) == ["big", "small"]
    run_to_completion(sched, [big, small], now=6.0)


# ---- randomized: invariants after every step -----------------------------------------------------------------
ADAPTER_NAMES = [None, "a", "b", "c", "d"]
# requests that combine adapters (each member pinned); drawn only where the fake's slots can hold all members
COMPOSITIONS = [{"a": 0.5, "b": -1.0}, {"c": 2.0}, {"b": 1.0, "c": 0.3, "d": 1.0}]


def _check_step(sched: Scheduler, ad: FakeAdapters, out: SchedulerOutput, before: dict, seqs: list[Sequence]) -> None:
    cfg, bm = sched.config, sched.blocks
    assert out.num_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    chunk_seqs = [c.seq for c in out.chunks]
    assert len(set(map(id, chunk_seqs))) == len(chunk_seqs), "a sequence scheduled twice"
    was_running = {id(s) for s, (status, *_) in before.items() if status is RUNNING}
    # decodes of sequences that were running come first, and none is left out
    kinds = []
    for c in out.chunks:
        assert c.seq.status is RUNNING and c.seq in sched.running
        assert c.num_tokens >= 1
        assert c.seq.num_cached + c.num_tokens <= c.seq.num_tokens
        assert c.needs_logits == (c.seq.num_cached + c.num_tokens == c.seq.num_tokens)
        assert len(c.seq.block_table) == bm.blocks_for(c.seq.num_cached + c.num_tokens)
        if id(c.seq) in was_running:
            kinds.append("decode" if before[c.seq][2] == 1 else "prefill")
        else:
            assert c.seq.num_cached == 0, "an admitted sequence starts from its first token"
    assert kinds == sorted(kinds), f"a decode after a prefill chunk: {kinds}"
    scheduled = {id(s) for s in chunk_seqs}
    preempted = {id(s) for s in out.preempted}
    for s, (status, _, uncached) in before.items():
        if status is RUNNING and uncached == 1 and s.status is RUNNING:
            assert id(s) in scheduled or id(s) in preempted, f"decode of {s} left out"
    # preemption: no admissions that step; victims are the newest running sequences
    if out.preempted:
        assert all(id(s) in was_running for s in chunk_seqs), "admitted in a step that preempted"
    for v in out.preempted:
        assert v.status is WAITING and v in sched.waiting and v.block_table == [] and v.num_cached == 0
        assert v.adapter_slots == ()
        for s in sched.running:
            assert s.times.arrival <= v.times.arrival, f"{v} preempted while newer {s} kept running"
    # running sequences not scheduled hold exactly their cached tokens' blocks
    for s in sched.running:
        if id(s) not in scheduled:
            assert len(s.block_table) == bm.blocks_for(s.num_cached)
    # waiting: arrival order, nothing held
    arrivals = [s.times.arrival for s in sched.waiting]
    assert arrivals == sorted(arrivals), "waiting is not in arrival order"
    for s in sched.waiting:
        assert s.status is WAITING and s.num_cached == 0 and s.block_table == [] and s.adapter_slots == ()
    # pins: exactly one per running request and adapter it uses (every member of a composition), on its slot
    using = Counter(name for s in sched.running for name in s.adapter_names)
    assert +ad.pins == using, f"pins {dict(+ad.pins)} != running uses {dict(using)}"
    for s in sched.running:
        assert s.adapter_slots == tuple(ad.slot_of[name] for name in s.adapter_names)
    if ad.num_slots is not None:
        assert len(using) <= ad.num_slots
    # tokens are never lost
    for s, (_, tokens, _) in before.items():
        assert s.token_ids[:len(tokens)] == tokens
    check_blocks(sched, seqs)


def _random_run(seed: int) -> Counter:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(3, 24)
    max_num_seqs = rng.randint(1, 6)
    budget = rng.randint(max_num_seqs, 40)
    ad = FakeAdapters(num_slots=rng.randint(1, 3), load_steps=rng.randint(0, 4))
    sched = make_scheduler(num_blocks, block_size, ad, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                           max_batch_wait_ms=rng.choice([0, 0, 3]), max_queue_skip_ms=rng.choice([0, 5, 1000]),
                           max_gpu_adapters=3, admission_lookahead=rng.choice([0, 0, 2, 8]))
    capacity = num_blocks * block_size
    n_requests = rng.randint(5, 30)
    seqs: list[Sequence] = []
    stats = Counter()
    aborted: set[int] = set()
    dt = 0.001
    for i in range(3000):
        now = i * dt
        ad.tick()
        while len(seqs) < n_requests and rng.random() < 0.4:
            prompt = rng.randint(1, min(capacity - 1, 40))
            max_tokens = rng.randint(1, min(capacity - prompt, 12))   # the engine's max_model_len ≤ capacity
            adapter = rng.choice(ADAPTER_NAMES + [c for c in COMPOSITIONS if len(c) <= ad.num_slots])
            seq = make_seq(f"r{len(seqs)}", prompt, arrival=now + len(seqs) * 1e-7, adapter=adapter,
                           max_tokens=max_tokens)
            seqs.append(seq)
            sched.add(seq)
        if rng.random() < 0.03:   # an abort, of a running or a waiting request
            live = [s for s in seqs if s.status is not FINISHED]
            if live:
                victim = rng.choice(live)
                stats["aborted_" + victim.status.value] += 1
                aborted.add(id(victim))
                sched.finish(victim)
        if len(seqs) == n_requests and not sched.has_work():
            break
        before = {s: (s.status, list(s.token_ids), s.num_uncached) for s in seqs if s.status is not FINISHED}
        out = sched.schedule(now=now)
        _check_step(sched, ad, out, before, seqs)
        assert not out.failed
        stats["preemptions"] += len(out.preempted)
        stats["composed_admitted"] += sum(len(c.seq.adapter_names) > 1 and c.start == 0 for c in out.chunks)
        stats["chunked"] += sum(1 for c in out.chunks if not c.needs_logits)
        stats["skipped"] += sum(1 for s in sched.waiting if any(n not in ad.slot_of for n in s.adapter_names))
        postprocess(sched, out, token=rng.randrange(100))
        check_blocks(sched, seqs)
    else:
        raise AssertionError(f"seed {seed}: not done after 3000 steps: running {sched.running}, "
                             f"waiting {sched.waiting}, resident {ad.slot_of}, loading {ad.loading}")
    assert all(s.status is FINISHED for s in seqs)
    for s in seqs:
        if id(s) not in aborted:
            assert s.num_output_tokens == s.params.max_tokens, f"seed {seed}: {s} ended early"
    assert sched.blocks.num_free == num_blocks, f"seed {seed}: blocks leaked"
    assert not sched.running and not sched.waiting
    ad.assert_balanced()
    return stats


@pytest.mark.parametrize("group", range(8))
def test_random_workloads_keep_every_invariant(group):
    totals = Counter()
    for seed in range(group * 40, group * 40 + 40):
        try:
            totals += _random_run(seed)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e
    # the workloads must actually exercise what the invariants guard
    assert totals["preemptions"] > 0 and totals["chunked"] > 0 and totals["skipped"] > 0, totals
    assert totals["composed_admitted"] > 0, totals
    assert totals["aborted_running"] + totals["aborted_waiting"] > 0, totals


class LruAdapters(FakeAdapters):
    """FakeAdapters whose eviction takes the least recently used adapter, a wish for a resident one
    counting as a use (as the real cache's LRU does)."""

    def want(self, names: list[str], num_gpu: int) -> None:
        for name in names[:num_gpu]:
            if name in self.slot_of:
                self.slot_of[name] = self.slot_of.pop(name)   # most recently used
        super().want(names, num_gpu)


def test_many_distinct_adapters_load_each_adapter_once():
    # every request its own adapter, more requests than slots: the loads for later requests must not
    # evict the adapters of earlier ones before those are admitted (they would, in turn, forever)
    ad = LruAdapters(num_slots=4, load_steps=1)
    sched = make_scheduler(adapters=ad, max_num_seqs=2, max_num_batched_tokens=64, max_gpu_adapters=4,
                           max_cpu_adapters=3, max_queue_skip_ms=1e9)
    seqs = [make_seq(f"r{i}", 3, arrival=i * 1e-3, adapter=f"a{i}", max_tokens=3) for i in range(12)]
    for s in seqs:
        sched.add(s)

    def on_step(out) -> None:
        pinned = {n for s in sched.running for n in s.adapter_names}
        assert len(ad.wanted) <= 4 - len(pinned), "wanted more adapters than the free slots"
        waiting = list(dict.fromkeys(n for s in sched.waiting for n in s.adapter_names if n not in pinned))
        assert ad.wanted + ad.read_ahead == waiting[:len(ad.wanted) + len(ad.read_ahead)], "not in queue order"
        assert len(ad.read_ahead) <= 3
        ad.tick()
    outs = run_to_completion(sched, seqs, max_steps=200, on_step=on_step)
    assert all(s.status is FINISHED for s in seqs)
    assert ad.loads == Counter({f"a{i}": 1 for i in range(12)}), f"adapters loaded more than once: {ad.loads}"
    assert len(outs) < 60, f"{len(outs)} steps for 12 requests of 3 tokens, 2 at a time"
    ad.assert_balanced()


def test_a_wish_withdrawn_stops_its_load():
    # the queue's head goes (aborted) before its adapter lands: its load stops, the next request's starts
    ad = FakeAdapters(num_slots=1, load_steps=3)
    sched = make_scheduler(adapters=ad, max_num_seqs=1, max_num_batched_tokens=64, max_gpu_adapters=1,
                           max_queue_skip_ms=1e9)
    first, second = (make_seq(f"r{i}", 3, arrival=i * 1e-3, adapter=f"a{i}") for i in range(2))
    sched.add(first)
    sched.add(second)
    step(sched, now=1.0)
    assert ad.wanted == ["a0"] and set(ad.loading) == {"a0"}
    sched.finish(first)
    step(sched, now=1.1)
    assert ad.wanted == ["a1"] and set(ad.loading) == {"a1"}


def test_waiting_on_adapters_says_whether_a_request_that_fits_waits_for_its_load():
    """What adapters/priority.py's adaptive mode reads: True only while a request that the batch has
    room for is held back by its adapter's load."""
    ad = FakeAdapters(resident=["hot"])
    sched = make_scheduler(adapters=ad, max_num_seqs=2, max_num_batched_tokens=64, max_queue_skip_ms=1e9)
    sched.add(make_seq("a", 3, arrival=0.0, adapter="hot", max_tokens=8))
    sched.add(make_seq("b", 3, arrival=1e-3, adapter="cold", max_tokens=8))
    postprocess(sched, sched.schedule())
    assert [s.request_id for s in sched.running] == ["a"] and sched.waiting_on_adapters
    ad.make_resident("cold")
    postprocess(sched, sched.schedule())
    assert len(sched.running) == 2 and not sched.waiting_on_adapters
    # a full batch: a cold adapter behind it is not what holds anyone back
    sched.add(make_seq("c", 3, arrival=2e-3, adapter="colder", max_tokens=8))
    postprocess(sched, sched.schedule())
    assert len(sched.running) == 2 and not sched.waiting_on_adapters


def test_waiting_on_adapters_is_false_when_the_kv_memory_has_no_room_for_the_request():
    # 8 blocks of 4 tokens, watermark 1: "a" holds 5 blocks (20 tokens), so "b" (12 tokens: 3 blocks)
    # would not fit beside it; its cold adapter is then not what holds the batch back
    ad = FakeAdapters(resident=["hot"])
    sched = make_scheduler(num_blocks=8, adapters=ad, max_num_seqs=4, max_num_batched_tokens=64,
                           max_queue_skip_ms=1e9)
    sched.add(make_seq("a", 20, arrival=0.0, adapter="hot", max_tokens=8))
    sched.add(make_seq("b", 12, arrival=1e-3, adapter="cold", max_tokens=8))
    postprocess(sched, sched.schedule())
    assert [s.request_id for s in sched.running] == ["a"] and not sched.waiting_on_adapters
    sched.add(make_seq("c", 4, arrival=2e-3, adapter="colder", max_tokens=8))   # 1 block: fits
    postprocess(sched, sched.schedule())
    assert [s.request_id for s in sched.running] == ["a"] and sched.waiting_on_adapters


@pytest.mark.parametrize("lookahead, admitted", [(0, ["a", "b", "c"]), (8, ["a", "b"])])
def test_admission_lookahead_keeps_room_for_the_running_sequences_to_grow(lookahead, admitted):
    """12 blocks of 4 tokens (1 kept back): with a lookahead of 8 tokens, a (8 tokens) and b (16) each
    reserve 2 blocks of growth, so c (8 tokens, 2 blocks) does not fit beside them (2 + 4 > 12 - 6 - 1);
    admitted by its tokens now, it does. `fits` (which `would_admit` asks) says the same."""
    sched = make_scheduler(num_blocks=12, block_size=4, admission_lookahead=64)
    assert sched.watermark == 1
    for rid, prompt in (("a", 8), ("b", 16), ("c", 8)):
        sched.add(make_seq(rid, prompt, arrival=len(rid) + ord(rid), max_tokens=40))
    sched.lookahead = lookahead + Scheduler.LOOKAHEAD_DECAY   # as preemptions had raised it (less the step's decay)
    out = sched.schedule(now=1000.0)
    assert ids(sched.running) == admitted == chunk_ids(out)
    if lookahead:
        c = sched.waiting[0]
        assert sched.lookahead == lookahead and not sched.fits(c)
        sched.lookahead = 0.0
        assert sched.fits(c) and not sched.fits(c, extra_blocks=4)   # 2 > 6 - 4 - 1 beside a continuation


def test_the_lookahead_rises_with_each_preemption_and_decays_without():
    sched = make_scheduler(num_blocks=64, block_size=4, admission_lookahead=300)
    assert sched.lookahead == 0
    sched.note_step(2)
    assert sched.lookahead == 2 * Scheduler.LOOKAHEAD_UP
    sched.note_step(1)
    assert sched.lookahead == 300                      # at most admission_lookahead
    for _ in range(10):
        sched.note_step(0)
    assert sched.lookahead == 300 - 10 * Scheduler.LOOKAHEAD_DECAY
    for _ in range(1000):
        sched.note_step(0)
    assert sched.lookahead == 0
    off = make_scheduler(admission_lookahead=0)
    off.note_step(5)
    assert off.lookahead == 0


def test_a_preemption_raises_the_lookahead_in_a_real_schedule():
    """Two growing sequences in 6 blocks of 4 tokens: the newer is preempted, and the lookahead rises."""
    sched = make_scheduler(num_blocks=6, block_size=4, admission_lookahead=256)
    for i, rid in enumerate("ab"):
        sched.add(make_seq(rid, 8, arrival=float(i), max_tokens=20))
    for t in range(40):
        out = step(sched, now=float(t))
        if out.preempted:
            assert ids(out.preempted) == ["b"] and sched.lookahead == Scheduler.LOOKAHEAD_UP
            return
    raise AssertionError("nothing was preempted")


def test_growth_is_capped_by_max_tokens():
    sched = make_scheduler(num_blocks=64, block_size=4, admission_lookahead=8)
    sched.lookahead = 8.0
    seq = make_seq("a", 8, arrival=0.0, max_tokens=40)
    assert sched._growth(seq) == 2                     # 8 → 16 tokens: 2 → 4 blocks
    seq = make_seq("b", 8, arrival=0.0, max_tokens=3)
    assert sched._growth(seq) == 1                     # 8 → 11 tokens: 2 → 3 blocks
    seq.token_ids += [5, 5, 5]                         # its 3 outputs are out: no more growth
    assert sched._growth(seq) == 0
    sched.lookahead = 0.0
    assert sched._growth(make_seq("c", 8, 0.0, max_tokens=40)) == 0


def test_the_first_request_is_admitted_whatever_the_lookahead():
    """Nothing runs: a request whose tokens fit is admitted even if its growth would not (it cannot
    preempt anyone)."""
    sched = make_scheduler(num_blocks=3, block_size=4, admission_lookahead=64)
    sched.add(make_seq("a", 12, arrival=0.0, max_tokens=100))
    sched.lookahead = 64.0
    sched.schedule(now=1.0)
    assert ids(sched.running) == ["a"]


def test_an_idle_scheduler_forgets_its_lookahead():
    sched = make_scheduler(num_blocks=64, block_size=4, admission_lookahead=256)
    sched.note_step(1)
    assert sched.lookahead == Scheduler.LOOKAHEAD_UP
    sched.add(make_seq("a", 4, arrival=0.0))
    assert sched.lookahead == 0
