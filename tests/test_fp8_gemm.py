"""ops/gemm/fp8.py: the FP8 decode kernel (weight-only and W8A8) and the prompts' W8A8 GEMM against float64 loops of
their documented sums (the kernel in Triton's CPU interpreter here, in bf16 on a GPU), and which GEMM `linear` picks."""
from __future__ import annotations

import pytest
import torch

from loraplex import envs, ops
from loraplex.ops.gemm import fp8, fp8_tiles, skinny
from loraplex.ops.gemm import linear as gemm
from loraplex.ops.gemm.fp8 import FP8, Fp8Matrix, fp8_skinny_linear, quantize_rows, w8a8_linear
from loraplex.ops.gemm.skinny import SkinnyConfig

interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")


def random_matrix(n: int, k: int, block: tuple[int, int], seed: int, device="cpu") -> Fp8Matrix:
    """Fresh e4m3 values (every finite magnitude drawn) and positive scales far from 1 over `block`."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    grid = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(grid, generator=g) * 0.02 + 0.001
    return Fp8Matrix(q.to(device), scale.to(device), block)


def loop_f64(x: torch.Tensor, m: Fp8Matrix, bias: torch.Tensor | None) -> torch.Tensor:
    """y[i, n] = Σ_j scale[n // bn, j] · Σ_{k in K block j} x[i, k] · q[n, k] + bias[n], by plain loops over the
    K blocks (fp8_kernels.py's sums)."""
    bn, bk = m.block
    N, K = m.shape
    x64, q64, s64 = x.double().cpu(), m.qweight.double().cpu(), m.scale.double().cpu()
    y = torch.zeros(x.shape[0], N, dtype=torch.float64)
    rows = torch.arange(N) // bn
    for j, lo in enumerate(range(0, K, bk)):
        y += (x64[:, lo:lo + bk] @ q64[:, lo:lo + bk].T) * s64[rows, j][None, :]
    return y + (bias.double().cpu() if bias is not None else 0)


CASES = [  # M, N, K, block, config
    (1, 64, 64, (1, 64), SkinnyConfig(block_n=32, block_k=32)),      # a scale per column: the epilogue's
    (5, 100, 300, (1, 300), SkinnyConfig(block_n=32, block_k=64)),    # N and K past the tiles
    (3, 96, 256, (32, 32), SkinnyConfig(block_n=32, block_k=64)),     # 32×32 blocks: K steps cut to 32
    (16, 80, 256, (128, 128), None),                                   # published blocks, pick_config's tiles
    (7, 40, 200, (1, 128), SkinnyConfig(block_n=16, block_k=128)),    # a block row per row, a short last block
    (33, 48, 160, (1, 32), SkinnyConfig(block_n=16, block_k=32)),     # a 64-row tile
    (5, 100, 300, (1, 300), SkinnyConfig(block_n=32, block_k=64, split_k=3)),  # K splits, a short last one
    (9, 64, 512, (32, 128), SkinnyConfig(block_n=32, block_k=128, split_k=4)),  # splits over block scales
    (2, 48, 160, (1, 160), SkinnyConfig(block_n=16, block_k=32, split_k=8)),    # 5 K steps over 8 splits
    # swap_ab: x's rows on the long side (a 64-row tile), w's on the short one
    (1, 64, 64, (1, 64), SkinnyConfig(block_n=32, block_k=32, swap_ab=True)),
    (5, 100, 300, (1, 300), SkinnyConfig(block_n=16, block_k=64, swap_ab=True)),     # N and K past the tiles
    (9, 64, 512, (32, 128), SkinnyConfig(block_n=32, block_k=128, split_k=4, swap_ab=True)),  # splits, block scales
    (33, 48, 160, (1, 32), SkinnyConfig(block_n=16, block_k=32, swap_ab=True)),      # rows past 32
]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fp8_skinny_linear_matches_the_float64_loop(case, with_bias, dtype):
    """Weight-only (x in its own dtype); swap_ab's tiles are W8A8's alone and refused here."""
    M, N, K, block, cfg = CASES[case]
    m = random_matrix(N, K, block, seed=case)
    g = torch.Generator().manual_seed(100 + case)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if with_bias else None
    if cfg is not None and cfg.swap_ab:
        with pytest.raises(ValueError, match="swap_ab, which takes W8A8"):
            fp8_skinny_linear(x, m, bias, config=cfg)
        return
    y = fp8_skinny_linear(x, m, bias, config=cfg)
    want = loop_f64(x, m, bias)
    assert y.dtype == dtype and y.shape == (M, N)
    if dtype == torch.float16:   # y's rounding
        torch.testing.assert_close(y.double(), want, rtol=2e-3, atol=2e-3)
    else:   # fp32 sums over K (in splits): within 1e-5 of the sum of the products' magnitudes
        size = x.double().abs() @ m.dequantize(torch.float64).abs().T + (bias.double().abs() if with_bias else 0)
        assert ((y.double() - want).abs() <= 1e-5 * (size + 1)).all()


@interpreted
@pytest.mark.parametrize("case", [0, 1, 3, 6, 7, 9, 10, 11, 12])
def test_the_w8a8_kernel_matches_the_float64_loop_of_its_quantized_rows(case):
    """quantize_x (W8A8 at decode rows: x quantized a row by `quantize_rows`, e4m3 products, sx[m] in the
    epilogue): the loop over the quantized rows to bf16's rounding, and within W8A8's documented error (Σ|x||w|/16
    a row) of the unquantized x; rows from 1e-20 to 1e20, bias, block scales and K splits included."""
    M, N, K, block, cfg = CASES[case]
    m = random_matrix(N, K, block, seed=case)
    g = torch.Generator().manual_seed(300 + case)
    x = (torch.randn(M, K, generator=g) * torch.logspace(-20, 20, M)[:, None]).to(torch.bfloat16)
    bias = torch.randn(N, generator=g).to(torch.bfloat16)
    y = fp8_skinny_linear(x, m, bias, config=cfg, quantize_x=True)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    xq, sx = quantize_rows(x)
    want = loop_f64(xq.double() * sx.double(), m, bias)
    torch.testing.assert_close(y.double(), want, rtol=1e-2, atol=1e-2)
    exact = loop_f64(x, m, bias)
    size = loop_f64(x.double().abs(), Fp8Matrix(m.qweight.double().abs(), m.scale, m.block), None)
    assert ((y.double() - exact).abs() <= size / 16 + 1e-2 * exact.abs() + 1e-2).all()
    with pytest.raises(ValueError, match="quantize_x takes bf16 or fp16 x, not torch.float32"):
        fp8_skinny_linear(x.float(), m, config=cfg, quantize_x=True)
    with pytest.raises(ValueError, match="K steps of at least 32"):
        fp8_skinny_linear(x, random_matrix(N, K, (16, 16), seed=1), quantize_x=True)


def test_default_tiles_move_the_dense_tiles_bytes_a_step(monkeypatch):
    """Without tuned tiles, each Llama-2-7B shape takes the dense kernel's tiles with twice the K step (at most
    MAX_BLOCK_K): as many bytes a step from a 1-byte weight. At 32 rows on an H100/H200 (232,448 bytes of shared
    memory a block) o's and down's 64 × 512 tiles keep 3 of their 4 stages; tuned tiles, where given, win."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(fp8_tiles, "TUNED", {})
    for n, k in ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (6144, 4096)):
        dense, got = skinny.default_config(n, k, cpu), fp8_tiles.default_config(n, k, cpu)
        assert got == SkinnyConfig(block_n=dense.block_n, block_k=min(2 * dense.block_k, fp8_tiles.MAX_BLOCK_K),
                                   split_k=dense.split_k, warps=dense.warps, stages=dense.stages), (n, k)
        assert got.block_n * got.block_k == dense.block_n * dense.block_k * 2 or got.block_k == fp8_tiles.MAX_BLOCK_K
    o = fp8_tiles.default_config(4096, 4096, cpu)
    assert (o.block_n, o.block_k) == (64, 512)
    assert skinny.fit_config(o, 32, 2, 232448, w_bytes=1) == SkinnyConfig(block_n=64, block_k=512, stages=3)
    assert skinny.fit_config(o, 32, 2, 232448) == SkinnyConfig(block_n=64, block_k=512, stages=2)  # 2-byte count
    # W8A8: at least 64 columns (a Hopper wgmma's rows), the same K step
    for n, k in ((12288, 4096), (4096, 11008)):
        got, w8 = fp8_tiles.default_config(n, k, cpu), fp8_tiles.default_config(n, k, cpu, w8a8=True)
        assert w8 == SkinnyConfig(block_n=max(64, got.block_n), block_k=got.block_k, split_k=got.split_k,
                                  warps=got.warps, stages=got.stages)
    tuned = SkinnyConfig(block_n=32, block_k=256, stages=5)
    tuned_w8 = SkinnyConfig(block_n=64, block_k=256, stages=4)
    monkeypatch.setattr(fp8_tiles, "TUNED", {("weight-only", "h100"): {(4096, 4096): tuned},
                                       ("w8a8", "h100"): {(4096, 4096): tuned_w8}})
    assert fp8_tiles.default_config(4096, 4096, cpu) == tuned
    assert fp8_tiles.default_config(4096, 4096, cpu, w8a8=True) == tuned_w8


def test_each_gpu_reads_its_own_tuned_tiles_else_the_h100s(monkeypatch):
    """An H200 reads tuned_fp8*_h200.json's tiles where the sweep ran there, else the H100's; GPUs no sweep ran on
    (tuned_gpu None; a GH200 until one does) and the CPU read the H100's; a shape in neither takes the rule."""
    h100, h200 = SkinnyConfig(block_n=64, block_k=256, stages=4), SkinnyConfig(block_n=128, block_k=512, stages=3)
    monkeypatch.setattr(fp8_tiles, "TUNED", {("w8a8", "h100"): {(4096, 4096): h100, (12288, 4096): h100},
                                       ("w8a8", "h200"): {(4096, 4096): h200}})
    for name, gpu in (("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", None),
                      ("NVIDIA GH200 480GB", None)):
        fp8_tiles._tuned_gpu.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None, name=name: name)
        cuda = torch.device("cuda", 0)
        assert fp8_tiles.tuned_gpu(cuda) == gpu, name
        assert fp8_tiles.default_config(4096, 4096, cuda, w8a8=True) == (h200 if gpu == "h200" else h100), name
        assert fp8_tiles.default_config(12288, 4096, cuda, w8a8=True) == h100, name   # not swept on the H200
        rule = fp8_tiles.default_config(22016, 4096, cuda, w8a8=True)
        assert rule.block_n >= 64 and rule not in (h100, h200), name
    fp8_tiles._tuned_gpu.cache_clear()
    assert fp8_tiles.tuned_gpu(torch.device("cpu")) is None
    assert fp8_tiles.default_config(4096, 4096, torch.device("cpu"), w8a8=True) == h100


def test_bench_fp8_gemm_refuses_to_write_tiles_for_a_gpu_without_its_files(monkeypatch, tmp_path):
    """--tuned-out on a GPU of no TUNED_GPUS stops before the sweep, naming the GPU, rather than writing its tiles
    over the H100's."""
    from benchmark_modules import load_benchmark
    bench = load_benchmark(monkeypatch, "bench_fp8_gemm")
    monkeypatch.setattr(fp8_tiles, "tuned_gpu", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA L40S")
    with pytest.raises(SystemExit, match="not 'NVIDIA L40S'"):
        bench.main(["--tuned-out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_the_bundled_w8a8_tiles_are_wide_enough_for_wgmma():
    """Each GPU's tuned_fp8_w8a8_<gpu>.json loads into TUNED, every tile 64 columns or wider (narrower e4m3 dots
    run as fp16 mma.sync on Hopper) unless x's rows take the wgmma's long side (swap_ab), with K steps of at least
    W8A8_MIN_K; the H100's, the fallback, is bundled."""
    assert fp8_tiles.TUNED_FILES[("w8a8", fp8_tiles.FALLBACK_GPU)].exists()
    for gpu in fp8_tiles.TUNED_GPUS:
        path = fp8_tiles.TUNED_FILES[("w8a8", gpu)]
        if not path.exists():
            continue
        tiles = skinny.load_configs(path, swap_ab=True)
        assert tiles and tiles == fp8_tiles.TUNED[("w8a8", gpu)]
        assert all((c.block_n >= 64 or c.swap_ab) and c.block_k >= fp8.W8A8_MIN_K for c in tiles.values()), path.name
        assert (4096, 4096) in tiles and (12288, 4096) in tiles   # Llama-2-7B's o and q/k/v


def test_fp8_skinny_linear_refuses_bad_arguments():
    m = random_matrix(16, 64, (1, 64), seed=1)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="K = 32 columns"):
        fp8_skinny_linear(torch.randn(2, 32), m)
    with pytest.raises(ValueError, match="scale has shape"):
        fp8_skinny_linear(x, Fp8Matrix(m.qweight, m.scale[:8], m.block))
    with pytest.raises(ValueError, match="qweight must be"):
        fp8_skinny_linear(x, Fp8Matrix(m.qweight.float(), m.scale, m.block))
    with pytest.raises(ValueError, match="bias is"):
        fp8_skinny_linear(x, m, torch.randn(15))
    with pytest.raises(ValueError, match="not a power of two"):
        fp8_skinny_linear(torch.randn(2, 96), random_matrix(16, 96, (1, 48), seed=2))
    with pytest.raises(ValueError, match="more than MAX_ROWS"):
        fp8_skinny_linear(torch.randn(skinny.MAX_ROWS + 1, 64), m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a8_linear_matches_the_float64_loop_of_its_quantized_rows(dtype):
    """y = sx[i] · scale[n] · Σ_k xq[i, k] · q[n, k] + bias (xq, sx: quantize_rows(x), per token), to the output's
    rounding; and within W8A8's documented error of the exact product with the unquantized x."""
    m = random_matrix(64, 96, (1, 96), seed=3)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(40, 96, generator=g) * torch.rand(40, 1, generator=g) * 10).to(dtype)
    x[7] = 0   # an all-zero row: scale 1, zeros out
    bias = torch.randn(64, generator=g).to(dtype)
    y = w8a8_linear(x, m, bias)
    xq, sx = quantize_rows(x)
    want = (xq.double() * sx.double()) @ (m.qweight.double() * m.scale.double()).T + bias.double()
    torch.testing.assert_close(y.double(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(y[7], bias)
    # e4m3 keeps 3 mantissa bits: each x rounds within 2^-4 of itself, so a row's error is at most 1/16 of
    # Σ|x||w| (the documented W8A8 tolerance the model tests use)
    exact = x.double() @ (m.qweight.double() * m.scale.double()).T + bias.double()
    bound = (x.double().abs() @ (m.qweight.double().abs() * m.scale.double()).T) / 16 + 1e-2 * exact.abs() + 1e-2
    assert ((y.double() - exact).abs() <= bound).all()


def test_quantize_rows_maps_each_rows_amax_to_448():
    x = torch.randn(6, 50) * torch.tensor([1e-3, 1, 10, 100, 1e4, 0])[:, None]
    q, s = quantize_rows(x)
    assert q.dtype == FP8 and s.shape == (6, 1)
    assert torch.equal(q.float().abs().amax(1)[:5], torch.full((5,), 448.0))
    assert s[5, 0] == 1 and torch.equal(q[5].float(), torch.zeros(50))
    torch.testing.assert_close(q.double() * s.double(), x.double(), rtol=2 ** -4, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_quantize_kernel_gives_quantize_rows_bits(dtype):
    """quantize_kernel.py (Triton's interpreter here) against fp8.quantize_rows, bit for bit: rows from 1e-6 to 1e4
    (e4m3's subnormals among the quotients), a zero row, values on e4m3's rounding ties and near ±448, a row
    wider than one power of two, a strided view."""
    from loraplex.ops.gemm.quantize_kernel import quantize_rows_fused
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, 300, generator=g) * torch.logspace(-6, 4, 9)[:, None]
    x[3] = 0
    x[4, :8] = torch.tensor([448.0, -448.0, 1.0625, 1.1875, -3.25, 2 ** -7 + 2 ** -10, 0.0, -0.0])   # ties: even
    x[5, ::7] *= 1e3   # a few large values: the rest of the row lands on subnormals
    x = x.to(dtype)
    wide = torch.cat([x, x[:, :57]], dim=1)   # K = 357: a masked block of 512
    for rows in (x, wide, wide[:, 20:320]):
        xq, s = quantize_rows_fused(rows)
        want_q, want_s = quantize_rows(rows)
        assert torch.equal(s, want_s)
        assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8))
    codes = quantize_rows(x)[0].view(torch.uint8)
    assert (((codes & 0x78) == 0) & ((codes & 0x07) != 0)).any()   # e4m3 subnormals were written
    with pytest.raises(ValueError, match="unit stride"):
        quantize_rows_fused(x.T)


def test_linear_picks_the_kernel_w8a8_or_the_dequantized_weight(monkeypatch):
    """Decode rows take the Triton kernel where the dense Triton GEMM would run (here: the interpreter with
    LORAPLEX_SKINNY_GEMM=on), W8A8 where LORAPLEX_FP8_W8A8 takes it (`decode_w8a8`); more rows take W8A8 where
    LORAPLEX_FP8_W8A8 allows and the scales are per column, else the dequantized weight. ops/gemm/linear.py routes
    an Fp8Matrix here and a tensor to the dense GEMM."""
    calls = []
    for name in ("fp8_skinny_linear", "w8a8_linear"):
        real = getattr(fp8, name)
        monkeypatch.setattr(fp8, name, lambda *a, _n=name, _r=real, **kw: calls.append(_n) or _r(*a, **kw))
    bf16 = torch.randn(4, 64).bfloat16()
    per_col, blocks = random_matrix(32, 64, (1, 64), seed=5), random_matrix(32, 64, (32, 32), seed=6)
    narrow = random_matrix(32, 64, (16, 16), seed=7)   # K steps of 16: too short for an e4m3 dot
    for setting, wanted in (("off", (False, False, False)), ("on", (True, True, False)),
                            ("auto", (False, False, False))):   # auto: bf16 on Hopper only (this is a CPU)
        monkeypatch.setattr(fp8, "W8A8", setting)
        assert tuple(fp8.decode_w8a8(bf16.to(d), per_col) for d in (torch.bfloat16, torch.float16,
                                                                    torch.float32)) == wanted
        assert fp8.decode_w8a8(bf16, blocks) == wanted[0] and not fp8.decode_w8a8(bf16, narrow)
    small, large = torch.randn(4, 64).half(), torch.randn(48, 64).half()
    monkeypatch.setattr(skinny, "SETTING", "off")
    monkeypatch.setattr(fp8, "W8A8", "off")
    for x, m in ((small, per_col), (large, per_col), (large, blocks)):
        torch.testing.assert_close(gemm.linear(x, m), x @ m.dequantize(x.dtype).T)
    assert calls == []
    monkeypatch.setattr(fp8, "W8A8", "on")
    gemm.linear(large, per_col)
    gemm.linear(large, blocks)              # 32×32 blocks: dequantized
    gemm.linear(large.float(), per_col)     # fp32 activations: dequantized
    assert calls == ["w8a8_linear"]
    monkeypatch.setattr(fp8, "W8A8", "auto")
    assert not fp8.w8a8_takes(large, per_col)   # auto: bf16 on CUDA Hopper GPUs only
    monkeypatch.setattr(fp8, "_on_hopper", lambda device: True)   # (only the predicate runs: no kernel)
    assert fp8.w8a8_takes(large.bfloat16(), per_col) and not fp8.w8a8_takes(large, per_col)   # fp16: not auto
    assert fp8.decode_w8a8(bf16, per_col) and not fp8.decode_w8a8(bf16.half(), per_col)
    monkeypatch.setattr(fp8, "_on_hopper", lambda device: False)
    assert envs.fp8_w8a8() == "auto"
    if ops.triton_interpreted():
        monkeypatch.setattr(skinny, "SETTING", "on")
        assert gemm.takes_input(small, per_col) and not gemm.takes_input(large, per_col)
        gemm.linear(small, blocks)
        assert calls == ["w8a8_linear", "fp8_skinny_linear"]
        monkeypatch.setattr(fp8, "W8A8", "on")   # decode rows through the kernel's W8A8: x's rows quantized
        xq, sx = quantize_rows(small)
        want, plain = loop_f64(xq.double() * sx.double(), per_col, None), loop_f64(small, per_col, None)
        y = gemm.linear(small, per_col).double()
        assert calls[-1] == "fp8_skinny_linear" and (y - want).abs().max() < 0.1 * (y - plain).abs().max()
        torch.testing.assert_close(y, want, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(1, 4096), (128, 128)])
@pytest.mark.parametrize("M", [1, 16, 32])
def test_fp8_skinny_linear_in_bf16_on_the_gpu(M, block):
    """Llama-2-7B's q/k/v shape in bf16: the kernel's products against the float64 loop, to bf16's rounding."""
    if not torch.cuda.is_available() or not fp8.fp8_capable(torch.cuda.current_device()):
        pytest.skip("needs a CUDA GPU of compute capability 8.9 or more")
    m = random_matrix(12288, 4096, block, seed=7, device="cuda")
    x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
    want = loop_f64(x, m, None)
    torch.testing.assert_close(fp8_skinny_linear(x, m).double().cpu(), want, rtol=1e-2, atol=1e-2)
    assert gemm.takes_input(x, m)
    # a K split (the counters and partials across programs), twice: the counters reset for the next launch
    split = SkinnyConfig(block_n=128, block_k=128, stages=4, split_k=4)
    for _ in range(2):
        torch.testing.assert_close(fp8_skinny_linear(x, m, config=split).double().cpu(), want, rtol=1e-2, atol=1e-2)
    # W8A8: the loop over x's quantized rows (the CPU's quantize_rows, bit for bit the GPU's), to bf16's rounding
    # plus what the e4m3 MMAs drop inside a K step (2^-10 of the sum of the products' magnitudes bounds it)
    xq, sx = quantize_rows(x.cpu())
    want_q = loop_f64(xq.double() * sx.double(), m, None)
    size = loop_f64((xq.double() * sx.double()).abs(), Fp8Matrix(m.qweight.double().abs().cpu(), m.scale.cpu(),
                                                                  m.block), None)
    swapped = SkinnyConfig(block_n=32, block_k=256, stages=4, swap_ab=True)   # x's rows on the wgmma's long side
    for cfg in (None, split, SkinnyConfig(block_n=64, block_k=512, stages=3), swapped,
                SkinnyConfig(block_n=16, block_k=128, stages=4, split_k=2, swap_ab=True)):
        got = fp8_skinny_linear(x, m, config=cfg, quantize_x=True).double().cpu()
        err = (got - want_q).abs() - 1e-2 * want_q.abs()
        print(f"W8A8 {cfg}: largest error past bf16's rounding {(err / size).max().item():.2e} of Σ|xq·w|")
        assert (err <= 2.0 ** -10 * size).all()


@pytest.mark.gpu
def test_every_e4m3_value_reaches_the_bf16_products_exactly():
    """The kernel's own e4m3 → bf16 conversion (fp8_kernels.py's `_e4m3_to_bf16`) on every finite byte, ±0 and the
    subnormals included: one-hot rows of x pick single weights, so y is each q · scale rounded once, bit for bit
    the dequantized weight."""
    if not torch.cuda.is_available() or not fp8.fp8_capable(torch.cuda.current_device()):
        pytest.skip("needs a CUDA GPU of compute capability 8.9 or more")
    N, K, M = 256, 128, 32
    codes = (torch.arange(N)[:, None] + 7 * torch.arange(K)[None, :]) % 256
    codes[(codes & 0x7F) == 0x7F] = 0x80   # e4m3fn's NaNs: -0 in their place
    q = codes.to(torch.uint8).view(FP8).cuda()
    scale = (torch.rand(N, 1, generator=torch.Generator().manual_seed(3)) + 0.5).cuda()
    m = Fp8Matrix(q, scale, (1, K))
    x = torch.zeros(M, K, device="cuda", dtype=torch.bfloat16)
    x[torch.arange(M), torch.arange(M) * 3] = 1.0
    y = fp8_skinny_linear(x, m)
    assert torch.equal(y, m.dequantize(torch.bfloat16)[:, :3 * M:3].T)
    assert len(set(codes[:, :3 * M:3].flatten().tolist())) == 254   # every finite byte was read


@pytest.mark.gpu
def test_w8a8_on_the_gpu_matches_the_cpu_loop():
    if not torch.cuda.is_available() or not fp8.fp8_capable(torch.cuda.current_device()):
        pytest.skip("needs a CUDA GPU of compute capability 8.9 or more")
    m = random_matrix(4096, 4096, (1, 4096), seed=8, device="cuda")
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    assert fp8.w8a8_takes(x, m)
    xq, sx = quantize_rows(x.cpu())   # the CPU's IEEE divisions: the documented semantics
    from loraplex.ops.gemm.quantize_kernel import quantize_rows_fused
    fused_q, fused_s = quantize_rows_fused(x)
    assert torch.equal(fused_s.cpu(), sx) and torch.equal(fused_q.cpu().view(torch.uint8), xq.view(torch.uint8))
    gpu_q, gpu_s = quantize_rows(x)   # torch's own kernels on the GPU round alike
    assert torch.equal(gpu_s.cpu(), sx) and torch.equal(gpu_q.cpu().view(torch.uint8), xq.view(torch.uint8))
    want = (xq.double() * sx.double()) @ (m.qweight.double() * m.scale.double()).cpu().T
    torch.testing.assert_close(w8a8_linear(x, m).double().cpu(), want, rtol=1e-2, atol=1e-1)


@pytest.mark.gpu
@pytest.mark.parametrize("M, K", [(32, 11008), (2048, 11008), (1337, 14336), (2048, 4096)])
def test_the_quantize_kernel_on_the_gpu_gives_the_cpu_bits(M, K):
    """quantize_rows_fused at decode and prompt rows of down's and o's widths (32 warps a program where the rows
    leave SMs idle, 16 past the SM count, 8 for 4,096 values): the CPU's IEEE divisions' bits."""
    if not torch.cuda.is_available() or not fp8.fp8_capable(torch.cuda.current_device()):
        pytest.skip("needs a CUDA GPU of compute capability 8.9 or more")
    from loraplex.ops.gemm.quantize_kernel import quantize_rows_fused
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 3, M, device="cuda")[:, None]
    xq, sx = quantize_rows(x.cpu())
    got_q, got_s = quantize_rows_fused(x)
    assert torch.equal(got_s.cpu(), sx) and torch.equal(got_q.cpu().view(torch.uint8), xq.view(torch.uint8))


def test_quantize_warps_follow_the_rows_and_the_width():
    """32 warps a row of 11,008 values (a 16,384-lane block) at a decode step's 32 rows, 16 past the SM count;
    narrower rows ~16 values a thread whatever the rows; wider ones 32 warps."""
    from loraplex.ops.gemm.quantize_kernel import quantize_warps
    assert [quantize_warps(M, 16384, 132) for M in (1, 32, 132, 133, 2048)] == [32, 32, 32, 16, 16]
    assert [quantize_warps(M, 4096, 132) for M in (32, 2048)] == [8, 8]
    assert quantize_warps(2048, 512, 132) == 4
    assert quantize_warps(2048, 32768, 132) == 32   # past the measured widths


@interpreted
def test_bench_fp8_gemm_smoke(monkeypatch, tmp_path):
    """benchmarks/bench_fp8_gemm.py --smoke (toy shapes in the interpreter): every shape's decode and prompt entries,
    each FP8 output checked against the dequantized weight's product, the layer sums and the markdown."""
    import json

    from benchmark_modules import load_benchmark
    bench = load_benchmark(monkeypatch, "bench_fp8_gemm")
    monkeypatch.setattr(load_benchmark(monkeypatch, "bench_skinny_gemm"), "SMOKE", False)   # (restored after)
    out, md = tmp_path / "fp8.json", tmp_path / "fp8.md"
    bench.main(["--smoke", "--rows", "2", "--prompt-rows", "40", "--out", str(out), "--md", str(md),
                "--tuned-out", str(tmp_path)])
    result = json.loads(out.read_text())
    assert len(result["decode"]) == len(result["prompt"]) == len(bench.SHAPES)
    for e in result["decode"].values():
        assert e["fp8_column"]["us"] > 0 and e["fp8_block128"]["us"] > 0 and e["fp8_w8a8_kernel"]["us"] > 0, e
    for name in ("tuned_fp8_h100.json", "tuned_fp8_w8a8_h100.json"):   # the files fp8_tiles.py reads, the CPU's
        assert len(skinny.load_configs(tmp_path / name, swap_ab=True)) == len(bench.SHAPES), name
    assert set(result["layer"]["2"]) == {"Llama-2-7B", "Llama-3-8B"}
    assert "| Llama-3-8B @ 2 |" in md.read_text()
    w8a8_dir = tmp_path / "w8a8_only"   # the W8A8 tiles swept and written alone, the others at their defaults
    w8a8_dir.mkdir()
    bench.main(["--smoke", "--rows", "2", "--prompt-rows", "40", "--out", str(out), "--tuned-out", str(w8a8_dir),
                "--w8a8-only"])
    result = json.loads(out.read_text())
    for e in result["decode"].values():
        assert e["fp8_column"]["us"] is None and e["fp8_column"]["default_us"] > 0 and e["fp8_w8a8_kernel"]["us"] > 0
    assert [p.name for p in w8a8_dir.iterdir()] == ["tuned_fp8_w8a8_h100.json"]
    path = w8a8_dir / "tuned_fp8_w8a8_h100.json"   # one shape swept again: the file keeps the others' entries
    earlier = json.loads(path.read_text())
    path.write_text(json.dumps({**earlier, "1,2": {"block_n": 64, "block_k": 128, "stages": 3}}))
    bench.main(["--smoke", "--rows", "2", "--prompt-rows", "40", "--out", str(out), "--md", str(md),
                "--tuned-out", str(w8a8_dir), "--w8a8-only", "--shapes", "l3.qkv"])
    result, tuned = json.loads(out.read_text()), json.loads(path.read_text())
    assert list(result["decode"]) == ["l3.qkv@2"] and list(result["prompt"]) == ["l3.qkv@40"]
    assert result["layer"]["2"] == {}   # no model had all four of its shapes timed
    assert {k: v for k, v in tuned.items() if k != "_note"} == {
        **{k: v for k, v in earlier.items() if k != "_note"}, "1,2": {"block_n": 64, "block_k": 128, "stages": 3}}
    assert "l3.qkv" in tuned["_note"] and earlier["_note"] in tuned["_note"]
    assert "| l3.qkv@2 |" in md.read_text()
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--shapes", "l3.qkv,l4.qkv"])
