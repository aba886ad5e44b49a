"""Loading served models from Hugging Face folders, dummy weights, presets and config parsing."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.models import ModelConfig, RopeConfig, dummy_model, load_model, preset_config
from loraplex.models.loader import weight_targets
from loraplex.models.registry import ARCHITECTURES
from model_fixtures import make_hf_model

VARIANT = "llama-gqa-llama3rope"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("base") / "m", VARIANT)


def _copy(base, tmp_path):
    return shutil.copytree(base, tmp_path / "copy")


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_loads_every_weight_where_transformers_has_it(base):
    from transformers import AutoModelForCausalLM
    ours = load_model(base, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    c = ours.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = ours.layers[1]
    p = "model.layers.1."
    assert torch.equal(layer.qkv_proj.weight[:q], theirs[p + "self_attn.q_proj.weight"])
    assert torch.equal(layer.qkv_proj.weight[q:q + kv], theirs[p + "self_attn.k_proj.weight"])
    assert torch.equal(layer.qkv_proj.weight[q + kv:], theirs[p + "self_attn.v_proj.weight"])
    assert torch.equal(layer.gate_up_proj.weight[:c.intermediate_size], theirs[p + "mlp.gate_proj.weight"])
    assert torch.equal(layer.gate_up_proj.weight[c.intermediate_size:], theirs[p + "mlp.up_proj.weight"])
    assert torch.equal(ours.lm_head, theirs["lm_head.weight"])
    assert torch.equal(ours.embed_tokens, theirs["model.embed_tokens.weight"])
    assert ours.inv_freq.dtype == torch.float32


def test_sharded_checkpoint_loads_the_same(base, tmp_path):
    sharded = make_hf_model(tmp_path / "sharded", VARIANT, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    a, b = _params(load_model(base, dtype=torch.float32)), _params(load_model(sharded, dtype=torch.float32))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pytorch_bin_checkpoint_loads_the_same(base, tmp_path):
    folder = _copy(base, tmp_path)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    a, b = _params(load_model(base, dtype=torch.float32)), _params(load_model(folder, dtype=torch.float32))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dtype_auto_follows_the_config_and_an_override_wins(base, tmp_path):
    assert load_model(base).dtype == torch.float32  # saved as float32
    folder = _copy(base, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for key, name, dtype in (("dtype", "bfloat16", torch.bfloat16), ("torch_dtype", "float16", torch.float16)):
        # transformers 5 writes `dtype`; older versions `torch_dtype`
        cfg.pop("dtype", None)
        cfg[key] = name
        (folder / "config.json").write_text(json.dumps(cfg))
        model = load_model(folder)
        assert model.dtype == dtype and model.layers[0].qkv_proj.weight.dtype == dtype
        assert model.inv_freq.dtype == torch.float32
    assert load_model(folder, dtype="bfloat16").norm.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be"):
        load_model(folder, dtype="int8")


def _edit_weights(folder, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), r"no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"),
    (lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.ones(96, 64)}),
     r"model\.safetensors: tensor 'model\.layers\.2\.mlp\.up_proj\.weight' is not a weight"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.ones(16, 64)}),
     r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[16, 64\]; the config gives \[32, 64\]"),
    (lambda t: t["model.norm.weight"].__setitem__(3, math.nan), r"'model\.norm\.weight' has NaN or inf"),
])
def test_bad_checkpoints_name_the_tensor(base, tmp_path, edit, message):
    folder = _copy(base, tmp_path)
    _edit_weights(folder, edit)
    with pytest.raises(ValueError, match=message):
        load_model(folder, dtype=torch.float32)


def test_overflow_into_the_serving_dtype_is_refused(base, tmp_path):
    folder = _copy(base, tmp_path)
    _edit_weights(folder, lambda t: t["model.layers.0.mlp.down_proj.weight"].__setitem__((0, 0), 1e6))
    load_model(folder, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"down_proj\.weight' has NaN or inf values in torch\.float16"):
        load_model(folder, dtype=torch.float16)


def test_old_rotary_buffers_are_ignored(base, tmp_path):
    folder = _copy(base, tmp_path)
    _edit_weights(folder, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_model(folder, dtype=torch.float32)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, r"architecture 'GPT2LMHeadModel' .* supported: \['LlamaForCausalLM'"),
    ({"model_type": "gpt2"}, r"model_type 'gpt2' is not served"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not served"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, r"rope type 'yarn' is not served"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 4.0, "rope_theta": 1e4}}, r"needs 'low_freq_factor'"),
    ({"num_key_value_heads": 3}, r"not a multiple of num_key_value_heads=3"),
])
def test_unsupported_configs_are_refused_by_name(base, tmp_path, change, message):
    folder = _copy(base, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(change)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_model(folder)


def test_missing_weights_and_config_are_named(tmp_path, base):
    with pytest.raises(ValueError, match="config.json: no such file"):
        load_model(tmp_path)
    folder = _copy(base, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_model(folder)


def test_progress_bar_on_request(base, capsys):
    load_model(base, dtype=torch.float32, progress=True)
    assert "loading m" in capsys.readouterr().err


def test_tied_checkpoints_that_also_store_lm_head_load_as_transformers_loads_them(tmp_path):
    """Tied with an equal lm_head: stays tied. A different one: untied, with a warning (as
    transformers does). lm_head alone: it fills the embedding."""
    import warnings

    from transformers import AutoModelForCausalLM
    base = make_hf_model(tmp_path / "tied", "qwen2-bias-tied-window")
    weights = load_file(base / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    cases = {"equal": {**weights, "lm_head.weight": embed.clone()},
             "different": {**weights, "lm_head.weight": embed + 0.5},
             "head-only": {**{k: v for k, v in weights.items() if "embed" not in k}, "lm_head.weight": embed + 0.5}}
    for name, tensors in cases.items():
        folder = shutil.copytree(base, tmp_path / name)
        save_file(tensors, str(folder / "model.safetensors"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = load_model(folder, dtype=torch.float32)
        assert (ours.lm_head_weight is not None) == (name == "different"), name
        assert any("differs from the embedding" in str(w.message) for w in caught) == (name == "different")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert torch.equal(ours.lm_head, theirs.lm_head.weight), name
        assert torch.equal(ours.embed_tokens, theirs.model.embed_tokens.weight), name


def test_moving_or_casting_the_model_keeps_rope_frequencies_in_float32(base):
    model = load_model(base, dtype=torch.float32)
    expect = model.inv_freq.clone()
    model.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16 and torch.equal(model.inv_freq, expect)


def test_gpu_only_head_sizes_are_refused_at_load():
    from loraplex.models.loader import build_empty
    config = ModelConfig(model_type="llama", hidden_size=72, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=6, num_key_value_heads=6, head_dim=12, vocab_size=50, name_or_path="odd")
    with pytest.raises(ValueError, match=r"head_dim=12 \(odd\) is not served on the GPU"):
        build_empty(config, torch.bfloat16, "cuda")


def test_stop_tokens_include_generation_config(base, tmp_path):
    folder = _copy(base, tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eos_token_id"] = 5
    (folder / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_pretrained(folder).eos_token_ids == (5, 2, 7)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id must be a token id"):
        ModelConfig.from_pretrained(folder)


def test_rope_theta_at_top_level_fills_rope_parameters():
    cfg = {"rope_theta": 5e5, "max_position_embeddings": 4096,
           "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
    rope = RopeConfig.from_config_dict(cfg)
    assert rope.theta == 5e5 and rope.original_max_position_embeddings == 4096


def test_rope_configs_old_and_new_formats_agree():
    old = RopeConfig.from_config_dict({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = RopeConfig.from_config_dict({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert old == new
    inv = new.inv_freq(8)
    assert torch.allclose(inv, 1 / (5e5 ** (torch.arange(0, 8, 2) / 8)) / 2)


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 5e5}
    hf = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072, rope_parameters=params)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert torch.equal(RopeConfig.from_config_dict({"rope_parameters": params}).inv_freq(128), theirs)


def test_sliding_windows_follow_each_family():
    base = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    assert ModelConfig.from_dict({**base, "model_type": "llama", "sliding_window": 8}).sliding_windows == ()
    assert ModelConfig.from_dict({**base, "model_type": "mistral", "sliding_window": 8}).sliding_windows == (8,) * 4
    assert ModelConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 8}).sliding_windows == ()
    qwen = {**base, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2}
    assert ModelConfig.from_dict(qwen).sliding_windows == (0, 0, 8, 8)
    typed = {**qwen, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert ModelConfig.from_dict(typed).sliding_windows == (8, 0, 8, 0)
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_dict({**qwen, "layer_types": ["sliding_attention"]})
    # Missing keys take transformers' defaults; an explicit null means no window.
    no_key = {k: v for k, v in base.items() if k != "num_key_value_heads"}
    mistral = ModelConfig.from_dict({**no_key, "model_type": "mistral", "num_attention_heads": 8})
    assert mistral.sliding_windows == (4096,) * 4 and mistral.num_key_value_heads == 8
    assert ModelConfig.from_dict({**base, "model_type": "mistral", "sliding_window": None}).sliding_windows == ()
    deep = {**base, "model_type": "qwen2", "num_hidden_layers": 30, "sliding_window": 8, "use_sliding_window": True}
    assert ModelConfig.from_dict(deep).sliding_windows == (0,) * 28 + (8, 8)


def test_presets_have_the_published_shapes():
    c = preset_config("llama-2-7b")
    assert (c.hidden_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim) == (4096, 32, 32, 128)
    c = preset_config("llama-3.1-8b", num_layers=2)
    assert (c.num_hidden_layers, c.num_key_value_heads, c.rope.rope_type, c.vocab_size) == (2, 8, "llama3", 128256)
    assert preset_config("qwen2-7b").qkv_bias
    with pytest.raises(ValueError, match="unknown model preset 'llama-9'"):
        preset_config("llama-9")


def test_dummy_weights_are_random_deterministic_and_fill_everything(tmp_path, base):
    config = ModelConfig.from_pretrained(base)
    a = dummy_model(config, dtype="float32", seed=1, num_layers=3)
    b = dummy_model(config, dtype="float32", seed=1, num_layers=3)
    assert a.config.num_hidden_layers == 3
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q) and torch.isfinite(p).all() and p.std() > 0, name
    assert set(ARCHITECTURES) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
    assert len(weight_targets(a)) == 2 + 1 + 3 * 9  # embed, norm, lm_head; 9 tensors per layer
