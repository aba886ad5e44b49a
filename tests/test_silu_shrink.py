"""ops/silu_shrink.py: SiLU-and-mul that also computes down_proj's LoRA shrink, on the CPU (the reference,
and the Triton kernel through TRITON_INTERPRET=1), against fused.silu_and_mul and a float64 loop."""
from __future__ import annotations

import pytest
import torch

from loraplex import ops
from loraplex.ops.fused import api as fused
from loraplex.ops.fused import silu_shrink_kernels
from loraplex.ops.lora.delta import LoraDelta
from loraplex.ops.fused.silu_shrink import silu_and_mul_shrink

from lora_cases import stable_seed

interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")
BACKENDS = ["reference", pytest.param("triton", marks=interpreted)]


def _case(gen, T: int, I: int, R: int, dtype: torch.dtype, delta_kind: str):
    gate_up = torch.randn(T, 2 * I, generator=gen).to(dtype)
    slots = 5
    ranks = torch.randint(1, R + 1, (slots,), generator=gen, dtype=torch.int32)
    ranks[1] = 0                                  # a slot whose adapter leaves down alone
    ranks[2] = R + 7                              # a rank past the stack's width counts as R
    lora_a = (torch.randn(slots, R, I, generator=gen) * I ** -0.5).to(dtype)
    for s in range(slots):                        # nothing past a slot's rank may be read
        lora_a[s, min(int(ranks[s]), R):] = float("nan")
    row_slot = torch.randint(0, slots, (T,), generator=gen, dtype=torch.int32)
    row_slot[::3] = -1
    row_slot[1], row_slot[2], row_slot[4] = 1, 2, 0   # rank 0, rank past R, and an ordinary rank
    delta = None
    if delta_kind == "tensor":
        delta = gate_up.float().abs().mean() * torch.randn(T, 2 * I, generator=gen)
    elif delta_kind == "lora_delta":
        values = gate_up.float().abs().mean() * torch.randn(T, 2 * I, generator=gen)
        values[row_slot < 0] = float("nan")       # never written, never read
        delta = LoraDelta(values, row_slot)
    return gate_up, lora_a, ranks, row_slot, delta


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("I, R, delta_kind", [(600, 16, "lora_delta"), (1100, 32, None), (300, 8, "tensor")])
def test_out_is_silu_and_mul_and_part_sums_to_the_shrink(backend, dtype, I, R, delta_kind, monkeypatch):
    """out: fused.silu_and_mul's bits. Σ_split part: out @ A[slot]ᵀ for rows with an adapter and ranks
    below the slot's (float64 loop; fp32 sums). Nothing else of part is read here (it is not written)."""
    monkeypatch.setattr(silu_shrink_kernels, "BLOCK", 256)   # several K splits at these widths
    gen = torch.Generator().manual_seed(stable_seed("silu-shrink", str(dtype), I, R, delta_kind))
    T = 7
    gate_up, lora_a, ranks, row_slot, delta = _case(gen, T, I, R, dtype, delta_kind)
    gate_up_in = gate_up.clone()
    out, part = silu_and_mul_shrink(gate_up, lora_a, ranks, row_slot, delta=delta, backend=backend)
    assert torch.equal(out, fused.silu_and_mul(gate_up, delta=delta, backend=backend))
    assert torch.equal(gate_up, gate_up_in)
    assert part.dtype == torch.float32 and part.shape[1:] == (1, T, R)
    if backend == "triton":
        assert part.shape[0] == -(-I // 256) > 1
    v = part.sum(0)[0]
    checked = 0
    for m, s in enumerate(row_slot.tolist()):
        if s < 0:
            continue
        r = min(int(ranks[s]), R)
        want = lora_a[s, :r].double() @ out[m].double()
        if r:
            err = ((v[m, :r].double() - want).norm() / want.norm()).item()
            assert err <= 1e-5, f"row {m} slot {s}: rel err {err:.2e}"
            checked += 1
    assert checked >= 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(lora_a=torch.zeros(3, 4, 8)), r"lora_a must be a torch.float16 \[slots, R, I=16\]"),
    (dict(lora_a=torch.zeros(3, 16, 4, dtype=torch.float16).transpose(1, 2)), "with its last dimension contiguous"),
    (dict(ranks=torch.zeros(3, dtype=torch.int64)), r"ranks must be a contiguous int32 \[3\]"),
    (dict(row_slot=torch.zeros(5, dtype=torch.int32)), r"row_slot must be a contiguous int32 \[4\]"),
    (dict(delta=torch.zeros(4, 32)), r"delta must be a contiguous float32 \[T=4, 32\]"),
    (dict(delta=LoraDelta(torch.zeros(4, 32), torch.zeros(3, dtype=torch.int32))),
     r"delta.row_slot must be a contiguous int32 \[T=4\]"),
    (dict(delta=object()), "delta must be an fp32 tensor or a LoraDelta, got object"),
])
def test_bad_arguments_name_what_is_wrong(kwargs, message):
    args = dict(gate_up=torch.zeros(4, 32, dtype=torch.float16), lora_a=torch.zeros(3, 4, 16, dtype=torch.float16),
                ranks=torch.zeros(3, dtype=torch.int32), row_slot=torch.zeros(4, dtype=torch.int32))
    args.update(kwargs)
    delta = args.pop("delta", None)
    if isinstance(delta, torch.Tensor):
        delta = delta.to(torch.float16)   # an fp16 "delta": not fp32
    with pytest.raises(ValueError, match=message):
        silu_and_mul_shrink(args["gate_up"], args["lora_a"], args["ranks"], args["row_slot"], delta=delta,
                            backend="reference")
