"""benchmarks/bench_fused_mlp.py, the persistent decode MLP probe: its float64 reference against a loop of its
docstring's semantics, and the kernel (Triton's interpreter, one program doing every item) against the reference."""
import json
import math

import pytest
import torch

from loraplex import ops
from loraplex.ops.gemm.fp8 import Fp8Matrix, quantize_rows

interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")


@pytest.fixture
def bench(monkeypatch):
    from benchmark_modules import load_benchmark
    return load_benchmark(monkeypatch, "bench_fused_mlp")


def _mlp(gen, H: int, I: int) -> tuple[Fp8Matrix, Fp8Matrix]:
    pair = []
    for w in (torch.randn(2 * I, H, generator=gen) / H ** 0.5, torch.randn(H, I, generator=gen) / I ** 0.5):
        q, s = quantize_rows(w)
        pair.append(Fp8Matrix(q, s, (1, w.shape[1])))
    return tuple(pair)


def test_reference_is_the_docstrings_loop(bench):
    """g, u, h = silu(g)·u, a scale per row and group of 128 columns, hq = e4m3(h / s), y = sd · Σ_j s · Σ hq·wd: one
    element at a time in Python floats."""
    gen = torch.Generator().manual_seed(1)
    group = 128
    H, I, M = 8, 2 * group, 2
    gate_up, down = _mlp(gen, H, I)
    xq, sx = quantize_rows(torch.randn(M, H, generator=gen))
    x = [[xq[m, k].item() * sx[m, 0].item() for k in range(H)] for m in range(M)]
    wgu = gate_up.qweight.double() * gate_up.scale.double()
    wd = down.qweight.double() * down.scale.double()
    want = torch.zeros(M, H, dtype=torch.float64)
    for m in range(M):
        gu = [sum(x[m][k] * wgu[n, k].item() for k in range(H)) for n in range(2 * I)]
        h = [gu[n] / (1 + math.exp(-gu[n])) * gu[I + n] for n in range(I)]
        hq = []
        for j in range(I // group):
            part = h[j * group:(j + 1) * group]
            s = max(abs(v) for v in part) / 448 or 1.0
            hq += [torch.tensor(v / s).to(torch.float8_e4m3fn).item() * s for v in part]
        for c in range(H):
            want[m, c] = sum(hq[n] * wd[c, n].item() for n in range(I))
    got = bench.reference(xq, sx, gate_up, down, group)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)


@interpreted
def test_the_fused_launch_matches_the_reference_and_leaves_its_counts_at_zero(bench, tmp_path):
    out, md = tmp_path / "m.json", tmp_path / "m.md"
    bench.main(["--smoke", "--rows", "1,32", "--out", str(out), "--md", str(md)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["rows"] for r in rows] == [1, 32]
    fused = [f for r in rows for f in r["fused"].values()]
    assert len(fused) == 2 * len(bench.VARIANTS) and all(f["programs"] == 1 for f in fused)
    assert max(f["rel_err"] for f in fused) <= 2e-3   # fp32 sums against float64: a rare e4m3 step of h
    assert md.read_text().startswith("# A decode MLP in one persistent launch")
    gen = torch.Generator().manual_seed(2)
    gate_up, down = _mlp(gen, 3 * 128, 3 * 128)
    xq, sx = quantize_rows(torch.randn(5, 3 * 128, generator=gen))
    counts = torch.zeros(2 + 3 * 128 // 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="at most 64 rows"):
        bench.fused_mlp(torch.cat([xq] * 13), torch.cat([sx] * 13), gate_up, down, counts, 1)
    with pytest.raises(ValueError, match="at least 5 of them"):
        bench.fused_mlp(xq, sx, gate_up, down, counts[:4], 1)
    for group, ksplit in ((64, 1), (128, 3)):
        y = bench.fused_mlp(xq, sx, gate_up, down, counts, 1, torch.float32, group, ksplit)
        ref = bench.reference(xq, sx, gate_up, down, group)
        assert (y.double() - ref).abs().max() <= 2e-3 * ref.abs().max() and not counts.any(), (group, ksplit)
