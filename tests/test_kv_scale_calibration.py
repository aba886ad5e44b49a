"""KV-cache scales computed at start-up (`calculate_kv_scales`, models/fp8/kv_calibration.py).

- the scales against the rule on transformers' own keys and values (its KV cache after a forward over the same
  prompts): HEADROOM · max |k| / 448 a layer;
- the engine on a model whose keys and values reach ~1,000 (k_proj and v_proj scaled up, q_proj and o_proj down
  by as much, so its unquantized outputs are the original model's): at scale 1.0 the e4m3 cache saturates and
  the tokens go astray; with calculated scales greedy tokens and logprobs equal transformers + PEFT reading the
  same e4m3 keys and values, and stay near plain transformers';
- the setting, its flag and its refusal without an fp8 cache.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_fixtures import GenerateOracle, make_served_model, random_prompts
from fp8_kv_fixtures import LOGPROB_TOL, Fp8KvOracle, generate_fp8, logprob_errors
from loraplex.models import load_model
from loraplex.models.fp8.kv_calibration import (CALIBRATION_SEQS, CALIBRATION_TOKENS, HEADROOM, calibrate_kv_scales,
                                                calibration_prompts)

LOUD = 300.0   # keys and values ~4 in the served model: ~1,200 here, past e4m3's 448


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return make_served_model(tmp_path_factory.mktemp("kvcal"))


@pytest.fixture(scope="module")
def loud(served, tmp_path_factory):
    """The served base model with keys and values LOUD times larger and the same unquantized outputs."""
    base, adapters = served
    out = tmp_path_factory.mktemp("kvcal_loud") / "base"
    shutil.copytree(base, out)
    # q/k/v: their outputs (weights and any biases) scale; o: its whole weight, as its input (v's) grew
    factors = {".q_proj.": 1 / LOUD, ".k_proj.": LOUD, ".v_proj.": LOUD, ".o_proj.": 1 / LOUD}
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name in list(tensors):
            for part, factor in factors.items():
                if part in name and (name.endswith("weight") or part != ".o_proj."):
                    tensors[name] = tensors[name] * factor
        save_file(tensors, path, metadata={"format": "pt"})
    return out, adapters


def _hf_kv_amax(path, prompts) -> torch.Tensor:
    """[layers, 2]: the largest |key| and |value| transformers' KV cache holds after each prompt's forward."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    amax = torch.zeros(model.config.num_hidden_layers, 2)
    with torch.no_grad():
        for prompt in prompts:
            cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
            for i, layer in enumerate(cache.layers):
                amax[i, 0] = max(amax[i, 0], layer.keys.abs().max())
                amax[i, 1] = max(amax[i, 1], layer.values.abs().max())
    return amax


@pytest.mark.parametrize("which", ["served", "loud"])
def test_calculated_scales_follow_the_rule_on_transformers_keys_and_values(served, loud, which):
    path = (served if which == "served" else loud)[0]
    model = load_model(path, dtype="float32", device="cpu")
    prompts = calibration_prompts(model.config.vocab_size, 100, seed=5)
    assert len(prompts) == CALIBRATION_SEQS and {len(p) for p in prompts} == {min(100, CALIBRATION_TOKENS)}
    assert prompts != calibration_prompts(model.config.vocab_size, 100, seed=6)
    scales = calibrate_kv_scales(model, prompts, block_size=8)
    expected = HEADROOM * _hf_kv_amax(path, prompts) / 448.0
    torch.testing.assert_close(scales.k, expected[:, 0], rtol=1e-5, atol=0)
    torch.testing.assert_close(scales.v, expected[:, 1], rtol=1e-5, atol=0)
    assert (scales.k > 1).all() == (which == "loud")


def test_engine_with_calculated_scales_matches_peft_on_the_same_e4m3_keys_and_values(loud):
    """Keys and values ~1,200: at 1.0 the cache clamps them to 448 and the logprobs land far from plain transformers
    + PEFT's; with calculated scales the tokens and logprobs equal the e4m3 oracle's with those scales, and come
    within the FP8 cache's usual distance of plain transformers' (0.03-0.2 on the served model at scale 1.0; here
    0.06 against 0.51 at 1.0)."""
    base, adapters = loud
    prompts = random_prompts(6, 128, (3, 20), seed=4)
    # the base model and an adapter of the MLP only: the loud model with it is the served one with it (LoRA on q/k/v/o
    # would not scale with their weights)
    which = [[None, "mlp-r2-rslora"][i % 2] for i in range(len(prompts))]
    plain = GenerateOracle(base, adapters)
    kv, outs = generate_fp8(base, adapters, prompts, which, kv_cache_dtype="fp8", calculate_kv_scales=True,
                            num_kv_blocks=64)
    k_scales, v_scales = kv.k_scale.tolist(), kv.v_scale.tolist()
    assert min(k_scales + v_scales) > 1
    oracle = Fp8KvOracle(base, adapters, k_scales, v_scales)
    for prompt, adapter, out in zip(prompts, which, outs):
        assert out.token_ids == oracle.greedy(prompt, adapter, 8), (adapter, len(prompt))
    assert max(logprob_errors(oracle, prompts, which, outs)) <= LOGPROB_TOL
    calculated = max(logprob_errors(plain, prompts, which, outs))
    _, unit = generate_fp8(base, adapters, prompts, which, kv_cache_dtype="fp8", num_kv_blocks=64)
    clamped = max(logprob_errors(plain, prompts, which, unit))
    assert calculated < 0.2 and clamped > 5 * calculated, (calculated, clamped)


def test_the_setting_its_flag_and_its_refusal():
    from loraplex.cli import build_parser
    from loraplex.cli_flags import given
    from loraplex.config import EngineConfig
    assert EngineConfig(model="m", device="cpu").calculate_kv_scales is False
    assert EngineConfig(model="m", device="cpu", kv_cache_dtype="fp8", calculate_kv_scales=True).calculate_kv_scales
    with pytest.raises(ValueError, match="calculate_kv_scales applies to an fp8 KV cache .* kv_cache_dtype is 'auto'"):
        EngineConfig(model="m", device="cpu", calculate_kv_scales=True)
    with pytest.raises(ValueError, match="EngineConfig.calculate_kv_scales must be a bool"):
        EngineConfig(model="m", device="cpu", kv_cache_dtype="fp8", calculate_kv_scales="yes")
    args = build_parser().parse_args(["serve", "--model", "m", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    assert given(args, "engine")["calculate_kv_scales"] is True
