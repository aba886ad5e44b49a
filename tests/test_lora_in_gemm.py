"""ops/lora_in_gemm.py: the expand that reads each row's shrink from an N-augmented GEMM's own output, held to a
float64 loop of its documented semantics. Shrink columns past a slot's rank, B's columns past it and unused
active adapters are NaN: reading any would show. The Triton kernel runs in Triton's interpreter (fp32, fp16)."""
from __future__ import annotations

import pytest
import torch

from loraplex import ops
from loraplex.ops import LoraBatch
from loraplex.ops.lora.lora_in_gemm import expand_in_gemm, shrink_columns

from lora_cases import stable_seed

interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")
BACKENDS = ["reference", pytest.param("triton", marks=interpreted)]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def make_case(gen: torch.Generator, widths: tuple[int, ...], seg_lens: list[int], dtype: torch.dtype, *,
              R: int = 8, K: int = 24, num_slots: int = 6, capacity: int = 8, device: str = "cpu"):
    """x, W_ext (the base weight, then `capacity` active adapters' A rows, adapter-major) and the GEMM's
    output y_ext in `dtype`, the pool's B/ranks/scalings, each slot's active index, and the batch."""
    S, N = len(widths), sum(widths)
    slot_ids = torch.randint(-1, num_slots, (len(seg_lens),), generator=gen).tolist()
    slot_ids[0], slot_ids[-1] = -1, 0
    slot_active = torch.randperm(capacity, generator=gen)[:num_slots].to(torch.int32)   # any slot, any place
    x = torch.randn(sum(seg_lens), K, generator=gen, dtype=torch.float64)
    w_ext = torch.full((shrink_columns(N, S, R, capacity), K), float("nan"), dtype=torch.float64)
    w_ext[:N] = torch.randn(N, K, generator=gen, dtype=torch.float64) / K ** 0.5
    lora_b, ranks, scalings = [], [], []
    for i, n in enumerate(widths):
        rk = torch.randint(0, R + 1, (num_slots,), generator=gen, dtype=torch.int32)
        rk[0], rk[1] = R, R + 5   # a rank past the stacks' width counts as the width
        b = torch.randn(num_slots, n, R, generator=gen, dtype=torch.float64)
        for s in range(num_slots):
            r = min(int(rk[s]), R)
            row = N + (int(slot_active[s]) * S + i) * R
            w_ext[row:row + r] = torch.randn(r, K, generator=gen, dtype=torch.float64) / K ** 0.5
            b[s, :, r:] = float("nan")
        lora_b.append(b.to(dtype))
        ranks.append(rk)
        scalings.append(torch.rand(num_slots, generator=gen) + 0.5)
    if device == "cpu":
        y_ext = (x @ w_ext.t()).to(dtype)   # the GEMM, rounded as a GEMM in `dtype` rounds its output
    else:                                  # cuBLAS's, as the model would run it
        y_ext = torch.nn.functional.linear(x.to(device, dtype), w_ext.to(device, dtype))
    to = lambda ts: [t.to(device) for t in ts]  # noqa: E731
    batch = LoraBatch.from_lengths(seg_lens, slot_ids, device)
    return y_ext, N, to(lora_b), to(ranks), to(scalings), batch, slot_active.to(device)


def loop_f64(y_ext, N, lora_b, ranks, scalings, batch, slot_active) -> torch.Tensor:
    """The module docstring's loop in float64: [T, N]."""
    S, R = len(lora_b), lora_b[0].shape[2]
    y = y_ext.double()
    out = y[:, :N].clone()
    row_slot = batch.row_slot.tolist()
    for m, s in enumerate(row_slot):
        if s < 0:
            continue
        col = 0
        for i, (b, rk, sc) in enumerate(zip(lora_b, ranks, scalings)):
            r = min(int(rk[s]), R)
            start = N + (int(slot_active[s]) * S + i) * R
            out[m, col:col + b.shape[1]] += float(sc[s]) * (b[s, :, :r].double() @ y[m, start:start + r])
            col += b.shape[1]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("widths, seg_lens, R", [((16, 8, 8), [1] * 9, 8), ((20,), [1, 3, 1, 17, 2, 1], 8),
                                                 ((12, 12), [5, 1, 40, 1, 1], 8), ((600,), [1, 2, 1, 1], 80)])
def test_expand_in_gemm_matches_the_float64_loop(backend, dtype, widths, seg_lens, R):
    """Decode rows (one per segment) and prompt-like segments (one adapter over many rows, tiles of 16 and
    64); q/k/v-like three slices, one slice, gate/up-like two; R=80 over two rank tiles and 600 columns
    over several column chunks."""
    gen = torch.Generator().manual_seed(stable_seed("lora-in-gemm", str(dtype), widths, seg_lens, R))
    y_ext, N, lora_b, ranks, scalings, batch, slot_active = make_case(gen, widths, seg_lens, dtype, R=R)
    before = y_ext.clone()
    want = loop_f64(y_ext, N, lora_b, ranks, scalings, batch, slot_active)
    out = expand_in_gemm(y_ext, N, lora_b, ranks, scalings, batch, slot_active, backend=backend)
    assert out is y_ext
    assert not torch.isnan(out[:, :N]).any(), "a value that must not be read was"
    torch.testing.assert_close(out[:, :N].double(), want, rtol=TOL[dtype], atol=TOL[dtype])
    # the shrink columns are only read, and rows without an adapter keep their bits
    torch.testing.assert_close(out[:, N:], before[:, N:], rtol=0, atol=0, equal_nan=True)
    keep = batch.row_slot < 0
    assert keep.any() and torch.equal(out[keep][:, :N], before[keep][:, :N])
    assert not torch.equal(out[~keep][:, :N], before[~keep][:, :N])   # the products counted


@pytest.mark.gpu
@pytest.mark.parametrize("widths, seg_lens", [((4096, 4096, 4096), [1] * 32), ((11008, 11008), [1] * 31 + [24]),
                                              ((4096,), [1] * 128)])
def test_expand_in_gemm_compiled_after_a_cublas_gemm(widths, seg_lens):
    """bf16 on the GPU at Llama-2-7B widths and rank 16: decode batches of 32 and 128, and one prompt beside
    31 decodes; y_ext from F.linear, the loop read from the same y_ext."""
    gen = torch.Generator().manual_seed(stable_seed("lora-in-gemm-gpu", widths, seg_lens))
    y_ext, N, lora_b, ranks, scalings, batch, slot_active = make_case(
        gen, widths, seg_lens, torch.bfloat16, R=16, K=512, num_slots=40, capacity=48, device="cuda")
    want = loop_f64(y_ext, N, lora_b, ranks, scalings, batch, slot_active)
    before = y_ext.clone()
    expand_in_gemm(y_ext, N, lora_b, ranks, scalings, batch, slot_active)
    assert not torch.isnan(y_ext[:, :N]).any()
    torch.testing.assert_close(y_ext[:, :N].double(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y_ext[:, N:], before[:, N:], rtol=0, atol=0, equal_nan=True)


def test_bad_arguments_name_what_is_wrong():
    gen = torch.Generator().manual_seed(1)
    y_ext, N, lora_b, ranks, scalings, batch, slot_active = make_case(gen, (16,), [1, 1, 1], torch.float32)
    good = dict(y_ext=y_ext, n_base=N, lora_b=lora_b, ranks=ranks, scalings=scalings, batch=batch,
                slot_active=slot_active, backend="reference")
    bad = [(dict(n_base=N + 1), "n_base"), (dict(y_ext=y_ext[:, :-1]), "shrink columns"),
           (dict(slot_active=slot_active.long()), "slot_active"), (dict(ranks=[r.long() for r in ranks]), "ranks"),
           (dict(lora_b=lora_b * 4, ranks=ranks * 4, scalings=scalings * 4, n_base=4 * N), "lora_b"),
           (dict(y_ext=y_ext[:2]), "batch has 3 rows"), (dict(backend="cuda"), "backend"),
           (dict(lora_b=[b.half() for b in lora_b]), "y_ext's dtype"),
           (dict(ranks=[torch.zeros(12, dtype=torch.int32)[::2] for _ in ranks]), "contiguous"),
           (dict(batch=LoraBatch.from_lengths([1, 1, 1], [0, 6, -1], "cpu")), "slot 6"),
           (dict(y_ext=y_ext[:, :N + 16], batch=LoraBatch.from_lengths([1, 1, 1], [0, 1, 2], "cpu")),
            "uses 3 adapters; y_ext holds the shrink columns of 2")]
    for change, words in bad:
        with pytest.raises(ValueError, match=words):
            expand_in_gemm(**{**good, **change})
