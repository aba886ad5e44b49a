"""`AsyncEngine` over a real tiny model on the CPU: streaming, concurrency with several adapters
(greedy results equal to running each request alone), aborts by leaving the stream, by
cancelling, or by `abort()`, refusals, failed adapter loads, worker death and shutdown."""
from __future__ import annotations

import asyncio
import shutil
import threading
import time

import pytest
from adapter_fixtures import make_adapter
from model_fixtures import make_hf_model

from loraplex import LLM, SamplingParams
from loraplex.adapters import AdapterError
from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncEngine, EngineDeadError

SETTINGS = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 32, "max_num_seqs": 8, "max_num_batched_tokens": 64}
PROMPT = [3, 17, 42, 99, 5, 64, 120, 7]
PROMPT2 = [11, 12, 13, 90, 91, 2]


def greedy(max_tokens: int) -> SamplingParams:
    # (the tiny random models emit their eos token now and then: runs have a known length)
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_engine")
    base = make_hf_model(root / "base", "llama-gqa-llama3rope")
    adapters = {
        "a": make_adapter(base, root / "a", seed=1),
        "b": make_adapter(base, root / "b", seed=2, r=4, lora_alpha=8,
                          target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]),
    }
    return base, adapters


@pytest.fixture(scope="module")
def reference(files):
    """Greedy output token ids of one request run alone through the synchronous `LLM`."""
    base, adapters = files
    llm = LLM(str(base), adapters=adapters, **SETTINGS)
    cache: dict = {}

    def run(prompt, adapter, max_tokens):
        key = (tuple(prompt), adapter, max_tokens)
        if key not in cache:
            [out] = llm.generate([list(prompt)], greedy(max_tokens), adapter=adapter, use_tqdm=False)
            assert out.finish_reason == "length"
            cache[key] = out.token_ids
        return cache[key]

    yield run
    llm.engine.close()


@pytest.fixture
def make_engine(files):
    """Build AsyncEngines over the tiny model; every one is shut down when the test ends."""
    base, adapters = files
    engines: list[AsyncEngine] = []

    def make(adapter_dirs=None, **overrides) -> AsyncEngine:
        config = EngineConfig(model=str(base), **{**SETTINGS, **overrides})
        engine = AsyncEngine(config, adapters=adapters if adapter_dirs is None else adapter_dirs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


async def collect(agen) -> list:
    return [out async for out in agen]


async def wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.005)
    return cond()


def all_released(engine: AsyncEngine, *names: str) -> bool:
    inner = engine.engine
    return (inner.blocks.num_free == inner.blocks.num_blocks and not inner.has_unfinished()
            and all(inner.adapters.pins(n) == 0 for n in names))


def check_stream(outs, max_tokens: int | None = None, reason: str = "length") -> list[int]:
    """The outputs of one request: token by token, only the last finished; returns its token ids."""
    assert outs, "no output"
    concat = [t for o in outs for t in o.new_token_ids]
    assert outs[-1].token_ids == concat
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == reason
    assert all(o.finish_reason is None for o in outs[:-1])
    if max_tokens is not None:
        assert len(concat) == max_tokens
    return concat


def hold_worker(engine: AsyncEngine):
    """Park the worker inside a `run_on_engine` call until the returned gate is set; commands
    queued meanwhile are applied, in order, once it is."""
    inside, gate = threading.Event(), threading.Event()

    def hold(_):
        inside.set()
        gate.wait(20)

    thread = threading.Thread(target=engine.run_on_engine, args=(hold,), daemon=True)
    thread.start()
    assert inside.wait(10), "the worker did not take the call"
    return gate, thread


# ---- streaming -------------------------------------------------------------------------------------
def test_outputs_stream_token_by_token(make_engine, reference):
    engine = make_engine()
    outs = asyncio.run(collect(engine.generate(PROMPT, greedy(8), adapter="a")))
    assert [len(o.new_token_ids) for o in outs] == [1] * 8, "one output per token"
    for i, o in enumerate(outs):
        assert len(o.token_ids) == i + 1 and o.prompt_token_ids == PROMPT and o.adapter == "a"
    tokens = check_stream(outs, 8)
    assert tokens == reference(PROMPT, "a", 8)
    assert outs[-1].metrics.first_token_time is not None and outs[-1].metrics.finished_time is not None


# ---- concurrency -----------------------------------------------------------------------------------
CASES = [  # (prompt, adapter, max_tokens); prompts of 12-15 tokens cross a 16-token block while decoding
    ([(5 * i + 1) % 128 for i in range(14)], "a", 8),
    ([(7 * i + 2) % 128 for i in range(15)], "b", 8),
    ([(3 * i + 9) % 128 for i in range(13)], None, 8),
    (PROMPT, "a", 6),
    (PROMPT, "b", 6),
    (PROMPT, None, 6),
    ([(11 * i + 4) % 128 for i in range(12)], "b", 7),
    ([1, 2, 3], "a", 9),
    ([(13 * i + 6) % 128 for i in range(15)], None, 5),
]


@pytest.mark.parametrize("num_kv_blocks", [32, 5], ids=["roomy", "preempting"])
def test_concurrent_requests_with_different_adapters_match_running_alone(make_engine, reference, num_kv_blocks):
    engine = make_engine(num_kv_blocks=num_kv_blocks, admission_lookahead=0)   # admitted by their tokens now

    def load(eng):   # both adapters resident first: where a load finished late (a busy CI machine), the requests
        for name in ("a", "b"):   # without one ran alone meanwhile, fitted the small cache and nothing was preempted
            eng.adapters.prefetch(name)
        assert all(eng.adapters.wait_resident(name, timeout=30) for name in ("a", "b"))
    engine.run_on_engine(load)
    gate, holder = hold_worker(engine)   # every request is queued before the first step

    async def main():
        tasks = [asyncio.create_task(collect(engine.generate(p, greedy(n), adapter=a))) for p, a, n in CASES]
        deadline = time.monotonic() + 10   # every submission queued (on a busy machine this takes a while)
        while engine._commands.qsize() < len(CASES) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        gate.set()
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
    finally:
        gate.set()
        holder.join()
    for (prompt, adapter, n), outs in zip(CASES, results):
        tokens = check_stream(outs, n)
        assert tokens == reference(prompt, adapter, n), f"adapter {adapter!r}, prompt of {len(prompt)}"
    # the adapters change the outputs, so a mixed-up slot would show
    same_prompt = {a: reference(PROMPT, a, 6) for a in ("a", "b", None)}
    assert len({tuple(t) for t in same_prompt.values()}) == 3
    stats = engine.engine.stats
    assert stats["steps"] < stats["tokens_generated"], "the requests were never batched together"
    if num_kv_blocks == 5:
        assert engine.engine.scheduler.num_preemptions > 0, "the small KV cache should have preempted"
    assert all_released(engine, "a", "b")


# ---- aborts ----------------------------------------------------------------------------------------
def test_leaving_the_stream_early_aborts_the_request(make_engine):
    engine = make_engine()

    async def main():
        got = []
        async for out in engine.generate(PROMPT, greedy(200), adapter="a"):
            got.append(out)
            if len(got) == 2:
                break
        return got, await wait_until(lambda: all_released(engine, "a"), timeout=3.0)

    got, released = asyncio.run(main())
    assert released, (f"after leaving the stream: {engine.engine.blocks.num_free}/{engine.engine.blocks.num_blocks} "
                      f"blocks free, pins {engine.engine.adapters.pins('a')}")
    assert len(got) == 2 and not got[-1].finished
    assert engine.engine.stats["tokens_generated"] < 200, "it ran to the end instead of being aborted"
    assert engine.is_running


def test_cancelling_the_consumer_aborts_the_request(make_engine):
    engine = make_engine()

    async def main():
        first = asyncio.Event()

        async def consume():
            async for _ in engine.generate(PROMPT2, greedy(200), adapter="b"):
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), timeout=10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await wait_until(lambda: all_released(engine, "b"), timeout=3.0)

    assert asyncio.run(main())
    assert engine.engine.stats["tokens_generated"] < 200


def test_abort_delivers_a_final_output(make_engine, reference):
    engine = make_engine()

    async def main():
        rid = await engine.submit(PROMPT, greedy(200), adapter="a", request_id="victim")
        assert rid == "victim"
        outs = []
        async for out in engine.stream(rid):
            outs.append(out)
            if len(outs) == 2:
                engine.abort(rid)
        # freed by the time the final output arrives
        state = (engine.engine.blocks.num_free, engine.engine.adapters.pins("a"), engine.engine.has_unfinished())
        engine.abort("no-such-request")   # harmless
        after = await collect(engine.generate(PROMPT, greedy(4), adapter="a"))
        return outs, state, after

    outs, state, after = asyncio.run(main())
    tokens = check_stream(outs, reason="abort")
    assert 2 <= len(tokens) < 200
    assert tokens == reference(PROMPT, "a", 200)[:len(tokens)]
    assert state == (engine.engine.blocks.num_blocks, 0, False)
    assert check_stream(after, 4) == reference(PROMPT, "a", 4)


# ---- refusals ----------------------------------------------------------------------------------------
def test_refused_requests_raise_from_submit_and_leave_others_alone(make_engine, reference):
    engine = make_engine()

    async def main():
        await engine.submit(PROMPT2, greedy(10), adapter="b", request_id="good")
        good = asyncio.create_task(collect(engine.stream("good")))
        with pytest.raises(AdapterError, match="unknown adapter"):
            await engine.submit(PROMPT, greedy(4), adapter="nope", request_id="x")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.submit([1, 2, 128], greedy(4), request_id="y")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.submit([-1, 2], greedy(4))
        with pytest.raises(ValueError, match="empty"):
            await engine.submit([], greedy(4))
        with pytest.raises(ValueError, match="stop_token_ids"):
            await engine.submit(PROMPT, SamplingParams(max_tokens=4, stop_token_ids=[500]))
        # a refused request leaves nothing behind: its id can be used again
        again = await collect(engine.generate(PROMPT, greedy(3), request_id="x"))
        return await good, again

    good, again = asyncio.run(main())
    assert check_stream(good, 10) == reference(PROMPT2, "b", 10)
    assert check_stream(again, 3) == reference(PROMPT, None, 3)
    assert engine.is_running and all_released(engine, "a", "b")


def test_a_duplicate_request_id_is_refused(make_engine, reference):
    engine = make_engine()

    async def main():
        await engine.submit(PROMPT, greedy(10), adapter="a", request_id="same")
        with pytest.raises(ValueError, match="already running"):
            await engine.submit(PROMPT2, greedy(3), request_id="same")
        first = await collect(engine.stream("same"))
        # finished and read to the end: the id is free again
        second = await collect(engine.generate(PROMPT2, greedy(3), request_id="same"))
        return first, second

    first, second = asyncio.run(main())
    assert check_stream(first, 10) == reference(PROMPT, "a", 10)
    assert check_stream(second, 3) == reference(PROMPT2, None, 3)


def test_an_adapter_that_fails_to_load_fails_only_its_request(make_engine, files, reference, tmp_path):
    _, adapters = files
    broken = shutil.copytree(adapters["a"], tmp_path / "broken")
    engine = make_engine({"a": adapters["a"], "broken": broken})
    for f in broken.glob("adapter_model.*"):   # registered (headers checked), then its weights vanish
        f.unlink()

    async def main():
        good = asyncio.create_task(collect(engine.generate(PROMPT, greedy(12), adapter="a")))
        bad = await collect(engine.generate(PROMPT2, greedy(12), adapter="broken"))
        with pytest.raises(AdapterError, match="failed to load"):
            await engine.submit(PROMPT2, greedy(2), adapter="broken")
        return await good, bad

    good, bad = asyncio.run(main())
    assert [o.finished for o in bad] == [True] and bad[0].finish_reason == "error"
    assert bad[0].error and bad[0].token_ids == []
    assert check_stream(good, 12) == reference(PROMPT, "a", 12)
    assert engine.is_running and all_released(engine, "a")


# ---- regressions: bugs found in review, fixed ----------------------------------------------------
def test_cancelling_a_submit_aborts_its_request(make_engine):
    engine = make_engine()
    gate, holder = hold_worker(engine)

    async def main():
        task = asyncio.create_task(engine.submit(PROMPT, greedy(200), adapter="a", request_id="gone"))
        await asyncio.sleep(0.01)          # its "add" is queued behind the held call
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await asyncio.to_thread(engine.run_on_engine, lambda e: None)   # the "add" has been applied
        return await wait_until(lambda: all_released(engine, "a"), timeout=5)

    try:
        released = asyncio.run(main())
    finally:
        gate.set()
        holder.join()
    assert released and engine.engine.stats["tokens_generated"] < 200, \
        f"the cancelled request ran on: {engine.engine.stats['tokens_generated']} tokens"


def test_a_submit_from_a_closed_event_loop_does_not_kill_the_worker(make_engine, reference):
    engine = make_engine()
    gate, holder = hold_worker(engine)

    async def orphan():
        task = asyncio.create_task(engine.submit(PROMPT, greedy(3), request_id="orphan"))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(orphan())   # its loop is closed before the worker reads the "add"
    finally:
        gate.set()
        holder.join()
    engine.run_on_engine(lambda e: None, timeout=3)   # the worker has read the "add"
    assert engine.is_running, f"the worker died: {engine.error!r}"
    outs = asyncio.run(asyncio.wait_for(collect(engine.generate(PROMPT2, greedy(4))), timeout=10))
    assert check_stream(outs, 4) == reference(PROMPT2, None, 4)


def test_a_submit_in_flight_when_the_worker_dies_raises(make_engine):
    engine = make_engine()
    entered, gate = threading.Event(), threading.Event()

    def dying_step():
        entered.set()
        gate.wait(10)
        raise RuntimeError("device lost")

    async def main():
        await engine.submit(PROMPT, greedy(200), request_id="running")
        await asyncio.to_thread(engine.run_on_engine, lambda e: setattr(e, "step", dying_step))
        assert await asyncio.to_thread(entered.wait, 10)
        late = asyncio.create_task(engine.submit(PROMPT2, greedy(2), request_id="late"))
        await asyncio.sleep(0.01)          # queued while the step runs
        gate.set()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(late, timeout=2)

    try:
        asyncio.run(main())
    finally:
        gate.set()


def test_a_generated_request_id_never_collides_with_a_chosen_one(make_engine):
    engine = make_engine()

    async def main():
        await engine.submit(PROMPT, greedy(30), request_id="req-0")
        try:
            rid = await engine.submit(PROMPT2, greedy(2))   # the caller named no id: nothing to collide with
        finally:
            engine.abort("req-0")
            await collect(engine.stream("req-0"))
        outs = await collect(engine.stream(rid))
        return rid, outs

    rid, outs = asyncio.run(main())
    assert rid != "req-0" and check_stream(outs, 2)


# ---- worker failure and shutdown ----------------------------------------------------------------------
def test_a_dead_worker_fails_open_streams_and_refuses_new_requests(make_engine):
    engine = make_engine()

    def broken_step():
        raise RuntimeError("device lost")

    async def main():
        first = asyncio.Event()

        async def consume():
            async for _ in engine.generate(PROMPT, greedy(200)):
                if not first.is_set():
                    first.set()
                    engine.run_on_engine(lambda e: setattr(e, "step", broken_step))

        with pytest.raises(EngineDeadError, match="device lost"):
            await asyncio.wait_for(consume(), timeout=10)
        with pytest.raises(EngineDeadError):
            await engine.submit(PROMPT, greedy(2))

    asyncio.run(main())
    assert not engine.is_running and isinstance(engine.error, RuntimeError)


def test_shutdown_joins_the_worker_thread(make_engine):
    engine = make_engine()
    thread = engine._thread
    assert thread.is_alive() and engine.is_running

    async def main():
        rid = await engine.submit(PROMPT, greedy(200), adapter="a")
        stream = engine.stream(rid)
        await stream.__anext__()       # running when shut down
        start = time.monotonic()
        engine.shutdown()
        elapsed = time.monotonic() - start
        await stream.aclose()
        return elapsed

    elapsed = asyncio.run(main())
    assert not thread.is_alive()
    assert elapsed < 10
    assert not engine.is_running
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(engine.submit(PROMPT, greedy(2)))


def test_shutdown_ends_open_streams(make_engine):
    engine = make_engine()

    async def main():
        rid = await engine.submit(PROMPT, greedy(200))
        stream = engine.stream(rid)
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)

        async def rest():
            return [out async for out in stream]

        try:
            outs = await asyncio.wait_for(rest(), timeout=2)
        except EngineDeadError:
            return
        assert outs and outs[-1].finished

    asyncio.run(main())


def test_a_reused_id_never_gets_the_abandoned_requests_outputs(make_engine, reference):
    engine = make_engine()
    other = [9, 10, 11]

    async def main():
        async for _ in engine.generate(PROMPT, greedy(200), request_id="x"):
            break   # abandoned: its abort is queued
        while True:  # the id comes back once the worker has applied the abort
            try:
                return await collect(engine.generate(other, greedy(5), request_id="x"))
            except ValueError:
                await asyncio.sleep(0.002)

    outs = asyncio.run(main())
    assert all(o.prompt_token_ids == other for o in outs)
    assert check_stream(outs, 5) == reference(other, None, 5)
