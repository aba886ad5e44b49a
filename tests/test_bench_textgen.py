"""`loraplex bench` on the CPU: the workload, the ceiling, and a well-formed report from every system
(speed is measured on the GPU, not here)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from server_fixtures import make_text_model

from loraplex import envs
from loraplex.bench.ceiling import StepBytes, simulate_ceiling
from loraplex.bench.run_hf import batches
from loraplex.bench.workload import BenchRequest, Workload, make_workload
from loraplex.cli import main


def test_punica_lengths_and_popularities():
    w = make_workload(2000, "distinct", max_len=2048, seed=3)
    assert w == make_workload(2000, "distinct", max_len=2048, seed=3)            # reproducible
    prompts = np.array([r.prompt_len for r in w.requests])
    totals = np.array([r.total_len for r in w.requests])
    assert prompts.min() >= 1 and totals.max() <= 2047 and min(r.output_len for r in w.requests) >= 2
    assert 15 < np.median(prompts) < 22          # lognormal(0.8, -1, 18): median 17
    assert 900 < totals.mean() < 1150            # uniform below 2048
    assert w.num_adapters == 2000 and len({r.adapter for r in w.requests}) == 2000
    assert make_workload(100, "uniform").num_adapters == 10
    assert make_workload(100, "identical").num_adapters == 1
    skewed = [r.adapter for r in make_workload(1000, "skewed").requests]
    counts = np.bincount(skewed)
    assert counts.max() > 250 and 20 < len(counts) < 1000     # Zipf 1.5: a hot head and a long tail
    # every popularity has the same lengths, so backbone runs serve them all
    assert [r.total_len for r in make_workload(50, "skewed").requests] == \
        [r.total_len for r in make_workload(50, "identical").requests]
    with pytest.raises(ValueError, match="popularity"):
        make_workload(10, "zipfy")


def test_ceiling_sums_each_steps_bytes():
    reqs = [BenchRequest(0, 2, 3, 0), BenchRequest(1, 1, 2, 1), BenchRequest(2, 4, 1, 1)]
    w = Workload(reqs, "distinct", "fixed", 8, 0)
    sb = StepBytes(weights=100, kv_per_token=10, adapter=7)
    # max batch 2: step 1 runs r0 (ctx 2) + r1 (ctx 1); step 2: r0 (3) + r1 (2); r1 done; step 3: r0 (4) + r2 (4)
    steps = [100 + 30 + 14, 100 + 50 + 14, 100 + 80 + 14]
    got = simulate_ceiling(w, sb, 1e-9, max_batch=2, kv_tokens=100)
    assert got["ceiling_steps"] == 3
    assert math.isclose(got["ceiling_seconds"], sum(steps))
    assert math.isclose(got["ceiling_tokens_per_s"], 6 / sum(steps))
    # KV memory for 6 tokens holds one request at a time (lengths 5, 3, 5): 3 + 2 + 1 steps
    assert simulate_ceiling(w, sb, 1.0, max_batch=None, kv_tokens=6)["ceiling_steps"] == 6
    with pytest.raises(ValueError, match="KV memory"):
        simulate_ceiling(w, sb, 1.0, max_batch=2, kv_tokens=4)


def test_hf_batches_first_come_first_served_or_grouped():
    reqs = [BenchRequest(i, 1, 1, a) for i, a in enumerate([0, 0, 1, 1, 1, 0])]
    w = Workload(reqs, "uniform", "fixed", 2, 0)
    assert batches(w, 4, grouped=False) == [[0, 1, 2, 3], [4, 5]]
    assert batches(w, 2, grouped=True) == [[0, 1], [2, 3], [4], [5]]


def test_bench_command_writes_a_report_from_every_system(tmp_path):
    base, _ = make_text_model(tmp_path / "m")
    out = tmp_path / "results"
    code = main(["bench", "--model", str(base), "--device", "cpu", "--requests", "6", "--baseline-requests", "4",
                 "--popularity", "distinct,identical", "--max-batch", "3,unlimited", "--lengths", "punica",
                 "--max-len", "24", "--rank", "4", "--gpu-adapters", "9", "--loader-threads", "3", "--preload-adapters",
                 "--admission-lookahead", "0", "--no-overlap-admissions", "--cpu-adapters", "1",
                 "--out-dir", str(out), "--name", "smoke", "--quiet"])
    assert code == 0
    result = json.loads((out / "smoke.json").read_text())
    assert result["loader_threads"] == 3 and result["gpu_adapters"] == 9 and result["admission_lookahead"] == 0
    assert result["overlap_admissions"] is False and result["cpu_adapters"] == 1
    assert result["settings"] == envs.snapshot()   # the LORAPLEX_* settings the run had
    systems = {(r["system"], r["popularity"], str(r["max_batch"]), r["requests"]) for r in result["rows"]}
    for pop in ("distinct", "identical"):
        for n in (4, 6):
            assert ("loraplex", pop, "3", n) in systems and ("loraplex", pop, "unlimited", n) in systems
        assert ("hf-peft", pop, "3", 4) in systems and ("hf-peft-grouped", pop, "3", 4) in systems
    assert ("loraplex-backbone", "distinct", "3", 6) in systems and ("hf-backbone", "distinct", "3", 4) in systems
    w = make_workload(6, "distinct", max_len=24)
    for r in result["rows"]:
        expect = w.head(r["requests"])
        assert r["output_tokens"] == expect.output_tokens and r["prompt_tokens"] == expect.prompt_tokens
        assert r["tokens_per_s"] > 0 and r["ceiling_tokens_per_s"] > 0
        assert r["ttft_ms_p50"] <= r["ttft_ms_p99"] and r["tpot_ms_p50"] <= r["tpot_ms_p99"]
        # the KV memory the ceiling was computed with: the engine's, which holds every request; none for HF
        assert (r["kv_tokens"] >= max(q.total_len for q in expect.requests)) if r["system"].startswith("loraplex") \
            else r["kv_tokens"] is None
    assert any(q["versus"] == "hf-peft" and q["requests"] == 4 for q in result["ratios"])
    assert any("first 4 of the 6" in n for n in result["notes"])
    assert any("put on the GPU before timing" in n for n in result["notes"])
    preloaded = {(r["popularity"], str(r["max_batch"]), r["requests"]): r.get("preloaded")
                 for r in result["rows"] if r["system"] == "loraplex"}
    assert preloaded[("distinct", "3", 6)] == 6 and preloaded[("identical", "3", 6)] == 1, preloaded
    for r in result["rows"]:
        if r["system"].startswith("loraplex"):   # the run's time, split by step kind, adds up
            mixed = r["steps"] - r["decode_steps"]
            split = (r["decode_steps"] * r["decode_step_ms"] + mixed * r["mixed_step_ms"]) / 1e3 + r["other_seconds"]
            # (seconds: rounded to ms)
            assert r["steps"] > 0 and r["other_seconds"] >= 0 and split == pytest.approx(r["seconds"], abs=1e-3)
            assert r["setup_seconds"] > 0 and r["warmup_seconds"] > 0   # before the clock: what a run needs on top
            assert r["graph_steps"] == r["mixed_graph_steps"] == 0   # the CPU runs every step eagerly
            assert "decode_gpu_ms" not in r and "mixed_gpu_ms" not in r   # GPU spans are CUDA's
            for kind in ("decode", "mixed"):   # each kind's spread of step times, around its mean
                spread = [r[f"{kind}_step_ms_{q}"] for q in ("p50", "p99", "max")]
                assert 0 < spread[0] <= spread[1] <= spread[2] and r[f"{kind}_step_ms"] <= spread[2], (kind, r)
            assert 0 <= r["steps_short_on_adapters"] <= r["steps"] and r["preemptions"] >= 0
            assert sum(r["steps_short_on_adapters_by_tenth"]) == r["steps_short_on_adapters"]
            assert (r["rows_short_on_adapters"] >= r["steps_short_on_adapters"]) and \
                (r["rows_short_on_adapters"] == 0) == (r["steps_short_on_adapters"] == 0)
            assert r["recomputed_tokens"] >= 0 and (r["preemptions"] > 0 or r["recomputed_tokens"] == 0)
            assert 0 < r["schedule_mean_batch"] <= (3 if r["max_batch"] == 3 else 6) and r["schedule_preemptions"] >= 0
            assert r["schedule_recomputed_tokens"] >= 0
            if r["system"] == "loraplex-backbone":   # no loads: the engine schedules as its scheduler alone does,
                # give or take the steps in which its overlapped decodes admit nobody
                assert abs(r["steps"] - r["schedule_steps"]) <= 0.25 * r["schedule_steps"], r
            if r["system"] == "loraplex":   # every adapter was put on the GPU before the clock: no load counts
                assert r["adapter_loads_gpu"] == r["adapter_loads_disk"] == 0, r
            # the run's own steps read at least each output token's context, and at least one adapter a step
            expect = w.head(r["requests"])
            assert r["step_context_tokens"] >= sum(q.prompt_len * q.output_len for q in expect.requests)
            assert (r["step_adapter_reads"] >= r["steps"]) == (r["system"] == "loraplex"), r
            assert r["run_ceiling_tokens_per_s"] > 0
    assert any(q["versus"] == "ceiling over its own steps" for q in result["ratios"])
    # a second copy-bandwidth reading after each engine (and after the transformers baselines), and each row's
    # ceiling at the higher reading: never above the ratio to the first reading's ceiling
    assert len(result["bandwidth_readings_gbs"]) == 1 + 2 + 1   # first; two engines (max batch 3, unlimited); HF
    for r in result["rows"]:
        assert r["bandwidth_after_gbs"] in result["bandwidth_readings_gbs"][1:]
        first = result["bandwidth_gbs"]
        assert r["ceiling_tokens_per_s_high"] == pytest.approx(r["ceiling_tokens_per_s"]
                                                               * max(r["bandwidth_after_gbs"], first) / first)
    by_row = {}
    for q in result["ratios"]:
        by_row.setdefault((q["popularity"], str(q["max_batch"]), q["requests"]), {})[q["versus"]] = q["ratio"]
    highs = [v for v in by_row.values() if "ceiling at the higher copy-bandwidth reading" in v]
    assert len(highs) == len([r for r in result["rows"] if r["system"] == "loraplex"])
    assert all(v["ceiling at the higher copy-bandwidth reading"] <= v["ceiling"] * (1 + 1e-9) for v in highs)
    md = (out / "smoke.md").read_text()
    assert "| distinct | 3 | hf-peft | 4 |" in md and "cpu" in md
    assert "Where loraplex's time went" in md and "| distinct | 3 | loraplex | " in md.split("time went")[1]
    for pop in ("distinct", "identical"):
        assert (out / f"smoke_{pop}.png").stat().st_size > 1000
    assert not (out / "smoke.partial.json").exists()


def test_the_ceiling_over_a_run_s_own_steps_equals_the_reference_schedule_s_where_they_are_the_same(tmp_path):
    """At max batch 1 the engine runs the reference schedule's steps exactly (one request at a time, its prompt
    in its first step): the ceiling summed over the run's own steps must be the reference ceiling."""
    base, _ = make_text_model(tmp_path / "m")
    out = tmp_path / "results"
    assert main(["bench", "--model", str(base), "--device", "cpu", "--requests", "3", "--systems", "loraplex",
                 "--popularity", "distinct", "--max-batch", "1", "--lengths", "punica", "--max-len", "24",
                 "--rank", "4", "--out-dir", str(out), "--name", "one", "--quiet", "--no-plots"]) == 0
    [row] = json.loads((out / "one.json").read_text())["rows"]
    assert row["steps"] == row["ceiling_steps"] == row["output_tokens"]
    assert row["step_adapter_reads"] == row["steps"]
    assert row["run_ceiling_tokens_per_s"] == pytest.approx(row["ceiling_tokens_per_s"], rel=1e-12)


def test_run_ceiling_sums_each_part():
    from loraplex.bench.ceiling import StepBytes, run_ceiling_tokens_per_s
    sb = StepBytes(weights=1000, kv_per_token=10, adapter=100)
    # 4 steps (4000 B), 50 context tokens (500 B), 5 adapter reads (500 B): 5000 B at 1 GB/s = 5 µs for 20 tokens
    got = run_ceiling_tokens_per_s(sb, 1.0, 20, steps=4, context_tokens=50, adapter_reads=5)
    assert got == pytest.approx(20 / 5e-6)
    with pytest.raises(ValueError, match="bandwidth_gbs must be positive"):
        run_ceiling_tokens_per_s(sb, 0.0, 20, steps=4, context_tokens=50, adapter_reads=5)


def test_gpu_spans_give_means_and_spreads_of_each_step_kind():
    from types import SimpleNamespace

    from loraplex.bench.run_loraplex import _gpu_ms
    span = lambda s: SimpleNamespace(seconds=lambda: s)  # noqa: E731
    decode = [span(0.010)] * 98 + [span(0.020), span(0.500)]
    got = _gpu_ms(torch.device("cuda"), {True: decode, False: [span(0.030)]})
    assert got["decode_gpu_ms"] == pytest.approx((98 * 10 + 20 + 500) / 100)
    spread = (got["decode_gpu_ms_p50"], got["decode_gpu_ms_p99"], got["decode_gpu_ms_max"])
    assert spread == pytest.approx((10, 500, 500))
    assert got["mixed_gpu_ms"] == got["mixed_gpu_ms_max"] == pytest.approx(30)
    assert _gpu_ms(torch.device("cpu"), {True: decode, False: []}) == {}


def test_load_stats_of_a_run():
    from loraplex.bench.run_loraplex import _load_stats
    times = [("disk", 0.3), ("gpu", 0.01), ("disk", 0.1), ("disk", 0.2), ("gpu", 0.03), ("slot_wait", 0.5)] \
        + [("disk", 1.0)] * 7
    assert _load_stats(times) == dict(adapter_loads_disk=10, adapter_load_disk_s_p50=1.0, adapter_load_disk_s_p90=1.0,
                                      adapter_loads_slot_wait=1, adapter_load_slot_wait_s_p50=0.5,
                                      adapter_load_slot_wait_s_p90=0.5, adapter_loads_copy_issue=0,
                                      adapter_loads_gpu=2, adapter_load_gpu_s_p50=0.03, adapter_load_gpu_s_p90=0.03,
                                      # the start-up's loads apart (here all: fewer than START_LOADS), in run order
                                      adapter_load_disk_s_first_mean=0.76, adapter_load_disk_s_first_max=1.0,
                                      adapter_load_slot_wait_s_first_mean=0.5, adapter_load_slot_wait_s_first_max=0.5,
                                      adapter_load_gpu_s_first_mean=0.02, adapter_load_gpu_s_first_max=0.03)
    from loraplex.bench import run_loraplex
    late = [("disk", 0.9)] * run_loraplex.START_LOADS + [("disk", 0.1)] * 100
    got = _load_stats(late)
    assert got["adapter_load_disk_s_first_mean"] == 0.9 and got["adapter_load_disk_s_p50"] == 0.1
    assert _load_stats([("disk", 0.5), ("disk", 0.1), ("disk", 0.3)])["adapter_load_disk_s_p50"] == 0.3
    assert _load_stats([]) == dict(adapter_loads_disk=0, adapter_loads_slot_wait=0, adapter_loads_copy_issue=0,
                                   adapter_loads_gpu=0)


def test_bench_command_refuses_bad_settings(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--popularity zipfy"):
        main(["bench", "--popularity", "zipfy", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--max-batch 0"):
        main(["bench", "--max-batch", "0", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--gpu-adapters"):
        main(["bench", "--gpu-adapters", "0", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--loader-threads must be at least 1, got 0"):
        main(["bench", "--loader-threads", "0", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--cpu-adapters must be at least 0, got -1"):
        main(["bench", "--cpu-adapters", "-1", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--admission-lookahead must be at least 0, got -1"):
        main(["bench", "--admission-lookahead", "-1", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--baseline-requests"):
        main(["bench", "--requests", "5", "--baseline-requests", "9", "--device", "cpu"])


def test_distinct_adapters_are_each_loaded_once_by_the_real_cache(tmp_path):
    """One adapter per request, more requests than GPU slots, through the real engine and adapter cache:
    every adapter is read and copied into a slot exactly once (no load is evicted before its request
    runs), and the warm-up's adapters are its own."""
    from loraplex.bench.run_loraplex import LoraplexSystem, engine_config
    base, _ = make_text_model(tmp_path / "m")
    config = engine_config(str(base), max_batch=2, rank=4, max_len=16, device="cpu", dtype="float32",
                           max_gpu_adapters=4, max_cpu_adapters=3, enforce_eager=True)
    system = LoraplexSystem(config, num_adapters=12)
    try:
        w = make_workload(12, "distinct", lengths="fixed", prompt_len=3, output_len=3, max_len=16, seed=1)
        prompts = w.prompt_ids(system.vocab_size)
        system.warm_up(w, prompts)
        cache = system.engine.adapters
        assert not any(name in cache.resident() for name in (f"a{i}" for i in range(12)))
        before = dict(cache.counters)
        result = system.run(w, prompts, backbone=False, name="loraplex", progress=False)
        assert result.output_tokens == 12 * 3
        loads = {k: cache.counters[k] - before[k] for k in before}
        assert loads["gpu_loads"] == 12 and loads["disk_reads"] == 12, loads
        # every load's stages were timed (the "gpu" one as the engine's steps polled it)
        assert all(result.extra[f"adapter_loads_{stage}"] == 12 for stage in ("disk", "slot_wait", "copy_issue",
                                                                                "gpu")), result.extra
        # preloading puts the first adapters (as many as the slots) on the GPU before the clock starts
        again = system.run(w.head(6), prompts, backbone=False, name="pre", progress=False, preload=True)
        assert again.extra["preloaded"] == 4 and again.output_tokens == 6 * 3
    finally:
        system.close()


def test_report_merges_runs_and_compares_only_rows_of_the_same_workload(tmp_path):
    from loraplex.bench.report import main as report_main

    def run(lengths, rows, **workload):
        return dict(gpu="G", date="2026-11-30", torch="t", model="dummy:m", layers=None, dtype="bfloat16", rank=16,
                    bandwidth_gbs=1000.0, rows=rows, ratios=[], notes=[f"note {lengths}"],
                    workload=dict(requests=rows[0]["requests"], lengths=lengths, max_len=64, seed=0, **workload))

    def row(system, tps, requests):
        return dict(system=system, popularity="distinct", max_batch=2, requests=requests, tokens_per_s=tps,
                    requests_per_s=1.0, ttft_ms_p50=1.0, ttft_ms_p99=2.0, tpot_ms_p50=1.0, tpot_ms_p99=2.0,
                    ceiling_tokens_per_s=400.0)
    a = run("punica", [row("loraplex", 300.0, 4), row("loraplex-backbone", 400.0, 4)])
    b = run("fixed", [row("loraplex", 200.0, 4), row("hf-peft", 2.0, 4)], prompt_len=8, output_len=4)
    paths = []
    for i, r in enumerate((a, b)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(r))
    assert report_main([str(p) for p in paths] + ["--out-dir", str(tmp_path), "--name", "all"]) == 0
    merged = json.loads((tmp_path / "all.json").read_text())
    got = {(q["lengths"], q["versus"]): round(q["ratio"], 3) for q in merged["ratios"]}
    # punica's loraplex is compared with punica's backbone only, fixed's with fixed's hf-peft only
    assert got == {("punica ≤64", "loraplex-backbone"): 0.75, ("punica ≤64", "ceiling"): 0.75,
                   ("fixed 8+4", "hf-peft"): 100.0, ("fixed 8+4", "ceiling"): 0.5}
    table = (tmp_path / "all.md").read_text()
    assert "| fixed 8+4 | distinct | 2 | hf-peft | 4 |" in table and "fixed 8+4: note fixed" in table
    assert (tmp_path / "all_distinct.png").stat().st_size > 0
    assert "run on" not in table   # one date: nothing to say
    paths[1].write_text(json.dumps(dict(b, date="2026-12-01")))
    assert report_main([str(p) for p in paths] + ["--out-dir", str(tmp_path), "--name", "dated"]) == 0
    table = (tmp_path / "dated.md").read_text()
    assert "Where loraplex's time went" not in table   # these rows did not record it
    assert "run on 2026-11-30: punica ≤64 loraplex (max batch 2), punica ≤64 loraplex-backbone (max batch 2)" in table
    assert "run on 2026-12-01: fixed 8+4 loraplex (max batch 2), fixed 8+4 hf-peft (max batch 2)" in table
    # settings the runs disagree on leave the top level for the rows of each run; --note adds a line
    paths[1].write_text(json.dumps(dict(b, torch="t2", loader_threads=3)))
    assert report_main([str(p) for p in paths] + ["--out-dir", str(tmp_path), "--name", "settings",
                                                 "--note", "said by hand"]) == 0
    merged = json.loads((tmp_path / "settings.json").read_text())
    assert "torch" not in merged and "loader_threads" not in merged and merged["rank"] == 16
    by_system = {(r["lengths"], r["system"]): r for r in merged["rows"]}
    assert by_system["fixed 8+4", "hf-peft"]["run_settings"] == dict(torch="t2", loader_threads=3)
    assert by_system["punica ≤64", "loraplex"]["run_settings"] == dict(torch="t")
    assert "- said by hand" in (tmp_path / "settings.md").read_text()
    paths[1].write_text(json.dumps(dict(b, model="dummy:other")))
    with pytest.raises(SystemExit, match="different model"):
        report_main([str(p) for p in paths] + ["--out-dir", str(tmp_path), "--name", "bad"])


def test_each_popularity_s_chart_shows_the_backbone_of_the_same_run(tmp_path, monkeypatch):
    """Backbone rows (no adapters) are the same for every popularity: each chart draws them beside its own."""
    import matplotlib.axes

    from loraplex.bench.report import plot
    drawn = []

    def bar(self, x, heights, **kw):
        drawn.append(list(heights))
        return original(self, x, heights, **kw)
    original = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", bar)

    def row(system, popularity, tps, max_batch=32):
        return dict(system=system, popularity=popularity, max_batch=max_batch, requests=8, tokens_per_s=tps)
    rows = [row("loraplex", "distinct", 300.0), row("loraplex-backbone", "distinct", 400.0),
            row("loraplex-backbone", "distinct", 700.0, max_batch=None), row("loraplex", "skewed", 350.0)]
    paths = plot(dict(rows=rows, model="dummy:m", gpu="G", date="d"), tmp_path, "t")
    assert [p.name for p in paths] == ["t_distinct.png", "t_skewed.png"]
    # skewed: its loraplex row and the backbone of the same max batch and requests, not the unlimited one
    assert drawn == [[300.0, 400.0, 700.0], [350.0, 400.0]]


def test_steps_short_on_adapters_by_tenth_of_the_run():
    """run_loraplex._short_on_adapters: the held-back steps, the rows they lacked, and when in the run they fell
    (a step at the very end counts in the last tenth)."""
    from loraplex.bench.run_loraplex import _short_on_adapters
    got = _short_on_adapters([(0.0, 3), (0.5, 1), (9.99, 2), (10.0, 5), (4.2, 4)], seconds=10.0)
    assert got == dict(steps_short_on_adapters=5, rows_short_on_adapters=15,
                       steps_short_on_adapters_by_tenth=[2, 0, 0, 0, 1, 0, 0, 0, 0, 2], last_short_on_adapters_s=10.0)
    assert _short_on_adapters([], seconds=3.0)["last_short_on_adapters_s"] == 0.0
    assert _short_on_adapters([], seconds=3.0)["steps_short_on_adapters_by_tenth"] == [0] * 10


def test_pinned_growth_of_a_run():
    """run_loraplex._pinned_growth: the fresh page-locked allocations a run made and their seconds (nothing off
    CUDA, where _pinned_allocs is None)."""
    from loraplex.bench.run_loraplex import _pinned_allocs, _pinned_growth
    assert _pinned_growth({"count": 3, "us": 1_000}, {"count": 10, "us": 251_000}) == dict(
        pinned_host_allocs=7, pinned_host_alloc_s=0.25)
    assert _pinned_growth(None, None) == {}
    if not torch.cuda.is_available():
        assert _pinned_allocs() is None


def test_span_stats_say_when_the_longest_span_fell():
    """run_loraplex._span_stats: means, spread, and the run time of each kind's longest GPU span."""
    from loraplex.bench.run_loraplex import _span_stats
    got = _span_stats({True: [0.008, 0.3, 0.009], False: [0.01]}, {True: [0.5, 1.25, 2.0], False: [0.1]})
    assert got["decode_gpu_ms_max"] == pytest.approx(300.0) and got["decode_gpu_ms_max_at_s"] == 1.25
    assert got["mixed_gpu_ms_max_at_s"] == 0.1 and got["decode_gpu_ms"] == pytest.approx(1e3 * 0.317 / 3)
    assert "decode_gpu_ms_max_at_s" not in _span_stats({True: [0.01], False: []}, None)


def test_bench_runs_fp8_weights_and_kv_and_counts_their_bytes(tmp_path):
    """--quantization fp8 --kv-cache-dtype fp8 run and are recorded; the ceiling counts the projections' weights and
    the KV at one byte a value, the rest (and the adapters) in the model's dtype."""
    from loraplex.models.presets import preset_config
    base, _ = make_text_model(tmp_path / "m")
    out = tmp_path / "results"
    code = main(["bench", "--model", str(base), "--device", "cpu", "--requests", "3", "--systems", "loraplex",
                 "--popularity", "distinct", "--max-batch", "2", "--max-len", "24", "--rank", "4",
                 "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--out-dir", str(out), "--name", "fp8",
                 "--quiet", "--no-plots"])
    assert code == 0
    result = json.loads((out / "fp8.json").read_text())
    assert result["quantization"] == "fp8" and result["kv_cache_dtype"] == "fp8"
    assert all(r["tokens_per_s"] > 0 for r in result["rows"])
    c = preset_config("llama-2-7b")
    dense, fp8 = StepBytes.of(c, 16, 2), StepBytes.of(c, 16, 2, projection_bytes=1, kv_bytes=1)
    projections = sum(i * o for i, o in (c.projection_shape(p) for p in
                                         ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")))
    assert dense.weights - fp8.weights == c.num_hidden_layers * projections
    assert fp8.kv_per_token * 2 == dense.kv_per_token and fp8.adapter == dense.adapter
