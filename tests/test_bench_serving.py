"""benchmarks/bench_serving.py against a real server (uvicorn in a thread, the tiny text model):
the JSON, markdown and plot it writes, a --launch command that dies, and the arrival times."""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import server_fixtures

KEY = server_fixtures.KEY
model, server = server_fixtures.model, server_fixtures.server   # the module-scoped tiny model and server

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("matplotlib")

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("bench_serving", BENCHMARKS / "bench_serving.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_poisson_arrivals_have_mean_gap_one_over_rate_and_repeat_with_the_seed(bench):
    times = bench.poisson_arrivals(20000, 4.0, seed=3)
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert np.all(gaps >= 0) and abs(gaps.mean() - 0.25) < 0.01
    assert abs(gaps.std() - 0.25) < 0.01                    # exponential: std = mean
    assert np.array_equal(times, bench.poisson_arrivals(20000, 4.0, seed=3))
    assert not np.array_equal(times, bench.poisson_arrivals(20000, 4.0, seed=4))
    assert np.allclose(bench.poisson_arrivals(50, 2.0, seed=1), bench.poisson_arrivals(50, 8.0, seed=1) * 4)
    with pytest.raises(ValueError, match="rate"):
        bench.poisson_arrivals(5, 0.0, seed=0)


def test_records_count_tokens_per_chunk_and_rows_follow_the_definitions(bench):
    import serving_report as report
    rec = report.RequestRecord(0, "poet", prompt_len=4, output_len=5, scheduled_s=0.09, sent_s=0.1)

    def lp(n: int) -> dict:
        return {"tokens": ["t"] * n, "token_logprobs": [0.0] * n, "top_logprobs": [{}] * n, "text_offset": [0] * n}

    rec.add_event({"choices": [{"index": 0, "text": "", "logprobs": lp(1), "finish_reason": None}]}, 0.3)
    rec.add_event({"choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]}, 0.35)  # no token
    rec.add_event({"choices": [{"index": 0, "text": "ab", "logprobs": lp(2), "finish_reason": None}]}, 0.4)
    rec.add_event({"choices": [{"index": 0, "text": "c", "logprobs": None, "finish_reason": "length"}]}, 0.5)
    rec.add_event({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}}, 0.5)
    rec.end_s = 0.5
    assert rec.first_token_s == 0.3 and rec.chunk_tokens == [1, 2, 1] and rec.completion_tokens == 5
    assert rec.finish_reason == "length" and rec.ok
    with pytest.raises(report.StreamError, match="boom"):
        rec.add_event({"error": {"message": "boom"}}, 0.6)
    failed = report.RequestRecord(1, "poet", 4, 5, 0.2, sent_s=0.2, error="APIStatusError: 400")
    unsent = report.RequestRecord(2, "poet", 4, 5, 9.0)
    row = report.summarize(2.0, [rec, failed, unsent], client_cpu=0.5)
    assert (row["sent"], row["completed"], row["errors"], row["not_sent"]) == (2, 1, 1, 1)
    assert row["error_messages"] == {"APIStatusError: 400": 1} and row["output_tokens"] == 5
    assert row["ttft_ms"]["p50"] == pytest.approx(200) and row["tpot_ms"]["p50"] == pytest.approx(50)
    assert row["itl_ms"]["p50"] == pytest.approx(100) and row["e2e_ms"]["p99"] == pytest.approx(400)
    assert row["makespan_s"] == pytest.approx(0.4) and row["achieved_rps"] == pytest.approx(2.5)
    assert report.client_bound(row) is None and report.client_bound({**row, "client_cpu": 0.95})


def test_benchmark_against_a_running_server_writes_json_markdown_and_plot(bench, server, tmp_path):
    out, md, png = tmp_path / "serving.json", tmp_path / "serving.md", tmp_path / "serving.png"
    vocab = server.state.vocab_size
    result = bench.main(["--url", server.url + "/v1", "--api-key", KEY, "--rates", "2,4", "--requests", "6",
                         "--popularity", "uniform", "--lengths", "fixed", "--prompt-len", "8", "--output-len", "6",
                         "--vocab-size", str(vocab), "--warmup", "2", "--seed", "0", "--raw",
                         "--out", str(out), "--md", str(md), "--plot", str(png)])
    assert json.loads(out.read_text()) == result
    assert result["server"]["base_model"] == "base" and result["server"]["adapters_served"] >= 3
    assert result["workload"]["output_tokens"] == 36 and result["workload"]["adapters_used"] >= 2
    assert [row["rate_rps"] for row in result["rows"]] == [2.0, 4.0]
    for row in result["rows"]:
        assert row["requests"] == row["sent"] == row["completed"] == 6, row
        assert row["errors"] == 0 and row["error_messages"] == {} and row["short_outputs"] == 0
        assert row["output_tokens"] == 36 and row["prompt_tokens"] == 48
        assert row["achieved_rps"] > 0 and row["output_tok_s"] > 0 and row["makespan_s"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = row[key]
            assert 0 <= s["p50"] <= s["p90"] <= s["p99"], (key, s)
        assert row["ttft_ms"]["p99"] <= row["e2e_ms"]["p99"]
    raw = result["raw"]["2"]
    assert len(raw) == 6 and all(r["completion_tokens"] == 6 and sum(r["chunk_tokens"]) == 6 for r in raw)
    assert all(r["sent_s"] <= r["first_token_s"] <= r["end_s"] for r in raw)
    text = md.read_text()
    assert "| offered req/s" in text and "GPU: " in text and text.count("\n| ") >= 3
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    server.wait_idle()


def test_benchmark_counts_failed_requests_without_crashing(bench, server, tmp_path):
    # prompt ids past the model's vocabulary: every request is refused (400), the run still reports
    vocab = server.state.vocab_size
    result = bench.main(["--url", server.url + "/v1", "--api-key", KEY, "--rates", "50", "--requests", "3",
                         "--lengths", "fixed", "--prompt-len", "64", "--output-len", "2", "--warmup", "0",
                         "--vocab-size", str(vocab * 100), "--out", str(tmp_path / "bad.json")])
    row = result["rows"][0]
    assert row["completed"] == 0 and row["errors"] == 3 and row["achieved_rps"] is None
    assert "vocabulary" in next(iter(row["error_messages"])) and row["ttft_ms"]["p50"] is None


def test_launch_of_a_command_that_exits_gives_a_clear_error(bench, tmp_path):
    command = f"{sys.executable} -c \"import sys; print('no model here'); sys.exit(3)\""
    start = time.monotonic()
    with pytest.raises(bench.BenchError, match=r"exited with code 3(.|\n)*no model here"):
        bench.main(["--launch", command, "--launch-timeout-s", "60", "--requests", "2",
                    "--server-log", str(tmp_path / "server.log"), "--out", str(tmp_path / "x.json")])
    assert time.monotonic() - start < 30
    assert not (tmp_path / "x.json").exists()
