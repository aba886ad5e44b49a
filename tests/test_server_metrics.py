"""ServerMetrics: what is recorded is what /metrics shows, parsed back with prometheus_client's own parser."""
from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from loraplex.server.metrics import TIERS, TTFT_BUCKETS, EngineSnapshot, ServerMetrics


def scrape(m: ServerMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)], from the rendered text."""
    body, content_type = m.render()
    assert content_type == CONTENT_TYPE_LATEST
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    matches = [v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} samples"
    return matches[0]


def snapshot(**kw) -> EngineSnapshot:
    base = {"num_running": 0, "num_waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 100,
            "running_adapters": [], "waiting_adapters": [], "adapters_by_tier": {}, "max_gpu_adapters": 4}
    return EngineSnapshot(**{**base, **kw})


def finish(m: ServerMetrics, adapter: str | None, outcome: str = "stop", **kw) -> None:
    args = {"prompt_tokens": 10, "output_tokens": 5, "ttft_s": 0.1, "e2e_s": 1.0, "tpot_s": 0.02}
    m.request_finished(adapter, outcome, **{**args, **kw})


def test_finished_requests_counted_with_histograms():
    m = ServerMetrics()
    ttfts = [0.02, 0.4, 3.0]
    for i, t in enumerate(ttfts):
        finish(m, "a", prompt_tokens=10 + i, output_tokens=4, ttft_s=t, e2e_s=2 * t + 1, tpot_s=0.01)
    finish(m, "a", "length", ttft_s=None, e2e_s=None, tpot_s=None)
    finish(m, None)
    s = scrape(m)
    assert value(s, "loraplex_requests_total", adapter="a", outcome="stop") == 3
    assert value(s, "loraplex_requests_total", adapter="a", outcome="length") == 1
    assert value(s, "loraplex_requests_total", adapter="base", outcome="stop") == 1
    assert value(s, "loraplex_prompt_tokens_total", adapter="a") == 10 + 11 + 12 + 10
    assert value(s, "loraplex_generation_tokens_total", adapter="a") == 3 * 4 + 5

    # None latencies are not observed: the request that hit its length limit without timings is absent.
    assert value(s, "loraplex_time_to_first_token_seconds_count", adapter="a") == 3
    assert value(s, "loraplex_time_to_first_token_seconds_sum", adapter="a") == pytest.approx(sum(ttfts))
    for le in TTFT_BUCKETS:
        expected = sum(t <= le for t in ttfts)
        assert value(s, "loraplex_time_to_first_token_seconds_bucket", adapter="a", le=str(le)) == expected
    assert value(s, "loraplex_time_to_first_token_seconds_bucket", adapter="a", le="+Inf") == 3
    assert value(s, "loraplex_e2e_request_latency_seconds_sum", adapter="a") == pytest.approx(
        sum(2 * t + 1 for t in ttfts))
    assert value(s, "loraplex_time_per_output_token_seconds_count", adapter="a") == 3
    assert value(s, "loraplex_time_per_output_token_seconds_bucket", adapter="a", le="0.001") == 0
    assert value(s, "loraplex_time_per_output_token_seconds_bucket", adapter="a", le="0.01") == 3


def test_rejections_count_twice_and_do_not_claim_labels():
    m = ServerMetrics(max_adapter_labels=2)
    finish(m, "known")
    m.request_rejected("known", 429)
    m.request_rejected("known", 429)
    m.request_rejected("", 400)
    for i in range(5):                      # made-up model names: 404s must not use up the label budget
        m.request_rejected(f"nope{i}", 404)
    finish(m, "later")                      # still gets its own label
    s = scrape(m)
    assert value(s, "loraplex_requests_total", adapter="known", outcome="rejected") == 2
    assert value(s, "loraplex_requests_rejected_total", adapter="known", status="429") == 2
    assert value(s, "loraplex_requests_rejected_total", adapter="base", status="400") == 1
    assert value(s, "loraplex_requests_rejected_total", adapter="other", status="404") == 5
    assert value(s, "loraplex_requests_total", adapter="later", outcome="stop") == 1


def test_adapter_label_cap():
    m = ServerMetrics(max_adapter_labels=3)
    assert m.adapter_label("") == "base" and m.adapter_label(None) == "base"
    for i in range(10):
        finish(m, f"ad{i}")
    finish(m, "")
    s = scrape(m)
    labels = {lab["adapter"] for lab, _ in s["loraplex_requests_total"]}
    assert labels == {"ad0", "ad1", "ad2", "other", "base"}
    assert value(s, "loraplex_requests_total", adapter="other", outcome="stop") == 7
    assert m.adapter_label("ad1") == "ad1" and m.adapter_label("ad9") == "other"


def test_tenant_counters_and_their_label_cap():
    m = ServerMetrics(max_tenant_labels=2)
    for tenant in ("acme", "globex", "initech", "umbrella", None):
        finish(m, "ad", tenant=tenant, prompt_tokens=3, output_tokens=5)
    m.request_rejected("ad", 404, tenant="acme")
    s = scrape(m)
    assert {lab["tenant"] for lab, _ in s["loraplex_tenant_requests_total"]} == {"acme", "globex", "other", "none"}
    assert value(s, "loraplex_tenant_requests_total", tenant="other", outcome="stop") == 2
    assert value(s, "loraplex_tenant_requests_total", tenant="acme", outcome="rejected") == 1
    assert value(s, "loraplex_tenant_generation_tokens_total", tenant="other") == 10
    assert value(s, "loraplex_tenant_prompt_tokens_total", tenant="none") == 3
    with pytest.raises(ValueError, match="max_tenant_labels"):
        ServerMetrics(max_tenant_labels=-1)


def test_adapter_label_is_thread_safe():
    m = ServerMetrics(max_adapter_labels=50)
    seen: list[str] = []
    lock = threading.Lock()

    def work(k: int) -> None:
        got = [m.adapter_label(f"x{(k * 37 + i) % 200}") for i in range(200)]
        with lock:
            seen.extend(got)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen) - {"other"}) == 50
    # Once named, always named: every thread agrees.
    assert all(m.adapter_label(name) == name for name in set(seen) - {"other"})


def test_step_histograms():
    m = ServerMetrics()
    for tokens, seqs in [(1, 1), (300, 12), (8192, 256), (9000, 3)]:
        m.observe_step(tokens, seqs)
    s = scrape(m)
    assert value(s, "loraplex_step_tokens_count") == 4
    assert value(s, "loraplex_step_tokens_sum") == 1 + 300 + 8192 + 9000
    assert value(s, "loraplex_step_tokens_bucket", le="1.0") == 1
    assert value(s, "loraplex_step_tokens_bucket", le="512.0") == 2
    assert value(s, "loraplex_step_tokens_bucket", le="8192.0") == 3
    assert value(s, "loraplex_step_tokens_bucket", le="+Inf") == 4
    assert value(s, "loraplex_step_sequences_sum") == 1 + 12 + 256 + 3


def test_engine_gauges_tiers_and_kv_fraction():
    m = ServerMetrics()
    s = scrape(m)
    assert {lab["tier"]: v for lab, v in s["loraplex_adapters"]} == {t: 0 for t in TIERS}
    m.set_engine(snapshot(num_running=7, num_waiting=3, kv_blocks_used=25, kv_blocks_total=200,
                          adapters_by_tier={"gpu": 4, "disk": 9}))
    s = scrape(m)
    assert value(s, "loraplex_num_requests_running") == 7
    assert value(s, "loraplex_num_requests_waiting") == 3
    assert value(s, "loraplex_kv_cache_usage_ratio") == pytest.approx(0.125)
    assert {lab["tier"]: v for lab, v in s["loraplex_adapters"]} == {
        "gpu": 4, "cpu": 0, "disk": 9, "loading": 0, "failed": 0}
    # A tier that empties goes back to zero instead of keeping its old value.
    m.set_engine(snapshot(adapters_by_tier={"cpu": 2}, kv_blocks_total=0))
    s = scrape(m)
    assert {lab["tier"]: v for lab, v in s["loraplex_adapters"]} == {
        "gpu": 0, "cpu": 2, "disk": 0, "loading": 0, "failed": 0}
    assert value(s, "loraplex_kv_cache_usage_ratio") == 0


def test_vllm_gateway_series():
    m = ServerMetrics()
    assert "vllm:lora_requests_info" not in scrape(m)    # no sample before the first snapshot
    m.set_engine(snapshot(num_running=2, num_waiting=5, kv_blocks_used=30, kv_blocks_total=120,
                          running_adapters=["b", "a", ""], waiting_adapters=["c"], max_gpu_adapters=8))
    s = scrape(m)
    assert value(s, "vllm:num_requests_waiting") == 5
    assert value(s, "vllm:num_requests_running") == 2
    assert value(s, "vllm:gpu_cache_usage_perc") == pytest.approx(0.25)
    assert value(s, "vllm:kv_cache_usage_perc") == pytest.approx(0.25)
    [(labels, stamp)] = s["vllm:lora_requests_info"]
    assert labels == {"running_lora_adapters": "a,b", "waiting_lora_adapters": "c", "max_lora": "8"}
    assert abs(stamp - time.time()) < 5

    before = stamp
    time.sleep(0.01)
    m.set_engine(snapshot(running_adapters=["c", "d"], waiting_adapters=[], max_gpu_adapters=8))
    s = scrape(m)
    [(labels, stamp)] = s["vllm:lora_requests_info"]       # the old label set is gone
    assert labels == {"running_lora_adapters": "c,d", "waiting_lora_adapters": "", "max_lora": "8"}
    assert stamp > before and abs(stamp - time.time()) < 5
    text = m.render()[0].decode()
    assert "# TYPE vllm:lora_requests_info gauge" in text
    assert text.count("vllm:lora_requests_info{") == 1


def test_adapter_load_histogram():
    m = ServerMetrics()
    m.adapter_loaded(0.002, "register")
    m.adapter_loaded(0.3, "disk")
    m.adapter_loaded(0.01, "gpu")
    m.adapter_loaded(0.02, "gpu")
    m.adapter_loaded(0.04, "slot_wait")
    m.adapter_loaded(0.001, "copy_issue")
    s = scrape(m)
    assert value(s, "loraplex_adapter_load_seconds_count", stage="gpu") == 2
    assert value(s, "loraplex_adapter_load_seconds_count", stage="slot_wait") == 1
    assert value(s, "loraplex_adapter_load_seconds_sum", stage="copy_issue") == pytest.approx(0.001)
    assert value(s, "loraplex_adapter_load_seconds_sum", stage="gpu") == pytest.approx(0.03)
    assert value(s, "loraplex_adapter_load_seconds_bucket", stage="disk", le="0.25") == 0
    assert value(s, "loraplex_adapter_load_seconds_bucket", stage="disk", le="0.5") == 1


def test_instances_do_not_share_state():
    m1, m2 = ServerMetrics(max_adapter_labels=1), ServerMetrics(max_adapter_labels=1)
    finish(m1, "a")
    m1.set_engine(snapshot(num_waiting=9, running_adapters=["a"]))
    finish(m2, "b")                          # m1's label budget is not m2's
    s1, s2 = scrape(m1), scrape(m2)
    assert value(s2, "loraplex_requests_total", adapter="b", outcome="stop") == 1
    assert "a" not in {lab["adapter"] for lab, _ in s2["loraplex_requests_total"]}
    assert value(s1, "vllm:num_requests_waiting") == 9
    assert value(s2, "vllm:num_requests_waiting") == 0
    assert "vllm:lora_requests_info" not in s2


def test_bad_inputs_raise():
    m = ServerMetrics()
    with pytest.raises(ValueError, match="outcome"):
        finish(m, "a", "timeout")
    with pytest.raises(ValueError, match="prompt_tokens"):
        finish(m, "a", prompt_tokens=-1)
    with pytest.raises(ValueError, match="ttft_s"):
        finish(m, "a", ttft_s=float("nan"))
    with pytest.raises(ValueError, match="status"):
        m.request_rejected("a", 42)
    with pytest.raises(ValueError, match="stage"):
        m.adapter_loaded(0.1, "network")
    with pytest.raises(ValueError, match="tier"):
        snapshot(adapters_by_tier={"ssd": 1})
    with pytest.raises(ValueError, match="kv_blocks_used"):
        snapshot(kv_blocks_used=5, kv_blocks_total=4)
    with pytest.raises(ValueError, match="max_adapter_labels"):
        ServerMetrics(max_adapter_labels=-1)
    # Nothing half-recorded by the refused calls.
    assert "loraplex_requests_total" not in scrape(m)
