"""FP8 base weights (models/fp8/) under bf16/fp32 LoRA, on the CPU's dequantizing path.

Tiny models are quantized by the tests into each published format (tests/fp8_fixtures.py). The oracle is
transformers + PEFT on the same model with every FP8 weight replaced by its float64 dequantization, saved in
float32: the weight-only path computes those very weights (an e4m3 value times an fp32 scale is exact in
float64 and rounds once to fp32 either way), so the logits match as tightly as the dense model's do.
"""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapter_fixtures import make_adapter
from engine_fixtures import GenerateOracle, random_prompts
from fp8_fixtures import ct_config, expand, fp8_config, make_blocky_model, quantize_folder
from loraplex.adapters import AdapterPool, inspect_peft_adapter, read_peft_adapter
from loraplex.models import KVCache, load_model
from loraplex.models.fp8 import E4M3_MAX, FP8, Fp8Weight, fp8_scheme, quantize_rows
from model_fixtures import HFOracle, make_hf_model
from test_model_vs_hf import BLOCK, PLAN, check_mixed_batch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# PLAN's adapter names: PEFT adapters trained (randomly drawn) on the float model, served on its FP8 version
ADAPTERS = {"all-r8": dict(r=8, lora_alpha=16, target_modules=ALL),
            "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
            "mlp-patterned": dict(r=6, lora_alpha=12, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
                                  use_rslora=True, rank_pattern={"down_proj": 3})}
# every finite e4m3fn value, float64, ascending: the grid round-to-nearest picks from
GRID = torch.arange(256, dtype=torch.uint8).view(FP8).double()
GRID = GRID[torch.isfinite(GRID)].unique()


class Fp8Setup:
    """An FP8 checkpoint of a tiny model, loaded, with PLAN's adapters in a pool, and its oracle: what
    test_model_vs_hf.check_mixed_batch reads."""

    def __init__(self, fp8_dir, oracle_dir, adapters: dict, **load) -> None:
        self.model = load_model(fp8_dir, dtype=torch.float32, **load)
        self.config = self.model.config
        self.oracle = HFOracle(oracle_dir, adapters)
        self.pool = AdapterPool(self.config, num_slots=4, max_rank=8, dtype=torch.float32, device="cpu")
        self.slots = {None: -1}
        for slot, (name, folder) in enumerate(adapters.items()):
            self.pool.write(slot + 1, read_peft_adapter(inspect_peft_adapter(folder, self.config, name=name),
                                                        torch.float32))
            self.slots[name] = slot + 1

    def new_cache(self, num_blocks: int = 64) -> KVCache:
        kv = KVCache(self.config, num_blocks, BLOCK, dtype=torch.float32)
        kv.data.fill_(float("nan"))
        return kv

    def forward(self, kv, chunks, pool=True, graph_room=None):
        from loraplex.models import ForwardBatch
        batch = ForwardBatch.build(chunks, block_size=BLOCK, num_blocks=kv.num_blocks,
                                   vocab_size=self.config.vocab_size)
        return self.model(batch, kv, self.pool if pool else None)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """name → (float checkpoint, its adapters), made once."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, make in (("llama", lambda d: make_hf_model(d, "llama-gqa-llama3rope", seed=5)),
                       ("mistral", lambda d: make_hf_model(d, "mistral-gqa4-window", seed=6)),
                       ("qwen2", lambda d: make_hf_model(d, "qwen2-bias-tied-window", seed=7)),
                       ("blocky", lambda d: make_blocky_model(d, seed=8))):
        base = make(root / name)
        out[name] = base, {a: make_adapter(base, root / f"{name}-{a}", seed=i + 3, **cfg)
                           for i, (a, cfg) in enumerate(ADAPTERS.items())}
    return out


IGNORE = ["lm_head", r"re:.*layers\.0\.self_attn\.k_proj", r"re:.*layers\.1\.mlp\.down_proj"]
# (base, quantization_config, modules left in float, scale dtype): each format's layouts (models/fp8/weight.py).
CASES = {
    # per-tensor scales in bf16 with static input scales: per-row scales over each fused part
    "ct-tensor-static": ("llama", ct_config("tensor", True, ["lm_head"]), (), torch.bfloat16),
    # per-channel, dynamic, the older format name; layer 0's k_proj (so its fused q/k/v stays dense, q and v
    # dequantized at load) and layer 1's down_proj left unquantized by regex
    "ct-channel-ignore": ("mistral", ct_config("channel", False, IGNORE, fmt="naive-quantized"),
                          ("layers.0.self_attn.k_proj", "layers.1.mlp.down_proj"), torch.float32),
    # 128×128 blocks over widths below 128 (q 64, k/v 32): each row takes its part's block row; the LM head
    # (tied here: not stored) stays in float
    "fp8-128-small": ("qwen2", fp8_config((128, 128), None), (), torch.float32),
    # 32×32 blocks over 64/96-wide parts: every part starts on a block row, the grids stack; the LM head is
    # quantized in the checkpoint (no modules_to_not_convert) and dequantized into float at load
    "fp8-32-stacked": ("llama", fp8_config((32, 32), None), (), torch.float32),
    # 128×128 blocks over widths that are multiples of 128, as published checkpoints have them
    "fp8-128-blocky": ("blocky", fp8_config((128, 128), ["lm_head"]), (), torch.float32),
}


def _skip(patterns):
    return lambda module: any(module.endswith(p) for p in patterns)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_checkpoint_matches_transformers_peft_on_dequantized_weights(bases, tmp_path, case):
    name, qconfig, kept, scale_dtype = CASES[case]
    base, adapters = bases[name]
    quantize_folder(base, tmp_path / "fp8", tmp_path / "oracle", qconfig, skip=_skip(kept), scale_dtype=scale_dtype,
                    seed=len(case))
    setup = Fp8Setup(tmp_path / "fp8", tmp_path / "oracle", adapters)
    _check_weights(setup.model, tmp_path / "oracle", kept)
    if qconfig.get("config_groups", {}).get("group_0", {}).get("input_activations", {}).get("dynamic") is False:
        stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
        layer = setup.model.layers[0]
        expect = torch.stack([stored[f"model.layers.0.self_attn.{p}.input_scale"].float().reshape(())
                              for p in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(layer.qkv_proj.weight.input_scale, expect)
    check_mixed_batch(setup, PLAN)


def _check_weights(model, oracle_dir, kept) -> None:
    """FP8 in memory where the checkpoint has it (no float copy), dense where it has not; the FP8 weights'
    dequantization is the oracle's weights bit for bit."""
    dense = load_file(str(oracle_dir / "model.safetensors"))
    kept_dense = set()
    for i, layer in enumerate(model.layers):
        for attr, block in (("qkv_proj", "self_attn"), ("o_proj", "self_attn"), ("gate_up_proj", "mlp"),
                            ("down_proj", "mlp")):
            proj = getattr(layer, attr)
            names = [f"model.layers.{i}.{block}.{p}" for p in proj.parts]
            expect = torch.cat([dense[f"{n}.weight"] for n in names])
            if any(n.endswith(k) for n in names for k in kept):
                assert isinstance(proj.weight, torch.Tensor) and proj.weight.dtype == torch.float32
                assert torch.equal(proj.weight, expect), names
                kept_dense.add(f"layers.{i}.{attr}.weight")
                continue
            assert isinstance(proj.weight, Fp8Weight) and proj.weight.qweight.dtype == FP8
            assert torch.equal(proj.weight.dequantize(torch.float32), expect), names
    # no float copy of an FP8 weight: the float tensors are embeddings, norms, biases, the LM head and the
    # projections kept dense
    for name, param in model.named_parameters():
        if param.dtype != FP8:
            assert name in kept_dense or re.search(r"(embed_tokens|norm|lm_head_weight|bias)$", name), name


def test_quantize_at_load_from_a_bf16_checkpoint(bases, tmp_path):
    """`quantization="fp8"` on a bfloat16 folder: per row, scale = amax / 448 and each value the nearest e4m3 to
    w / scale; the model then matches transformers + PEFT on its dequantized weights."""
    base, adapters = bases["llama"]
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    cfg = json.loads((base / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="bfloat16", dtype="bfloat16")))
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(str(base / "model.safetensors")).items()}
    save_file(weights, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(bf16, dtype=torch.float32, quantization="fp8")
    oracle = dict(weights)
    for i, layer in enumerate(model.layers):
        for proj, block in ((layer.qkv_proj, "self_attn"), (layer.o_proj, "self_attn"),
                            (layer.gate_up_proj, "mlp"), (layer.down_proj, "mlp")):
            w = torch.cat([weights[f"model.layers.{i}.{block}.{p}.weight"] for p in proj.parts]).double()
            f8 = proj.weight
            assert isinstance(f8, Fp8Weight) and f8.block == (1, w.shape[1]) and f8.scale.shape == (w.shape[0], 1)
            amax = w.abs().amax(dim=1, keepdim=True)
            assert torch.allclose(f8.scale.double(), amax / E4M3_MAX, rtol=2 ** -23, atol=0)
            _assert_nearest(f8.qweight, (w.float() / f8.scale).double())   # the quotient as fp32 computes it
            deq = f8.qweight.double() * expand(f8.scale, tuple(w.shape), 1, w.shape[1])
            row = 0
            for p in proj.parts:
                key = f"model.layers.{i}.{block}.{p}.weight"
                oracle[key] = deq[row:row + weights[key].shape[0]].float()
                row += weights[key].shape[0]
    (tmp_path / "oracle").mkdir()
    (tmp_path / "oracle" / "config.json").write_text((base / "config.json").read_text())
    save_file({k: v.float() for k, v in oracle.items()}, str(tmp_path / "oracle" / "model.safetensors"),
              metadata={"format": "pt"})
    setup = Fp8Setup(bf16, tmp_path / "oracle", adapters, quantization="fp8")
    check_mixed_batch(setup, PLAN[:5])


def _assert_nearest(q: torch.Tensor, x: torch.Tensor) -> None:
    """Each q is a nearest finite e4m3 value to x, and x is within the grid's range."""
    assert x.abs().max() <= E4M3_MAX * (1 + 2 ** -20)
    nearest = (x.reshape(-1, 1) - GRID).abs().min(dim=1).values.reshape(x.shape)
    assert torch.all((q.double() - x).abs() <= nearest * (1 + 2 ** -40)), "not rounded to nearest"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_round_trip_error_bound(dtype):
    """quantize_rows: per row the largest |w| maps to 448; every value rounds to a nearest e4m3 value, so
    |w - q·s| <= 2^-4 |w| where w/s is a normal e4m3 number (|w/s| >= 2^-6: 3 mantissa bits, half a spacing
    is 2^-4 of the value's binade start) and <= 2^-10 s below (the subnormal spacing 2^-9, halved). A row of
    zeros takes scale 1 and stays zero."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 200, generator=gen) * torch.logspace(-6, 3, 48)[:, None]
    w[5, :50] *= 1e-4   # values deep in the row's subnormal range
    w[7] = 0.0
    w = w.to(dtype)
    q, s = quantize_rows(w)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (48, 1)
    w64 = w.double()
    amax = w64.abs().amax(dim=1, keepdim=True)
    assert s[7].item() == 1.0 and torch.all(q[7].float() == 0)
    live = amax[:, 0] > 0
    assert torch.allclose(s.double()[live], amax[live] / E4M3_MAX, rtol=2 ** -23, atol=0)
    _assert_nearest(q, (w.float() / s).double())
    err = (w64 - q.double() * s.double()).abs()
    bound = torch.maximum(2.0 ** -4 * w64.abs(), 2.0 ** -10 * s.double()) * (1 + 2 ** -20)
    assert torch.all(err <= bound)
    assert torch.all(q.float().abs().amax(dim=1)[live] == E4M3_MAX)   # the row's largest value maps to 448


def test_fp8_model_greedy_per_adapter_in_a_mixed_batch_through_the_engine(bases, tmp_path):
    """The engine (LLM) serves a compressed-tensors checkpoint with PEFT adapters of the float model: greedy
    tokens of each adapter and the base model, side by side in one batch, equal transformers + PEFT's on the
    dequantized weights."""
    from loraplex import LLM, SamplingParams
    base, adapters = bases["llama"]
    quantize_folder(base, tmp_path / "fp8", tmp_path / "oracle", ct_config("channel", True, ["lm_head"]))
    oracle = GenerateOracle(tmp_path / "oracle", adapters)
    names = [None, *adapters]
    prompts = random_prompts(6, 128, (3, 20), seed=2)
    which = [names[i % len(names)] for i in range(len(prompts))]
    with LLM(str(tmp_path / "fp8"), adapters={k: str(v) for k, v in adapters.items()}, dtype="float32",
             device="cpu", num_kv_blocks=128, block_size=8, max_num_seqs=8, max_num_batched_tokens=128,
             max_gpu_adapters=4) as llm:
        assert isinstance(llm.engine.runner.model.layers[0].qkv_proj.weight, Fp8Weight)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), adapter=which)
    for prompt, adapter, out in zip(prompts, which, outs):
        assert out.token_ids == oracle.greedy(prompt, adapter, 8), (adapter, len(prompt))
    for name in adapters:   # the adapters matter on the FP8 model too
        assert any(oracle.greedy(p, name, 8) != oracle.greedy(p, None, 8) for p in prompts)


def _ct(**weights) -> dict:
    config = ct_config("channel", False, ["lm_head"])
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


# (quantization_config, the field the refusal must name)
REFUSED = [
    ({"quant_method": "gptq", "bits": 4}, "quantization_config.quant_method='gptq'"),
    ({"quant_method": "awq"}, "quant_method='awq'"),
    (_ct(type="int"), "config_groups.group_0.weights.type='int'"),
    (_ct(num_bits=4), "weights.num_bits=4"),
    (_ct(strategy="group", group_size=128), "weights.strategy='group'"),
    (_ct(strategy="block", block_structure=[128, 128]), "weights.strategy='block'"),
    (_ct(symmetric=False), "weights.symmetric=False"),
    (dict(_ct(), format="pack-quantized"), "quantization_config.format='pack-quantized'"),
    (dict(_ct(), format="int-quantized"), "format='int-quantized'"),
    (dict(_ct(), kv_cache_scheme={"num_bits": 8, "type": "float"}), "quantization_config.kv_cache_scheme"),
    (dict(fp8_config((128, 128), None), activation_scheme="static"), "quantization_config.activation_scheme='static'"),
    (dict(fp8_config((128, 128), None), fmt="e5m2"), "quantization_config.fmt='e5m2'"),
    (dict(fp8_config((128, 128), None), weight_block_size=[128]), "quantization_config.weight_block_size=[128]"),
]


@pytest.mark.parametrize("qconfig,field", REFUSED, ids=[f for _, f in REFUSED])
def test_unsupported_quantization_configs_are_refused_naming_the_field(qconfig, field):
    with pytest.raises(ValueError, match="quantization_config") as info:
        fp8_scheme({"quantization_config": qconfig}, None, " in /m")
    assert field in str(info.value) and "/m" in str(info.value)


def test_static_channel_activations_and_odd_targets_are_refused():
    config = ct_config("channel", True, [])
    config["config_groups"]["group_0"]["input_activations"]["strategy"] = "channel"
    with pytest.raises(ValueError, match=r"group_0\.input_activations\.strategy='channel'"):
        fp8_scheme({"quantization_config": config}, None)
    config = ct_config("channel", False, [])
    config["config_groups"]["group_0"]["targets"] = ["re:.*mlp.*"]
    with pytest.raises(ValueError, match=r"group_0\.targets"):
        fp8_scheme({"quantization_config": config}, None)
    with pytest.raises(ValueError, match="quantization must be None or 'fp8', got 'int8'"):
        fp8_scheme({}, "int8")


def test_bad_fp8_checkpoints_are_refused_naming_the_tensor(bases, tmp_path):
    base, _ = bases["llama"]
    quantize_folder(base, tmp_path / "ok", tmp_path / "oracle", ct_config("tensor", False, ["lm_head"]))
    good = load_file(str(tmp_path / "ok" / "model.safetensors"))
    key = "model.layers.1.mlp.up_proj"

    def write(name: str, tensors: dict, quantized: bool = True):
        folder = tmp_path / name
        folder.mkdir()
        cfg = json.loads((base / "config.json").read_text())
        if quantized:
            cfg["quantization_config"] = ct_config("tensor", False, ["lm_head"])
        (folder / "config.json").write_text(json.dumps(cfg))
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder

    cases = [
        (write("e5m2", dict(good, **{f"{key}.weight": good[f"{key}.weight"].float().to(torch.float8_e5m2)})),
         f"'{key}.weight' is torch.float8_e5m2"),
        (write("noconfig", good, quantized=False), "but config.json has no quantization_config"),
        (write("noscale", {k: v for k, v in good.items() if k != f"{key}.weight_scale"}),
         f"no tensor '{key}.weight_scale'"),
        (write("badscale", dict(good, **{f"{key}.weight_scale": torch.ones(3, 1)})), f"'{key}.weight_scale' has shape"),
        (write("negscale", dict(good, **{f"{key}.weight_scale": -torch.ones(1)})), "not finite and positive"),
        (write("static", dict(good, **{f"{key}.input_scale": torch.ones(1)})), f"'{key}.input_scale' is not part"),
        (write("zp", dict(good, **{f"{key}.weight_zero_point": torch.ones(1, dtype=torch.int8)})), "zero points"),
    ]
    for folder, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            load_model(folder, dtype=torch.float32)
    # FP8 tensors under no quantization_config, with quantization="fp8": not a float checkpoint to quantize
    with pytest.raises(ValueError, match="quantization='fp8' takes a float32, float16 or bfloat16 checkpoint"):
        load_model(tmp_path / "noconfig", dtype=torch.float32, quantization="fp8")


def test_engine_config_and_flags_take_quantization():
    from loraplex.cli import build_parser
    from loraplex.cli_flags import given
    from loraplex.config import EngineConfig
    assert EngineConfig(model="m", device="cpu").quantization is None
    assert EngineConfig.from_kwargs("m", device="cpu", quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="EngineConfig.quantization must be None or 'fp8', got 'int4'"):
        EngineConfig(model="m", device="cpu", quantization="int4")
    for command in (["serve"], ["generate", "hi"]):
        args = build_parser().parse_args([command[0], "--model", "m", "--quantization", "fp8", *command[1:]])
        assert given(args, "engine")["quantization"] == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int8"])


@pytest.mark.parametrize("case,kernel", [("fp8-32-stacked", True), ("ct-channel-ignore", True),
                                         ("fp8-32-stacked", False)])
def test_fp8_weights_under_the_triton_decode_plan(bases, tmp_path, monkeypatch, case, kernel):
    """The "decode" LoRA plan (Triton's interpreter here): overlap.py's GEMMs beside the LoRA kernels take the FP8
    weight, through ops/gemm/fp8.py's weight-only kernel where the dense Triton GEMM would run (`kernel`:
    LORAPLEX_SKINNY_GEMM=on; block and per-column scales), else dequantized; the logits still match
    transformers + PEFT on the dequantized weights."""
    from loraplex import ops
    from loraplex.ops.gemm import fp8, skinny
    if not ops.triton_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 (no CUDA)")
    base_name, qconfig, kept, _ = CASES[case]
    base, adapters = bases[base_name]
    quantize_folder(base, tmp_path / "fp8", tmp_path / "oracle", qconfig, skip=_skip(kept))
    setup = Fp8Setup(tmp_path / "fp8", tmp_path / "oracle", adapters)
    setup.model.backend = "triton"
    from loraplex.models.lora_plan import LoraPlan
    kinds, real_make = [], LoraPlan.make
    monkeypatch.setattr(LoraPlan, "make", lambda *a, **kw: kinds.append(real_make(*a, **kw)) or kinds[-1])
    launches, real_kernel = [], fp8.fp8_skinny_linear
    monkeypatch.setattr(fp8, "fp8_skinny_linear", lambda *a, **kw: launches.append(a[1].block) or real_kernel(*a, **kw))
    monkeypatch.setattr(skinny, "SETTING", "on" if kernel else "auto")
    check_mixed_batch(setup, [("all-r8", 2, 1), ("attn-r4", 1, 1), (None, 1, 1), ("mlp-patterned", 2, 1)])
    assert [p.kind for p in kinds] == ["decode", "decode"]
    assert bool(launches) == kernel, launches


def test_dummy_models_quantize_like_loaded_ones(bases):
    """dummy_model(..., quantization="fp8") (the engine's dummy:<preset> with --quantization fp8): the same random
    weights as the float dummy, each projection quantized per row by quantize_rows."""
    from loraplex.models import ModelConfig, dummy_model
    config = ModelConfig.from_pretrained(bases["llama"][0])
    dense = dummy_model(config, dtype="float32", seed=3)
    fp8 = dummy_model(config, dtype="float32", seed=3, quantization="fp8")
    for d, f in zip(dense.layers, fp8.layers):
        for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            w = getattr(f, attr).weight
            q, s = quantize_rows(getattr(d, attr).weight)
            assert isinstance(w, Fp8Weight) and torch.equal(w.qweight.float(), q.float()) and torch.equal(w.scale, s)
    assert torch.equal(fp8.embed_tokens, dense.embed_tokens) and torch.equal(fp8.lm_head, dense.lm_head)
    # module casts leave FP8 weights and their scales as they are (a cast would round the scales)
    proj = fp8.layers[0].qkv_proj
    before = proj.weight.dequantize(torch.float32)
    proj.to(torch.bfloat16)
    assert proj.weight.qweight.dtype == FP8 and proj.weight.scale.dtype == torch.float32
    assert torch.equal(proj.weight.dequantize(torch.float32), before)
