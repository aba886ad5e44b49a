"""A tiny text model with PEFT adapters and a chat template, and a real server on 127.0.0.1: uvicorn
in a thread of the test process (`ServerThread`), or `loraplex serve` in its own (`ServeProcess`)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from adapter_fixtures import make_adapter
from model_fixtures import make_hf_model
from tokenizer_fixtures import make_tokenizer

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SERVER_ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=256, block_size=8, max_num_seqs=8,
                     max_num_batched_tokens=64, max_model_len=256)


def make_text_model(root: Path) -> tuple[Path, dict[str, Path]]:
    """A llama with a byte-level BPE tokenizer that has a chat template, and three adapters (in root/adapters)."""
    from transformers import AutoTokenizer
    base = make_hf_model(root / "base", "llama-text", seed=5)
    make_tokenizer(base, "byte_bpe", vocab_size=320)
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(base)
    adapters = {
        "poet": make_adapter(base, root / "adapters" / "poet", seed=21, r=8, lora_alpha=32,
                             target_modules=ALL_PROJECTIONS),
        "coder": make_adapter(base, root / "adapters" / "coder", seed=22, r=4, lora_alpha=16,
                              target_modules=["q_proj", "v_proj", "down_proj"]),
        "quotes": make_adapter(base, root / "adapters" / "quotes", seed=23, r=8, lora_alpha=64,
                               target_modules=["gate_proj", "up_proj", "o_proj"]),
    }
    spare = root / "adapters" / "spare"   # a copy to register at run time
    shutil.copytree(adapters["poet"], spare)
    return base, {name: Path(path) for name, path in adapters.items()}


class ServerThread:
    """`loraplex.server` on a free port of 127.0.0.1, in a thread; `.state` is its ServerState."""

    def __init__(self, base: Path, adapters: dict[str, Path], engine: dict | None = None,
                 packed: list[Path] = (), **settings) -> None:
        import uvicorn

        from loraplex.config import EngineConfig
        from loraplex.server.app import create_app
        from loraplex.server.serve import build_state
        from loraplex.server.settings import ServerSettings

        self.settings = ServerSettings(port=0, log_level="warning", **settings)
        config = EngineConfig(str(base), **(engine or SERVER_ENGINE))
        self.state = build_state(config, self.settings, adapters, list(packed))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.state), log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.state.engine.shutdown()
        self.sock.close()

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the server has no request in flight and the engine has freed every KV block."""
        core = self.state.core
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self.state.in_flight == 0 and not core.has_unfinished()
                    and core.blocks.num_free == core.blocks.num_blocks):
                return
            time.sleep(0.02)
        raise AssertionError(f"not idle: {self.state.in_flight} in flight, {core.num_unfinished} in the engine, "
                             f"{core.blocks.num_blocks - core.blocks.num_free} KV blocks used")


class ServeProcess:
    """`loraplex serve --model base ...` in a process of its own, listening on a free port; `.url` as
    ServerThread's. `prelude`: Python run in that process before the command (to inject faults)."""

    def __init__(self, base: Path, *flags: str, lora: dict[str, Path] | None = None, prelude: str = "",
                 engine: dict | None = None) -> None:
        args = ["serve", "--model", str(base), "--port", "0", "--log-level", "warning", *flags]
        for key, value in (SERVER_ENGINE if engine is None else engine).items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        for name, path in (lora or {}).items():
            args += ["--lora", f"{name}={path}"]
        code = prelude + "\nimport sys\nfrom loraplex.cli import main\nsys.exit(main(sys.argv[1:]))\n"
        self.proc = subprocess.Popen([sys.executable, "-c", code, *args], stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        for line in self.proc.stderr:
            self.lines.append(line)
            if "serving" in line and "http://" in line:
                self.url = line.split(" at ")[-1].split(" ")[0].rstrip("/").removesuffix("/v1")
                break
        else:
            self.proc.wait(timeout=30)
            raise RuntimeError("loraplex serve did not start:\n" + "".join(self.lines))
        # keep reading, so a chatty server never blocks on a full pipe
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


# ---- pytest fixtures (import them into a test module) ------------------------------------------
KEY, ADMIN = "sk-test-key", "admin-test-key"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    base, adapters = make_text_model(root)
    return root, base, adapters


@pytest.fixture(scope="module")
def server(model):
    root, base, adapters = model
    srv = ServerThread(base, adapters, api_key=KEY, admin_api_key=ADMIN, adapter_roots=[root / "adapters"])
    yield srv
    srv.close()


@pytest.fixture
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def post(server, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    """POST `body` (a dict or list as JSON; bytes or str as they are, typed as JSON) with the key."""
    if isinstance(body, (dict, list)):
        kw["json"] = body
    else:
        kw["content"] = body
        kw.setdefault("headers", {})["Content-Type"] = "application/json"
    headers = {**(auth(key) if key else {}), **kw.pop("headers", {})}
    kw.setdefault("timeout", 60)
    return httpx.post(server.url + path, headers=headers, **kw)
