"""Several adapters in one request over HTTP: the `adapters` field ({adapter: weight}, sent by the
official client through `extra_body`), named compositions (`POST /v1/adapters {"name", "compose"}`),
their listing, deletion rules, refusals and per-member metrics, against a real server."""
from __future__ import annotations

import json
import shutil
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_fixtures import (  # noqa: F401 (fixtures)
    ADMIN, KEY, SERVER_ENGINE, ServerThread, auth, client, model, post, server)

from loraplex.adapters.composition import MAX_MEMBERS
from loraplex.server.errors import APIError
from loraplex.server.composition_fields import duplicated_member, parse_composition
from loraplex.server.protocol import CompletionRequest

pytest.importorskip("fastapi")

PROMPT = "Hello world"
MIX = {"poet": 0.7, "coder": -1.3}   # a negative weight too: any finite weight is allowed
GOOD = {"model": "base", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}


def greedy(client, model: str, adapters: dict | None = None, chat: bool = False, n: int = 10) -> str:
    extra = {"extra_body": {"adapters": adapters}} if adapters is not None else {}
    if chat:
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=n, temperature=0, **extra).choices[0].message.content
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0,
                                     **extra).choices[0].text


def compose(server, name: str, members: dict, key: str = ADMIN) -> httpx.Response:
    return post(server, "/v1/adapters", {"name": name, "compose": members}, key=key)


def delete(server, name: str, key: str = ADMIN) -> httpx.Response:
    return httpx.delete(f"{server.url}/v1/adapters/{name}", headers=auth(key), timeout=60)


def counts(server, family: str) -> dict[tuple[str, str], float]:
    text = httpx.get(server.url + "/metrics", headers=auth()).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {(s.labels["adapter"], s.labels["outcome"]): s.value
            for s in families[family].samples if s.name == family + "_total"}


@pytest.fixture(scope="module")
def mixed(server):
    """The named composition "mix" = MIX, for the module."""
    assert compose(server, "mix", MIX).status_code == 200
    yield "mix"
    delete(server, "mix")


# ---- the same tokens as the engine -------------------------------------------------------------
def test_a_composition_by_field_or_by_name_equals_the_engine_with_it(client, server, model, mixed):
    from loraplex import LLM, SamplingParams
    _, base, adapters = model
    by_field = greedy(client, "base", MIX)
    by_name = greedy(client, mixed)
    params = SamplingParams(max_tokens=10, temperature=0)
    with LLM(str(base), adapters=adapters, **SERVER_ENGINE) as llm:
        expected = llm.generate([PROMPT], params, adapter=MIX)[0].text
        singles = {name: llm.generate([PROMPT], params, adapter=name)[0].text for name in (None, "poet", "coder")}
    assert by_field == by_name == expected
    assert expected not in singles.values(), "the composition should differ from each adapter alone"
    assert greedy(client, "base", {"poet": 1.0}) == singles["poet"]   # one adapter at weight 1: that adapter
    assert greedy(client, "base", {"poet": 0}) == greedy(client, "base", {}) == singles[None]   # 0: absent
    chat = greedy(client, "base", MIX, chat=True)
    assert chat == greedy(client, mixed, chat=True) and chat != greedy(client, "base", chat=True)


def test_a_streamed_composition_equals_the_whole_one(client):
    whole = greedy(client, "base", MIX)
    chunks = client.completions.create(model="base", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                       extra_body={"adapters": MIX})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole


# ---- named compositions: listed, used, removed -------------------------------------------------
def test_models_and_adapters_list_the_composition_with_its_members(client, server, mixed):
    listed = {m.id: m for m in client.models.list().data}
    assert listed[mixed].model_extra["compose"] == MIX and listed[mixed].model_extra["parent"] == "base"
    assert "compose" not in listed["poet"].model_extra
    assert client.models.retrieve(mixed).model_extra["compose"] == MIX
    entries = {e["id"]: e for e in httpx.get(server.url + "/v1/adapters", headers=auth(ADMIN)).json()["data"]}
    assert entries[mixed]["object"] == "composition" and entries[mixed]["compose"] == MIX


def test_a_member_cannot_be_removed_while_a_composition_uses_it(client, server):
    assert post(server, "/v1/adapters", {"name": "spare", "path": "spare"}, key=ADMIN).status_code == 200
    assert compose(server, "spare-mix", {"spare": 0.5, "quotes": 0.5}).status_code == 200
    for r, param in ((delete(server, "spare"), "name"),
                     (post(server, "/v1/unload_lora_adapter", {"lora_name": "spare"}, key=ADMIN), "lora_name")):
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["param"] == param and "spare-mix" in error["message"] and error["code"] == "adapter_in_use"
    assert greedy(client, "spare-mix", n=3) is not None   # still served
    r = delete(server, "spare-mix")
    assert r.status_code == 200 and r.json() == {"id": "spare-mix", "object": "composition", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        greedy(client, "spare-mix", n=3)
    assert "spare-mix" not in server.state.core.compositions()
    assert delete(server, "spare").status_code == 200
    assert delete(server, "spare-mix").status_code == 404


# ---- refusals ----------------------------------------------------------------------------------
def raw(**fields) -> bytes:
    """A completions body with `fields` spliced in as raw JSON text (NaN, duplicated keys)."""
    return ("{" + ", ".join(f'"{k}": {v}' for k, v in {**{k: json.dumps(v) for k, v in GOOD.items()},
                                                        **fields}.items()) + "}").encode()


FIVE = {name: 0.1 * (i + 1) for i, name in enumerate(["poet", "coder", "quotes", "a", "b"])}


@pytest.mark.parametrize("body, status, words", [
    ({**GOOD, "adapters": FIVE}, 400, f"at most {MAX_MEMBERS}"),
    (raw(adapters='{"poet": NaN}'), 400, "finite"),
    (raw(adapters='{"poet": Infinity, "coder": 1}'), 400, "finite"),
    (raw(adapters='{"poet": -Infinity}'), 400, "finite"),
    (raw(adapters='{"poet": 1e999}'), 400, "finite"),
    (raw(adapters='{"poet": ' + "9" * 400 + "}"), 400, "too large"),
    ({**GOOD, "adapters": {"poet": "0.5"}}, 400, "number"),
    ({**GOOD, "adapters": {"poet": True}}, 400, "number"),
    ({**GOOD, "adapters": {"poet": None}}, 400, "number"),
    ({**GOOD, "adapters": {"": 0.5}}, 400, "non-empty"),
    ({**GOOD, "adapters": ["poet"]}, 400, "dictionary"),
    (raw(adapters='{"poet": 0.5, "coder": 0.2, "poet": 0.3}'), 400, "'poet' is given twice"),
    (raw(adapters='{"poet": 0.5, "\\u0070oet": 0.3}'), 400, "'poet' is given twice"),   # an escaped duplicate
    ({**GOOD, "model": "poet", "adapters": {"coder": 0.5}}, 400, "base model"),
    ({**GOOD, "adapters": {"poet": 0.5, "nope": 0.5}}, 404, "'nope'"),                   # as an unknown model
    ({**GOOD, "adapters": {"poet": 0.5, "mix": 0.5}}, 400, "'mix' in adapters is a composition"),
])
def test_bad_compositions_are_refused_naming_the_field(server, mixed, body, status, words):
    r = post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == "adapters" and words in r.json()["error"]["message"], r.text


def test_chat_refuses_like_completions(server):
    body = {"model": "base", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = post(server, "/v1/chat/completions", json.dumps(body)[:-1].encode() + b', "adapters": {"poet": NaN}}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "adapters"
    r = post(server, "/v1/chat/completions", json.dumps(body)[:-1].encode() + b', "adapters": {"a": 1, "a": 2}}')
    assert r.status_code == 400 and "given twice" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, status, param, words", [
    ({"name": "c1", "compose": FIVE}, 400, "compose", f"at most {MAX_MEMBERS}"),
    (b'{"name": "c1", "compose": {"poet": NaN}}', 400, "compose", "finite"),
    (b'{"name": "c1", "compose": {"poet": 0.5, "poet": 0.5}}', 400, "compose", "given twice"),
    ({"name": "c1", "compose": {"poet": 0.5, "nope": 0.5}}, 404, "compose", "'nope'"),
    ({"name": "c1", "compose": {}}, 400, "compose", "at least one adapter"),
    ({"name": "c1", "compose": {"poet": 0.5}, "path": "poet"}, 400, "compose", "not both"),
    ({"name": "c1"}, 400, "path", "required"),
    ({"name": "coder", "compose": {"poet": 0.5}}, 409, "name", "already served"),
    ({"name": "mix", "compose": {"poet": 0.5}}, 409, "name", "already served"),
    ({"name": "bad name!", "compose": {"poet": 0.5}}, 400, "name", "not allowed"),
])
def test_bad_named_compositions_are_refused_naming_the_field(server, mixed, body, status, param, words):
    r = post(server, "/v1/adapters", body, key=ADMIN)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.text
    assert "c1" not in server.state.compositions and "c1" not in server.state.core.compositions()
    assert server.state.core.compositions()["mix"].names == ("poet", "coder")


def test_bad_compositions_leave_other_requests_alone(client, server, mixed):
    expected = greedy(client, mixed)
    bad = [raw(adapters='{"poet": NaN}'), {**GOOD, "adapters": FIVE}, {**GOOD, "adapters": {"nope": 1, "poet": 1}}]
    for body in bad:
        assert post(server, "/v1/completions", body).status_code in (400, 404)
    assert greedy(client, "base", MIX) == expected
    server.wait_idle()
    assert server.state.in_flight == 0 and not server.state.in_flight_by_adapter


def test_a_member_that_fails_to_load_is_a_424_naming_it(client, server, model):
    root = model[0]
    broken = root / "adapters" / "mix-break"
    shutil.copytree(root / "adapters" / "coder", broken)
    assert post(server, "/v1/adapters", {"name": "mix-break", "path": "mix-break"}, key=ADMIN).status_code == 200
    server.wait_idle()
    deadline = time.monotonic() + 5   # its prefetch done: then registered again with its file broken
    while server.state.cache.state("mix-break").value not in ("gpu", "cpu") and time.monotonic() < deadline:
        time.sleep(0.02)
    server.state.cache.unregister("mix-break")
    server.state.cache.register("mix-break", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    r = post(server, "/v1/completions", {**GOOD, "adapters": {"poet": 0.5, "mix-break": 0.5}})
    assert r.status_code == 424, r.text
    assert r.json()["error"]["param"] == "adapters" and "'mix-break'" in r.json()["error"]["message"]
    assert greedy(client, "base", {"poet": 0.5, "quotes": 0.5}, n=3) is not None   # others serve on
    assert delete(server, "mix-break").status_code == 200


# ---- metrics -----------------------------------------------------------------------------------
def test_metrics_count_each_member_of_a_composed_request(client, server, mixed):
    members, by_name = counts(server, "loraplex_adapter_requests"), counts(server, "loraplex_requests")
    greedy(client, "base", MIX, n=3)
    greedy(client, mixed, n=3)
    greedy(client, "poet", n=3)
    greedy(client, "base", n=3)
    after_members, after_names = counts(server, "loraplex_adapter_requests"), counts(server, "loraplex_requests")

    def grew(before: dict, after: dict, label: str) -> float:
        return after.get((label, "length"), 0) - before.get((label, "length"), 0)
    assert grew(members, after_members, "poet") == 3 and grew(members, after_members, "coder") == 2
    assert grew(members, after_members, "base") == 0   # the base model is no adapter
    assert grew(by_name, after_names, "composed") == 1 and grew(by_name, after_names, mixed) == 1
    assert grew(by_name, after_names, "poet") == 1 and grew(by_name, after_names, "base") == 1


# ---- tenants -----------------------------------------------------------------------------------
def test_a_tenant_composes_only_what_it_may_use_and_the_slots_bound_a_composition(model, tmp_path):
    _, base, adapters = model
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": {
        "acme": {"key": "sk-acme", "adapters": ["poet", "coder", "acme-*"], "base_model": False},
        "globex": {"key": "sk-globex", "adapters": ["poet", "globex-*"], "manage_adapters": True}}}))
    srv = ServerThread(base, adapters, {**SERVER_ENGINE, "max_gpu_adapters": 2}, api_key=KEY, admin_api_key=ADMIN,
                       api_keys=keys)
    try:
        three = {**GOOD, "adapters": {"poet": 0.5, "coder": 0.5, "quotes": 0.5}}   # more than the 2 slots
        r = post(srv, "/v1/completions", three, key=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == "adapters" and "at most 2" in r.text
        assert compose(srv, "acme-3", three["adapters"]).json()["error"]["param"] == "compose"
        assert compose(srv, "acme-mix", MIX).status_code == 200
        acme = {**GOOD, "adapters": MIX}
        assert post(srv, "/v1/completions", acme, key="sk-acme").status_code == 200   # no base model needed
        assert post(srv, "/v1/completions", {**GOOD, "model": "acme-mix"}, key="sk-acme").status_code == 200
        assert post(srv, "/v1/completions", {**acme, "adapters": {}}, key="sk-acme").status_code == 404
        r = post(srv, "/v1/completions", acme, key="sk-globex")   # coder: not its adapter, so no such adapter
        assert r.status_code == 404 and r.json()["error"]["param"] == "adapters"
        r = compose(srv, "globex-mix", MIX, key="sk-globex")
        assert r.status_code == 404 and r.json()["error"]["param"] == "compose"
        assert compose(srv, "acme-x", {"poet": 1.0}, key="sk-globex").status_code == 403
        assert compose(srv, "globex-mix", {"poet": 0.5}, key="sk-globex").status_code == 200
        seen = {m["id"] for m in httpx.get(srv.url + "/v1/models", headers=auth("sk-globex")).json()["data"]}
        assert seen == {"base", "poet", "globex-mix"}   # acme-mix uses coder: not listed
        r = delete(srv, "poet", key="sk-globex")
        assert r.status_code == 409 and "'globex-mix'" in r.json()["error"]["message"]
        assert "acme-mix" not in r.json()["error"]["message"] and "1 you cannot see" in r.json()["error"]["message"]
    finally:
        srv.close()


# ---- parsing (no server) -----------------------------------------------------------------------
def test_the_field_parses_into_a_composition():
    req = CompletionRequest.model_validate({**GOOD, "adapters": {"poet": 0.5, "coder": 2, "quotes": 0}})
    assert req.composition.members == (("poet", 0.5), ("coder", 2.0))   # weight 0: absent
    assert CompletionRequest.model_validate(GOOD).composition is None
    with pytest.raises(APIError) as e:
        parse_composition({"x": float("nan")}, "compose")
    assert e.value.status == 400 and e.value.param == "compose"


@pytest.mark.parametrize("body, found", [
    (b'{"adapters": {"a": 1, "b": 2, "a": 3}}', ("adapters", "a")),
    (b'{"compose": {"a": 1, "a": 1}}', ("compose", "a")),
    ('{"adapters": {"a": 1, "a": 3}}'.encode("utf-16"), ("adapters", "a")),
    (b'{"\\u0061dapters": {"x": 1, "\\u0078": 3}}', ("adapters", "x")),
    (b'{"adapters": {"a": 1}, "logit_bias": {"1": 1, "1": 2}}', None),   # elsewhere: not ours to refuse
    (b'{"prompt": "adapters", "x": {"a": 1, "a": 2}}', None),
    (b'{"adapters": {"a": 1, "a": 2', None),                              # not JSON: the route says so
    (b'[{"adapters": {"a": 1, "a": 2}}]', None),
])
def test_duplicated_members_are_found_in_the_raw_body(body, found):
    assert duplicated_member(body) == found
