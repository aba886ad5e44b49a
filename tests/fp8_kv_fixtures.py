"""transformers + PEFT whose attention reads e4m3 keys and values (the FP8 KV cache's oracle), and the engine
settings and helpers its tests share (test_fp8_kv_cache.py, test_kv_scale_calibration.py)."""
from __future__ import annotations

import torch

from engine_fixtures import GenerateOracle
from loraplex.ops.attention import KV_FP8

E4M3_MAX = 448.0
ORACLE_ATTENTION = "loraplex_test_fp8_kv"


def _fp8_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention over keys and values rounded through e4m3 by the module's (k, v) scales."""
    from transformers.models.llama.modeling_llama import eager_attention_forward
    ks, vs = module.fp8_kv_scales

    def round_trip(x, s):
        return ((x.float() / torch.tensor(s)).clamp(-E4M3_MAX, E4M3_MAX).to(KV_FP8).float() * s).to(x.dtype)
    return eager_attention_forward(module, query, round_trip(key, ks), round_trip(value, vs), attention_mask,
                                   scaling, dropout, **kwargs)


class Fp8KvOracle(GenerateOracle):
    """GenerateOracle whose attention reads e4m3 keys and values, layer i's scaled by (k_scales[i], v_scales[i])."""

    def __init__(self, base, adapters, k_scales, v_scales) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        AttentionInterface.register(ORACLE_ATTENTION, _fp8_attention)
        AttentionMaskInterface.register(ORACLE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])  # eager's mask
        super().__init__(base, adapters)
        self.scales = list(zip(k_scales, v_scales))

    def _model(self, adapter):
        fresh = adapter not in self._models
        model = super()._model(adapter)
        if fresh:
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            base.set_attn_implementation(ORACLE_ATTENTION)
            for layer, scales in zip(base.model.layers, self.scales, strict=True):
                layer.self_attn.fp8_kv_scales = scales
        return model


ENGINE = dict(dtype="float32", device="cpu", block_size=8, max_num_seqs=8, max_num_batched_tokens=128)
# Our logprobs against the oracle's: both read the same e4m3 values, dequantized in fp32, so only fp32 rounding
# differs (worst seen 1e-6), unless some key lands on the other side of an e4m3 rounding boundary (then ~1e-3).
# Plain transformers (unquantized keys and values) is 0.04-0.13 away at scale 1.0.
LOGPROB_TOL = 2e-3


def generate_fp8(model, adapters, prompts, which, max_tokens=8, **settings):
    from loraplex import LLM, SamplingParams
    with LLM(str(model), adapters={k: str(v) for k, v in adapters.items()}, **dict(ENGINE, **settings)) as llm:
        kv = llm.engine.runner.kv
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                    logprobs=0), adapter=which, use_tqdm=False)
    return kv, outs


def logprob_errors(oracle, prompts, which, outs) -> list[float]:
    """Per sequence: max |our logprob - the oracle's| over the sampled tokens (its logits of the whole text)."""
    errs = []
    for prompt, adapter, out in zip(prompts, which, outs):
        full = prompt + out.token_ids
        theirs = torch.log_softmax(oracle.logits(full, adapter), -1)
        rows = torch.arange(len(prompt) - 1, len(full) - 1)
        ours = torch.tensor([lp.logprob for lp in out.logprobs])
        errs.append((ours - theirs[rows, torch.tensor(out.token_ids)]).abs().max().item())
    return errs
