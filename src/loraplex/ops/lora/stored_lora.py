"""A prompt forward's projection with LoRA, the expand first: each row's LoRA product is stored into the output,
then the GEMM adds `x @ Wᵀ` to it in its epilogue (cuBLAS's beta = 1, `Tensor.addmm_`).

After the GEMM (`sgmv.add_lora`), the expand is a read-modify-write of the whole output: in a 1,920-row Llama-2-7B
prompt step, 10.6 GB a forward at ~60% of the copy bandwidth, ~4.3 ms of a ~53 ms step (H200, 2026-12-02,
benchmarks/NOTES.md). Stored first it only writes, half the bytes, and the GEMM, compute-bound at these rows,
reads the output in its epilogue beside its main loop. For every row m (each has an adapter, slot s):

    y[m, c_i + n] = round(x[m] @ W[c_i + n]ᵀ + round(scalings[i][s] · Σ_r v_i[m, r] · lora_b[i][s, n, r]))

(0 for the product of a slice of rank 0), where `sgmv.add_lora` rounds the other way round,
`round(round(x[m] @ W[c_i + n]ᵀ) + scalings[i][s] · …)`: the two may differ in the last bit.

Measured, it does not pay, so it is opt-in (H200, 2026-12-02, nineteenth session, benchmarks/NOTES.md): the
profiler counted 3–17% less kernel time in eager 7B prompt forwards, but the forwards were not shorter (47.9 →
48.9 ms for six 320-token prompts, 53.2 → 53.3 for one of 2,048), and issue 5's engine benchmark moved its
median prompt step by −2.5, +0.7 and +2.8 ms in three processes.

Only where it is safe (`applies`):
- every row of the batch has an adapter: the expand never writes the rows without one, and the output is not
  zero-filled (a fill would cost what this saves);
- no bias (the epilogue has one addend);
- more rows than `skinny_gemm.DECODE_MAX_ROWS` (fewer take the Triton GEMM, which has no addend);
- eager forwards only: the choice is made on the host from the batch, which a CUDA graph would bake in;
- the tile config's `KernelConfig.store_first` (LORAPLEX_LORA_PREFILL's "store" / "nostore").
"""
from __future__ import annotations

import torch

from . import sgmv
from .batch import LoraBatch
from ..gemm.skinny import DECODE_MAX_ROWS


def applies(batch: LoraBatch) -> bool:
    """May an eager forward over `batch` take `linear_with_lora_stored` (biasless projections)?"""
    return (sgmv.config_for(batch.block_m).store_first and batch.num_rows > DECODE_MAX_ROWS
            and batch.group_bounds[-1] == batch.num_rows)


def linear_with_lora_stored(x: torch.Tensor, weight: torch.Tensor, lora_a: list[torch.Tensor],
                            lora_b: list[torch.Tensor], batch: LoraBatch, ranks: list[torch.Tensor],
                            scalings: list[torch.Tensor]) -> torch.Tensor:
    """`x @ weightᵀ` plus every row's LoRA product of the slices (`[T, ΣN]`, x's dtype). Arguments as the
    model passes them (checked there); `applies(batch)` must hold."""
    if batch.group_bounds[-1] != batch.num_rows or x.shape[0] != batch.num_rows:
        raise ValueError(f"linear_with_lora_stored needs an adapter on every row: {batch.group_bounds[-1]} of "
                         f"{batch.num_rows} rows have one (x has {x.shape[0]})")
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    sgmv.add_lora(y, x, lora_a, lora_b, batch, ranks, scalings, 0, accumulate=False)
    return y.addmm_(x, weight.t())
