"""benchmarks/probe_prefill_cublas.py's designs (the prompt rows' LoRA through cuBLAS, per segment) on the CPU, in
fp32 through Triton's interpreter: each returns the GEMM plus every row's LoRA product, against the probe's
float64 loop, with prompts before one-row decode segments and without any."""
import pytest
import torch

from benchmark_modules import load_benchmark


@pytest.mark.parametrize("seg_lens", [[40, 33, 1, 1, 1], [20, 20]])
@pytest.mark.parametrize("K, Ns", [(64, (32, 48, 48)), (96, (64,))])
def test_designs_match_the_float64_loop(seg_lens, K, Ns, monkeypatch):
    probe = load_benchmark(monkeypatch, "probe_prefill_cublas")
    monkeypatch.setattr(probe, "DEVICE", "cpu")
    gen = torch.Generator().manual_seed(len(seg_lens) * 100 + K)
    t = probe.tensors(K, Ns, sum(seg_lens), len(seg_lens), gen)
    for key in ("xs", "a", "b"):   # fp32: the interpreter's tl.dot takes no bf16
        t[key] = [v.float() for v in t[key]]
    t["w"] = t["w"].float()
    want = probe.oracle(t, seg_lens, t["xs"][0])
    base = t["xs"][0].double() @ t["w"].double().T
    for name in probe.DESIGNS:
        got = probe.Design(name, t, seg_lens).run(0).double()
        err = ((got - want).norm() / (want - base).norm()).item()
        assert err < 1e-5, (name, err)
