"""`LoraLinear`: one projection kind of a decoder layer with the LoRA of every adapter in the pool."""
from __future__ import annotations

import torch
from torch import nn

from .lora_plan import LoraPlan, Pending

QKV = ("q_proj", "k_proj", "v_proj")
O = ("o_proj",)
GATE_UP = ("gate_proj", "up_proj")
DOWN = ("down_proj",)


class LoraLinear(nn.Module):
    """`y = x @ weightᵀ + bias` plus each row's adapter's LoRA, for the PEFT modules `parts` of layer `layer`.

    Fused projections (q/k/v, gate/up) hold their parts' weights as row blocks (`[q; k; v]`) and run one
    GEMM and one multi-slice LoRA launch; the adapter pool keeps each part's A and B (`pool.stacks`).
    Weights keep Hugging Face's `[out, in]` orientation.
    """

    def __init__(self, layer: int, parts: tuple[str, ...], in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.layer, self.parts = layer, parts
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, plan: LoraPlan) -> tuple[torch.Tensor, Pending]:
        """`(y, pending)`: y the projection with its LoRA added, or without it where `pending` carries it for the op
        after this projection to add (`LoraPlan.linear` says which)."""
        return plan.linear(x, self.weight, self.bias, self.layer, self.parts)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, parts={self.parts}, in={self.weight.shape[1]}, out={self.weight.shape[0]}, " \
               f"bias={self.bias is not None}"
