"""The `loraplex` command: flags built from the settings dataclasses, `serve`'s hand-off to the server,
`generate` end to end on a tiny model, and the README's first command (`op-demo`)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

import loraplex
from loraplex.cli import GROUPS, main
from loraplex.config import EngineConfig
from loraplex.server.settings import ServerSettings

SETTINGS = (EngineConfig, ServerSettings)


def _flag(f: dataclasses.Field) -> str:
    flag = "--" + f.name.replace("_", "-")
    return flag[:-1] if f.default_factory is list else flag   # a list field's flag is given once per item


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_op_demo_runs_and_matches_the_float64_loop(capsys):
    assert main(["op-demo", "--iters", "1", "--requests", "5", "--hidden", "96"]) == 0
    out = capsys.readouterr().out
    assert "5 requests" in out and "error vs a float64 loop" in out


def test_top_level_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for command in ("serve", "generate", "convert", "op-demo", "bench", "demo"):
        assert f"    {command} " in out


def test_top_level_help_imports_neither_torch_nor_numpy():
    code = ("import sys\nfrom loraplex.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.parametrize("cls", SETTINGS)
def test_every_setting_has_a_help_sentence_and_a_group(cls):
    for f in dataclasses.fields(cls):
        help_ = f.metadata.get("help", "")
        assert len(help_) > 15 and help_.endswith("."), f"{cls.__name__}.{f.name}: help {help_!r}"
        assert f.metadata.get("group") in GROUPS, f"{cls.__name__}.{f.name}"


def test_serve_help_has_a_flag_for_every_setting_in_its_group(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    sections = {}  # group → its lines of help
    for block in out.split("\n\n"):
        title = block.split("\n", 1)[0]
        if title.endswith(":"):
            sections[title[:-1]] = block
    assert set(GROUPS) <= set(sections)
    for cls in SETTINGS:
        for f in dataclasses.fields(cls):
            section = sections[f.metadata["group"]]
            shown = (f"  {_flag(f)} ", f"  {_flag(f)}\n", f"  {_flag(f)}, --no-{_flag(f)[2:]}")  # a bool on by default
            assert any(s in section for s in shown), f"{cls.__name__}.{f.name}"
            assert _flat(f.metadata["help"]).rstrip(".") in _flat(section)
    assert "default: 256." in _flat(sections["batching"])           # max_num_seqs, from the dataclass
    assert "default: 127.0.0.1." in _flat(sections["server"])
    assert "--lora NAME=DIR" in sections["adapters"] and "--packed FILE" in sections["adapters"]
    assert "dummy:<preset>" in out and "llama-3-8b" in out           # the presets are listed


# ---- serve: what reaches run_server ----------------------------------------------------------------

@pytest.fixture
def fake_server(monkeypatch):
    """A stand-in for loraplex.server.serve whose run_server records its arguments."""
    calls = []

    def run_server(config, settings, *, adapters, packed):
        calls.append((config, settings, adapters, packed))
        return 7

    module = types.ModuleType("loraplex.server.serve")
    module.run_server = run_server
    monkeypatch.setitem(sys.modules, "loraplex.server.serve", module)
    return calls


def test_serve_passes_exactly_the_given_settings(fake_server, tmp_path):
    roots = [tmp_path / "r1", tmp_path / "r2"]
    for d in roots + [tmp_path / "sql"]:
        d.mkdir()
    packed = tmp_path / "pack"
    packed.mkdir()
    rc = main(["serve", "--model", "dummy:llama-2-7b", "--dummy-layers", "2", "--device", "cpu", "--dtype", "float32",
               "--seed", "3", "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--max-model-len", "512",
               "--max-batch-wait-ms", "2.5", "--block-size", "32", "--gpu-memory-utilization", "0.5",
               "--num-kv-blocks", "64", "--max-gpu-adapters", "4", "--max-lora-rank", "64", "--max-cpu-adapters", "0",
               "--enforce-eager", "--cuda-graph-max-batch", "16", "--cuda-graph-max-prompt-tokens", "0",
               "--adapter-loader-threads", "5", "--no-overlap-admissions",
               "--host", "0.0.0.0", "--port", "9001", "--api-key", "k1", "--admin-api-key", "k2",
               "--adapter-root", str(roots[0]), "--adapter-root", str(roots[1]), "--served-model-name", "base",
               "--max-waiting-requests", "0", "--max-body-bytes", "2048", "--max-adapter-labels", "5",
               "--graceful-shutdown-s", "1.5", "--log-level", "debug",
               "--lora", f"sql={tmp_path / 'sql'}", "--packed", str(packed)])
    assert rc == 7
    [(config, settings, adapters, packs)] = fake_server
    assert config == EngineConfig(
        model="dummy:llama-2-7b", dummy_layers=2, device="cpu", dtype="float32", seed=3, max_num_seqs=8,
        max_num_batched_tokens=128, max_model_len=512, max_batch_wait_ms=2.5, block_size=32,
        gpu_memory_utilization=0.5, num_kv_blocks=64, max_gpu_adapters=4, max_lora_rank=64, max_cpu_adapters=0,
        enforce_eager=True, cuda_graph_max_batch=16, cuda_graph_max_prompt_tokens=0, adapter_loader_threads=5,
        overlap_admissions=False)
    assert config.max_queue_skip_ms == 2000.0 and config.tokenizer is None and config.cpu_kv_cache_gib == 1.0
    assert settings == ServerSettings(
        host="0.0.0.0", port=9001, api_key="k1", admin_api_key="k2", adapter_roots=roots, served_model_name="base",
        max_waiting_requests=0, max_body_bytes=2048, max_adapter_labels=5, graceful_shutdown_s=1.5,
        log_level="debug")
    assert adapters == {"sql": tmp_path / "sql"} and packs == [packed]


def test_serve_flags_left_out_keep_the_dataclass_defaults(fake_server):
    assert main(["serve", "--model", "some/folder", "--device", "cpu"]) == 7
    [(config, settings, adapters, packs)] = fake_server
    assert config == EngineConfig(model="some/folder", device="cpu")
    assert settings == ServerSettings()
    assert adapters == {} and packs == []


@pytest.mark.parametrize("flag, value, field", [
    ("--max-num-seqs", "0", "EngineConfig.max_num_seqs"),
    ("--gpu-memory-utilization", "2", "EngineConfig.gpu_memory_utilization"),
    ("--max-batch-wait-ms", "-1", "EngineConfig.max_batch_wait_ms"),
    ("--port", "70000", "ServerSettings.port"),
    ("--max-body-bytes", "10", "ServerSettings.max_body_bytes"),
])
def test_serve_refuses_a_bad_value_naming_field_and_flag(fake_server, capsys, flag, value, field):
    assert main(["serve", "--model", "m", "--device", "cpu", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err and flag in err and "Traceback" not in err
    assert fake_server == []


@pytest.mark.parametrize("args, words", [
    (["--lora", "noequals"], ["--lora", "NAME=DIR", "noequals"]),
    (["--max-num-seqs", "many"], ["--max-num-seqs", "invalid int value"]),
    (["--dtype", "float8"], ["--dtype", "invalid choice"]),
    (["--max-num-seq", "4"], ["unrecognized arguments: --max-num-seq"]),   # no abbreviations
])
def test_serve_usage_errors_exit_2(fake_server, capsys, args, words):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "m", "--device", "cpu", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert fake_server == []


def test_serve_refuses_missing_adapter_paths(fake_server, capsys, tmp_path):
    (tmp_path / "a").mkdir()
    cases = [(["--lora", f"a={tmp_path / 'nope'}"], str(tmp_path / "nope")),
             (["--lora", f"a={tmp_path / 'a'}", "--lora", f"a={tmp_path / 'a'}"], "--lora a: the name is given twice"),
             (["--packed", str(tmp_path / "none.safetensors")], str(tmp_path / "none.safetensors")),
             (["--adapter-root", str(tmp_path / "nope")], "adapter_roots")]
    for args, words in cases:
        assert main(["serve", "--model", "m", "--device", "cpu", *args]) == 2
        assert words in capsys.readouterr().err
    assert fake_server == []


def test_serve_error_as_a_process_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "loraplex.cli", "serve", "--model", "m", "--device", "cpu",
                           "--gpu-memory-utilization", "2"], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: EngineConfig.gpu_memory_utilization") and "Traceback" not in proc.stderr


# ---- generate --------------------------------------------------------------------------------------

class _FakeLLM:
    """Stands in for loraplex.LLM: records its arguments (`calls` is set per test)."""
    calls: typing.ClassVar[list] = []

    def __init__(self, model, adapters=None, **settings):
        self.calls.append((model, adapters, settings))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def generate(self, prompts, params, adapter=None, **kw):
        self.calls.append((prompts, params, adapter))
        return [types.SimpleNamespace(text=f"<{p}>", finish_reason="length", error=None) for p in prompts]


def test_generate_passes_engine_and_sampling_settings(monkeypatch, capsys):
    monkeypatch.setattr(loraplex, "LLM", _FakeLLM)
    monkeypatch.setattr(_FakeLLM, "calls", [])
    assert main(["generate", "--model", "m", "--device", "cpu", "--max-num-seqs", "4", "--max-num-batched-tokens",
                 "32", "--engine-seed", "9", "--seed", "5", "--temperature", "0.7", "--top-k", "20",
                 "--stop", "\n", "--stop", "END", "one", "two"]) == 0
    (model, adapters, settings), (prompts, params, adapter) = _FakeLLM.calls
    assert model == "m" and adapters == {} and adapter is None and prompts == ["one", "two"]
    assert settings == {"device": "cpu", "max_num_seqs": 4, "max_num_batched_tokens": 32, "seed": 9}
    assert (params.seed, params.temperature, params.top_k, params.top_p, params.max_tokens, params.stop) == \
        (5, 0.7, 20, 1.0, 64, ("\n", "END"))
    assert capsys.readouterr().out == "==> prompt 1: 'one' <==\n<one>\n\n==> prompt 2: 'two' <==\n<two>\n"


@pytest.mark.parametrize("args, words", [
    (["--top-p", "2"], "SamplingParams.top_p"),
    (["--temperature", "-1"], "SamplingParams.temperature"),
    (["--max-tokens", "0"], "SamplingParams.max_tokens"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--adapter", "sql"], "--adapter sql: not among the --lora names"),
    (["--stream", "second prompt"], "--stream takes one prompt"),
    (["--model", "dummy:llama-2-7b"], "dummy models have no tokenizer"),
])
def test_generate_refuses_bad_values_before_loading(monkeypatch, capsys, args, words):
    monkeypatch.setattr(loraplex, "LLM", _FakeLLM)
    monkeypatch.setattr(_FakeLLM, "calls", [])
    assert main(["generate", "--model", "m", "--device", "cpu", *args, "prompt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err
    assert _FakeLLM.calls == []


ENGINE = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "8", "--max-num-seqs", "4",
          "--max-num-batched-tokens", "64"]
PROMPTS = ["The quick brown", "Hello world"]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A tiny model with a tokenizer, one adapter, and the LLM's own greedy texts for PROMPTS."""
    from adapter_fixtures import make_adapter
    from model_fixtures import make_hf_model
    from tokenizer_fixtures import make_tokenizer

    root = tmp_path_factory.mktemp("cli")
    folder = make_hf_model(root / "model", "llama-text", seed=5)
    make_tokenizer(folder, "byte_bpe", vocab_size=320)
    adapter = make_adapter(folder, root / "ad", seed=11, r=8, lora_alpha=32,
                           target_modules=["q_proj", "v_proj", "down_proj"])
    params = loraplex.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with loraplex.LLM(str(folder), adapters={"ad": adapter}, dtype="float32", device="cpu", num_kv_blocks=64,
                      block_size=8, max_num_seqs=4, max_num_batched_tokens=64) as llm:
        texts = {name: [o.text for o in llm.generate(PROMPTS, params, adapter=name, use_tqdm=False)]
                 for name in (None, "ad")}
    return folder, adapter, texts


def _generate(folder: Path, *args: str) -> list[str]:
    return ["generate", "--model", str(folder), *ENGINE, "--max-tokens", "16", "--ignore-eos", *args]


def test_generate_prints_what_the_llm_makes_with_the_adapter(text_model, capsys):
    folder, adapter, texts = text_model
    assert texts["ad"][0] != texts[None][0], "the adapter should change this model's text"
    assert main(_generate(folder, "--lora", f"ad={adapter}", "--adapter", "ad", PROMPTS[0])) == 0
    assert capsys.readouterr().out == texts["ad"][0] + "\n"
    assert main(_generate(folder, "--lora", f"ad={adapter}", PROMPTS[0])) == 0   # registered, not used
    assert capsys.readouterr().out == texts[None][0] + "\n"


def test_generate_several_prompts_print_a_header_each(text_model, capsys):
    folder, _, texts = text_model
    assert main(_generate(folder, *PROMPTS)) == 0
    out = capsys.readouterr().out
    assert out == "".join(f"{'' if i == 0 else chr(10)}==> prompt {i + 1}: {p!r} <==\n{t}\n"
                          for i, (p, t) in enumerate(zip(PROMPTS, texts[None])))


def test_generate_stream_prints_the_same_text(text_model, capsys):
    folder, adapter, texts = text_model
    assert main(_generate(folder, "--stream", "--lora", f"ad={adapter}", "--adapter", "ad", PROMPTS[1])) == 0
    assert capsys.readouterr().out == texts["ad"][1] + "\n"


def test_generate_refuses_a_bad_adapter_folder(text_model, capsys, tmp_path):
    folder, _, _ = text_model
    missing = tmp_path / "missing-adapter"
    assert main(_generate(folder, "--lora", f"x={missing}", "--adapter", "x", "hi")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err
    empty = tmp_path / "empty"
    empty.mkdir()   # a folder, but no adapter: the engine's AdapterError
    assert main(_generate(folder, "--lora", f"x={empty}", "hi")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(empty) in err and "Traceback" not in err
