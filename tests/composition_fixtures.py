"""Requests that combine adapters, and their oracle: transformers + PEFT's `add_weighted_adapter(...,
combination_type="cat")`, whose merged adapter adds Σ_i w_i · scaling_i · B_i A_i to each projection it targets."""
from __future__ import annotations

import json
import warnings

import torch

from engine_fixtures import GenerateOracle
from loraplex.adapters.composition import Composition

# make_served_model's adapters: all-r8 (every projection, rank 8), qv-r4 (q and v, rank 4), mlp-r2-rslora (the MLP,
# rank 2, rsLoRA). Two compositions per request kind; negative weights; a weighted adapter alone.
REQUESTS = [
    {"all-r8": 0.7, "qv-r4": 0.3},
    {"qv-r4": -0.5, "mlp-r2-rslora": 1.5},
    {"mlp-r2-rslora": 0.8, "all-r8": -1.2, "qv-r4": 0.6},
    {"all-r8": -0.6},
    "qv-r4",
    None,
]


class CatOracle(GenerateOracle):
    """`GenerateOracle` where an adapter may also be a Composition: PEFT's `add_weighted_adapter(...,
    combination_type="cat")` of its members, built once per composition (in `dtype`: float32, or bfloat16 for
    the rounding transformers itself makes there)."""

    def __init__(self, base, adapters, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(base, adapters)
        self.dtype = dtype

    def _model(self, adapter):
        if isinstance(adapter, Composition) and adapter not in self._models:
            self._models[adapter] = self._merged(adapter)
        return super()._model(adapter)

    def _merged(self, composition: Composition):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        names, weights = list(composition.names), list(composition.weights)
        if len(names) == 1:   # PEFT's cat of one adapter turns into "linear" (square roots of the weight): the
            names, weights = names * 2, [weights[0] / 2] * 2   # adapter twice at half the weight is the same sum
        # the merged adapter's config is the first one's with lora_alpha = r: an rsLoRA adapter first would scale
        # the sum by √r instead of 1, so a plain one goes first (the sum's order does not matter)
        order = sorted(range(len(names)), key=lambda i: self._rslora(names[i]))
        labels = [f"m{i}" for i in order]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=self.dtype, attn_implementation="eager")
            model = PeftModel.from_pretrained(model, self.adapter_dirs[names[order[0]]], adapter_name=labels[0])
            for i, label in zip(order[1:], labels[1:]):
                model.load_adapter(self.adapter_dirs[names[i]], adapter_name=label)
            model.add_weighted_adapter(labels, [weights[i] for i in order], "mix", combination_type="cat")
            model.set_adapter("mix")
        return model.eval()

    def _rslora(self, name: str) -> bool:
        return json.loads((self.adapter_dirs[name] / "adapter_config.json").read_text()).get("use_rslora", False)


def as_key(adapter):
    """A request's adapter as the oracle takes it: a mapping as its Composition, a name or None as it is."""
    return Composition.parse(adapter) if isinstance(adapter, dict) else adapter
