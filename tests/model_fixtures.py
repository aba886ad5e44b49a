"""Tiny transformers models of each served architecture, saved with `save_pretrained`, and the
transformers + PEFT oracle that our forward is compared with."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

# Shapes that exercise what differs between checkpoints: GQA and MHA, odd widths, tied
# embeddings, biases, each RoPE scaling kind, sliding windows short enough to matter.
VARIANTS: dict[str, dict] = {
    "llama-gqa-llama3rope": dict(
        family="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    "llama-mha-tied-odd-bias-linear": dict(
        family="llama", hidden_size=72, intermediate_size=100, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=6, vocab_size=131, max_position_embeddings=256, tie_word_embeddings=True,
        attention_bias=True, mlp_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral-gqa4-window": dict(
        family="mistral", hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=128, max_position_embeddings=256, sliding_window=7),
    "qwen2-bias-tied-window": dict(
        family="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=True,
        use_sliding_window=True, sliding_window=6, max_window_layers=1),
    # MHA with a power-of-two head size and biases on every projection (q/k/v, o and the MLP's): the one
    # configuration whose Triton attention has one head per kv head and whose o, gate/up and down are biased
    "llama-mha-bias": dict(
        family="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, max_position_embeddings=256, attention_bias=True, mlp_bias=True),
    # a vocabulary that holds the tiny test tokenizers (tests/tokenizer_fixtures.py), for text in and out
    "llama-text": dict(
        family="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=512, bos_token_id=1, eos_token_id=2),
}


def hf_config(variant: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    fields = dict(VARIANTS[variant])
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[fields.pop("family")]
    return cls(**fields)


def make_hf_model(folder: Path, variant: str, seed: int = 0, *, max_shard_size: str | None = None) -> Path:
    """Save a random model of `variant` whose activations stay O(1) through the layers.

    transformers' default init (std 0.02) makes near-uniform logits that would hide errors, so
    weights are redrawn at unit-gain scale.
    """
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(hf_config(variant), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:  # a Linear weight [out, in]
                p.normal_(0.0, p.shape[1] ** -0.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return Path(folder)


class HFOracle:
    """Logits of transformers (+ PEFT, per adapter) for whole token sequences, float32, cached."""

    def __init__(self, base_dir: Path, adapters: dict[str, Path]) -> None:
        self.base_dir, self.adapter_dirs = base_dir, adapters
        self._models: dict[str | None, torch.nn.Module] = {}
        self._cache: dict[tuple, torch.Tensor] = {}

    def _model(self, adapter: str | None):
        if adapter not in self._models:
            from transformers import AutoModelForCausalLM
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32,
                                                             attn_implementation="eager")
                if adapter is not None:
                    from peft import PeftModel
                    model = PeftModel.from_pretrained(model, self.adapter_dirs[adapter])
            self._models[adapter] = model.eval()
        return self._models[adapter]

    def logits(self, tokens: list[int], adapter: str | None) -> torch.Tensor:
        """`[len(tokens), vocab]`: row i is the prediction after tokens[:i+1]."""
        key = (adapter, tuple(tokens))
        if key not in self._cache:
            with torch.no_grad():
                out = self._model(adapter)(input_ids=torch.tensor([tokens])).logits[0]
            self._cache[key] = out.float()
        return self._cache[key]


def assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor, rel: float, what: str) -> None:
    """max |ours - theirs| ≤ rel · max |theirs| (a relative error over the whole logit row)."""
    scale = theirs.abs().max().item()
    err = (ours.float() - theirs.float()).abs().max().item()
    if not err <= rel * scale:
        raise AssertionError(f"{what}: max abs error {err:.3g} exceeds {rel:g} × max |logit| {scale:.3g}")
