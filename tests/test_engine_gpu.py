"""The engine on a CUDA GPU: Triton kernels, KV sized from memory, CUDA graphs of decode and mixed steps."""
from __future__ import annotations

import contextlib

import pytest
import torch

from engine_fixtures import GenerateOracle, make_llm, make_served_model, random_prompts, record_variants
from loraplex import SamplingParams

pytestmark = pytest.mark.gpu
VOCAB = 128


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base, adapters = make_served_model(tmp_path_factory.mktemp("served_gpu"))
    return base, adapters, GenerateOracle(base, adapters)


@pytest.fixture(scope="class")
def default_engines(served):
    """{enforce_eager: LLM} with the default settings, shared by the tests of one class (an engine's start, its
    LoRA kernels' first compiles above all, is most of an engine test's time); closed when the class ends."""
    llms = {eager: make_llm(served, enforce_eager=eager) for eager in (False, True)}
    yield llms
    for llm in llms.values():
        llm.close()


def _graphs_and_eager_agree(served, seed: int, check, engines=None, lengths=(4, 50), **settings) -> None:
    """12 greedy requests (the base model and every adapter; prompts of `lengths` tokens), run with CUDA graphs and
    eagerly (the shared `engines`, else two made with `settings`): the same tokens both ways, and transformers +
    PEFT's. `check(llm, eager)` runs after each engine's requests."""
    _, adapters, oracle = served
    names = [None, *adapters]
    prompts = random_prompts(12, VOCAB, lengths, seed=seed)
    which = [names[i % len(names)] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = {}
    for eager in (False, True):
        with contextlib.nullcontext(engines[eager]) if engines else make_llm(served, enforce_eager=eager,
                                                                             **settings) as llm:
            results[eager] = [o.token_ids for o in llm.generate(prompts, params, adapter=which)]
            check(llm, eager)
    assert results[False] == results[True]
    agree = sum(out == oracle.greedy(p, a, 16) for p, a, out in zip(prompts, which, results[False]))
    assert agree == len(prompts), f"{agree}/{len(prompts)} requests equal transformers + PEFT generate"


class TestDefaultEngines:
    """Tests that run on the two default engines (CUDA graphs, eager), started once for all of them."""

    def test_graphs_and_eager_give_the_same_tokens_and_match_transformers(self, served, default_engines):
        def check(llm, eager):
            stats = llm.engine.stats
            assert (stats["graph_steps"] > 0) != eager, stats
            assert (stats["mixed_graph_steps"] > 0) != eager, stats   # prompts beside decodes, replayed
            assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
            gpu = llm.engine.last_step.gpu_seconds   # the last step's GpuSpan: its inputs, forward and sample
            assert gpu is not None and 0 < gpu < 10, llm.engine.last_step
        _graphs_and_eager_agree(served, 21, check, default_engines)

    def test_seeded_sampling_is_the_same_with_graphs_and_eager(self, served, default_engines):
        prompts = random_prompts(6, VOCAB, (4, 30), seed=22)
        params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=100 + i, ignore_eos=True)
                  for i in range(len(prompts))]
        outs = {eager: [o.token_ids for o in llm.generate(prompts, params, adapter="all-r8")]
                for eager, llm in default_engines.items()}
        assert outs[False] == outs[True]

    def test_compositions_replay_their_graph_variant_and_match_peft_cat(self, served, default_engines, monkeypatch):
        """Compositions (negative weights, a weighted adapter alone, rsLoRA) beside single adapters and the base
        model, with CUDA graphs and eagerly (fp32): the same tokens both ways, and transformers + PEFT's with the
        adapter `add_weighted_adapter(..., combination_type="cat")` makes; steps with a composition replay the
        composed variant, the engine captures three variants per shape."""
        from composition_fixtures import REQUESTS, CatOracle, as_key
        base, adapters, _ = served
        oracle = CatOracle(base, adapters)
        prompts = random_prompts(12, VOCAB, (4, 50), seed=51)
        which = [REQUESTS[i % len(REQUESTS)] for i in range(len(prompts))]
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        graphs = default_engines[False].engine.runner.graphs
        assert graphs.variants == ["base", "lora", "composed"]
        assert len(graphs._graphs) == 3 * len(graphs.shapes.all())
        del graphs   # (a name left to the graphs would keep the engine's memory past its close)
        seen = record_variants(monkeypatch)
        results = {}
        for eager, llm in default_engines.items():
            results[eager] = [o.token_ids for o in llm.generate(prompts, params, adapter=which)]
            assert (llm.engine.stats["graph_steps"] > 0) != eager
            assert all(llm.engine.adapters.pins(n) == 0 for n in adapters)
        assert "composed" in seen, seen
        assert results[False] == results[True]
        for prompt, adapter, out in zip(prompts, which, results[False]):
            assert out == oracle.greedy(prompt, as_key(adapter), 16), adapter

    def test_steps_without_compositions_replay_the_plain_graphs(self, served, default_engines, monkeypatch):
        """Single-adapter and base-model steps replay the graphs they replayed before compositions existed (the
        plain LoRA variant), whatever the engine allows; with max_adapters_per_request=1 no composed graph is
        captured."""
        _, adapters, oracle = served
        names = [None, *adapters]
        prompts = random_prompts(8, VOCAB, (4, 40), seed=52)
        which = [names[i % len(names)] for i in range(len(prompts))]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        seen = record_variants(monkeypatch)
        for limit in (4, 1):   # 4: the default engine's
            llm = default_engines[False] if limit == 4 else make_llm(served, max_adapters_per_request=limit)
            expected = ["base", "lora", "composed"] if limit > 1 else ["base", "lora"]
            assert llm.engine.runner.graphs.variants == expected
            outs = llm.generate(prompts, params, adapter=which)
            if limit == 1:
                llm.close()
            assert [o.token_ids for o in outs] == [oracle.greedy(p, a, 8) for p, a in zip(prompts, which)]
        assert "lora" in seen and set(seen) <= {"base", "lora"}, seen


def test_graphs_and_eager_agree_with_the_skinny_gemm_in_fp32(served, monkeypatch):
    """LORAPLEX_SKINNY_GEMM=on: the fp32 projections of steps of up to 32 rows through ops/skinny_gemm.py (its
    tuned tiles cut to the GPU's shared memory by fit_config), captured and eager: the same tokens both ways,
    and transformers + PEFT's ("auto", the default, leaves fp32 to cuBLAS)."""
    from loraplex.ops.gemm import skinny as skinny_gemm
    monkeypatch.setattr(skinny_gemm, "SETTING", "on")
    rows = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda x, *a, **kw: rows.append(x.shape[0]) or real(x, *a, **kw))
    _graphs_and_eager_agree(served, 23, lambda llm, eager: None)
    assert rows and max(rows) <= skinny_gemm.DECODE_MAX_ROWS


def test_prompts_admitted_beside_a_step_in_flight_replay_mixed_graphs(served):
    """overlap_admissions: a request arriving while decodes run joins the step queued ahead, whose mixed graph
    takes the decodes' tokens from the sample of the step in flight (its first rows) and the prompt's from
    the host; every request's tokens equal transformers + PEFT's."""
    _, adapters, oracle = served
    names = [None, *adapters]
    prompts = random_prompts(6, VOCAB, (3, 30), seed=41)
    greedy = dict(temperature=0.0, ignore_eos=True)
    with make_llm(served, overlap_admissions=True) as llm:
        engine = llm.engine
        for name in adapters:   # resident first, so that each arrival is admitted at the next step
            engine.adapters.wait_resident(name, timeout=60)
        engine.add_request("first", [7, 8, 9], SamplingParams(max_tokens=30, **greedy), "qv-r4")
        outs, step = {}, 0
        while step <= 2 * len(prompts) or engine.has_unfinished():
            assert step < 300, "requests never finished"
            if step % 2 and step // 2 < len(prompts):
                i = step // 2
                engine.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=8, **greedy), names[i % 4])
            for out in engine.step():
                outs[out.request_id] = out.token_ids
            step += 1
        stats = dict(engine.stats)
    assert stats["overlapped_admissions"] == len(prompts) and stats["mixed_graph_steps"] >= len(prompts), stats
    assert outs["first"] == oracle.greedy([7, 8, 9], "qv-r4", 30)
    for i, prompt in enumerate(prompts):
        assert outs[f"r{i}"] == oracle.greedy(prompt, names[i % 4], 8), (i, names[i % 4])


@pytest.mark.parametrize("seqs, wide", [(16, [384, 512, 624]), (32, [384, 512, 608])])
def test_prompt_steps_past_256_tokens_replay_the_wide_graphs(served, monkeypatch, seqs, wide):
    """With max_num_batched_tokens 640, steps of 273 to 640 rows (whole and chunked prompts, some longer than their
    graph's prompt bucket) replay the wide mixed graphs (`seqs` sequences beside `wide` prompt tokens, the last up to
    640 rows): the same tokens as eager, and transformers + PEFT's. With 32 sequences the smaller shapes come in two
    sequence buckets, (16, 32) left out for (32, 16)."""
    from loraplex.engine import cuda_graphs
    keys: list = []
    key_for = cuda_graphs.GraphShapes.key_for
    monkeypatch.setattr(cuda_graphs.GraphShapes, "key_for", lambda self, chunks: keys.append(key_for(self, chunks))
                        or keys[-1])

    def check(llm, eager):
        if not eager:
            assert llm.engine.runner.graphs.shapes.wide_prompts == wide
    _graphs_and_eager_agree(served, 24, check, lengths=(150, 230), max_num_seqs=seqs, max_num_batched_tokens=640)
    replayed = {prompt for _, prompt in filter(None, keys)}
    assert wide[-1] in replayed and replayed & set(wide[:-1]), sorted(replayed)


@pytest.mark.gpu_memory
def test_kv_cache_is_sized_from_free_memory(served):
    total = torch.cuda.get_device_properties(0).total_memory
    with make_llm(served, num_kv_blocks=None, gpu_memory_utilization=0.1) as small:
        small_blocks = small.engine.runner.kv.num_blocks
        assert torch.cuda.memory_reserved() <= 0.1 * total + (256 << 20)
    with make_llm(served, num_kv_blocks=None, gpu_memory_utilization=0.2) as large:
        large_blocks = large.engine.runner.kv.num_blocks
    assert small_blocks > 1000 and large_blocks > 1.5 * small_blocks


def test_preemption_on_gpu_keeps_outputs(served):
    _, adapters, oracle = served
    names = [None, *adapters]
    prompts = random_prompts(16, VOCAB, (30, 60), seed=23)
    which = [names[i % len(names)] for i in range(len(prompts))]
    with make_llm(served, num_kv_blocks=24, block_size=8, max_num_seqs=10, max_num_batched_tokens=64) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), adapter=which)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for p, a, o in zip(prompts, which, outs):
        assert o.token_ids == oracle.greedy(p, a, 10)


def test_the_engine_reserves_pinned_memory_after_capturing_its_graphs(served):
    """adapters/pinned_reserve.py through the engine: once it has started (graphs captured: each capture empties
    PyTorch's pinned cache), as many full-rank adapter reads as the CPU tier and the loader threads hold page-lock
    no fresh memory; with the reserve off (0), they do."""
    from loraplex.adapters.synthetic import read_synthetic, synthetic_spec
    torch.cuda.init()
    if "num_host_alloc" not in torch.cuda.host_memory_stats():
        pytest.skip("this torch does not count pinned allocations")
    for gib, fresh in ((None, False), (0, True)):
        getattr(torch._C, "_host_emptyCache", lambda: None)()   # nothing left over from earlier engines
        with make_llm(served, max_cpu_adapters=3, adapter_loader_threads=2, adapter_host_reserve_gib=gib) as llm:
            engine = llm.engine
            assert engine.runner.graphs is not None
            count = 3 + 2
            before = torch.cuda.host_memory_stats()["num_host_alloc"]
            rank, dtype = engine.config.max_lora_rank, engine.adapters.pool.dtype
            held = [read_synthetic(synthetic_spec(f"s{i}", engine.model_config, rank, seed=i), dtype, True)
                    for i in range(count)]
            assert all(b.is_pinned() for h in held for b in h.buffers)
            assert (torch.cuda.host_memory_stats()["num_host_alloc"] > before) == fresh, gib


def test_fp8_kv_cache_with_calculated_scales_matches_peft_on_the_same_e4m3_keys_and_values(served):
    """kv_cache_dtype fp8 with calculate_kv_scales on the GPU (fp32 model): the scales computed at start-up land in
    the cache, and greedy tokens of the base model and adapters, with CUDA graphs and eagerly, equal transformers +
    PEFT's whose attention reads the same e4m3 keys and values (tests/fp8_kv_fixtures.py)."""
    from fp8_kv_fixtures import Fp8KvOracle
    from loraplex.ops.gemm.fp8 import fp8_capable
    if not fp8_capable(torch.cuda.current_device()):
        pytest.skip("an FP8 KV cache needs compute capability 8.9 or newer")
    base, adapters, _ = served
    names = [None, *adapters]
    prompts = random_prompts(8, VOCAB, (4, 40), seed=61)
    which = [names[i % len(names)] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results, scales = {}, {}
    for eager in (False, True):
        with make_llm(served, enforce_eager=eager, kv_cache_dtype="fp8", calculate_kv_scales=True) as llm:
            kv = llm.engine.runner.kv
            scales[eager] = (kv.k_scale.tolist(), kv.v_scale.tolist())
            results[eager] = [o.token_ids for o in llm.generate(prompts, params, adapter=which)]
            del kv
    assert scales[False] == scales[True] and all(s != 1.0 for s in scales[False][0] + scales[False][1])
    assert results[False] == results[True]
    oracle = Fp8KvOracle(base, adapters, *scales[False])
    for prompt, adapter, out in zip(prompts, which, results[False]):
        assert out == oracle.greedy(prompt, adapter, 8), adapter
