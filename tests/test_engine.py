"""The engine end to end on the CPU: outputs against transformers + PEFT `generate`, and the same
output for a request whatever else runs with it (other adapters, chunked prefill, preemption)."""
from __future__ import annotations

import time

import pytest
import torch

from engine_fixtures import GenerateOracle, make_served_model, random_prompts
from loraplex import LLM, SamplingParams
from loraplex.adapters import AdapterError
from loraplex.config import EngineConfig

VOCAB = 128
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base, adapters = make_served_model(tmp_path_factory.mktemp("served"))
    return base, adapters, GenerateOracle(base, adapters)


def make_llm(served, **settings) -> LLM:
    base, adapters, _ = served
    defaults = dict(dtype="float32", device="cpu", num_kv_blocks=256, block_size=8, max_num_seqs=16,
                    max_num_batched_tokens=256, max_gpu_adapters=4)
    return LLM(str(base), adapters={k: str(v) for k, v in adapters.items()}, **{**defaults, **settings})


def test_greedy_equals_transformers_peft_generate(served):
    base, adapters, oracle = served
    names = [None, *adapters]
    prompts = random_prompts(8, VOCAB, (3, 40), seed=1)
    which = [names[i % len(names)] for i in range(len(prompts))]
    with make_llm(served) as llm:  # one batch: every adapter and the base model side by side
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), adapter=which)
    for prompt, adapter, out in zip(prompts, which, outs):
        assert out.token_ids == oracle.greedy(prompt, adapter, 12), f"adapter {adapter}, prompt of {len(prompt)}"
        assert out.finish_reason == "length" and out.finished
    # the adapters matter: each changes the base model's output for some prompt
    for name in adapters:
        assert any(oracle.greedy(p, name, 12) != oracle.greedy(p, None, 12) for p in prompts)


@pytest.fixture(scope="module")
def alone(served):
    """Ten requests of various adapters, each run alone in the engine: (prompts, adapters, 16 greedy tokens each)."""
    _, adapters, _ = served
    names = [None, *adapters]
    prompts = random_prompts(10, VOCAB, (5, 60), seed=2)
    which = [names[(3 * i) % len(names)] for i in range(len(prompts))]
    with make_llm(served) as llm:
        tokens = [llm.generate([p], SamplingParams(max_tokens=16, **GREEDY), adapter=a, use_tqdm=False)[0]
                  .token_ids for p, a in zip(prompts, which)]
    return prompts, which, tokens


@pytest.mark.parametrize("setting", ["batched", "chunked", "preempted", "preempted-lookahead", "one-adapter-slot"])
def test_same_output_alone_and_in_any_batch(served, alone, setting):
    _, adapters, _ = served
    prompts, which, alone = alone
    settings = {
        "batched": {},
        "chunked": dict(max_num_batched_tokens=16, max_num_seqs=4),     # prompts spread over many steps
        "preempted": dict(num_kv_blocks=24, max_num_seqs=10,            # 192 tokens of KV for ~10 × 50
                          admission_lookahead=0),                       # admitted by their tokens now
        "preempted-lookahead": dict(num_kv_blocks=24, max_num_seqs=10,  # admission more careful after each
                                    admission_lookahead=256),           # preemption (Scheduler.note_step)
        "one-adapter-slot": dict(max_gpu_adapters=1),                   # adapters take turns in one slot
    }[setting]
    with make_llm(served, **settings) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, **GREEDY), adapter=which)
        engine = llm.engine
        assert engine.blocks.num_free == engine.blocks.num_blocks
        assert all(engine.adapters.pins(n) == 0 for n in adapters)
    assert [o.token_ids for o in outs] == alone
    if setting.startswith("preempted"):
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    if setting == "batched":  # decode steps were queued before the previous step's tokens were known
        assert engine.stats["overlapped_steps"] > 0
    if setting == "chunked":  # every prompt token went through 16-token steps
        assert engine.stats["steps"] >= sum(map(len, prompts)) // 16


def test_burst_larger_than_kv_memory_all_finish(served):
    _, adapters, oracle = served
    names = [None, *adapters]
    prompts = random_prompts(24, VOCAB, (20, 50), seed=3)
    which = [names[i % len(names)] for i in range(len(prompts))]
    # 16 blocks × 8 = 128 tokens of KV for 24 requests of up to 60 tokens each
    with make_llm(served, num_kv_blocks=16, max_num_seqs=8, max_num_batched_tokens=32) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY), adapter=which)
        assert llm.engine.blocks.num_free == 16
    for prompt, adapter, out in zip(prompts, which, outs):
        assert out.token_ids == oracle.greedy(prompt, adapter, 10)


def test_seed_reproduces_whatever_the_batch(served):
    _, adapters, _ = served
    prompt = random_prompts(1, VOCAB, (12, 12), seed=4)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    with make_llm(served) as llm:
        alone = llm.generate([prompt], params, adapter="all-r8", use_tqdm=False)[0].token_ids
        others = random_prompts(5, VOCAB, (3, 30), seed=5)
        mixed = llm.generate(others[:2] + [prompt] + others[2:],
                             [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)] * 2 + [params] +
                             [SamplingParams(max_tokens=12, temperature=0.7, seed=7, ignore_eos=True)] * 3,
                             adapter=[None, "qv-r4", "all-r8", None, "mlp-r2-rslora", "all-r8"])
        other_seed = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99,
                                                           ignore_eos=True), adapter="all-r8")[0].token_ids
    assert mixed[2].token_ids == alone
    assert other_seed != alone


def test_max_tokens_and_stop_token_ids(served):
    _, _, oracle = served
    prompt = random_prompts(1, VOCAB, (10, 10), seed=6)[0]
    full = oracle.greedy(prompt, "qv-r4", 20)
    stop_at = next(i for i in range(3, 20) if full[i] not in full[:i])  # first occurrence of that token
    with make_llm(served) as llm:
        short = llm.generate([prompt], SamplingParams(max_tokens=5, **GREEDY), adapter="qv-r4")[0]
        stopped = llm.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=[full[stop_at]], **GREEDY),
                               adapter="qv-r4")[0]
    assert short.token_ids == full[:5] and short.finish_reason == "length"
    assert stopped.token_ids == full[:stop_at + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == full[stop_at]


def test_eos_stops_unless_ignored(served):
    base, _, oracle = served
    prompt = random_prompts(1, VOCAB, (8, 8), seed=7)[0]
    full = oracle.greedy(prompt, None, 20)
    eos = next(t for t in full[2:] if t not in full[:2])  # declare one of its tokens the model's eos
    with make_llm(served) as llm:
        llm.engine.eos_token_ids = frozenset({eos})
        cut = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0]
        kept = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert cut.token_ids == full[:full.index(eos) + 1] and cut.finish_reason == "stop" and cut.stop_reason is None
    assert kept.token_ids == full


def test_logprobs_match_the_model_distribution(served):
    _, _, oracle = served
    prompt = random_prompts(1, VOCAB, (9, 9), seed=8)[0]
    with make_llm(served) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=4, logprobs=3, **GREEDY), adapter="all-r8")[0]
    tokens = prompt + out.token_ids
    ref = torch.log_softmax(oracle.logits(tokens, "all-r8").double(), dim=-1)
    assert len(out.logprobs) == 4
    for i, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        top = torch.topk(row, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert max(abs(v - r) for (_, v), r in zip(lp.top, top.values.tolist())) < 1e-4


def test_abort_frees_blocks_and_adapter_at_once(served):
    with make_llm(served) as llm:
        engine = llm.engine
        assert engine.adapters.wait_resident("all-r8", timeout=30)
        engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=100, **GREEDY), adapter="all-r8")
        engine.add_request("b", list(range(5, 20)), SamplingParams(max_tokens=8, **GREEDY))
        for _ in range(3):
            engine.step()
        assert engine.blocks.num_free < engine.blocks.num_blocks and engine.adapters.pins("all-r8") == 1
        out = engine.abort("a")
        assert out.finished and out.finish_reason == "abort" and len(out.token_ids) == 3
        assert engine.adapters.pins("all-r8") == 0
        assert engine.blocks.num_free == engine.blocks.num_blocks - 3  # b's 15 + 3 tokens: 3 blocks of 8
        assert engine.abort("a") is None
        while engine.has_unfinished():
            engine.step()
        assert engine.blocks.num_free == engine.blocks.num_blocks


def test_bad_requests_are_refused_at_submission(served):
    with make_llm(served, max_model_len=64) as llm:
        engine = llm.engine
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request("x", [1, 2, VOCAB], SamplingParams())
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add_request("x", [5] * 64, SamplingParams())
        with pytest.raises(ValueError, match="empty"):
            engine.add_request("x", [], SamplingParams())
        with pytest.raises(ValueError, match="no tokenizer"):
            engine.add_request("x", "hello", SamplingParams())
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            engine.add_request("x", [5, 6], SamplingParams(stop="x"))
        with pytest.raises(AdapterError, match="unknown adapter 'nope'"):
            engine.add_request("x", [5, 6], SamplingParams(), adapter="nope")
        with pytest.raises(ValueError, match="stop_token_ids"):
            engine.add_request("x", [5, 6], SamplingParams(stop_token_ids=[VOCAB]))
        with pytest.raises(ValueError, match="token ids"):
            engine.add_request("x", [5, "6"], SamplingParams())
        engine.add_request("x", [5, 6], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="already running"):
            engine.add_request("x", [5, 6], SamplingParams())
        assert not engine.has_unfinished() or engine.num_unfinished == 1
        with pytest.raises(ValueError, match="has 2 entries for 3 prompts"):
            llm.generate([[5], [6], [7]], adapter=[None, None])
        with pytest.raises(ValueError, match="unknown engine setting"):
            make_llm(served, max_num_seq=3)


def test_length_limit_of_the_model_ends_a_request(served):
    with make_llm(served, max_model_len=20) as llm:
        out = llm.generate([[5] * 15], SamplingParams(max_tokens=100, **GREEDY))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_a_failing_adapter_ends_only_its_requests(served, tmp_path):
    import shutil
    base, adapters, oracle = served
    broken = tmp_path / "broken"
    shutil.copytree(adapters["qv-r4"], broken)
    with make_llm(served) as llm:
        llm.engine.add_adapter("broken", broken)
        (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")  # breaks after registration
        prompts = random_prompts(3, VOCAB, (5, 10), seed=9)
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY), adapter=["all-r8", "broken", None])
        assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    assert outs[1].finish_reason == "error" and "broken" in outs[1].error and outs[1].token_ids == []
    assert outs[0].token_ids == oracle.greedy(prompts[0], "all-r8", 6)
    assert outs[2].token_ids == oracle.greedy(prompts[2], None, 6)


@pytest.mark.parametrize("beside", [True, False])
def test_prompts_arriving_mid_run_join_the_step_queued_beside_the_one_in_flight(served, beside, tmp_path):
    """overlap_admissions: a request that arrives while decodes run is admitted into the step queued before
    the step in flight is back (its prompt after the decodes, which take their tokens from that step's
    sample on the device); off, such steps are scheduled after it. Both give transformers + PEFT's tokens,
    and a request whose adapter fails to load when admitted that way ends alone, with an error."""
    import shutil
    _, adapters, oracle = served
    broken = tmp_path / "broken"
    shutil.copytree(adapters["all-r8"], broken)
    names = [None, *adapters]
    prompts = random_prompts(6, VOCAB, (3, 30), seed=31)
    arrivals = {2 * i + 1: i for i in range(len(prompts))}   # step -> request: one every other step
    with make_llm(served, overlap_admissions=beside) as llm:
        engine = llm.engine
        engine.add_adapter("broken", broken)
        (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
        for name in adapters:   # resident first, so that each arrival is admitted at the next step
            engine.adapters.wait_resident(name, timeout=60)
        engine.add_request("first", [7, 8, 9], SamplingParams(max_tokens=30, **GREEDY), "qv-r4")
        failed_beside = []
        admit_beside = engine.scheduler.admit_beside

        def recording(*args, **kwargs):
            out = admit_beside(*args, **kwargs)
            failed_beside.extend(seq.request_id for seq in out.failed)
            return out
        engine.scheduler.admit_beside = recording
        outs, step, admitted_beside = {}, 0, 0
        while step <= 2 * len(prompts) + 2 or engine.has_unfinished():
            assert step < 200, "requests never finished"
            if step in arrivals:
                i = arrivals[step]
                engine.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=8, **GREEDY), names[i % 4])
            if step == 6:   # its load starts in this step and fails (in a loader thread) before the next
                engine.add_request("bad", [4, 5], SamplingParams(max_tokens=4, **GREEDY), "broken")
            if step == 7:
                deadline = time.monotonic() + 30
                while engine.adapters.error("broken") is None and time.monotonic() < deadline:
                    time.sleep(0.001)
            before = engine.stats["overlapped_admissions"]
            for out in engine.step():
                outs[out.request_id] = out
            admitted_beside += engine.stats["overlapped_admissions"] - before
            step += 1
        assert engine.blocks.num_free == engine.blocks.num_blocks
        assert all(engine.adapters.pins(n) == 0 for n in adapters)
    assert outs["first"].token_ids == oracle.greedy([7, 8, 9], "qv-r4", 30)
    for i, prompt in enumerate(prompts):
        assert outs[f"r{i}"].token_ids == oracle.greedy(prompt, names[i % 4], 8), (i, names[i % 4])
    assert outs["bad"].finish_reason == "error" and "broken" in outs["bad"].error
    assert failed_beside == (["bad"] if beside else []), failed_beside   # ("first" decodes all along)
    # each arrival found decodes in flight: with the setting on, it joined a queued step
    assert admitted_beside == (len(prompts) if beside else 0)


def test_engine_config_errors_name_the_field():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model="dummy:llama-2-7b", max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="dummy:llama-2-7b", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model="dummy:llama-2-7b", block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model="dummy:llama-2-7b", dtype="int8")
    with pytest.raises(ValueError, match="cuda_graph_max_prompt_tokens must be an integer >= 0, got -1"):
        EngineConfig(model="dummy:llama-2-7b", cuda_graph_max_prompt_tokens=-1)
    with pytest.raises(ValueError, match="adapter_loader_threads must be an integer >= 1, got 0"):
        EngineConfig(model="dummy:llama-2-7b", adapter_loader_threads=0)


def test_removing_an_adapter_ends_only_its_queued_requests(served):
    with make_llm(served) as llm:
        engine = llm.engine
        engine.add_request("a", list(range(3, 20)), SamplingParams(max_tokens=12, **GREEDY))
        for _ in range(2):
            engine.step()
        engine.add_request("w", list(range(5, 15)), SamplingParams(max_tokens=4, **GREEDY), adapter="qv-r4")
        engine.remove_adapter("qv-r4")
        outs = {}
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] = out
        assert outs["w"].finish_reason == "error" and "qv-r4" in outs["w"].error
        assert outs["a"].finish_reason == "length" and len(outs["a"].token_ids) == 12


def test_non_finite_logits_end_the_request_with_an_error(served):
    with make_llm(served) as llm:
        engine = llm.engine
        launch = engine.runner.sampler.launch

        def poisoned(logits, params, generators):  # the second request's row turns NaN
            logits = logits.clone()
            logits[-1] = float("nan")
            return launch(logits, params, generators)

        engine.runner.sampler.launch = poisoned
        outs = llm.generate([[5, 6, 7], [8, 9, 10]], SamplingParams(max_tokens=3, **GREEDY))
        assert outs[1].finish_reason == "error" and "non-finite" in outs[1].error and outs[1].token_ids == []
        assert outs[0].finish_reason in ("length", "error")  # it is the last row once the other is gone


def test_stop_token_text_is_not_in_the_output(tmp_path):
    from model_fixtures import make_hf_model
    from tokenizer_fixtures import make_tokenizer
    folder = make_hf_model(tmp_path / "m", "llama-text", seed=5)
    make_tokenizer(folder, "byte_bpe", vocab_size=320)
    with LLM(str(folder), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8) as llm:
        full = llm.generate(["Hello"], SamplingParams(max_tokens=12, **GREEDY))[0]
        stop = full.token_ids[4]
        cut = llm.generate(["Hello"], SamplingParams(max_tokens=12, stop_token_ids=[stop], **GREEDY))[0]
    first = full.token_ids.index(stop)
    assert cut.token_ids == full.token_ids[:first + 1] and cut.stop_reason == stop
    assert cut.text == llm.tokenizer.decode(full.token_ids[:first], skip_special_tokens=True)


@pytest.mark.parametrize("graphs", [True, False])
def test_eager_forwards_run_with_adapter_loads_stepping_aside(served, graphs):
    """With decode graphs, each eager forward is a `busy` stretch of adapters/priority.py (loads get the
    graphed steps' host time instead); without graphs (the CPU, enforce_eager) every step is eager, so
    loads are never held back."""
    from loraplex.adapters.priority import HOST_PRIORITY

    class NoGraph:   # an engine with graphs whose steps all run eager (as steps that fit no graph do)
        class shapes:
            @staticmethod
            def key_for(chunks):
                return None

    llm = make_llm(served)
    runner, busy = llm.engine.runner, []
    if graphs:
        runner.graphs = NoGraph()
    run_eager = runner._run_eager

    def recording(*args, **kwargs):
        busy.append(HOST_PRIORITY.is_busy)
        return run_eager(*args, **kwargs)

    runner._run_eager = recording
    try:
        llm.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=4, **GREEDY), adapter=["all-r8", None, "qv-r4"])
    finally:
        runner.graphs = None
        llm.close()
    assert busy and set(busy) == {graphs}
    assert not HOST_PRIORITY.is_busy


def test_steps_run_by_the_graph_shapes_choose_and_are_counted(served):
    """The runner asks the graphs' shapes which graph runs each step, passes that key to `run` and reports
    it; the engine counts graphed and mixed graphed steps. A stand-in replays by running the step's
    chunks through a padded graph batch on the CPU (ForwardBatch.for_graph + update_), so the tokens
    must still equal transformers + PEFT's."""
    from loraplex.engine.cuda_graphs import GraphShapes
    from loraplex.models.forward_batch import ForwardBatch
    _, _, oracle = served
    llm = make_llm(served, overlap_admissions=True)
    runner = llm.engine.runner
    keys, fed_from_device = [], []   # each replay's key, and how many of its rows took the sample in flight

    class CpuGraphs:   # what StepGraphs does, without capturing
        shapes = GraphShapes.make(16, runner.max_model_len, 64)

        @staticmethod
        def run(chunks, inputs=None, *, key):
            keys.append(key)
            fed_from_device.append(0 if inputs is None else len(inputs[1]))
            c = runner.model.config
            batch = ForwardBatch.for_graph(key[0], runner.max_model_len, block_size=runner.kv.block_size,
                                           num_blocks=runner.kv.num_blocks, vocab_size=c.vocab_size,
                                           num_adapter_slots=runner.adapters.pool.num_slots, device="cpu",
                                           max_prompt_tokens=key[1]).update_(chunks)
            if inputs is not None:
                batch.input_ids[:len(inputs[1])].copy_(inputs[0].index_select(0, inputs[1]))
            return runner.model(batch, runner.kv, runner.adapters.pool)[:len(batch.logits_seqs)]

    runner.graphs = CpuGraphs()
    engine = llm.engine
    for name in ("all-r8", "qv-r4"):   # resident first, so when each request is admitted does not vary
        engine.adapters.wait_resident(name, timeout=60)
    # (arrival step, prompt, adapter): decodes run alone, then prompts join them (mixed graphs), one of
    # more prompt tokens than any mixed graph holds (eager)
    plan = [(0, [5, 6, 7], "all-r8"), (0, [9] * 12, None), (3, [3, 1, 4, 1, 5, 9, 2, 6], "qv-r4"),
            (3, [2] * 30, "all-r8"), (6, [4] * 90, None)]
    tokens: dict[str, list[int]] = {}
    named = []   # each step's StepInfo.adapters
    try:
        step = 0
        while step < 7 or engine.has_unfinished():
            assert step < 200, "requests never finished"
            for i, (when, prompt, adapter) in enumerate(plan):
                if when == step:
                    engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, **GREEDY), adapter)
            for out in engine.step():
                tokens[out.request_id] = out.token_ids
            named.append(engine.last_step.adapters)
            assert engine.last_step.gpu_seconds is None   # no GpuSpan on the CPU
            step += 1
        stats = dict(engine.stats)
    finally:
        runner.graphs = None
        llm.close()
    for i, (_, prompt, adapter) in enumerate(plan):
        assert tokens[f"r{i}"] == oracle.greedy(prompt, adapter, 8), (prompt, adapter)
    assert any(k[1] > 0 for k in keys) and any(k[1] == 0 for k in keys), keys
    # prompts admitted beside decodes fed from the step in flight (overlap_admissions): a mixed graph
    assert any(k[1] > 0 and fed for k, fed in zip(keys, fed_from_device)), list(zip(keys, fed_from_device))
    assert stats["graph_steps"] == len(keys) < stats["steps"]   # the 90-token prompt's steps ran eager
    assert stats["mixed_graph_steps"] == sum(k[1] > 0 for k in keys)
    # each step names its adapters, the base model (None) first
    assert named[0] == (None, "all-r8") and (None, "all-r8", "qv-r4") in named and named[-1] == (None,), named


@pytest.mark.parametrize("freeze", [True, False])
def test_the_engine_freezes_its_heap_out_of_full_collections_until_closed(served, freeze):
    """freeze_gc_heap: once started, the objects alive (the model, the adapters' specs…) are frozen, so that
    Python's full garbage collections skip them (engine/gc_heap.py); freeze_heap() again takes in what was
    registered since; the heap is unfrozen when the last engine that froze it closes. Off, nothing is."""
    import gc

    def collectable(obj) -> bool:   # in a generation the collector walks (frozen objects are in none)
        return any(o is obj for g in (0, 1, 2) for o in gc.get_objects(g))

    from loraplex.engine import gc_heap
    holders, frozen = gc_heap._holders, gc.get_freeze_count()   # engines other tests left open (none, normally)
    with make_llm(served, freeze_gc_heap=freeze) as llm, make_llm(served, freeze_gc_heap=freeze) as other:
        engine = llm.engine
        # the model's modules and tensors at least; off, nothing more is frozen
        assert gc.get_freeze_count() > frozen + 1000 if freeze else gc.get_freeze_count() == frozen
        engine.adapters.register_synthetic("late", 4, seed=1)   # a ModuleSpec per layer and projection
        module = next(iter(engine.adapters.spec("late").modules.values()))
        assert collectable(module)
        engine.freeze_heap()
        assert collectable(module) != freeze
        outs = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY), adapter="late")
        assert len(outs[0].token_ids) == 4   # serving is unaffected
        other.close()   # another engine still holds the freeze
        assert collectable(module) != freeze
    assert gc_heap._holders == holders
    if holders == 0:   # the last engine that froze has closed: the heap is the collector's again
        assert gc.get_freeze_count() == 0 and collectable(module)
