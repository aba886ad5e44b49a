"""benchmarks/step_profile.py (bench_engine.py --profile): it profiles the asked-for number of full-batch decode
steps and leaves the engine with nothing unfinished; its table ranks kernels and sums each variant's."""
from loraplex.config import EngineConfig
from loraplex.demo.assets import demo_adapters, demo_model_dir
from loraplex.engine import Engine


def test_profile_decode_counts_full_batch_steps_and_finishes(monkeypatch):
    from benchmark_modules import load_benchmark
    step_profile = load_benchmark(monkeypatch, "step_profile")
    engine = Engine(EngineConfig(str(demo_model_dir()), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8,
                                 max_num_seqs=3, max_num_batched_tokens=64, max_model_len=256, freeze_gc_heap=False),
                    demo_adapters())
    names = sorted(demo_adapters())
    prompts = [[5, 9, 13, 2, 7], [4, 4, 8], [11, 3, 6, 10]]
    got = step_profile.profile_decode(engine, prompts, [names[0], {names[0]: 0.5, names[1]: 0.5}, None], steps=4)
    assert got["steps"] == 4
    assert not engine.has_unfinished()
    engine.close()


def test_markdown_ranks_kernels_by_their_largest_time_and_sums_each_variant(monkeypatch):
    from benchmark_modules import load_benchmark
    step_profile = load_benchmark(monkeypatch, "step_profile")
    profiles = {"merged": dict(steps=8, span_us=100.0, kernels={"gemm": 50.0, "shrink": 10.0}),
                "composed": dict(steps=8, span_us=130.0, kernels={"gemm": 50.0, "shrink": 30.0, "x" * 90: 5.0})}
    md = step_profile.markdown(profiles).splitlines()
    assert md[0] == "| kernel | merged (µs/step) | composed (µs/step) |"
    assert [line.split("|")[1].strip() for line in md[2:5]] == ["`gemm`", "`shrink`", f"`{'x' * 59}…`"]
    assert md[4].endswith("| 0 | 5 |")
    assert md[-2] == "| **all kernels** | 60 | 85 |" and md[-1] == "| **span** | 100 | 130 |"
