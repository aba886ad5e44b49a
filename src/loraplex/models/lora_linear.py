"""`LoraLinear`: one projection kind of a decoder layer with the LoRA of every adapter in the pool."""
from __future__ import annotations

import torch
from torch import nn

from ..ops.gemm.fp8 import QuantizedRows
from .fp8.gemm import e4m3_input
from .fp8.weight import Fp8Weight
from .lora_plan import LoraPlan, Pending

QKV = ("q_proj", "k_proj", "v_proj")
O = ("o_proj",)
GATE_UP = ("gate_proj", "up_proj")
DOWN = ("down_proj",)


class LoraLinear(nn.Module):
    """`y = x @ weightᵀ + bias` plus each row's adapter's LoRA, for the PEFT modules `parts` of layer `layer`.

    Fused projections (q/k/v, gate/up) hold their parts' weights as row blocks (`[q; k; v]`) and run one
    GEMM and one multi-slice LoRA launch; the adapter pool keeps each part's A and B (`pool.stacks`).
    Weights keep Hugging Face's `[out, in]` orientation. `weight` is a dense tensor in the model's dtype, or an
    `Fp8Weight` (e4m3 with fp32 scales, `use_fp8`); the bias and the adapters stay in the model's dtype.
    """

    def __init__(self, layer: int, parts: tuple[str, ...], in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.layer, self.parts = layer, parts
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, plan: LoraPlan,
                x_e4m3: QuantizedRows | None = None) -> tuple[torch.Tensor, Pending]:
        """`(y, pending)`: y the projection with its LoRA added, or without it where `pending` carries it for the op
        after this projection to add (`LoraPlan.linear` says which). `x_e4m3`: x quantized a row by the op that made
        it (`e4m3_input`'s buffers), for the FP8 GEMM."""
        return plan.linear(x, self.weight, self.bias, self.layer, self.parts, x_e4m3)

    def e4m3_input(self, x_like: torch.Tensor) -> QuantizedRows | None:
        """Buffers for this projection's input quantized a row where its GEMM quantizes it (FP8 weights under W8A8,
        models/fp8/gemm.py), for the op that makes the input to fill; None elsewhere."""
        return e4m3_input(self.weight, x_like)

    def use_fp8(self, block: tuple[int, int], parts: int, input_scale: bool) -> Fp8Weight:
        """Replace the dense weight by an uninitialised `Fp8Weight` of the same shape on the same device, with
        scales over `block`-sized tiles (models/fp8/weight.py) and, with `input_scale`, one per fused part."""
        out, cols = self.weight.shape
        device = self.weight.device
        del self.weight
        with torch.device(device):
            self.weight = Fp8Weight(out, cols, block, parts, input_scale)
        return self.weight

    def extra_repr(self) -> str:
        return f"layer={self.layer}, parts={self.parts}, in={self.weight.shape[1]}, out={self.weight.shape[0]}, " \
               f"bias={self.bias is not None}"
