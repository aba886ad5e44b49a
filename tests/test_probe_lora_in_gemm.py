"""benchmarks/probe_lora_in_gemm.py on the CPU (Triton's interpreter, fp32): every design's layouts give
`x @ Wᵀ + s · (x @ Aᵀ) @ Bᵀ` per row, as its float64 loop says; the GPU run only times them."""
import pytest

from benchmark_modules import load_benchmark


@pytest.fixture()
def probe(monkeypatch):
    return load_benchmark(monkeypatch, "probe_lora_in_gemm")


def test_every_design_matches_the_float64_loop(probe):
    before = probe.overlap.MAX_ROWS, probe.overlap.SHRINK_MAX_ROWS
    result = probe.main(["--tiny", "--batches", "3,16", "--layers", "2"])
    assert (probe.overlap.MAX_ROWS, probe.overlap.SHRINK_MAX_ROWS) == before   # the engine's policy, restored
    assert {(r["batch"], r["design"]) for r in result["rows"]} == {(m, d) for m in (3, 16) for d in probe.DESIGNS}
    checked = [e for r in result["rows"] for e in r["max_rel_err"].values()]
    assert len(checked) == 2 * (4 * 4 + 3 + 3)   # per batch: 4 projections in 4 designs, 3 in naug-rope and kaug
    assert max(checked) < 1e-4


def test_a_design_that_drops_the_expand_is_caught(probe, monkeypatch):
    # naug's expand only (its part is a view of the GEMM's output, split stride 1); the designs before it
    # (sgmv.add_lora, overlap's "full") keep theirs, so the first one caught is naug
    real = probe.sgmv.expand_from
    monkeypatch.setattr(probe.sgmv, "expand_from",
                        lambda y, part, *a, **kw: None if part.stride(0) == 1 else real(y, part, *a, **kw))
    with pytest.raises(SystemExit, match="naug: relative error"):
        probe.main(["--tiny", "--batches", "3", "--layers", "1"])
