"""The demo model shipped with loraplex: each adapter is better at its own kind of text than the base and
every other adapter (measured here, with transformers + PEFT), loraplex serves it as transformers does,
and `loraplex serve` with no --model starts with it and answers for every adapter."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.demo.assets import (
    ADAPTER_KINDS,
    demo_adapters,
    demo_model_dir,
    heldout_path,
)

CTX = 512


@pytest.fixture(scope="module")
def hf_models():
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(demo_model_dir())
    base = AutoModelForCausalLM.from_pretrained(demo_model_dir(), dtype=torch.float32).eval()
    folders = demo_adapters()
    peft = PeftModel.from_pretrained(base, folders[ADAPTER_KINDS[0]], adapter_name=ADAPTER_KINDS[0])
    for kind in ADAPTER_KINDS[1:]:
        peft.load_adapter(folders[kind], adapter_name=kind)
    return tok, peft.eval()


def heldout_ids(tok, kind: str) -> torch.Tensor:
    ids: list[int] = []
    for line in heldout_path(kind).read_text().splitlines():
        ids += tok(json.loads(line)["text"])["input_ids"] + [tok.eos_token_id]
    return torch.tensor(ids)


@torch.no_grad()
def mean_loss(model, ids: torch.Tensor) -> float:
    n = (len(ids) - 1) // CTX
    rows = torch.stack([ids[i * CTX:i * CTX + CTX + 1] for i in range(n)])
    logits = model(input_ids=rows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1)).item()


def test_shipped_files_are_small_and_complete():
    sizes = sum(p.stat().st_size for p in demo_model_dir().rglob("*") if p.is_file())
    assert sizes < 30e6, f"demo model is {sizes / 1e6:.1f} MB"
    config = json.loads((demo_model_dir() / "config.json").read_text())
    params = config["vocab_size"] * config["hidden_size"] + config["num_hidden_layers"] * (
        4 * config["hidden_size"] ** 2 + 3 * config["hidden_size"] * config["intermediate_size"])
    assert params < 50e6
    for kind in ADAPTER_KINDS:
        assert heldout_path(kind).stat().st_size > 2000


def test_each_adapter_is_best_at_its_own_kind(hf_models):
    tok, peft = hf_models
    texts = {kind: heldout_ids(tok, kind) for kind in ADAPTER_KINDS}
    losses = {}
    with peft.disable_adapter():
        losses["base"] = {kind: mean_loss(peft, ids) for kind, ids in texts.items()}
    for adapter in ADAPTER_KINDS:
        peft.set_adapter(adapter)
        losses[adapter] = {kind: mean_loss(peft, ids) for kind, ids in texts.items()}
    for kind in ADAPTER_KINDS:
        own = losses[kind][kind]
        others = {name: row[kind] for name, row in losses.items() if name != kind}
        assert all(own < other - 0.005 for other in others.values()), (kind, own, others)


def test_loraplex_matches_transformers_on_the_demo_model(hf_models):
    tok, peft = hf_models
    prompt = "The "
    ids = tok(prompt, return_tensors="pt").input_ids
    with LLM(demo_model_dir(), adapters=demo_adapters(), device="cpu", dtype="float32") as llm:
        outs = llm.generate([prompt] * (1 + len(ADAPTER_KINDS)), SamplingParams(max_tokens=12, temperature=0.0),
                            adapter=[None, *ADAPTER_KINDS])
    texts = [o.text for o in outs]
    for out, name in zip(outs, [None, *ADAPTER_KINDS]):
        if name is None:
            with peft.disable_adapter():
                ref = peft.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
        else:
            peft.set_adapter(name)
            ref = peft.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
        assert out.token_ids and out.token_ids == ref[0, ids.shape[1]:].tolist()[:len(out.token_ids)], name
        assert len(out.token_ids) == 12 or out.finish_reason == "stop", name
    assert len(set(texts)) >= 4, texts   # the adapters visibly differ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_without_a_model_serves_the_demo(tmp_path):
    import openai
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "serve", "--port", str(port), "--device", "cpu"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"loraplex serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("loraplex serve did not become healthy in 120 s")
            time.sleep(0.3)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        models = {m.id for m in client.models.list().data}
        assert models == {"loraplex-demo", *ADAPTER_KINDS}, models
        texts = {}
        for name in ["loraplex-demo", *ADAPTER_KINDS]:
            r = client.completions.create(model=name, prompt="The ", max_tokens=8, temperature=0)
            assert r.usage.completion_tokens > 0
            texts[name] = r.choices[0].text
        assert len(set(texts.values())) >= 4, texts
        # the chat template the demo model ships renders (a tokenizer that failed to load once made this
        # "this model has no chat template")
        stream = client.chat.completions.create(model="fortune", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        # on a CPU server an adapter in a slot is in the "cpu" tier, not "gpu"
        listed = {a["id"]: a for a in httpx.get(f"http://127.0.0.1:{port}/v1/adapters").json()["data"]}
        assert listed["fortune"]["tier"] == "cpu" and listed["fortune"]["resident"] is True, listed["fortune"]
        assert all(a["tier"] in ("cpu", "disk", "reading", "loading") for a in listed.values()), listed
        assert "(float32)" in log.read_text()   # dtype auto on the CPU
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
