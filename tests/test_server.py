"""The HTTP server, for real: uvicorn on 127.0.0.1, a tiny model with PEFT adapters, driven by the
official `openai` client (and httpx for what the client hides)."""
from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time

import httpx
import openai
import pytest

from server_fixtures import ADMIN, KEY, auth, client, model, post, server  # noqa: F401 (fixtures)

pytest.importorskip("fastapi")

PROMPTS = ["Hello world", "The quick brown fox", "Numbers: 1 2 3", "Café crème", "def f(x):", "Once upon"]


def greedy(client, model: str, prompt: str, n: int = 10) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0).choices[0].text


# ---- generation --------------------------------------------------------------------------------
def test_models_lists_base_and_adapters(client, server):
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) >= {"base", "poet", "coder", "quotes"}
    assert listed["poet"].model_extra["parent"] == "base" and listed["base"].model_extra["parent"] is None
    from server_fixtures import SERVER_ENGINE
    assert {m.model_extra["max_model_len"] for m in listed.values()} == {SERVER_ENGINE["max_model_len"]}


def test_completions_match_the_offline_engine_for_base_and_each_adapter(client, server, model):
    from loraplex import LLM, SamplingParams
    from server_fixtures import SERVER_ENGINE
    _, base, adapters = model
    served = {name: greedy(client, name, "Hello world", 12) for name in ["base", "poet", "coder", "quotes"]}
    with LLM(str(base), adapters=adapters, **SERVER_ENGINE) as llm:
        for name, text in served.items():
            out = llm.generate(["Hello world"], SamplingParams(max_tokens=12, temperature=0),
                               adapter=None if name == "base" else name)[0]
            assert text == out.text, name
    assert len(set(served.values())) == 4, "each adapter should change the output"


def test_streamed_equals_whole_for_completions_and_chat(client, model):
    base = model[1]
    for name in ["base", "coder"]:
        whole = client.completions.create(model=name, prompt="The quick brown fox", max_tokens=16,
                                          temperature=0.8, seed=7)
        chunks = list(client.completions.create(model=name, prompt="The quick brown fox", max_tokens=16,
                                                temperature=0.8, seed=7, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 16
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
        chat = client.chat.completions.create(model=name, messages=messages, max_tokens=12, temperature=0)
        stream = list(client.chat.completions.create(model=name, messages=messages, max_tokens=12,
                                                     temperature=0, stream=True))
        assert stream[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
        assert chat.usage.prompt_tokens == len(template_tokens(base, messages))


def template_tokens(base, messages) -> list[int]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|assistant|>")
    return tok.encode(text, add_special_tokens=False)


def test_n_logprobs_stop_and_seed(client):
    r = client.completions.create(model="poet", prompt="Once upon", max_tokens=8, temperature=1.0, seed=3, n=3,
                                  logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24
    for c in r.choices:
        assert len(c.logprobs.tokens) == 8 and all(len(t) <= 3 for t in c.logprobs.top_logprobs)
    again = client.completions.create(model="poet", prompt="Once upon", max_tokens=8, temperature=1.0, seed=3, n=3)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    text = greedy(client, "quotes", "Numbers: 1 2 3", 24)
    stop = text[5:8]
    cut = client.completions.create(model="quotes", prompt="Numbers: 1 2 3", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_concurrent_requests_over_adapters_equal_one_at_a_time(client, server):
    jobs = [(["base", "poet", "coder", "quotes"][i % 4], PROMPTS[i % len(PROMPTS)], 6 + i % 7) for i in range(32)]
    alone = [greedy(client, m, p, n) for m, p, n in jobs]

    async def all_at_once():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        outs = await asyncio.gather(*[aclient.completions.create(model=m, prompt=p, max_tokens=n, temperature=0)
                                      for m, p, n in jobs])
        await aclient.close()
        return [o.choices[0].text for o in outs]

    assert asyncio.run(all_at_once()) == alone
    server.wait_idle()


# ---- adapters at run time ------------------------------------------------------------------------
def _stream_in_thread(server, model: str, max_tokens: int, box: list) -> threading.Thread:
    def run():
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        chunks = list(c.completions.create(model=model, prompt="Once upon", max_tokens=max_tokens, temperature=0,
                                           stream=True))
        box.append(chunks)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_adapters_added_and_removed_while_requests_run(client, server, model):
    root = model[0]
    expected = greedy(client, "quotes", "Once upon", 60)
    box: list = []
    running = _stream_in_thread(server, "quotes", 60, box)
    time.sleep(0.3)
    r = post(server, "/v1/adapters", {"name": "spare", "path": "spare"}, key=ADMIN)
    assert r.status_code == 200, r.text
    assert greedy(client, "spare", "Hello world", 12) == greedy(client, "poet", "Hello world", 12)  # same weights
    listed = httpx.get(server.url + "/v1/adapters", headers=auth(ADMIN)).json()["data"]
    info = {a["id"]: a for a in listed}
    assert info["spare"]["rank"] == 8 and info["spare"]["tier"] in ("gpu", "cpu", "disk", "loading")
    assert set(info["coder"]["targets"]) == {"q_proj", "v_proj", "down_proj"}
    r = httpx.delete(server.url + "/v1/adapters/quotes", headers=auth(ADMIN))
    assert r.status_code == 200 and r.json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        greedy(client, "quotes", "Hello", 4)
    running.join(timeout=120)
    assert "".join(c.choices[0].text for c in box[0]) == expected   # the request in flight was not disturbed
    assert "quotes" not in {m.id for m in client.models.list().data}
    server.wait_idle()
    assert "quotes" not in server.state.cache   # unregistered once its last request ended
    # back again under the same name
    r = post(server, "/v1/adapters", {"name": "quotes", "path": str(root / "adapters" / "quotes")}, key=ADMIN)
    assert r.status_code == 200, r.text
    assert greedy(client, "quotes", "Once upon", 60) == expected
    assert httpx.delete(server.url + "/v1/adapters/spare", headers=auth(ADMIN)).status_code == 200
    # names may hold "/" (an org prefix): served and deleted like any other
    assert post(server, "/v1/adapters", {"name": "org/poet", "path": "poet"}, key=ADMIN).status_code == 200
    assert greedy(client, "org/poet", "Hello world", 12) == greedy(client, "poet", "Hello world", 12)
    assert httpx.delete(server.url + "/v1/adapters/org/poet", headers=auth(ADMIN)).status_code == 200


def test_adapter_loads_are_confined_to_the_roots(server, model, tmp_path):
    root = model[0]
    outside = tmp_path / "outside"
    shutil.copytree(root / "adapters" / "poet", outside)
    os.symlink(outside, root / "adapters" / "link-out")
    sneaky = root / "adapters" / "sneaky"   # a folder inside the roots whose files point outside
    sneaky.mkdir()
    for f in outside.iterdir():
        os.symlink(f, sneaky / f.name)
    os.symlink(root / "adapters" / "loop", root / "adapters" / "loop")
    cases = {"../base": 403, str(outside): 403, "link-out": 403, "/etc": 403, "missing": 400, "sneaky": 403,
             "loop": 403, "~nosuchuser/a": 400}
    for path, status in cases.items():
        r = post(server, "/v1/adapters", {"name": "x1", "path": path}, key=ADMIN)
        assert r.status_code == status, (path, r.text)
        assert r.json()["error"]["message"]
    # a corrupt adapter is refused with its reason; nothing else changes
    bad = root / "adapters" / "corrupt"
    shutil.copytree(root / "adapters" / "coder", bad)
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    r = post(server, "/v1/adapters", {"name": "corrupt", "path": "corrupt"}, key=ADMIN)
    assert r.status_code == 400 and "safetensors" in r.json()["error"]["message"]
    # a pickle that would run code on load is refused (weights_only)
    evil = root / "adapters" / "evil"
    shutil.copytree(root / "adapters" / "coder", evil)
    (evil / "adapter_model.safetensors").unlink()
    (evil / "adapter_model.bin").write_bytes(_malicious_pickle(tmp_path / "pwned"))
    r = post(server, "/v1/adapters", {"name": "evil", "path": "evil"}, key=ADMIN)
    assert r.status_code == 400 and not (tmp_path / "pwned").exists()
    assert post(server, "/v1/adapters", {"name": "poet", "path": "poet"}, key=ADMIN).status_code == 409
    assert post(server, "/v1/adapters", {"name": "bad name!", "path": "poet"}, key=ADMIN).status_code == 400
    assert post(server, "/v1/adapters", {"name": "x2", "path": "poet"}, key=KEY).status_code == 403   # not an admin key
    assert httpx.delete(server.url + "/v1/adapters/nope", headers=auth(ADMIN)).status_code == 404
    assert "corrupt" not in server.state.cache and "evil" not in server.state.cache


def _malicious_pickle(marker) -> bytes:
    import pickle

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    return pickle.dumps({"x": Evil()})


def test_run_time_loading_is_off_without_roots(model):
    from loraplex.server.adapters_api import resolve_inside_roots
    from loraplex.server.errors import APIError
    with pytest.raises(APIError) as e:
        resolve_inside_roots(str(model[0] / "adapters" / "poet"), [])
    assert e.value.status == 403 and "--adapter-root" in e.value.message


def test_relative_paths_are_looked_up_in_every_root(tmp_path, model):
    from loraplex.server.adapters_api import resolve_inside_roots
    first, second = tmp_path / "r1", tmp_path / "r2"
    first.mkdir()
    shutil.copytree(model[0] / "adapters" / "poet", second / "poet")
    assert resolve_inside_roots("poet", [first.resolve(), second.resolve()]) == (second / "poet").resolve()


def test_packed_adapters_are_served_like_folders(model, tmp_path):
    from loraplex.adapters import convert
    from loraplex.models import ModelConfig
    from server_fixtures import ServerThread
    _, base, adapters = model
    packed = convert(ModelConfig.from_pretrained(base), [("p-poet", adapters["poet"]), ("p-coder", adapters["coder"])],
                     tmp_path / "packed", dtype=None, progress=False)
    srv = ServerThread(base, {"poet": adapters["poet"]}, packed=[packed])
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert {m.id for m in c.models.list().data} == {"base", "poet", "p-poet", "p-coder"}
        assert greedy(c, "p-poet", "Hello world", 12) == greedy(c, "poet", "Hello world", 12)
    finally:
        srv.close()


def test_serve_freezes_the_heap_with_its_adapters_registered(tmp_path):
    """`loraplex serve` registers its adapters after the engine has started, then freezes the heap again,
    so that their specs too are out of Python's full garbage collections (engine/gc_heap.py)."""
    import gc

    from server_fixtures import SERVER_ENGINE, make_text_model

    from loraplex.config import EngineConfig
    from loraplex.server.serve import build_state
    from loraplex.server.settings import ServerSettings

    from loraplex.engine import gc_heap

    base, _ = make_text_model(tmp_path)
    holders = gc_heap._holders   # engines of other tests (this module's server) may hold the freeze
    state = build_state(EngineConfig(str(base), max_lora_rank=8, **SERVER_ENGINE),
                        ServerSettings(synthetic_adapters=2), {}, [])
    try:
        module = next(iter(state.core.adapters.spec("syn-1").modules.values()))
        assert not any(o is module for g in (0, 1, 2) for o in gc.get_objects(g)), "the spec was not frozen"
    finally:
        state.engine.shutdown()
    assert gc_heap._holders == holders   # closed: it no longer holds the freeze
    if holders == 0:
        assert gc.get_freeze_count() == 0   # and the heap is the collector's again
