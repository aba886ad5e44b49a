"""Every bad argument is a ValueError that names it, raised from metadata alone.

All tensors here live on the meta device: they have shapes and dtypes but no data, so any
attempt to read them (or to launch a kernel) would fail instead of raising the checked error.
"""
from __future__ import annotations

import pytest
import torch

from loraplex import ops
from loraplex.ops.lora import api

META = "meta"
S, R, K, N, T = 4, 8, 32, 24, 6


def good(**over):
    d = dict(
        y=torch.empty(T, N + 2, device=META, dtype=torch.float16),
        x=torch.empty(T, K, device=META, dtype=torch.float16),
        lora_a=torch.empty(S, R, K, device=META, dtype=torch.float16),
        lora_b=torch.empty(S, N, R, device=META, dtype=torch.float16),
        batch=ops.LoraBatch.from_lengths([2, 1, 3], [0, -1, 3], META),
        ranks=torch.empty(S, device=META, dtype=torch.int32),
        scalings=torch.empty(S, device=META, dtype=torch.float32),
    )
    d.update(over)
    return d


def call(**over):
    d = good(**over)
    y_offset = d.pop("y_offset", 0)
    return ops.add_lora(d["y"], d["x"], d["lora_a"], d["lora_b"], d["batch"], d["ranks"], d["scalings"],
                        y_offset=y_offset, backend=d.pop("backend", "reference"))


def h(*shape, dtype=torch.float16):
    return torch.empty(*shape, device=META, dtype=dtype)


CASES = [
    (dict(x=[[1.0]]), "x must be a torch.Tensor"),
    (dict(x=h(T, K, 1)), r"x must be \[T, K\], got shape \[6, 32, 1\]"),
    (dict(x=h(T, K, dtype=torch.int32)), "x must be float16, bfloat16 or float32"),
    (dict(y=h(T, N, dtype=torch.float32)), "y is torch.float32 but x is torch.float16"),
    (dict(y=h(T + 1, N)), "y has 7 rows but x has 6"),
    (dict(y=h(T, N - 1)), r"need 24 columns but y has 23"),
    (dict(y_offset=3), r"from y_offset=3 need 27 columns but y has 26"),
    (dict(y_offset=-1), "y_offset must be a non-negative int"),
    (dict(y=torch.empty(T, N, dtype=torch.float16)), "y is on cpu but x is on meta"),
    (dict(lora_a=h(R, K)), r"lora_a must have 3 dimensions, got shape \[8, 32\]"),
    (dict(lora_a=h(S, R, K + 1)), r"lora_a must be \[num_slots, R, K=32\]"),
    (dict(lora_a=h(S, R, K, dtype=torch.bfloat16)), "lora_a is torch.bfloat16 but x is torch.float16"),
    (dict(lora_a=h(S, K, R).transpose(1, 2)), "lora_a must be contiguous"),
    (dict(lora_b=h(S, N, R + 1)), r"lora_b must be \[num_slots=4, N, R=8\]"),
    (dict(lora_b=h(S + 1, N, R)), r"lora_b must be \[num_slots=4, N, R=8\]"),
    (dict(lora_b=h(S, R, N).transpose(1, 2)), "lora_b must be contiguous"),
    (dict(lora_b=h(S, N, R, dtype=torch.float32)), "lora_b is torch.float32 but x is torch.float16"),
    (dict(ranks=h(S, dtype=torch.int64)), r"ranks must be contiguous int32 \[num_slots=4\]"),
    (dict(ranks=h(S + 1, dtype=torch.int32)), r"ranks must be contiguous int32 \[num_slots=4\], got shape \[5\]"),
    (dict(scalings=h(S, dtype=torch.float16)), r"scalings must be contiguous float32 \[num_slots=4\]"),
    (dict(scalings=h(2, dtype=torch.float32)), r"scalings must be contiguous float32 \[num_slots=4\]"),
    (dict(batch="segments"), "batch must be a LoraBatch"),
    (dict(batch=ops.LoraBatch.from_lengths([2, 2], [0, 1], META)), "batch covers 4 rows but x has 6 rows"),
    (dict(batch=ops.LoraBatch.from_lengths([3, 3], [0, 4], META)), "batch uses slot 4 but the adapter stacks have 4"),
    (dict(batch=ops.LoraBatch.from_lengths([3, 3], [0, 1])), "batch is on cpu but x is on meta"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(x=h(K, T).t()), r"x's rows must be contiguous \(stride 1 along the last dimension\)"),
    (dict(y=h(N + 2, T).t()), r"y's rows must be contiguous"),
    (dict(y=h(1, N + 2).expand(T, N + 2)), "y has elements that share memory"),
    (dict(x=h(T, K).requires_grad_()), "x requires grad, but the LoRA ops are not differentiable"),
    (dict(y=h(T, N + 2).requires_grad_()), "y requires grad"),
    (dict(ranks=[h(S, dtype=torch.int32)]), "ranks must be a tensor when lora_a is a single tensor"),
]


@pytest.mark.parametrize("over, match", CASES, ids=[m[:40] for _, m in CASES])
def test_bad_argument_is_named(over, match):
    with pytest.raises(ValueError, match=match):
        call(**over)


def _lists(n=2, **over):
    d = dict(lora_a=[h(S, R, K) for _ in range(n)], lora_b=[h(S, N // 2, R) for _ in range(n)],
             ranks=[h(S, dtype=torch.int32) for _ in range(n)], scalings=[h(S, dtype=torch.float32) for _ in range(n)])
    d.update(over)
    return d


@pytest.mark.parametrize("over, match", [
    (_lists(ranks=h(S, dtype=torch.int32)), "ranks must be a list of tensors when lora_a is a list"),
    (_lists(lora_b=[h(S, 4, R)]), "lora_b has 1 entries but ranks has 2"),
    (_lists(scalings=[h(S, dtype=torch.float32)] * 3), "scalings has 3 entries but ranks has 2"),
    (dict(lora_a=[], lora_b=[], ranks=[], scalings=[]), "lists are empty"),
    (_lists(n=5), "5 slices given; one launch takes at most 4"),
    (_lists(lora_a=[h(S, R, K), h(S, R + 8, K)]), r"lora_a\[1\] has shape \[4, 16, 32\].*R=8"),
    (_lists(lora_b=[h(S, 12, R), h(S, 12, R + 1)]), r"lora_b\[1\] must be \[num_slots=4, N, R=8\]"),
    (_lists(ranks=[h(S, dtype=torch.int32), h(S, dtype=torch.int16)]), r"ranks\[1\] must be contiguous int32"),
])
def test_bad_slice_lists_are_named(over, match):
    with pytest.raises(ValueError, match=match):
        call(**over)


def test_halves_check_their_intermediate():
    d = good()
    with pytest.raises(ValueError, match=r"out must be contiguous float32 \[6, 8\]"):
        ops.lora_shrink(d["x"], d["lora_a"], d["batch"], d["ranks"], out=h(T, R))
    with pytest.raises(ValueError, match=r"v must be contiguous float32 \[6, 8\], got shape \[6, 9\]"):
        ops.lora_expand(d["y"], h(T, R + 1, dtype=torch.float32), d["lora_b"], d["batch"], d["ranks"],
                        d["scalings"])
    with pytest.raises(ValueError, match=r"v must be contiguous float32 \[2, 6, 8\]"):
        ops.lora_expand(h(T, 2 * N), h(T, R, dtype=torch.float32), [d["lora_b"], d["lora_b"]], d["batch"],
                        [d["ranks"]] * 2, [d["scalings"]] * 2)


def test_triton_backend_refused_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.setattr(api, "triton_interpreted", lambda: False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        call(backend="triton")


def test_good_arguments_pass_the_checks():
    """The baseline of every case above: with nothing bad, the reference runs (on real CPU tensors)."""
    d = {k: (torch.randn(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
         for k, v in good().items()}
    d["ranks"] = torch.full((S,), R, dtype=torch.int32)
    d["batch"] = ops.LoraBatch.from_lengths([2, 1, 3], [0, -1, 3])
    y0 = d["y"].clone()
    ops.add_lora(d["y"], d["x"], d["lora_a"], d["lora_b"], d["batch"], d["ranks"], d["scalings"])
    assert not torch.equal(d["y"], y0)
