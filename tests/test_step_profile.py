"""benchmarks/step_profile.py (bench_engine.py --profile): it profiles the asked-for number of full-batch decode
steps, or of prompt steps, and leaves the engine with nothing unfinished; its table ranks kernels and sums each
variant's."""
from loraplex.config import EngineConfig
from loraplex.demo.assets import demo_adapters, demo_model_dir
from loraplex.engine import Engine


def test_profiles_count_the_asked_for_steps_and_finish(monkeypatch):
    from benchmark_modules import load_benchmark
    step_profile = load_benchmark(monkeypatch, "step_profile")
    engine = Engine(EngineConfig(str(demo_model_dir()), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8,
                                 max_num_seqs=3, max_num_batched_tokens=64, max_model_len=256, freeze_gc_heap=False),
                    demo_adapters())
    names = sorted(demo_adapters())
    prompts = [[5, 9, 13, 2, 7], [4, 4, 8], [11, 3, 6, 10]]
    adapters = [names[0], {names[0]: 0.5, names[1]: 0.5}, None]
    got = step_profile.profile_decode(engine, prompts, adapters, steps=4)
    assert got["steps"] == 4
    assert not engine.has_unfinished()
    # prompt steps: 40-token prompts at 64 tokens a step take two steps or more; the profile counts two
    long = [[(7 * i + j) % 50 + 3 for j in range(40)] for i in range(3)]
    got = step_profile.profile_prompts(engine, long, adapters, steps=2)
    assert got["steps"] == 2 and got["span_us"] >= 0
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
