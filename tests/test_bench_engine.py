"""benchmarks/bench_engine.py's engines (the benchmark itself needs a GPU): which variants share an engine, each
engine's pool (its width, its slots and the adapters made resident), and a group's runs (warm-ups, timed runs)."""
from types import SimpleNamespace

import pytest


class FakeAdapters:
    def __init__(self):
        self.registered: list[tuple[str, int]] = []

    def register_synthetic(self, name, rank, seed):
        self.registered.append((name, rank))

    def prefetch(self, name):
        pass

    def wait_resident(self, name, timeout):
        pass


@pytest.fixture
def bench(monkeypatch):
    from benchmark_modules import load_benchmark
    module = load_benchmark(monkeypatch, "bench_engine")
    monkeypatch.setattr(module, "Engine", lambda config: SimpleNamespace(config=config, adapters=FakeAdapters()))
    return module


def test_composed_and_merged_get_engines_of_their_own_unless_the_pool_is_shared(bench):
    variants = ["backbone", "distinct", "composed", "merged"]
    assert bench._groups(variants, False) == [["backbone", "distinct"], ["composed"], ["merged"]]
    assert bench._groups(variants, True) == [["backbone", "distinct"], ["composed", "merged"]]
    assert bench._groups(["merged"], False) == [["merged"]]


@pytest.mark.parametrize("variants, rank, adapters", [
    (["backbone", "distinct"], 16, [16] * 4),
    (["composed"], 16, [16] * 8),
    (["merged"], 32, [32] * 4),
    (["composed", "merged"], 32, [16] * 8 + [32] * 4),
])
def test_each_pool_is_as_wide_as_its_adapters(bench, variants, rank, adapters):
    args = SimpleNamespace(preset="llama-2-7b", layers=1)
    engine, _ = bench._engine(args, 4, "graphs", variants, "none")
    assert engine.config.max_lora_rank == rank
    assert engine.config.max_gpu_adapters == len(adapters)
    assert [r for _, r in engine.adapters.registered] == adapters
    names = {n for n, _ in engine.adapters.registered}
    for i in range(4):   # every request's adapters are among them
        wanted = [bench._adapter(v, i, 4) for v in variants if v != "backbone"]
        assert all(set([w] if isinstance(w, str) else w) <= names for w in wanted)


@pytest.mark.parametrize("quant, weights, kv", [("none", None, "auto"), ("fp8", "fp8", "auto"),
                                                ("fp8kv", "fp8", "fp8")])
def test_quantizations_name_the_weights_and_the_kv_cache(bench, quant, weights, kv):
    assert quant in bench.QUANTIZATIONS
    engine, _ = bench._engine(SimpleNamespace(preset="llama-2-7b", layers=1), 4, "graphs", ["backbone"], quant)
    assert (engine.config.quantization, engine.config.kv_cache_dtype) == (weights, kv)


def test_markdown_lists_each_runs_decode_step_and_prompt_steps(bench):
    """With repeats, every run's tokens/s, decode step and prompt steps (which of them moved a run); rows of older
    results, which kept tokens/s only, show dashes for the rest."""
    row = dict(batch=32, mode="graphs", variant="backbone", quantization="fp8kv", tokens_per_s=4332.0,
               full_decode_step_ms=5.25, full_decode_gpu_ms=5.33, floor_ms=3.37, prefill_step_ms=40.9,
               prefill_gpu_ms=40.2, graph_steps=249, steps=261, repeats_tokens_per_s=[4697.7, 4249.9, 4332.0],
               repeats_decode_step_ms=[5.251, 5.262, 5.248], repeats_prompt_seconds=[0.371, 0.489, 0.478])
    old = dict(row, variant="distinct", repeats_tokens_per_s=[3736.1, 3805.0])
    del old["repeats_decode_step_ms"], old["repeats_prompt_seconds"]
    res = dict(gpu="NVIDIA H100", date="2026-12-06", preset="llama-2-7b", rank=16, output_tokens=128, copy_gbs=3000.0,
               repeats=3, rows=[row, old])
    lines = bench.markdown(res).splitlines()
    assert "- 32 graphs fp8kv backbone: 4698 / 5.25 / 0.371; 4250 / 5.26 / 0.489; 4332 / 5.25 / 0.478" in lines
    assert "- 32 graphs fp8kv distinct: 3736 / – / –; 3805 / – / –" in lines
    assert not any(line.startswith("- ") for line in bench.markdown(dict(res, repeats=1)).splitlines())


def test_markdown_gives_each_runs_prompt_gpu_spans_and_the_graphed_prompt_tokens(bench):
    """Runs that recorded their prompt steps' GPU spans show them beside the wall time (host-bound prompt steps
    show as a GPU span that waits on the host); results name the prompt tokens that CUDA graphs cover."""
    row = dict(batch=32, mode="graphs", variant="backbone", quantization="fp8kv", tokens_per_s=4581.0,
               full_decode_step_ms=5.19, full_decode_gpu_ms=5.26, floor_ms=3.35, prefill_step_ms=38.4,
               prefill_gpu_ms=36.8, graph_steps=249, steps=261, repeats_tokens_per_s=[4581.3, 4631.9],
               repeats_decode_step_ms=[5.19, 5.18], repeats_prompt_seconds=[0.444, 0.417],
               repeats_prompt_gpu_seconds=[0.4312, 0.4011], setup_s=33.97)
    other = dict(row, batch=256, variant="distinct", setup_s=68.4)
    res = dict(gpu="NVIDIA H100", date="2026-12-06", preset="llama-2-7b", rank=16, output_tokens=128, copy_gbs=3000.0,
               repeats=2, graph_prompt_tokens=2048, rows=[row, dict(row, variant="distinct"), other])
    text = bench.markdown(res)
    assert "- 32 graphs fp8kv backbone: 4581 / 5.19 / 0.444 (GPU 0.431); 4632 / 5.18 / 0.417 (GPU 0.401)" in text
    assert "In graph mode, steps with up to 2048 prompt tokens replay CUDA graphs too." in text
    # each engine's start once (its variants share it): what the CUDA graphs' captures add to it
    assert "Engine start-up (weights, KV sizing, kernels, CUDA graphs), s: 32 graphs fp8kv 34; " \
           "256 graphs fp8kv 68." in text


@pytest.mark.parametrize("given", [None, 0, 2048])
def test_graph_prompt_tokens_reach_the_engine(bench, given):
    from loraplex.config import EngineConfig
    args = SimpleNamespace(preset="llama-2-7b", layers=1, graph_prompt_tokens=given)
    engine, _ = bench._engine(args, 4, "graphs", ["backbone"], "none")
    want = EngineConfig(model="m").cuda_graph_max_prompt_tokens if given is None else given
    assert engine.config.cuda_graph_max_prompt_tokens == want


def test_every_variant_warms_up_with_a_whole_run(bench, monkeypatch):
    """Each variant's first run is a warm-up over all the requests (its own kernels see every step shape: the
    backbone's launch no LoRA kernel), then `repeats` timed runs; the rows come from the timed runs only."""
    calls = []

    def fake_run(engine, work, adapters):
        calls.append((adapters[0], len(work)))
        return dict(tokens_per_s=float(len(calls)), full_decode_step_ms=1.0, prompt_steps_seconds=0.1,
                    prompt_steps_gpu_seconds=0.1, started=0.0, mean_full_context=100.0)

    model = SimpleNamespace(config=SimpleNamespace(vocab_size=100))
    engine = SimpleNamespace(runner=SimpleNamespace(model=model), close=lambda: None)
    monkeypatch.setattr(bench, "_engine", lambda *a: (engine, 0.0))
    monkeypatch.setattr(bench, "run", fake_run)
    for name in ("kv_bytes", "weight_bytes", "adapter_bytes"):
        monkeypatch.setattr(bench, name, lambda *a: 1)
    args = SimpleNamespace(waves=2, repeats=2, profile=None)
    rows, _ = bench.run_group(args, 4, "graphs", ["backbone", "distinct"], copy_gbs=1.0)
    # round 1: backbone warm-up + run, distinct warm-up + run; round 2 (rotated): distinct, backbone
    assert calls == [(None, 8), (None, 8), ("a0", 8), ("a0", 8), ("a0", 8), (None, 8)]
    assert {r["variant"]: r["repeats_tokens_per_s"] for r in rows} == {"backbone": [2.0, 6.0],
                                                                       "distinct": [4.0, 5.0]}


def test_blocks_and_decode_tiles_reach_the_engines(bench, monkeypatch):
    """--decode-tiles and --block-size: the module defaults every engine of the run reads (put back after the
    test), the block size in each engine's config, and a line of the report."""
    from loraplex.ops.attention import launchers
    for name in ("DECODE_CONFIGS", "FP8_DECODE_CONFIGS"):
        monkeypatch.setattr(launchers, name, getattr(launchers, name))
    tiles = bench._tile_fields("even_split_tokens=128,programs_per_sm=4")
    assert tiles == {"even_split_tokens": 128, "programs_per_sm": 4.0}
    args = SimpleNamespace(preset="llama-2-7b", layers=1, decode_tiles=tiles, block_size=32)
    bench._set_decode_tiles(args)
    assert {(c.even_split_tokens, c.programs_per_sm) for c in launchers.DECODE_CONFIGS.values()} == {(128, 4.0)}
    fp8 = launchers.decode_config(128, bench.torch.bfloat16, fp8_kv=True)
    assert (fp8.even_split_tokens, fp8.num_warps) == (128, 2)   # the e4m3 tiles kept, the field set
    engine, _ = bench._engine(args, 4, "graphs", ["backbone"], "fp8kv")
    assert engine.config.block_size == 32
    note = bench._cache_note(dict(block_size=32, decode_tiles=tiles))
    assert note == " KV-cache blocks of 32 tokens. Decode attention's tiles: even_split_tokens=128, " \
                   "programs_per_sm=4.0."
    assert bench._cache_note({}) == ""


@pytest.mark.parametrize("text, match", [("warps=2", "not FIELD=VALUE"), ("block_n", "not FIELD=VALUE"),
                                         ("block_n=x", "block_n: 'x' is not of type int"),
                                         ("even_split_tokens=-1", "even_split_tokens must be at least 0")])
def test_decode_tiles_refuse_unknown_fields_and_bad_values(bench, text, match):
    with pytest.raises(bench.argparse.ArgumentTypeError, match=match):
        bench._tile_fields(text)
