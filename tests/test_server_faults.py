"""The server's last 5xx and its exits, through a real `loraplex serve` process: a lone surrogate in
an adapter path, an adapter whose files vanish and come back, error bodies without escape codes or
server paths, lax inputs, and the exit status after an engine failure."""
from __future__ import annotations

import json
import shutil
import socket
import time

import httpx
import openai
import pytest

from server_fixtures import ADMIN, KEY, ServeProcess, auth, model  # noqa: F401 (fixtures)

pytest.importorskip("fastapi")

GOOD = {"model": "poet", "prompt": "Hello world", "max_tokens": 6, "temperature": 0}
# one GPU slot and no CPU tier: serving one adapter evicts the other, so the next use reads its files again
ONE_SLOT = ["--max-gpu-adapters", "1", "--max-cpu-adapters", "0"]


@pytest.fixture(scope="module")
def served(model):
    root, base, adapters = model
    proc = ServeProcess(base, "--api-key", KEY, "--admin-api-key", ADMIN, "--adapter-root", str(root / "adapters"),
                        *ONE_SLOT, lora={"poet": adapters["poet"], "coder": adapters["coder"]})
    yield proc
    proc.close()


def post(served, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    headers = auth(key) if key else {}
    if isinstance(body, (bytes, str)):
        return httpx.post(served.url + path, content=body, timeout=60,
                          headers={**headers, "Content-Type": "application/json"}, **kw)
    return httpx.post(served.url + path, json=body, headers=headers, timeout=60, **kw)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    body = r.json()["error"]
    assert "\x1b" not in r.text and "\\u001b" not in r.text, "no terminal escape codes"
    return body


def _raw_exchange(url: str, requests: list[bytes]) -> list[bytes]:
    """Send each request on ONE connection, reading each response before the next."""
    host, port = url.removeprefix("http://").split(":")
    answers = []
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for request in requests:
            sock.sendall(request)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                assert chunk, f"the server closed the connection after {len(answers)} answer(s)"
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += sock.recv(65536)
            answers.append(head.split(b"\r\n")[0] + b" " + body)
    return answers


def test_a_lone_surrogate_in_an_adapter_path_is_400_and_the_connection_stays(served):
    for path in ("\\ud800", "valid\\udfff/x"):   # JSON escapes: lone surrogates once parsed
        body = ('{"name": "s1", "path": "%s"}' % path).encode()
        error = error_of(post(served, "/v1/adapters", body, key=ADMIN), 400)
        assert error["param"] == "path"
        vllm = ('{"lora_name": "s1", "lora_path": "%s"}' % path).encode()
        assert error_of(post(served, "/v1/load_lora_adapter", vllm, key=ADMIN), 400)["param"] == "lora_path"
    body = b'{"name": "s1", "path": "\\ud800"}'
    request = (b"POST /v1/adapters HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ADMIN.encode()
               + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
               + b"\r\n\r\n" + body)
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    answers = _raw_exchange(served.url, [request, request, health])   # keep-alive holds across them
    assert [a.split(b" ")[1] for a in answers] == [b"400", b"400", b"200"]


def test_an_adapter_whose_files_vanish_is_its_own_424_and_recovers_when_they_return(served, model):
    root = model[0]
    folder = root / "adapters" / "fragile"
    shutil.copytree(root / "adapters" / "quotes", folder)
    assert post(served, "/v1/adapters", {"name": "fragile", "path": "fragile"}, key=ADMIN).status_code == 200
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    expected = client.completions.create(model="fragile", prompt="Once upon", max_tokens=8, temperature=0)
    hidden = root / "hidden-fragile"
    folder.rename(hidden)
    poet = client.completions.create(model="poet", prompt="Once upon", max_tokens=8, temperature=0)  # evicts it
    for stream in (False, True, False):
        r = post(served, "/v1/completions", {"model": "fragile", "prompt": "Once upon", "max_tokens": 8,
                                              "stream": stream})
        error = error_of(r, 424)   # streamed too: the status comes before any 200
        assert "'fragile'" in error["message"] and error["code"] == "adapter_unavailable"
        assert error["param"] == "model" and int(r.headers["retry-after"]) >= 1
        assert str(root) not in r.text and "/adapters/" not in r.text, "the server's paths stay private"
        # the other adapters and the base model serve on
        assert client.completions.create(model="poet", prompt="Once upon", max_tokens=8,
                                         temperature=0).choices[0].text == poet.choices[0].text
        assert client.completions.create(model="base", prompt="Hi", max_tokens=2).choices
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="fragile", prompt="Once upon", max_tokens=8)
    assert info.value.status_code == 424
    hidden.rename(folder)   # the files are back: after its back-off, the adapter serves again
    deadline = time.monotonic() + 30
    while True:
        r = post(served, "/v1/completions", {"model": "fragile", "prompt": "Once upon", "max_tokens": 8,
                                              "temperature": 0})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        assert r.status_code == 424, r.text
        time.sleep(0.3)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected.choices[0].text
    chunks = list(client.completions.create(model="fragile", prompt="Once upon", max_tokens=8, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.choices[0].text


def test_error_bodies_hold_no_escape_codes_or_server_paths(served, model, tmp_path):
    root = model[0]
    evil = root / "adapters" / "pickled"
    shutil.copytree(root / "adapters" / "coder", evil)
    (evil / "adapter_model.safetensors").unlink()
    import pickle
    (evil / "adapter_model.bin").write_bytes(pickle.dumps({"x": print}))   # torch's refusal has ANSI codes
    broken = root / "adapters" / "broken"
    shutil.copytree(root / "adapters" / "coder", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    for name in ("pickled", "broken"):
        r = post(served, "/v1/adapters", {"name": name, "path": name}, key=ADMIN)
        error = error_of(r, 400)
        assert f"'{name}'" in error["message"] and error["param"] == "path"
        assert str(root) not in r.text and str(tmp_path) not in r.text
    r = post(served, "/v1/adapters", {"name": "nothere", "path": "nothere"}, key=ADMIN)
    assert error_of(r, 400)["param"] == "path" and str(root) not in r.text


@pytest.mark.parametrize("change, param", [
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [[1, 2], [True]]}, "prompt"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids[0]"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids[0]"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"max_tokens": True}, "max_tokens"),
    ({"n": True}, "n"),
])
def test_lax_inputs_are_400_naming_the_field(served, change, param):
    r = post(served, "/v1/completions", {**GOOD, **change})
    assert error_of(r, 400)["param"] == param


def test_an_engine_failure_stops_the_server_with_exit_1(model):
    _, base, adapters = model
    prelude = ("import loraplex.engine.engine as m\n"
               "def broken_step(self):\n"
               "    raise RuntimeError('injected device failure')\n"
               "m.Engine.step = broken_step\n")
    proc = ServeProcess(base, prelude=prelude, lora={"poet": adapters["poet"]})
    try:
        r = httpx.post(proc.url + "/v1/completions", json=GOOD, timeout=30)
        assert r.status_code == 503 and json.loads(r.text)["error"]["code"] == "engine_dead"
        assert proc.wait(timeout=60) == 1, proc.log
        assert "engine failed" in proc.log
    finally:
        proc.close()
