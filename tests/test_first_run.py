"""A newcomer's first commands on a CPU machine, as the README gives them: what the tokenizer and chat template
need is installed with loraplex, a script that uses `LLM` ends cleanly with or without `close()`, `loraplex
demo --once` in a pipe prints plain text and ends, a rank above the pool's limit names the flag that raises
it, and an adapter's tier names the device it is on."""
from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loraplex.demo.assets import ADAPTER_KINDS, demo_adapters, demo_model_dir

ROOT = Path(__file__).resolve().parents[1]


# ---- 1. the tokenizer and chat templates come with loraplex ------------------------------------------
def _declared_closure() -> set[str]:
    """Distributions `pip install loraplex` brings: pyproject's [project] dependencies and, through the
    installed packages' metadata, theirs (extras left out), as canonical names."""
    tomllib = pytest.importorskip("tomllib")
    requirements = pytest.importorskip("packaging.requirements")
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [requirements.Requirement(r) for r in project["dependencies"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue   # another platform's, or an extra's
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [requirements.Requirement(r) for r in md.requires(req.name) or []]
        except md.PackageNotFoundError:
            pass
    return seen


@pytest.mark.parametrize("module", ["transformers", "tokenizers", "jinja2"])
def test_what_tokenizers_and_chat_templates_import_is_a_dependency(module):
    """AutoTokenizer (transformers, tokenizers) reads the model's tokenizer files; apply_chat_template renders
    its template with jinja2: each must come with `pip install loraplex`, not only with the test extra."""
    from packaging.utils import canonicalize_name
    pytest.importorskip(module)
    dists = {canonicalize_name(d) for d in md.packages_distributions().get(module, [])}
    assert dists, f"no installed distribution provides {module}"
    assert dists & _declared_closure(), f"{module} ({', '.join(dists)}) is not among loraplex's dependencies"


def test_the_demo_models_tokenizer_loads_and_renders_its_chat_template():
    """The cause of the server's 'no chat template' on the demo model was a tokenizer that did not load."""
    from loraplex.engine.detokenizer import load_tokenizer
    from loraplex.server.protocol import ChatCompletionRequest
    try:
        from loraplex.server.translate import chat_prompt
    except ImportError:
        from loraplex.server.protocol import chat_prompt

    tok = load_tokenizer(demo_model_dir())
    assert tok.chat_template, "the demo model ships a chat template"
    req = ChatCompletionRequest.model_validate({"model": "fortune", "messages": [
        {"role": "system", "content": "Be wise."}, {"role": "user", "content": "Say something."}]})
    ids = chat_prompt(req, tok)
    assert tok.decode(ids) == "Be wise.\n\nUser: Say something.\nAssistant:"
    assert ids == tok("Be wise.\n\nUser: Say something.\nAssistant:", add_special_tokens=False)["input_ids"]


# ---- 5. LLM: a context manager, and a clean exit without close() ----------------------------------------
_SCRIPT = """
from loraplex import LLM, SamplingParams
from loraplex.demo.assets import demo_adapters, demo_model_dir

{body}
"""
_BODIES = {
    "no-close": """
llm = LLM(str(demo_model_dir()), adapters=demo_adapters(), device="cpu")
print(repr(llm.generate("def ", SamplingParams(max_tokens=4), adapter="python")[0].text))
""",
    "with": """
with LLM(str(demo_model_dir()), adapters=demo_adapters(), device="cpu") as llm:
    print(repr(llm.generate("def ", SamplingParams(max_tokens=4), adapter="python")[0].text))
assert llm.closed
llm.close()   # again: nothing to do
""",
    "dropped": """
llm = LLM(str(demo_model_dir()), device="cpu")
print(repr(llm.generate("The ", SamplingParams(max_tokens=4))[0].text))
del llm
import gc; gc.collect()
""",
}


@pytest.mark.parametrize("case", sorted(_BODIES))
def test_a_script_using_llm_exits_cleanly(case):
    """With the heap the engine froze (gc.freeze) left frozen at exit, Triton's nanobind objects outlived the
    interpreter and nanobind printed dozens of 'leaked instances' lines; closing at exit unfreezes it."""
    code = _SCRIPT.format(body=textwrap.dedent(_BODIES[case]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "the script printed its completion"
    assert "leaked" not in proc.stderr, proc.stderr[-3000:]


def test_llm_is_a_context_manager_that_closes_once(monkeypatch):
    from loraplex import LLM
    from loraplex.engine.engine import Engine

    closed = []
    real_close = Engine.close

    def close(self):
        closed.append(self)
        real_close(self)
    monkeypatch.setattr(Engine, "close", close)
    with LLM(str(demo_model_dir()), device="cpu", num_kv_blocks=8, max_num_seqs=2,
             max_num_batched_tokens=16) as llm:
        assert not llm.closed
    assert llm.closed and closed == [llm.engine]
    llm.close()
    assert closed == [llm.engine]


# ---- 6. loraplex demo in a pipe ---------------------------------------------------------------------
def test_demo_once_in_a_pipe_prints_plain_text_and_ends():
    proc = subprocess.run([sys.executable, "-m", "loraplex.cli", "demo", "--once", "--max-tokens", "6",
                           "--device", "cpu"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "\x1b" not in proc.stdout and "\x1b" not in proc.stderr   # no escape codes anywhere
    assert len(lines) == 1 + len(ADAPTER_KINDS) + 1, proc.stdout      # a line per stream, and a summary
    # Each stream ends at its 6th token or at the demo model's stop token: on the CPU a logit can move with the
    # batch a step happens to hold (the GEMM's kernel depends on its rows), so the sampled text may differ.
    total = 0
    for adapter in ["base", *ADAPTER_KINDS]:
        [line] = [ln for ln in lines if f"· adapter {adapter} ·" in ln]
        found = re.search(r"· (\d+) tokens · [\d.]+ tok/s · (length|stop): \".+\"$", line)
        assert found and int(found[1]) <= 6 and (found[2] == "stop" or int(found[1]) == 6), line
        total += int(found[1])
    assert lines[-1].startswith(f"all streams: {total} tokens in "), lines[-1]
    assert "leaked" not in proc.stderr


# ---- 4. a rank above the pool's limit names --max-lora-rank -------------------------------------------
def test_a_rank_above_the_limit_names_the_flag():
    import torch

    from loraplex.adapters import AdapterError
    from loraplex.adapters.cache import AdapterCache
    from loraplex.models import ModelConfig

    cache = AdapterCache(ModelConfig.from_pretrained(demo_model_dir()), max_gpu_adapters=1, max_lora_rank=8,
                         max_cpu_adapters=0, dtype=torch.float32, device="cpu")
    try:
        with pytest.raises(AdapterError, match=r"'python' has rank 16, above the pool's max_lora_rank=8: raise it "
                                               r"to at least 16 with --max-lora-rank \(EngineConfig.max_lora_rank\)"):
            cache.register("python", demo_adapters()["python"])
        assert "python" not in cache
    finally:
        cache.close()


# ---- 7. the tier of an adapter names the device it is on ----------------------------------------------
def test_an_adapter_in_a_cpu_slot_is_in_the_cpu_tier():
    import torch

    from loraplex.adapters.cache import AdapterCache
    from loraplex.models import ModelConfig

    cache = AdapterCache(ModelConfig.from_pretrained(demo_model_dir()), max_gpu_adapters=1, max_lora_rank=16,
                         max_cpu_adapters=0, dtype=torch.float32, device="cpu")
    try:
        cache.register("json", demo_adapters()["json"])
        assert cache.tier("json") == "disk"
        cache.prefetch("json")
        cache.wait_resident("json", timeout=60)
        assert cache.tier("json") == "cpu" and cache.is_resident("json")
    finally:
        cache.close()


# ---- 2. the README's install order ---------------------------------------------------------------------
def _section(readme: str, title: str) -> str:
    start = readme.index(f"\n## {title}\n")
    end = readme.find("\n## ", start + 1)
    return readme[start:end]


def test_the_readme_installs_in_the_order_a_cpu_machine_needs():
    readme = (ROOT / "README.md").read_text()
    install = _section(readme, "Install")
    commands = [line.split("#")[0].strip() for line in install.split("```bash\n", 1)[1].split("```")[0].splitlines()]
    assert commands[0].startswith("git clone ") and commands[0].endswith("&& cd loraplex"), commands
    cpu_torch = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert commands.index(cpu_torch) < commands.index("pip install -e ."), commands   # CPU torch first
    assert " CI" not in install   # an instruction for users, not for this project's machines
    first = _section(readme, "First commands")
    assert readme.index(first) < 3000   # the first screen: install, then the three first commands
    for command in ('loraplex demo', 'loraplex serve', 'loraplex generate "def " --adapter python'):
        assert f"\n{command} " in first, command
    ops = [p for p in readme.split("\n- ") if "loraplex op-demo" in p]
    assert ops and all("unlike `loraplex demo`" in p for p in ops)   # the kernel's demo, not the demo
