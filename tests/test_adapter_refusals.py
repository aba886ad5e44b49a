"""Every adapter we cannot serve exactly is refused with an `AdapterError` naming the field, key or file at
fault: at inspect time from the config and the tensor headers, or at read time where only the values tell.

Each case starts from a valid folder written by PEFT (rank 8 on q/k/v/o of a tiny GQA Llama: k/v are
narrower than q) and breaks one thing."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters import AdapterError, AdapterPool, inspect_peft_adapter, read_peft_adapter
from loraplex.models import ModelConfig, module_path

from adapter_fixtures import make_adapter, make_base

SAFETENSORS, BIN, CONFIG = "adapter_model.safetensors", "adapter_model.bin", "adapter_config.json"
R = 8


def key(layer: int, proj: str, ab: str, infix: str = "") -> str:
    """A PEFT weight key, optionally with an adapter-name infix."""
    return f"base_model.model.{module_path(layer, proj)}.lora_{ab}{'.' + infix if infix else ''}.weight"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(base folder, ModelConfig, a valid PEFT adapter folder) shared by every test; tests break copies."""
    root = tmp_path_factory.mktemp("refusals")
    base = make_base(root / "base", "llama", seed=3)
    adapter = make_adapter(base, root / "valid", seed=4, r=R, lora_alpha=16)
    return base, ModelConfig.from_pretrained(base), adapter


@pytest.fixture
def folder(model, tmp_path):
    """A fresh copy of the valid adapter, to break."""
    return Path(shutil.copytree(model[2], tmp_path / "adapter"))


@pytest.fixture
def config(model):
    return model[1]


def edit_config(folder: Path, **changes) -> None:
    path = folder / CONFIG
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def edit_weights(folder: Path, fn) -> None:
    state = load_file(folder / SAFETENSORS)
    save_file(fn(dict(state)), folder / SAFETENSORS)


def test_valid_folder_loads(folder, config):
    """The starting point is servable: every refusal below comes from the one thing each test breaks."""
    spec = inspect_peft_adapter(folder, config, max_rank=R)
    assert len(spec.modules) == 2 * 4 and spec.max_rank == R and spec.warnings == []
    assert len(read_peft_adapter(spec, torch.float16).modules) == 8
    assert issubclass(AdapterError, ValueError)


# ---- config fields ------------------------------------------------------------------------------

CONFIG_REFUSALS = [
    ("bias-all", dict(bias="all"), r"'bias' is 'all'"),
    ("bias-lora-only", dict(bias="lora_only"), r"'bias' is 'lora_only'"),
    ("dora", dict(use_dora=True), r"use_dora"),
    ("modules-to-save", dict(modules_to_save=["lm_head"]), r"modules_to_save"),
    ("lora-bias", dict(lora_bias=True), r"lora_bias"),
    ("ia3", dict(peft_type="IA3"), r"'peft_type' is 'IA3'"),
    ("layer-replication", dict(layer_replication=[[0, 2], [1, 2]]), r"layer_replication"),
    ("target-parameters", dict(target_parameters=["mlp.experts.gate_up_proj"]), r"target_parameters"),
    ("trainable-token-indices", dict(trainable_token_indices=[3, 5]), r"trainable_token_indices"),
    ("qalora", dict(use_qalora=True, qalora_group_size=16), r"use_qalora"),
    ("alora", dict(alora_invocation_tokens=[7, 9]), r"alora_invocation_tokens"),
    ("arrow", dict(arrow_config={"top_k": 2, "router_temperature": 1.0}), r"arrow_config"),
    ("kasa", dict(kasa_config={"beta": 0.1, "gamma": 0.1}), r"kasa_config"),
    ("monteclora", dict(monteclora_config={"num_samples": 4}), r"monteclora_config"),
    ("bdlora", dict(use_bdlora={"target_modules_bd_a": ["q_proj"], "nblocks": 2}), r"use_bdlora"),
    # PEFT turns a sub-config on when it is not None: `{}` means "on, with every default" (_get_lora_subconfig).
    ("arrow-defaults", dict(arrow_config={}), r"arrow_config"),
    ("kasa-defaults", dict(kasa_config={}), r"kasa_config"),
    ("monteclora-defaults", dict(monteclora_config={}), r"monteclora_config"),
    ("bdlora-defaults", dict(use_bdlora={}), r"use_bdlora"),
    ("lm-head-target", dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]), r"'lm_head'"),
    ("lm-head-regex", dict(target_modules=r"(.*\.[qkvo]_proj|lm_head)"), r"'lm_head'"),
    ("embed-tokens-target", dict(target_modules=["embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj"]),
     r"'model\.embed_tokens'"),
    ("r-zero", dict(r=0), r"'r' must be a positive integer, got 0"),
    ("r-string", dict(r="8"), r"'r' must be a positive integer, got '8'"),
    ("r-bool", dict(r=True), r"'r' must be a positive integer"),
    ("alpha-string", dict(lora_alpha="16"), r"'lora_alpha' must be a finite number, got '16'"),
    ("alpha-nan", dict(lora_alpha=float("nan")), r"'lora_alpha' must be a finite number"),
    ("rslora-string", dict(use_rslora="true"), r"'use_rslora'"),
    ("targets-int", dict(target_modules=5), r"'target_modules' must be a list"),
    ("targets-list-of-int", dict(target_modules=["q_proj", 3]), r"'target_modules' must be a list"),
    ("targets-bad-regex", dict(target_modules="(q_proj"), r"'target_modules' is not a valid regular expression"),
    ("rank-pattern-bad-regex", dict(rank_pattern={"(k_proj": 4}), r"rank_pattern\['\(k_proj'\].*regular expression"),
    ("rank-pattern-zero", dict(rank_pattern={"k_proj": 0}), r"rank_pattern\['k_proj'\].*positive integer"),
    ("rank-pattern-list", dict(rank_pattern=["k_proj"]), r"'rank_pattern' must be an object"),
    ("alpha-pattern-string", dict(alpha_pattern={"v_proj": "32"}), r"alpha_pattern\['v_proj'\].*finite number"),
    ("exclude-bad-regex", dict(exclude_modules="[q_proj"), r"'exclude_modules' is not a valid regular expression"),
    ("layers-string", dict(layers_to_transform="1"), r"'layers_to_transform' must be an integer"),
    ("layers-list-of-string", dict(layers_to_transform=["0"]), r"'layers_to_transform' must be an integer"),
    ("targets-match-nothing", dict(target_modules=["foo_proj"]), r"matches no module"),
    ("targets-empty-list", dict(target_modules=[]), r"matches no module"),
    ("targets-regex-nothing", dict(target_modules=r".*\.c_attn"), r"matches no module"),
    ("layers-out-of-range", dict(layers_to_transform=[5]), r"matches no module"),
    ("everything-excluded", dict(exclude_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), r"matches no module"),
    # Unvalidated field types: must be an AdapterError naming the field, not a TypeError / re.error from inside.
    ("exclude-int", dict(exclude_modules=5), r"exclude_modules"),
    ("layers-pattern-int", dict(layers_to_transform=[0], layers_pattern=5), r"layers_pattern"),
    ("layers-pattern-bad-regex", dict(layers_to_transform=[0], layers_pattern="(layers"), r"layers_pattern"),
    # PEFT's LoraConfig refuses these combinations outright (lora/config.py __post_init__), so no PEFT
    # user can load them; serving them would give them a meaning PEFT never did.
    ("regex-with-layers", dict(target_modules=r".*\.[qkvo]_proj", layers_to_transform=[0]), r"layers_to_transform"),
    ("regex-with-layers-pattern", dict(target_modules=r".*\.[qkvo]_proj", layers_pattern="layers"), r"layers_pattern"),
    ("layers-pattern-without-layers", dict(layers_pattern="layers"), r"layers_pattern"),
]


@pytest.mark.parametrize("changes, match", [pytest.param(c, m, id=i) for i, c, m in CONFIG_REFUSALS])
def test_config_refusals(folder, config, changes, match):
    """A config field we do not serve (or an invalid value) is refused at inspect time, naming the field and file."""
    edit_config(folder, **changes)
    with pytest.raises(AdapterError, match=match) as info:
        inspect_peft_adapter(folder, config)
    assert CONFIG in str(info.value)


# ---- weight keys --------------------------------------------------------------------------------

def _add(**tensors):
    def fn(state):
        for k, shape in tensors.items():
            state[k] = torch.randn(shape)
        return state
    return fn


def _drop(*keys):
    def fn(state):
        for k in keys:
            del state[k]
        return state
    return fn


def _reshape(k, shape):
    def fn(state):
        state[k] = torch.randn(shape)
        return state
    return fn


def _rename_all(infixes):
    """Every module twice, once per adapter name: a file holding several adapters."""
    def fn(state):
        out = {}
        for k, v in state.items():
            for name in infixes:
                out[k.replace(".weight", f".{name}.weight")] = v.clone()
        return out
    return fn


LM_HEAD_A = "base_model.model.lm_head.lora_A.weight"
EMBED_A = "base_model.model.model.embed_tokens.lora_embedding_A"
KEY_REFUSALS = [
    ("lm-head-key", _add(**{LM_HEAD_A: (R, 64), "base_model.model.lm_head.lora_B.weight": (128, R)}),
     re.escape(LM_HEAD_A) + r".*'lm_head'"),
    ("embed-tokens-key", _add(**{"base_model.model.model.embed_tokens.lora_A.weight": (R, 128)}),
     r"model\.embed_tokens\.lora_A\.weight.*'embed_tokens'"),
    ("lora-embedding-key", _add(**{EMBED_A: (R, 128), "base_model.model.model.embed_tokens.lora_embedding_B": (64, R)}),
     re.escape(EMBED_A)),
    ("dora-magnitude-key", _add(**{"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": (64,)}),
     r"q_proj\.lora_magnitude_vector.*DoRA"),
    ("layer-7", _add(**{key(7, "q_proj", "A"): (R, 64), key(7, "q_proj", "B"): (64, R)}),
     re.escape(key(7, "q_proj", "A")) + r".*layer 7 does not exist \(the model has 2 layers\)"),
    ("foo-proj", _add(**{"base_model.model.model.layers.0.self_attn.foo_proj.lora_A.weight": (R, 64)}),
     r"self_attn\.foo_proj\.lora_A\.weight'? matches no module"),
    ("q-proj-under-mlp", _add(**{"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": (R, 64)}),
     r"mlp\.q_proj\.lora_A\.weight'? matches no module"),
    ("non-lora-key", _add(**{"base_model.model.model.norm.weight": (64,)}),
     r"unexpected key 'base_model\.model\.model\.norm\.weight'"),
    ("base-weight-key", _add(**{"base_model.model.model.layers.0.self_attn.q_proj.weight": (64, 64)}),
     r"unexpected key '.*q_proj\.weight'"),
    ("untargeted-module", _add(**{key(0, "gate_proj", "A"): (R, 64), key(0, "gate_proj", "B"): (96, R)}),
     r"layer 0 gate_proj .*" + re.escape(key(0, "gate_proj", "A")) + r".*does not target"),
    ("missing-lora-b", _drop(key(1, "v_proj", "B")), r"no lora_B weight for layer 1 v_proj"),
    ("missing-lora-a", _drop(key(0, "o_proj", "A")), r"no lora_A weight for layer 0 o_proj"),
    ("missing-module", _drop(key(1, "k_proj", "A"), key(1, "k_proj", "B")), r"no lora_A weight for layer 1 k_proj"),
    ("several-adapter-names", _rename_all(["a", "b"]), r"several adapters \('a', 'b'\)"),
    ("a-wrong-in-features", _reshape(key(0, "q_proj", "A"), (R, 63)),
     re.escape(key(0, "q_proj", "A")) + r".*\[8, 63\].*\[8, 64\]"),
    ("b-wrong-out-features", _reshape(key(1, "o_proj", "B"), (65, R)),
     re.escape(key(1, "o_proj", "B")) + r".*\[65, 8\].*\[64, 8\]"),
    # GQA: k_proj's output is 2 kv heads x 16 = 32 wide, q_proj's 64; a B shaped like q's is wrong.
    ("k-b-shaped-like-q", _reshape(key(0, "k_proj", "B"), (64, R)),
     re.escape(key(0, "k_proj", "B")) + r".*\[64, 8\].*k_proj.*\[32, 8\]"),
    ("v-a-transposed", _reshape(key(1, "v_proj", "A"), (64, R)), re.escape(key(1, "v_proj", "A")) + r".*\[64, 8\]"),
]


@pytest.mark.parametrize("fn, match", [pytest.param(f, m, id=i) for i, f, m in KEY_REFUSALS])
def test_key_refusals(folder, config, fn, match):
    """A key we cannot place, a missing or extra tensor, or a wrong shape is refused from the headers alone."""
    edit_weights(folder, fn)
    with pytest.raises(AdapterError, match=match) as info:
        inspect_peft_adapter(folder, config)
    assert SAFETENSORS in str(info.value)


def test_shape_refusal_in_bin_file(folder, config):
    """The same shape checks hold for adapter_model.bin."""
    state = load_file(folder / SAFETENSORS)
    state[key(0, "v_proj", "B")] = torch.randn(64, R)  # q's width on a kv projection
    torch.save(state, folder / BIN)
    (folder / SAFETENSORS).unlink()
    with pytest.raises(AdapterError, match=re.escape(key(0, "v_proj", "B")) + r".*\[64, 8\].*\[32, 8\]"):
        inspect_peft_adapter(folder, config)


@pytest.mark.parametrize("changes, bad", [
    pytest.param(dict(r=4), key(0, "k_proj", "A"), id="r-below-file"),
    pytest.param(dict(r=16), key(0, "k_proj", "A"), id="r-above-file"),
    pytest.param(dict(rank_pattern={"v_proj": 2}), key(0, "v_proj", "A"), id="rank-pattern-not-file"),
])
def test_rank_differs_from_config(folder, config, changes, bad):
    """A file whose rank is not the config's `r` (or its rank_pattern) is refused, naming the key and the ranks."""
    edit_config(folder, **changes)
    rank = changes.get("r") or next(iter(changes["rank_pattern"].values()))
    with pytest.raises(AdapterError, match=re.escape(bad) + rf".*\[8, 64\].*rank {rank} needs \[{rank}, 64\]"):
        inspect_peft_adapter(folder, config)


def test_rank_above_pool_max(folder, config):
    """A rank above the pool's maximum is refused at inspect time, naming max_lora_rank."""
    with pytest.raises(AdapterError, match=r"rank 8, above the pool's max_lora_rank=4"):
        inspect_peft_adapter(folder, config, max_rank=4)
    inspect_peft_adapter(folder, config, max_rank=8)  # equal is fine


def test_rank_above_pool_max_at_write(folder, config):
    """An adapter inspected without a limit is still refused by a pool that cannot hold its rank."""
    adapter = read_peft_adapter(inspect_peft_adapter(folder, config), torch.float32)
    pool = AdapterPool(config, 2, 4, torch.float32, "cpu")
    with pytest.raises(AdapterError, match=r"max_lora_rank=4"):
        pool.write(1, adapter)
    assert int(pool.ranks.abs().sum()) == 0


# ---- files --------------------------------------------------------------------------------------

def _truncate(folder):
    data = (folder / SAFETENSORS).read_bytes()
    (folder / SAFETENSORS).write_bytes(data[: len(data) // 2])


def _garbage_bin(folder):
    (folder / SAFETENSORS).unlink()
    (folder / BIN).write_bytes(b"this is not a pickle" * 10)


def _bin_not_tensors(folder):
    (folder / SAFETENSORS).unlink()
    torch.save({key(0, "q_proj", "A"): [1.0, 2.0]}, folder / BIN)


def _int8(folder, fmt):
    state = load_file(folder / SAFETENSORS)
    state[key(1, "k_proj", "A")] = torch.randint(-8, 8, (R, 64), dtype=torch.int8)
    if fmt == "bin":
        (folder / SAFETENSORS).unlink()
        torch.save(state, folder / BIN)
    else:
        save_file(state, folder / SAFETENSORS)


FILE_REFUSALS = [
    ("missing-folder", lambda f: shutil.rmtree(f), r"not a folder"),
    ("file-not-folder", lambda f: (shutil.rmtree(f), f.write_text("{}")), r"not a folder"),
    ("missing-config", lambda f: (f / CONFIG).unlink(), r"adapter_config\.json: missing"),
    ("invalid-json", lambda f: (f / CONFIG).write_text('{"r": 8,'), r"adapter_config\.json: unreadable"),
    ("config-not-object", lambda f: (f / CONFIG).write_text("[8, 16]"),
     r"adapter_config\.json: expected a JSON object"),
    ("no-weights", lambda f: (f / SAFETENSORS).unlink(),
     r"no weights file \(adapter_model\.safetensors or adapter_model\.bin\)"),
    ("truncated-safetensors", _truncate, r"adapter_model\.safetensors: unreadable safetensors"),
    ("garbage-bin", _garbage_bin, r"adapter_model\.bin: unreadable PyTorch weights"),
    ("bin-not-tensors", _bin_not_tensors, r"adapter_model\.bin: expected a dict of tensors"),
    ("int8-safetensors", lambda f: _int8(f, "safetensors"), re.escape(key(1, "k_proj", "A")) + r".*I8.*floating point"),
    ("int8-bin", lambda f: _int8(f, "bin"), re.escape(key(1, "k_proj", "A")) + r".*int8.*floating point"),
]


@pytest.mark.parametrize("breaker, match", [pytest.param(b, m, id=i) for i, b, m in FILE_REFUSALS])
def test_file_refusals(folder, config, breaker, match):
    """A missing, unreadable or mistyped file is refused at inspect time, naming the file."""
    breaker(folder)
    with pytest.raises(AdapterError, match=match) as info:
        inspect_peft_adapter(folder, config)
    assert str(folder) in str(info.value)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_weight_refused_at_read(folder, config, fmt, value):
    """A NaN or infinite weight passes inspect (headers only) and is refused at read, naming the key."""
    bad = key(1, "v_proj", "B")
    state = load_file(folder / SAFETENSORS)
    state[bad][3, 5] = value
    if fmt == "bin":
        (folder / SAFETENSORS).unlink()
        torch.save(state, folder / BIN)
    else:
        save_file(state, folder / SAFETENSORS)
    spec = inspect_peft_adapter(folder, config)
    with pytest.raises(AdapterError, match=re.escape(bad) + r".*NaN or infinite"):
        read_peft_adapter(spec, torch.float32)


def test_fp16_overflow_refused_at_read(folder, config):
    """A value beyond fp16's range is refused when read into fp16 (naming the file and dtype), served in bf16/fp32."""
    state = load_file(folder / SAFETENSORS)
    state[key(0, "o_proj", "A")][0, 0] = 1e5  # fp16 max is 65504
    save_file(state, folder / SAFETENSORS)
    spec = inspect_peft_adapter(folder, config)
    with pytest.raises(AdapterError, match=re.escape(str(folder / SAFETENSORS)) + r".*overflow float16"):
        read_peft_adapter(spec, torch.float16)
    for dtype in (torch.bfloat16, torch.float32):
        assert all(torch.isfinite(b).all() for b in read_peft_adapter(spec, dtype).buffers)


def test_file_changed_after_inspect(folder, config):
    """Weights rewritten with another rank between inspect and read are refused, not misread."""
    spec = inspect_peft_adapter(folder, config)
    edit_weights(folder, lambda s: {k: (v[:4] if ".lora_A." in k else v[:, :4]).contiguous() for k, v in s.items()})
    with pytest.raises(AdapterError, match=r"changed since it was registered"):
        read_peft_adapter(spec, torch.float32)


# ---- initialisations that rewrite the base model ------------------------------------------------

@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga"])
def test_base_rewriting_init_is_not_served_silently(folder, config, init):
    """PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA subtract their initial B @ A from the base weights (PEFT's
    lora/layer.py `*_init`); saved unconverted (the config keeps `init_lora_weights`), the adapter only
    means what it was trained to on that modified base, so on the original base it is refused."""
    edit_config(folder, init_lora_weights=init)
    with pytest.raises(AdapterError, match=rf"init_lora_weights' is '{init}'.*changes the base weights"):
        inspect_peft_adapter(folder, config)


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal", "mica"])
def test_plain_init_is_served_quietly(folder, config, init):
    """Initialisations that leave the base weights alone change nothing at inference: no refusal, no warning."""
    edit_config(folder, init_lora_weights=init)
    assert inspect_peft_adapter(folder, config).warnings == []
