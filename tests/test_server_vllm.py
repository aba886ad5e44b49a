"""What vLLM users expect of the server: /v1/load_lora_adapter and /v1/unload_lora_adapter, batches of
prompts in /v1/completions, /openapi.json, /docs, /version, and /metrics open to scrapers."""
from __future__ import annotations

import json
from collections import defaultdict

import httpx
import openai
import pytest

from server_fixtures import ADMIN, KEY, auth, client, model, post, server  # noqa: F401 (fixtures)

pytest.importorskip("fastapi")

PROMPTS = ["Hello world", "Once upon", "def f(x):"]


def one(client, model: str, prompt, max_tokens: int = 8) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0).choices[0].text


# ---- 8: vLLM's adapter routes ------------------------------------------------------------------
def test_load_and_unload_lora_adapter_as_vllm_does(server, client):
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "v-poet", "lora_path": "poet", "lora_int_id": 7},
             key=ADMIN)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'v-poet' added successfully."
    assert "v-poet" in {m.id for m in client.models.list().data}
    assert one(client, "v-poet", "Hello world") == one(client, "poet", "Hello world")
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "v-poet", "lora_path": "poet"},
                key=ADMIN).json()["error"]["param"] == "lora_name"   # 409: already served
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "v-poet"}, key=ADMIN)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'v-poet' removed successfully."
    with pytest.raises(openai.NotFoundError):
        one(client, "v-poet", "Hello world")
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "v-poet"}, key=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize("body, key, status, param", [
    ({"lora_name": "v1", "lora_path": "../base"}, ADMIN, 403, "lora_path"),       # outside --adapter-root
    ({"lora_name": "v1", "lora_path": "/etc"}, ADMIN, 403, "lora_path"),
    ({"lora_name": "v1", "lora_path": "missing"}, ADMIN, 400, "lora_path"),
    ({"lora_name": "bad name!", "lora_path": "poet"}, ADMIN, 400, "lora_name"),
    ({"lora_name": "base", "lora_path": "poet"}, ADMIN, 409, "lora_name"),
    ({"lora_path": "poet"}, ADMIN, 400, "lora_name"),
    ({"lora_name": "v1", "lora_path": "poet"}, KEY, 403, None),                    # the admin key, as /v1/adapters
    ({"lora_name": "v1", "lora_path": "poet"}, None, 401, None),
])
def test_load_lora_adapter_refusals(server, body, key, status, param):
    r = post(server, "/v1/load_lora_adapter", body, key=key)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert "v1" not in server.state.adapters


def test_unload_needs_the_admin_key(server):
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "poet"}, key=KEY).status_code == 403
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "poet"}, key=None).status_code == 401
    assert "poet" in server.state.adapters


# ---- 9: batches of prompts ---------------------------------------------------------------------
def test_a_list_of_prompts_gets_one_indexed_choice_each(client, server):
    r = client.completions.create(model="coder", prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [one(client, "coder", p) for p in PROMPTS]
    tokenizer = server.state.tokenizer
    ids = [tokenizer.encode(p) for p in PROMPTS]
    assert r.usage.prompt_tokens == sum(len(i) for i in ids) and r.usage.completion_tokens == 24
    by_ids = client.completions.create(model="coder", prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in r.choices]


def test_a_batch_times_n_numbers_choices_prompt_major(client):
    r = client.completions.create(model="poet", prompt=PROMPTS[:2], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert texts[0] == texts[1] == one(client, "poet", PROMPTS[0], 6)   # choice k * n + j: prompt k's
    assert texts[2] == texts[3] == one(client, "poet", PROMPTS[1], 6)
    seeded = client.completions.create(model="poet", prompt=PROMPTS[:2], max_tokens=6, temperature=1.0, n=2, seed=5)
    again = client.completions.create(model="poet", prompt=PROMPTS[:2], max_tokens=6, temperature=1.0, n=2, seed=5)
    assert [c.text for c in seeded.choices] == [c.text for c in again.choices]


def test_a_streamed_batch_interleaves_choices_by_index(client):
    whole = client.completions.create(model="quotes", prompt=PROMPTS, max_tokens=10, temperature=0)
    texts, reasons = defaultdict(str), {}
    chunks = list(client.completions.create(model="quotes", prompt=PROMPTS, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert dict(texts) == {c.index: c.text for c in whole.choices}
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 30


def test_batch_refusals(server):
    base = {"model": "poet", "max_tokens": 4}
    r = post(server, "/v1/completions", {**base, "prompt": ["a", ""]})
    assert r.status_code == 400 and "prompt[1]" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {**base, "prompt": [[1, 2], [3, 400]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = post(server, "/v1/completions", {**base, "prompt": ["a"] * 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = post(server, "/v1/completions", {**base, "prompt": ["a"] * 20, "n": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    server.wait_idle()


# ---- 10: the schema, docs, version, metrics --------------------------------------------------
def test_openapi_docs_and_version_need_no_key(server):
    from loraplex import __version__
    schema = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/load_lora_adapter",
                 "/v1/unload_lora_adapter", "/v1/adapters"):
        assert path in schema["paths"], path
    assert schema["info"]["version"] == __version__
    docs = httpx.get(server.url + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def test_metrics_are_open_to_scrapers_by_default(server, client):
    one(client, "poet", "Hi")
    r = httpx.get(server.url + "/metrics")   # no key, though the server has one
    assert r.status_code == 200 and "loraplex_requests_total" in r.text
    assert 'loraplex_tenant_requests_total{outcome="length",tenant="none"}' in r.text
    assert httpx.get(server.url + "/v1/models").status_code == 401   # the API itself still needs it
    json.loads(httpx.get(server.url + "/health").text)
