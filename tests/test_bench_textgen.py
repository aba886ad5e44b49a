"""`loraplex bench` on the CPU: the workload, the ceiling, and a well-formed report from every system
(speed is measured on the GPU, not here)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_fixtures import make_text_model

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
                 "--max-len", "24", "--rank", "4", "--out-dir", str(out), "--name", "smoke", "--quiet"])
    assert code == 0
    result = json.loads((out / "smoke.json").read_text())
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
    assert any(q["versus"] == "hf-peft" and q["requests"] == 4 for q in result["ratios"])
    assert result["notes"] and "first 4 of the 6" in result["notes"][0]
    md = (out / "smoke.md").read_text()
    assert "| distinct | 3 | hf-peft | 4 |" in md and "cpu" in md
    for pop in ("distinct", "identical"):
        assert (out / f"smoke_{pop}.png").stat().st_size > 1000
    assert not (out / "smoke.partial.json").exists()


def test_bench_command_refuses_bad_settings(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--popularity zipfy"):
        main(["bench", "--popularity", "zipfy", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--max-batch 0"):
        main(["bench", "--max-batch", "0", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--baseline-requests"):
        main(["bench", "--requests", "5", "--baseline-requests", "9", "--device", "cpu"])
