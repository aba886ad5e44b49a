"""The server under bad input, overload, disconnects and shutdown: clear OpenAI-style errors, and
nothing else breaks."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_fixtures import ADMIN, KEY, SERVER_ENGINE, auth, client, model, post, server  # noqa: F401 (fixtures)

pytest.importorskip("fastapi")

GOOD = {"model": "poet", "prompt": "Hello world", "max_tokens": 4, "temperature": 0}


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    assert len(r.content) < 2000, "error bodies stay short"
    body = r.json()["error"]
    assert body["message"] and body["type"]
    return body


@pytest.mark.parametrize("change, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 300}, "max_tokens"),            # past the 256-token context
    ({"prompt": "word " * 400}, "prompt"),           # longer than the context
    ({"prompt": [5, 7, 320]}, "prompt"),             # a token id outside the vocabulary (320)
    ({"stop_token_ids": [999]}, "stop_token_ids"),
    ({"logit_bias": {"4000": 5}}, "logit_bias"),
    ({"logit_bias": {"7": 500}}, "logit_bias"),
    ({"n": 9}, "n"),
    ({"logprobs": 6}, "logprobs"),
    ({"top_p": 0}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"echo": True}, "echo"),
])
def test_bad_completion_fields_are_400_naming_the_field(server, change, param):
    body = error_of(post(server, "/v1/completions", {**GOOD, **change}), 400)
    assert body["param"] == param, body
    assert body["type"] == "invalid_request_error"


def test_bad_chat_fields_and_bodies(server):
    chat = {"model": "coder", "messages": [{"role": "user", "content": "hi"}]}
    assert error_of(post(server, "/v1/chat/completions", {**chat, "top_logprobs": 21, "logprobs": True}),
                    400)["param"] == "top_logprobs"
    assert error_of(post(server, "/v1/chat/completions", {**chat, "messages": []}), 400)
    assert error_of(post(server, "/v1/chat/completions", {**chat, "max_completion_tokens": 10_000}),
                    400)["param"] == "max_completion_tokens"
    assert "JSON" in error_of(post(server, "/v1/completions", b'{"model": "poet", "prompt": '), 400)["message"]
    assert "object" in error_of(post(server, "/v1/completions", [1, 2, 3]), 400)["message"]
    lone_surrogate = b'{"model": "poet", "prompt": "\\ud800"}'
    assert error_of(post(server, "/v1/completions", lone_surrogate), 400)["param"] == "prompt"
    huge = "x" * 20_000
    body = error_of(post(server, "/v1/completions", {**GOOD, "temperature": huge}), 400)
    assert huge[:100] not in body["message"]


def test_body_over_the_limit_is_413(server):
    big = b'{"model": "poet", "prompt": "' + b"a" * (server.settings.max_body_bytes + 10) + b'"}'
    error_of(post(server, "/v1/completions", big), 413)

    def chunks():   # no Content-Length: the limit holds for streamed bodies too
        for _ in range(server.settings.max_body_bytes // 65536 + 2):
            yield b" " * 65536
    error_of(post(server, "/v1/completions", chunks()), 413)


def test_unknown_model_route_and_keys(server):
    body = error_of(post(server, "/v1/completions", {**GOOD, "model": "nope"}), 404)
    assert body["param"] == "model"
    error_of(httpx.get(server.url + "/v1/nowhere", headers=auth()), 404)
    error_of(post(server, "/v1/completions", GOOD, key=None), 401)
    error_of(post(server, "/v1/completions", GOOD, key="wrong"), 401)
    error_of(httpx.get(server.url + "/v1/models"), 401)
    assert httpx.get(server.url + "/metrics").status_code == 200               # open to scrapers by default
    error_of(httpx.get(server.url + "/v1/adapters", headers=auth(KEY)), 403)   # management needs the admin key
    error_of(httpx.get(server.url + "/v1/adapters", headers=auth("wrong")), 401)
    assert httpx.get(server.url + "/health").json()["status"] == "ok"          # open, no key
    # the key is checked before the body is even parsed
    error_of(post(server, "/v1/completions", {**GOOD, "n": 99}, key=None), 401)
    error_of(post(server, "/v1/completions", b"{not json", key=None), 401)
    error_of(post(server, "/v1/adapters", {"name": "x", "path": "poet"}, key=None), 401)
    error_of(httpx.delete(server.url + "/v1/adapters/poet", headers=auth(KEY)), 403)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()


@contextlib.contextmanager
def slowed(server, seconds: float = 0.02):
    """Each engine step takes `seconds` longer, so requests stay in flight while the test looks."""
    core = server.state.core
    original = core.step

    def slow_step():
        time.sleep(seconds)
        return original()
    core.step = slow_step
    try:
        yield
    finally:
        del core.step


def _slow_streams(server, count: int, max_tokens: int = 200) -> list[httpx.Response]:
    """Open `count` streaming requests and read their first event (they are running)."""
    streams = []
    for i in range(count):
        cm = httpx.stream("POST", server.url + "/v1/completions", headers=auth(), timeout=120,
                          json={"model": ["poet", "coder"][i % 2], "prompt": "Once upon", "max_tokens": max_tokens,
                                "temperature": 1.0, "ignore_eos": True, "stream": True})
        r = cm.__enter__()
        assert r.status_code == 200
        lines = r.iter_lines()   # kept: a dropped iterator closes the connection (a disconnect)
        next(lines)
        streams.append((cm, lines))
    return streams


def test_a_client_that_disconnects_frees_its_request(server):
    with slowed(server):
        streams = _slow_streams(server, 3)
        assert server.state.in_flight == 3
        for cm, _ in streams:
            cm.__exit__(None, None, None)
        server.wait_idle(timeout=2)
        # a whole (non-streamed) request whose client times out is aborted too
        with pytest.raises(httpx.ReadTimeout):
            post(server, "/v1/completions", {**GOOD, "max_tokens": 200, "ignore_eos": True}, timeout=0.5)
        server.wait_idle(timeout=2)
    assert post(server, "/v1/completions", GOOD).status_code == 200


def test_full_queue_is_429_with_retry_after_and_health_stays_up(server):
    old = server.state.settings.max_waiting_requests
    server.state.settings.max_waiting_requests = 0
    limit = server.state.max_in_flight   # max_num_seqs (8) + no queue
    streams = []
    try:
        with slowed(server):
            streams = _slow_streams(server, limit)
            t0 = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            assert time.monotonic() - t0 < 1.0, "health answers while the engine is busy"
            r = post(server, "/v1/completions", GOOD)
            error_of(r, 429)
            assert r.headers["retry-after"] == "1"
    finally:
        server.state.settings.max_waiting_requests = old
        for cm, _ in streams:
            cm.__exit__(None, None, None)
    server.wait_idle()


def test_streamed_text_never_splits_a_character(client, server):
    for seed in range(4):
        whole = client.completions.create(model="poet", prompt="Café crème", max_tokens=40, temperature=1.0,
                                          seed=seed).choices[0].text
        deltas = [c.choices[0].text for c in client.completions.create(
            model="poet", prompt="Café crème", max_tokens=40, temperature=1.0, seed=seed, stream=True)]
        assert "".join(deltas) == whole
        for d in deltas:
            d.encode("utf-8")   # every delta is whole characters (no lone surrogates)
            if "\ufffd" in d:   # a replacement character only where the final text has one
                assert "\ufffd" in whole


def test_metrics_parse_and_count(client, server):
    client.completions.create(model="coder", prompt="Hello", max_tokens=3, temperature=0)
    post(server, "/v1/completions", {**GOOD, "model": "nope"})
    time.sleep(0.3)   # the gauges refresh a few times a second
    text = httpx.get(server.url + "/metrics", headers=auth()).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    done = {(s.labels["adapter"], s.labels["outcome"]): s.value
            for s in families["loraplex_requests"].samples if s.name == "loraplex_requests_total"}
    assert done[("coder", "length")] >= 1
    assert done.get(("other", "rejected"), 0) >= 1
    assert "loraplex_time_to_first_token_seconds" in families
    assert families["vllm:num_requests_waiting"].samples[0].value == 0
    assert 0 <= families["vllm:gpu_cache_usage_perc"].samples[0].value <= 1
    info = families["vllm:lora_requests_info"].samples
    assert len(info) == 1 and info[0].labels["max_lora"] == str(server.state.core.config.max_gpu_adapters)
    assert set(info[0].labels) >= {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
    tiers = {s.labels["tier"]: s.value for s in families["loraplex_adapters"].samples}
    assert sum(tiers.values()) == len(server.state.cache.names())


def test_a_failing_adapter_is_reported_only_to_its_callers(client, server, model):
    root = model[0]
    import shutil
    broken = root / "adapters" / "late-break"
    shutil.copytree(root / "adapters" / "coder", broken)
    assert post(server, "/v1/adapters", {"name": "late-break", "path": "late-break"}, key=ADMIN).status_code == 200
    server.wait_idle()
    # evict it from every tier, then break its file: the next load fails
    deadline = time.monotonic() + 5
    while server.state.cache.state("late-break").value not in ("gpu", "cpu") and time.monotonic() < deadline:
        time.sleep(0.02)
    server.state.cache.unregister("late-break")
    server.state.cache.register("late-break", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    r = post(server, "/v1/completions", {**GOOD, "model": "late-break"})
    assert r.status_code == 424 and "late-break" in r.json()["error"]["message"], r.text
    assert str(broken) not in r.text and "/tmp" not in r.text   # the adapter named, not the server's paths
    assert client.completions.create(model="poet", prompt="Hi", max_tokens=3).choices[0].text is not None
    assert httpx.delete(server.url + "/v1/adapters/late-break", headers=auth(ADMIN)).status_code == 200


def test_sigterm_finishes_requests_in_flight_and_refuses_new_ones(model, tmp_path):
    _, base, adapters = model
    port_file = tmp_path / "port"
    args = [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(base), "--port", "0",
            "--lora", f"poet={adapters['poet']}", "--log-level", "warning"]
    for key, value in SERVER_ENGINE.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "serving" in line and "http://" in line:
                url = line.split("at ")[-1].split(" ")[0].rstrip("/")
                break
        assert url, "".join(lines)
        assert "poet" in lines[-1]
        box: list = []
        streaming = threading.Event()

        def stream():
            try:
                with httpx.stream("POST", url + "/completions", timeout=60,
                                  json={"model": "poet", "prompt": "Once upon", "max_tokens": 120, "temperature": 0,
                                        "ignore_eos": True, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line:
                            box.append(line)
                            streaming.set()
            finally:
                streaming.set()   # (a stream that failed: the asserts below say so)
        thread = threading.Thread(target=stream)
        thread.start()
        streaming.wait(timeout=60)   # its first chunk: the request is in flight
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):
            httpx.post(url + "/completions", json={"model": "poet", "prompt": "x", "max_tokens": 2}, timeout=5)
        thread.join(timeout=60)
        assert box and box[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in box[-2]
        assert proc.wait(timeout=60) == 0   # drained: a clean exit, not death by the re-raised signal
    finally:
        if proc.poll() is None:
            proc.kill()
        port_file.unlink(missing_ok=True)


def test_serve_refuses_a_bad_adapter_at_start(model, tmp_path):
    _, base, _ = model
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    r = subprocess.run([sys.executable, "-m", "loraplex.cli", "serve", "--model", str(base), "--port", "0",
                        "--device", "cpu", "--lora", f"bad={bad}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "adapter_config.json" in r.stderr and "Traceback" not in r.stderr


def test_concurrent_arrivals_cannot_overrun_the_queue_bound(server):
    old = server.state.settings.max_waiting_requests
    server.state.settings.max_waiting_requests = 0
    limit = server.state.max_in_flight
    peak = 0

    async def burst():
        nonlocal peak
        async with httpx.AsyncClient(base_url=server.url, headers=auth(), timeout=120) as c:
            async def one(i):
                nonlocal peak
                r = await c.post("/v1/chat/completions", json={
                    "model": "coder", "messages": [{"role": "user", "content": "hi " * (i % 5 + 1)}],
                    "max_tokens": 20, "temperature": 0, "ignore_eos": True})
                peak = max(peak, server.state.in_flight)
                return r.status_code
            return await asyncio.gather(*[one(i) for i in range(30)])
    try:
        with slowed(server, 0.01):
            statuses = asyncio.run(burst())
    finally:
        server.state.settings.max_waiting_requests = old
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 1 and statuses.count(429) >= 1
    assert peak <= limit
    server.wait_idle()


def test_a_partial_multi_choice_submit_leaves_nothing_behind(server, monkeypatch):
    engine = server.state.engine
    real = engine.submit
    calls = 0

    async def flaky(prompt, params=None, adapter=None, request_id=None):
        nonlocal calls
        calls += 1
        if calls % 3 == 2:
            raise ValueError("injected refusal")
        return await real(prompt, params, adapter, request_id)
    monkeypatch.setattr(engine, "submit", flaky)
    for _ in range(3):
        error_of(post(server, "/v1/completions", {**GOOD, "n": 3, "temperature": 1.0}), 400)
    monkeypatch.undo()
    server.wait_idle()
    deadline = time.monotonic() + 5
    while engine._streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine._streams, "aborted choices must not leave stream entries"
