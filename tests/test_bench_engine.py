"""benchmarks/bench_engine.py's engines (the benchmark itself needs a GPU): which variants share an engine, and
each engine's pool (its width, its slots and the adapters made resident)."""
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
