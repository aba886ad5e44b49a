"""Keys scoped to tenants (`--api-keys FILE`): what each key sees and may use, who may manage adapters,
per-tenant metrics, and the file reloaded when it changes or on SIGHUP."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_fixtures import ADMIN, KEY, ServerThread, ServeProcess, auth, model, post  # noqa: F401 (fixtures)

from loraplex.server.tenants import KeysFileError, parse_tenants, read_keys_file

pytest.importorskip("fastapi")

TENANTS = {"tenants": {
    "acme": {"keys": ["sk-acme-1", "sk-acme-2"], "adapters": ["poet", "acme-*"]},
    "globex": {"key": "sk-globex", "adapters": ["coder"], "base_model": False},
    "acme-ops": {"key": "sk-acme-ops", "adapters": ["acme-*"], "manage_adapters": True},
    "ops": {"key": "sk-ops", "adapters": ["*"], "manage_adapters": True, "metrics": True},
}}


def write_keys(path, data) -> None:
    """Replace the file at once (a new inode), as an editor or a config manager would."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    write_keys(path, TENANTS)
    return path


@pytest.fixture(scope="module")
def server(model, keys_file):
    root, base, adapters = model
    srv = ServerThread(base, adapters, api_key=KEY, admin_api_key=ADMIN, api_keys=keys_file,
                       metrics_require_key=True, adapter_roots=[root / "adapters"])
    yield srv
    srv.close()


def client_for(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def listed(server, key: str) -> set[str]:
    return {m.id for m in client_for(server, key).models.list().data}


def test_each_key_lists_only_what_it_may_use(server):
    assert listed(server, "sk-acme-1") == listed(server, "sk-acme-2") == {"base", "poet"}
    assert listed(server, "sk-globex") == {"coder"}           # no base model for this one
    assert listed(server, "sk-ops") == listed(server, KEY) == {"base", "poet", "coder", "quotes"}
    assert client_for(server, "sk-acme-1").completions.create(model="poet", prompt="Hi", max_tokens=3).choices


def test_a_model_the_key_may_not_use_is_a_404_like_one_that_does_not_exist(server):
    def answer(key: str, model: str, stream: bool = False) -> tuple[int, str]:
        r = post(server, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2, "stream": stream},
                 key=key)
        return r.status_code, r.text.replace(repr(model), "'X'")
    for key, hidden in (("sk-acme-1", "coder"), ("sk-acme-1", "quotes"), ("sk-globex", "base"), ("sk-globex", "poet")):
        assert answer(key, hidden) == answer(key, "no-such-model")
        assert answer(key, hidden, stream=True) == answer(key, "no-such-model", stream=True)
        assert answer(key, hidden)[0] == 404
        r = httpx.get(server.url + f"/v1/models/{hidden}", headers=auth(key))
        assert r.status_code == 404
        chat = post(server, "/v1/chat/completions", {"model": hidden, "messages": [{"role": "user", "content": "x"}]},
                    key=key)
        assert chat.status_code == 404
    with pytest.raises(openai.NotFoundError):
        client_for(server, "sk-globex").completions.create(model="base", prompt="Hi", max_tokens=2)


def test_keys_and_rights(server):
    assert post(server, "/v1/completions", {"model": "poet", "prompt": "Hi"}, key="sk-nobody").status_code == 401
    assert post(server, "/v1/completions", {"model": "poet", "prompt": "Hi"}, key=None).status_code == 401
    for key in ("sk-acme-1", "sk-globex"):   # valid keys without manage_adapters
        assert httpx.get(server.url + "/v1/adapters", headers=auth(key)).status_code == 403
        assert post(server, "/v1/load_lora_adapter", {"lora_name": "acme-x", "lora_path": "poet"},
                    key=key).status_code == 403
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/openapi.json").status_code == 200


def test_a_tenant_manages_only_the_names_it_may_use(server):
    ops = "sk-acme-ops"
    assert httpx.get(server.url + "/v1/adapters", headers=auth(ops)).json()["data"] == []
    r = post(server, "/v1/adapters", {"name": "acme-poet", "path": "poet"}, key=ops)
    assert r.status_code == 200 and r.json()["source"] == "poet", r.text
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "acme-coder", "lora_path": "coder"}, key=ops)
    assert r.status_code == 200, r.text
    mine = httpx.get(server.url + "/v1/adapters", headers=auth(ops)).json()["data"]
    assert {a["id"]: a["source"] for a in mine} == {"acme-poet": "poet", "acme-coder": "coder"}   # no server paths
    assert post(server, "/v1/adapters", {"name": "poet2", "path": "poet"}, key=ops).status_code == 403
    for name in ("poet", "coder"):   # others' adapters: as if they did not exist
        assert httpx.delete(server.url + f"/v1/adapters/{name}", headers=auth(ops)).status_code == 404
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": name}, key=ops).status_code == 404
    assert "poet" in server.state.adapters and "coder" in server.state.adapters
    # the tenant's users see the new adapters at once, the others never
    assert listed(server, "sk-acme-1") == {"base", "poet", "acme-poet", "acme-coder"}
    assert "acme-poet" not in listed(server, "sk-globex")
    acme = client_for(server, "sk-acme-1")
    same = [acme.completions.create(model=m, prompt="Hello world", max_tokens=6, temperature=0).choices[0].text
            for m in ("acme-poet", "poet")]
    assert same[0] == same[1]
    assert httpx.delete(server.url + "/v1/adapters/acme-poet", headers=auth(ops)).status_code == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "acme-coder"}, key=ops).status_code == 200
    server.wait_idle()


def scrape(server, key: str | None) -> httpx.Response:
    return httpx.get(server.url + "/metrics", headers=auth(key) if key else {})


def test_metrics_count_by_tenant_and_may_require_a_key(server):
    acme = client_for(server, "sk-acme-2")
    acme.completions.create(model="poet", prompt="Hello", max_tokens=4, temperature=0)
    post(server, "/v1/completions", {"model": "coder", "prompt": "Hi", "max_tokens": 2}, key="sk-acme-1")   # 404
    client_for(server, "sk-globex").completions.create(model="coder", prompt="Hi", max_tokens=3, temperature=0)
    assert scrape(server, None).status_code == 401            # --metrics-require-key
    assert scrape(server, "sk-acme-1").status_code == 403      # a tenant without "metrics"
    assert scrape(server, KEY).status_code == 200 and scrape(server, ADMIN).status_code == 200
    text = scrape(server, "sk-ops").text
    assert "sk-" not in text, "keys never appear in the metrics"
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = {(s.labels["tenant"], s.labels["outcome"]): s.value
                for s in families["loraplex_tenant_requests"].samples if s.name.endswith("_total")}
    assert requests[("acme", "length")] >= 1 and requests[("acme", "rejected")] >= 1
    assert requests[("globex", "length")] >= 1
    tokens = {s.labels["tenant"]: s.value for s in families["loraplex_tenant_generation_tokens"].samples
              if s.name.endswith("_total")}
    assert tokens["acme"] >= 4 and tokens["globex"] >= 3
    prompt = {s.labels["tenant"]: s.value for s in families["loraplex_tenant_prompt_tokens"].samples
              if s.name.endswith("_total")}
    assert prompt["acme"] >= 1


def test_the_file_is_reloaded_when_it_changes(server, keys_file):
    changed = json.loads(json.dumps(TENANTS))
    del changed["tenants"]["globex"]
    changed["tenants"]["newco"] = {"key": "sk-newco", "adapters": ["quotes"]}
    changed["tenants"]["acme"]["adapters"] = ["coder"]
    try:
        write_keys(keys_file, changed)
        assert listed(server, "sk-newco") == {"base", "quotes"}
        assert listed(server, "sk-acme-1") == {"base", "coder"}
        assert post(server, "/v1/completions", {"model": "coder", "prompt": "Hi"}, key="sk-globex").status_code == 401
        keys_file.write_text("{not json")   # a broken edit: the keys in force stay
        assert listed(server, "sk-newco") == {"base", "quotes"}
    finally:
        write_keys(keys_file, TENANTS)
    assert listed(server, "sk-globex") == {"coder"}
    assert post(server, "/v1/completions", {"model": "quotes", "prompt": "Hi"}, key="sk-newco").status_code == 401


def test_sighup_reloads_the_file_of_a_real_server(model, tmp_path):
    _, base, adapters = model
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": {"a": {"key": "sk-aaaa", "adapters": ["poet"]}}}))
    proc = ServeProcess(base, "--api-keys", str(keys), lora={"poet": adapters["poet"], "coder": adapters["coder"]})
    try:
        models = lambda key: httpx.get(proc.url + "/v1/models", headers=auth(key))  # noqa: E731
        assert {m["id"] for m in models("sk-aaaa").json()["data"]} == {"base", "poet"}
        assert models("sk-bbbb").status_code == 401 and httpx.get(proc.url + "/metrics").status_code == 200
        # same size, same inode, same mtime: only a SIGHUP can tell the server
        before = os.stat(keys)
        text = keys.read_text().replace("sk-aaaa", "sk-bbbb").replace('["poet"]', '["cod*"]')
        with open(keys, "r+") as f:   # in place: the same inode
            f.write(text)
        os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert models("sk-aaaa").status_code == 200   # not reloaded yet
        proc.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while models("sk-bbbb").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {m["id"] for m in models("sk-bbbb").json()["data"]} == {"base", "coder"}
        assert models("sk-aaaa").status_code == 401
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.wait() == 0
    finally:
        proc.close()


def test_a_bad_keys_file_stops_serve_before_it_loads_the_model(model, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": {"a": {"key": "sk-a", "adapter": ["poet"]}}}))
    r = subprocess.run([sys.executable, "-m", "loraplex.cli", "serve", "--model", str(model[1]), "--port", "0",
                        "--device", "cpu", "--api-keys", str(keys)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "tenants.a" in r.stderr and "'adapter'" in r.stderr and "Traceback" not in r.stderr


# ---- the file's format ----------------------------------------------------------------------------
@pytest.mark.parametrize("tenants, words", [
    ({"a": {"keys": ["k1"], "adapter": ["x"]}}, "unknown field 'adapter'"),
    ({"a": {"key": "k1", "keys": ["k2"]}}, "not both"),
    ({"a": {"adapters": ["x"]}}, "needs 'key'"),
    ({"a": {"key": "k1"}, "b": {"key": "k1"}}, "also a key of tenant 'a'"),
    ({"other": {"key": "k1"}}, "not allowed"),
    ({"a b": {"key": "k1"}}, "not allowed"),
    ({"a": {"key": "k 1"}}, "tenants.a.keys[0]"),
    ({"a": {"key": "k1", "base_model": "yes"}}, "tenants.a.base_model"),
    ({"a": {"key": "k1", "adapters": "poet"}}, "tenants.a.adapters"),
])
def test_the_keys_file_is_checked_naming_the_field(tenants, words):
    with pytest.raises(KeysFileError) as info:
        parse_tenants({"tenants": tenants})
    assert words in str(info.value)


def test_yaml_and_json_read_alike(tmp_path):
    yaml = pytest.importorskip("yaml")
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump(TENANTS))
    (tmp_path / "keys.json").write_text(json.dumps(TENANTS))
    assert read_keys_file(tmp_path / "keys.yaml") == read_keys_file(tmp_path / "keys.json")
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(KeysFileError, match="bad.json"):
        read_keys_file(tmp_path / "bad.json")
