"""ops.skinny_gemm.skinny_linear against the float64 loop of its documented sums (skinny_gemm_kernels.py):
in Triton's CPU interpreter here (fp32, fp16), at Llama-2-7B's shapes in bf16 on a GPU."""
from __future__ import annotations

import os

import pytest
import torch

from loraplex import ops
from loraplex.ops.gemm import skinny as skinny_gemm
from loraplex.ops.gemm.skinny import SkinnyConfig, skinny_linear

interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")


def loop_f64(x, w, bias, split: int, block_k: int) -> torch.Tensor:
    """The documented sums: each K split's products summed, the splits summed in order, plus the bias."""
    K = x.shape[1]
    k_tiles = -(-K // block_k)
    per = -(-k_tiles // min(split, k_tiles)) * block_k
    x64, w64 = x.double(), w.double()
    y = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for lo in range(0, K, per):
        y += x64[:, lo:lo + per] @ w64[:, lo:lo + per].T
    return y + (bias.double() if bias is not None else 0)


CASES = [  # M, N, K, config
    (1, 64, 64, SkinnyConfig(block_n=32, block_k=32)),
    (5, 100, 300, SkinnyConfig(block_n=32, block_k=64, split_k=3)),   # N and K past the tiles, a short last split
    (16, 128, 256, SkinnyConfig(block_n=64, block_k=64, split_k=1)),
    (32, 96, 512, SkinnyConfig(block_n=32, block_k=128, split_k=4)),
    (33, 48, 160, SkinnyConfig(block_n=16, block_k=32, split_k=8)),   # a 64-row tile; 5 K tiles over 8 splits
    (7, 80, 96, None),                                                # pick_config's choice
    (4, 64, 320, SkinnyConfig(block_n=32, block_k=64, split_k=2)),    # K and splits in whole tiles, the last short
]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_skinny_linear_matches_the_float64_loop(case, with_bias, dtype):
    M, N, K, cfg = CASES[case]
    g = torch.Generator().manual_seed(1000 * case + 10 * with_bias + (dtype == torch.float16))
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if with_bias else None
    out = torch.full((M, N), float("nan"), dtype=dtype)   # poisoned: every element must be written
    y = skinny_linear(x, w, bias, out=out, config=cfg)
    assert y is out and not y.isnan().any()
    used = cfg or skinny_gemm.pick_config(N, K, 132)
    want = loop_f64(x, w, bias, used.split_k, used.block_k)
    err = ((y.double() - want).abs().max() / want.abs().max()).item()
    assert err <= (1e-6 if dtype == torch.float32 else 1e-3), err
    assert torch.equal(skinny_linear(x, w, bias, config=cfg), y)   # again: the same bits (counters were reset)
    for (_, split, n), (_, count) in skinny_gemm._WORKSPACES.items():
        assert not count.any(), (split, n)


@interpreted
def test_split_launches_of_one_width_with_other_tiles_share_the_counters_safely():
    """The split workspace is kept per (device, split, N); launches with narrower column tiles (more tiles, more
    counters) after wider ones still compute the documented sums and leave every counter at 0."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(3, 128, generator=g), torch.randn(256, 128, generator=g)
    want = loop_f64(x, w, None, 2, 32)
    for block_n in (128, 64, 16, 32):
        y = skinny_linear(x, w, config=SkinnyConfig(block_n=block_n, block_k=32, split_k=2))
        assert ((y.double() - want).abs().max() / want.abs().max()).item() <= 1e-6, block_n
    counts = skinny_gemm._WORKSPACES[(x.device, 2, 256)][1]
    assert counts.numel() >= 256 // 16 and not counts.any()


@interpreted
def test_a_row_tile_larger_than_the_rows_leaves_other_memory_alone():
    """x and out as row slices of bigger buffers (strides past their widths): only out's rows change."""
    g = torch.Generator().manual_seed(5)
    big_x = torch.randn(10, 200, generator=g)
    big_out = torch.randn(10, 90, generator=g)
    before = big_out.clone()
    x, out = big_x[2:5, :150], big_out[4:7, 10:90]
    w = torch.randn(80, 150, generator=g)
    skinny_linear(x, w, out=out, config=SkinnyConfig(block_n=32, block_k=32, split_k=2))
    want = loop_f64(x, w, None, 2, 32)
    assert ((out.double() - want).abs().max() / want.abs().max()).item() <= 1e-6
    mask = torch.ones_like(big_out, dtype=torch.bool)
    mask[4:7, 10:90] = False
    assert torch.equal(big_out[mask], before[mask])


def test_arguments_are_checked():
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match="K = 32 columns but weight"):
        skinny_linear(x, torch.randn(16, 31))
    with pytest.raises(ValueError, match="more than MAX_ROWS"):
        skinny_linear(torch.randn(skinny_gemm.MAX_ROWS + 1, 32), w)
    with pytest.raises(ValueError, match="bias is torch.float16"):
        skinny_linear(x, w, torch.randn(16).half())
    with pytest.raises(ValueError, match=r"bias has shape \(15,\)"):
        skinny_linear(x, w, torch.randn(15))
    with pytest.raises(ValueError, match=r"out has shape \(4, 15\)"):
        skinny_linear(x, w, out=torch.empty(4, 15))
    with pytest.raises(ValueError, match="bias must have unit stride"):
        skinny_linear(x, w, torch.randn(32)[::2])
    with pytest.raises(ValueError, match="weight must have unit stride"):
        skinny_linear(x, torch.randn(32, 16).t())
    with pytest.raises(ValueError, match="dtype torch.int32"):
        skinny_linear(x.int(), w.int())
    with pytest.raises(ValueError, match="block_k=48"):
        SkinnyConfig(block_k=48)
    with pytest.raises(ValueError, match="split_k=0"):
        SkinnyConfig(split_k=0)
    with pytest.raises(ValueError, match="swap_ab=1"):
        SkinnyConfig(swap_ab=1)
    with pytest.raises(ValueError, match="only the FP8 kernel"):
        skinny_linear(x, w, config=SkinnyConfig(block_n=16, block_k=32, swap_ab=True))
    assert skinny_linear(torch.randn(0, 32), w).shape == (0, 16)
    bias = torch.randn(16)
    assert torch.equal(skinny_linear(torch.randn(3, 0), torch.randn(16, 0), bias), bias.expand(3, 16))


def test_pick_config_follows_the_sweep():
    # on 132 SMs, as the H200 sweep found at Llama-2-7B's shapes (skinny_gemm.TUNED): no K split; few tiles (o,
    # down: 64) take 256 of K a step in 4 stages; gate/up's 344 tiles fit one wave at three programs an SM (3
    # stages); q/k/v's 192 tiles do not need that (4 stages)
    for (n, k), tuned in skinny_gemm.TUNED.items():
        picked = skinny_gemm.pick_config(n, k, 132)
        assert picked.split_k == 1 and picked.block_n == 64
        if n != 12288 and n != 32000:   # q/k/v and the LM head were fastest with 128-column tiles
            assert picked == tuned, (n, k)
    assert skinny_gemm.pick_config(4096, 4096, 132) == SkinnyConfig(block_k=256, stages=4)
    assert skinny_gemm.pick_config(22016, 4096, 132) == SkinnyConfig(block_k=128, stages=3)
    assert skinny_gemm.pick_config(12288, 4096, 132) == SkinnyConfig(block_k=128, stages=4)
    assert skinny_gemm.pick_config(128256, 4096, 132).stages == 4   # Llama-3's LM head: 2,004 tiles
    assert skinny_gemm.CONFIGS == skinny_gemm.TUNED or os.environ.get("LORAPLEX_SKINNY_CONFIGS")


def test_fit_config_keeps_launches_within_the_gpus_shared_memory():
    h200, ada = 232_448, 101_376
    for (n, k), tuned in skinny_gemm.TUNED.items():   # as tuned: 16-bit, 32 rows, an H200
        assert skinny_gemm.fit_config(tuned, 32, 2, h200) == tuned, (n, k)
    o = skinny_gemm.TUNED[(4096, 4096)]   # 256 of K a step in 4 stages: 262,144 bytes at 64 rows
    assert skinny_gemm.launched_config(o, 64, torch.empty(64, 8)) == o   # the interpreter has no such limit
    assert skinny_gemm.fit_config(o, 64, 2, h200) == SkinnyConfig(block_n=64, block_k=256, stages=3)
    assert skinny_gemm.fit_config(o, 16, 4, h200) == SkinnyConfig(block_n=64, block_k=256, stages=2)   # fp32
    assert skinny_gemm.fit_config(o, 32, 2, ada) == SkinnyConfig(block_n=64, block_k=256, stages=2)
    assert skinny_gemm.fit_config(o, 32, 4, ada) == SkinnyConfig(block_n=64, block_k=128, stages=2)   # fp32
    for limit in (232_448, 166_912, 101_376, 49_152, 24_000):
        for cfg in (o, *skinny_gemm.TUNED.values(), SkinnyConfig(block_n=256, block_k=512, stages=8, split_k=4)):
            for block_m in (16, 32, 64):
                for elem in (2, 4):
                    fitted = skinny_gemm.fit_config(cfg, block_m, elem, limit)
                    assert skinny_gemm.shared_bytes(fitted, block_m, elem) <= limit, (cfg, block_m, elem, limit)
                    assert fitted.split_k == cfg.split_k and fitted.warps == cfg.warps
                    if skinny_gemm.shared_bytes(cfg, block_m, elem) <= limit:
                        assert fitted == cfg


def test_the_prefetch_spans_prefetch_bytes_of_a_row_only_with_pdl_on_a_gpu(monkeypatch):
    """prefetch_elements (the GEMMs' PREFETCH): PREFETCH_BYTES of a row in the weight's elements for a compiled
    kernel on a GPU with PDL on, else 0; a PREFETCH_BYTES that is not whole lines is refused by name."""
    from loraplex.ops import pdl

    class Weight:   # (the CPU has no CUDA tensor: what prefetch_elements reads of one)
        def __init__(self, size: int, cuda: bool = True):
            self.size, self.is_cuda = size, cuda

        def element_size(self) -> int:
            return self.size

    monkeypatch.setattr(pdl, "PDL", True)
    assert [skinny_gemm.prefetch_elements(Weight(b), True) for b in (1, 2, 4)] == \
        [skinny_gemm.PREFETCH_BYTES // b for b in (1, 2, 4)]
    assert skinny_gemm.prefetch_elements(Weight(1), False) == 0   # the interpreter
    assert skinny_gemm.prefetch_elements(Weight(1, cuda=False), True) == 0
    monkeypatch.setattr(skinny_gemm, "PREFETCH_BYTES", 384)
    with pytest.raises(ValueError, match="PREFETCH_BYTES"):
        skinny_gemm.prefetch_elements(Weight(1), True)
    monkeypatch.setattr(pdl, "PDL", False)
    monkeypatch.setattr(skinny_gemm, "PREFETCH_BYTES", 512)
    assert skinny_gemm.prefetch_elements(Weight(1), True) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)])
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_skinny_linear_at_llama_shapes_on_the_gpu(shape, rows):
    N, K = shape
    g = torch.Generator(device="cuda").manual_seed(N + rows)
    x = torch.randn(rows, K, generator=g, device="cuda").bfloat16()
    w = (torch.randn(N, K, generator=g, device="cuda") * K ** -0.5).bfloat16()
    bias = torch.randn(N, generator=g, device="cuda").bfloat16()
    for cfg in (None, skinny_gemm.TUNED[shape], SkinnyConfig(block_n=128, block_k=128, split_k=2, stages=3),
                SkinnyConfig(block_n=64, block_k=256, split_k=8, stages=3)):
        used = cfg or skinny_gemm.pick_config(N, K, torch.cuda.get_device_properties(0).multi_processor_count)
        out = torch.full((rows, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        y = skinny_linear(x, w, bias, out=out, config=cfg)
        want = loop_f64(x.cpu(), w.cpu(), bias.cpu(), used.split_k, used.block_k)
        err = ((y.cpu().double() - want).abs().max() / want.abs().max()).item()
        assert err <= 8e-3, (cfg, err)   # one bf16 rounding of the fp32 sum
        graph = torch.cuda.CUDAGraph()   # captured and replayed: the same bits
        with torch.cuda.graph(graph):
            z = skinny_linear(x, w, bias, config=cfg)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(z, y), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tuned_tiles_fit_at_64_rows_and_in_fp32_on_the_gpu(dtype):
    """The tuned tiles need more shared memory than an H200 has at 64 rows (o's, down's) or in fp32: fit_config
    takes fewer stages, and the sums still match the loop."""
    for (N, K), tuned in skinny_gemm.TUNED.items():
        rows = 64 if dtype == torch.bfloat16 else 32
        g = torch.Generator(device="cuda").manual_seed(N + K + rows)
        x = torch.randn(rows, K, generator=g, device="cuda").to(dtype)
        w = (torch.randn(N, K, generator=g, device="cuda") * K ** -0.5).to(dtype)
        y = skinny_linear(x, w, out=torch.full((rows, N), float("nan"), device="cuda", dtype=dtype), config=tuned)
        want = loop_f64(x.cpu(), w.cpu(), None, 1, tuned.block_k)
        err = ((y.cpu().double() - want).abs().max() / want.abs().max()).item()
        assert err <= (8e-3 if dtype == torch.bfloat16 else 1e-5), ((N, K), err)


@pytest.mark.gpu
def test_a_first_split_call_inside_a_capture_is_refused():
    x = torch.randn(32, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    cfg = SkinnyConfig(block_n=64, block_k=64, split_k=16)   # a workspace no other test made
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="run the same shape once before capturing"):
        with torch.cuda.graph(graph):
            skinny_linear(x, w, config=cfg)


def test_tuned_configs_load_from_the_file_the_bench_writes(tmp_path):
    good = tmp_path / "configs.json"
    good.write_text('{"4096,4096": {"block_n": 128, "block_k": 256, "split_k": 2, "warps": 4, "stages": 3}}')
    assert skinny_gemm.load_configs(str(good)) == {(4096, 4096): SkinnyConfig(128, 256, 2, 4, 3)}
    for text, match in (("[1]", "expected an object"), ("{", "cannot read it as JSON"),
                        ('{"4096": {}}', "entry '4096'"), ('{"8,8": {"block_n": 24}}', "block_n=24"),
                        ('{"8,8": {"tile": 4}}', "entry '8,8'"),
                        ('{"8,8": {"block_n": 32, "swap_ab": true}}', "swap_ab is the FP8 kernel's")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match=match):
            skinny_gemm.load_configs(str(bad))
    with pytest.raises(ValueError, match="cannot read"):
        skinny_gemm.load_configs(str(tmp_path / "missing.json"))
    bad.write_text('{"8,8": {"block_n": 32, "swap_ab": true}}')   # the FP8 kernel's files may hold them
    assert skinny_gemm.load_configs(str(bad), swap_ab=True) == {(8, 8): SkinnyConfig(block_n=32, swap_ab=True)}


def test_the_tuned_tiles_ship_as_data_and_a_file_can_replace_them(tmp_path):
    """TUNED is the bundled tuned_h200.json (notes under "_" keys skipped); LORAPLEX_SKINNY_CONFIGS, read at
    import, replaces it."""
    import json
    import subprocess
    import sys
    raw = json.loads(skinny_gemm.TUNED_FILE.read_text())
    assert {k for k in raw if not k.startswith("_")} == {f"{n},{k}" for n, k in skinny_gemm.TUNED}
    assert skinny_gemm.TUNED[(4096, 4096)] == SkinnyConfig(block_n=64, block_k=256, stages=4)
    mine = tmp_path / "tiles.json"
    mine.write_text('{"_note": "mine", "64,32": {"block_n": 16, "block_k": 32}}')
    probe = "from loraplex.ops.gemm import skinny; print(sorted(skinny.CONFIGS), len(skinny.TUNED))"
    out = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, LORAPLEX_SKINNY_CONFIGS=str(mine)),
                         capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == str(len(skinny_gemm.TUNED)) and "[(64, 32)]" in out


def test_linear_takes_the_kernel_only_where_set_and_for_few_rows(monkeypatch):
    """`linear` (the model's projections): F.linear for CPU tensors unless LORAPLEX_SKINNY_GEMM=on in the
    interpreter, and even then only for 1 to DECODE_MAX_ROWS rows; the same values either way."""
    used = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda x, *a, **kw: used.append(x.shape[0]) or real(x, *a, **kw))
    w, b = torch.randn(48, 64), torch.randn(48)
    few = torch.randn(5, 64)
    many = torch.cat([few, torch.randn(skinny_gemm.DECODE_MAX_ROWS + 1 - 5, 64)])
    assert skinny_gemm.SETTING in ("auto", "off") or ops.triton_interpreted()
    for setting in ("off", "auto"):   # "auto": GPUs only, not CPU tensors, not in the interpreter
        monkeypatch.setattr(skinny_gemm, "SETTING", setting)
        assert torch.equal(skinny_gemm.linear(few, w, b), torch.nn.functional.linear(few, w, b)) and used == []
    monkeypatch.setattr(skinny_gemm, "SETTING", "on")
    y = torch.empty(5, 48)
    skinny_gemm.linear_into(y, few, w, b)
    for got in (skinny_gemm.linear(few, w, b), skinny_gemm.linear(many, w, b)[:5], y):
        assert torch.allclose(got, torch.nn.functional.linear(few, w, b), rtol=1e-5, atol=1e-5)
    assert used == ([5, 5] if ops.triton_interpreted() else [])   # not the 33 rows
    before = len(used)
    assert skinny_gemm.linear(few.double(), w.double()).dtype == torch.float64 and len(used) == before   # F.linear


@interpreted
def test_the_benchmark_runs_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    """benchmarks/bench_skinny_gemm.py --smoke (toy shapes in the interpreter): every shape's cuBLAS and kernel
    timings, the kernel checked against F.linear, the layer timing, and a configs file that load_configs reads."""
    import json

    from benchmark_modules import load_benchmark
    bench = load_benchmark(monkeypatch, "bench_skinny_gemm")   # a fresh module: --smoke rescales its settings
    out, configs = tmp_path / "skinny.json", tmp_path / "configs.json"
    bench.main(["--smoke", "--rows", "4,2", "--out", str(out), "--md", str(tmp_path / "skinny.md"),
                "--configs-out", str(configs)])
    result = json.loads(out.read_text())
    assert set(result["shapes"]) == {f"{name}@{m}" for name in bench.SHAPES for m in (4, 2)}
    for entry in result["shapes"].values():
        assert isinstance(entry["blas"]["default"], float) and entry["best"]
        assert all("us" in v and v["rel_err"] <= 1e-2 for v in entry["skinny"].values()), entry["skinny"]
    assert result["layer"]["cublas"] > 0 and result["layer"]["skinny"] > 0
    loaded = skinny_gemm.load_configs(str(configs))
    assert set(loaded) == {bench.SHAPES[name] for name in bench.SHAPES}
    assert "skinny / cuBLAS" in (tmp_path / "skinny.md").read_text()
