"""The `loraplex` command: flags built from the settings dataclasses, `serve`'s hand-off to the server,
`generate` end to end on a tiny model, one grammar for --model and --lora in every command, `convert`,
and `op-demo`."""
from __future__ import annotations

import dataclasses
import re
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


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_serve_help_all_has_a_flag_for_every_setting_in_its_group(capsys):
    out = _help(capsys, "serve", "--help-all")
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


def test_serve_help_is_short_and_leaves_the_tuning_flags_to_help_all(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = _help(capsys, "serve", "--help")
    advanced = [f for cls in SETTINGS for f in dataclasses.fields(cls) if f.metadata.get("advanced")]
    assert advanced and f"--help-all                Show this help with every flag ({len(advanced)} more)." in out
    for f in dataclasses.fields(EngineConfig) + dataclasses.fields(ServerSettings):
        assert (f"  {_flag(f)} " in out or f"  {_flag(f)}\n" in out or f"  {_flag(f)}, " in out) != \
            bool(f.metadata.get("advanced")), f.name
    assert len(out.splitlines()) <= 110, len(out.splitlines())
    assert out.startswith("usage: loraplex serve [--model DIR] [--lora NAME=DIR ...]")
    assert len(_help(capsys, "generate", "--help").splitlines()) <= 90


# Run history has no place in a flag's help: measurements, GPUs, dates, "the paper's run".
_ANECDOTE = re.compile(r"H100|H200|A100|\d[\d,.]* ?(tokens/s|tok/s|ms\b)|\d{4}-\d{2}-\d{2}|\bpaper\b|"
                       r"\bmeasured\b|\btook\b|halved|\.py\b")


def test_no_flag_help_tells_a_benchmark_story(capsys):
    for cls in SETTINGS:
        for f in dataclasses.fields(cls):
            assert not _ANECDOTE.search(f.metadata["help"]), f"{cls.__name__}.{f.name}: {f.metadata['help']!r}"
    for command in ("serve", "generate", "demo", "convert", "op-demo"):
        out = _help(capsys, command, "--help-all" if command in ("serve", "generate") else "--help")
        assert not _ANECDOTE.search(out), (command, _ANECDOTE.search(out))


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
    assert main(_generate(folder, PROMPTS[0], "--lora", f"ad={adapter}")) == 0   # registered, not used
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
    assert main(_generate(folder, "--lora", f"x={empty}", "--", "hi")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(empty) in err and "Traceback" not in err


# ---- one grammar in every command: --model for the base, --lora repeated or listed ----------------------
def _parse(*argv: str):
    from loraplex.cli import build_parser
    return build_parser().parse_args(list(argv))


def _model(args) -> str:
    return getattr(args, "model", None) or vars(args).get("engine.model")


LORA_COMMANDS = {   # the arguments each command needs beside --lora
    "serve": [], "demo": [], "convert": ["--model", "M", "--out", "O"], "generate": ["prompt"],
}


@pytest.mark.parametrize("command", sorted(LORA_COMMANDS))
def test_every_command_takes_lora_repeated_or_listed(command):
    extra = LORA_COMMANDS[command]
    pairs = [("a", "/x"), ("b", "/y"), ("c", "/z")]
    for lora in (["--lora", "a=/x", "--lora", "b=/y", "--lora", "c=/z"],
                 ["--lora", "a=/x", "b=/y", "c=/z"],
                 ["--lora", "a=/x", "b=/y", "--lora", "c=/z"]):
        args = _parse(command, *extra, *lora)
        assert args.lora == pairs, (command, lora)
    if command == "generate":   # a prompt after listed --lora values: after --, or a clear error
        args = _parse("generate", "--lora", "a=/x", "b=/y", "--", "hello")
        assert args.lora == pairs[:2] and args.prompts == ["hello"]


def test_a_prompt_swallowed_by_lora_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--lora", "a=/x", "hello"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--lora" in err and "expected NAME=DIR, got 'hello'" in err and "put -- before it" in err


@pytest.mark.parametrize("command, extra", [("serve", []), ("generate", ["p"]), ("demo", []), ("bench", []),
                                            ("convert", ["--lora", "a=/x", "--out", "O"])])
def test_every_command_takes_the_base_model_as_model(command, extra):
    assert _model(_parse(command, "--model", "/models/base", *extra)) == "/models/base"


def test_convert_keeps_base_as_a_deprecated_alias(capsys):
    args = _parse("convert", "--base", "/models/base", "--lora", "a=/x", "--out", "O")
    assert args.model == "/models/base"
    assert "--base is deprecated; use --model" in capsys.readouterr().err


def test_serve_takes_adapter_roots_and_packed_files_listed_too(fake_server, tmp_path):
    roots = [tmp_path / "r1", tmp_path / "r2"]
    packs = [tmp_path / "p1", tmp_path / "p2"]
    for d in roots + packs:
        d.mkdir()
    assert main(["serve", "--model", "m", "--device", "cpu", "--adapter-root", *map(str, roots),
                 "--packed", *map(str, packs)]) == 7
    [(_, settings, _, packed)] = fake_server
    assert settings.adapter_roots == roots and packed == packs


def test_convert_packs_every_lora_given_either_way(text_model, tmp_path, capsys):
    """`--lora a=X --lora b=Y` once packed only b (argparse kept the last flag) and exited 0."""
    from loraplex.adapters import PackedFile
    from loraplex.models import ModelConfig

    folder, adapter, _ = text_model
    parent = tmp_path / "many"
    parent.mkdir()
    for name in ("c", "d"):
        (parent / name).symlink_to(adapter, target_is_directory=True)
    cases = {"repeated": ["--lora", f"a={adapter}", "--lora", f"b={adapter}"],
             "listed": ["--lora", f"a={adapter}", f"b={adapter}"],
             "dirs": ["--lora-dir", str(parent), "--lora", f"a={adapter}"]}
    for case, loras in cases.items():
        out = tmp_path / case
        assert main(["convert", "--model", str(folder), *loras, "--out", str(out), "--quiet"]) == 0, case
        packed = PackedFile(out / "adapters.safetensors", ModelConfig.from_pretrained(folder))
        expected = ["a", "b"] if case != "dirs" else ["a", "c", "d"]
        assert sorted(s.name for s in packed.specs) == expected, case
    capsys.readouterr()
    assert main(["convert", "--lora", f"a={adapter}", "--out", str(tmp_path / "none")]) == 2
    assert "--model" in capsys.readouterr().err


# ---- the demo model: one name and one dtype rule, however it is given ----------------------------------
def test_serve_names_the_demo_model_alike_with_or_without_model(fake_server, tmp_path):
    from loraplex.demo.assets import demo_adapters, demo_model_dir

    assert main(["serve", "--device", "cpu"]) == 7
    assert main(["serve", "--device", "cpu", "--model", str(demo_model_dir())]) == 7
    assert main(["serve", "--device", "cpu", "--model", str(demo_model_dir()), "--served-model-name", "tiny"]) == 7
    assert main(["serve", "--device", "cpu", "--model", str(tmp_path)]) == 7
    (c1, s1, a1, _), (c2, s2, a2, _), (_, s3, _, _), (c4, s4, _, _) = fake_server
    assert s1.served_model_name == s2.served_model_name == "loraplex-demo" and s3.served_model_name == "tiny"
    assert s4.served_model_name is None                     # the server names it after the folder
    assert c1.dtype == c2.dtype == c4.dtype == "float32"    # dtype auto on the CPU, whatever the model
    assert a1 == demo_adapters() and a2 == {}               # the demo's adapters come only without --model


def test_dtype_auto_is_float32_on_the_cpu_and_the_checkpoints_on_a_gpu():
    assert EngineConfig(model="m", device="cpu").dtype == "float32"
    assert EngineConfig(model="m", device="cpu", dtype="bfloat16").dtype == "bfloat16"
    assert EngineConfig(model="m", device="cuda").dtype == "auto"   # the checkpoint's, read when it loads


# ---- a rank above the pool's limit --------------------------------------------------------------------
def test_a_rank_above_max_lora_rank_names_the_flag(capsys):
    assert main(["generate", "--device", "cpu", "--max-lora-rank", "8", "def "]) == 2   # the demo's are rank 16
    err = capsys.readouterr().err
    assert "\nerror: adapter " in err and "has rank 16, above the pool's max_lora_rank=8" in err
    assert "--max-lora-rank" in err and "Traceback" not in err
