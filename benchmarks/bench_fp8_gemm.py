"""FP8 weights in the projections' GEMMs on the GPU, against bf16: per weight shape of a Llama-2-7B and a Llama-3-8B
layer, side by side in one run.

- decode rows (1, 16, 32 by default): cuBLAS bf16, the bf16 Triton GEMM (ops/gemm/skinny.py, its tuned or picked
  tiles), and the FP8 weight-only kernel (ops/gemm/fp8.py) with its default tiles and over a sweep of tiles (all
  of it at the first row count, its TOP fastest per-column tiles at the others), with a
  scale per output column (`--quantization fp8`, compressed-tensors) and with 128×128 block scales (transformers'
  `fp8`); the floors are each weight's bytes over the copy bandwidth measured in the same run (bf16: 2 bytes an
  element, FP8: 1); cuBLAS's W8A8 (below) at the same rows; and the kernel's W8A8 (what LORAPLEX_FP8_W8A8 picks on
  Hopper: `quantize_rows_fused`'s launch, then q read by the FP8 tensor cores) over its own sweep of tiles 64
  columns wide or more, and of 16 or 32 with x's rows on the wgmma's long side (swap_ab). `--tuned-out DIR`
  writes each shape's fastest per-column and W8A8 tiles at the first row count into DIR, in the files
  ops/gemm/fp8_tiles.py reads for this GPU (tuned_fp8_<gpu>.json, tuned_fp8_w8a8_<gpu>.json) when DIR is
  src/loraplex/ops/gemm; `--w8a8-only` sweeps the W8A8 tiles alone (what Hopper's decode steps run: 44 of a shape's 80
  tiles) and writes their file alone; `--shapes` sweeps some shapes alone (a few minutes each at 44 tiles), and
  --tuned-out then keeps the file's entries for the others;
- prompt rows (128, 512, 1337, 2048; 1337 as an engine step's rows, rarely a multiple of 16): cuBLAS bf16, W8A8
  (each row of x quantized to e4m3, then torch._scaled_mm: what LORAPLEX_FP8_W8A8 picks) and the weight
  dequantized for cuBLAS (the fallback).
Every timing replays a CUDA graph of calls over rotating weight copies (together past the L2), median of
CUDA-event timings after warm-up. Each FP8 output is checked against the dequantized weight's cuBLAS product first.

    python benchmarks/bench_fp8_gemm.py --out benchmarks/results/fp8_gemm.json --md benchmarks/results/fp8_gemm.md \
        --tuned-out src/loraplex/ops/gemm
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import copy_bandwidth_gbs  # noqa: E402
import bench_skinny_gemm  # noqa: E402
from bench_skinny_gemm import per_call_us  # noqa: E402

from loraplex import envs  # noqa: E402
from loraplex.ops.gemm import skinny  # noqa: E402
from loraplex.ops.gemm import fp8_tiles  # noqa: E402
from loraplex.ops.gemm.fp8 import Fp8Matrix, fp8_skinny_linear, quantize_rows, w8a8_linear  # noqa: E402

SHAPES = {"l2.qkv": (12288, 4096), "l2.o": (4096, 4096), "l2.gate_up": (22016, 4096), "l2.down": (4096, 11008),
          "l3.qkv": (6144, 4096), "l3.gate_up": (28672, 4096), "l3.down": (4096, 14336)}
FULL_SHAPES = dict(SHAPES)
LAYERS = {"Llama-2-7B": ("l2.qkv", "l2.o", "l2.gate_up", "l2.down"),
          "Llama-3-8B": ("l3.qkv", "l2.o", "l3.gate_up", "l3.down")}
ROTATION_BYTES = 600 << 20
# e4m3 tiles move half a bf16 tile's bytes: K steps to 512, and 32-column tiles (twice the programs, past the SM
# count for o's and down's 4,096 columns)
SWEEP = [skinny.SkinnyConfig(block_n=bn, block_k=bk, stages=st)
         for bn, bk, st in itertools.product((32, 64, 128), (128, 256, 512), (3, 4))] + \
        [skinny.SkinnyConfig(block_n=bn, block_k=bk, stages=4, split_k=sp)   # wider tiles, K split to keep programs
         for bn, bk, sp in itertools.product((64, 128), (128, 256), (2, 4))]
# the W8A8 kernel's tiles: 64 columns or more (narrower ones' e4m3 products run as fp16 mma.sync on Hopper) unless
# x's rows take the wgmma's long side (swap_ab),
# 512-wide K steps in splits too (x's e4m3 tile is as small as q's), and deeper pipelines (more bytes in flight a
# program, for an H200's bandwidth; tiles past the shared memory are skipped)
W8A8_SWEEP = [c for c in SWEEP if c.block_n >= 64] + \
    [skinny.SkinnyConfig(block_n=bn, block_k=512, stages=st, split_k=sp)
     for bn, st, sp in itertools.product((64, 128), (3,), (2, 4))] + \
    [skinny.SkinnyConfig(block_n=bn, block_k=bk, stages=st)
     for bn, bk, st in itertools.product((64, 128), (256, 512), (5, 6))] + \
    [skinny.SkinnyConfig(block_n=bn, block_k=bk, stages=st, swap_ab=True)   # x's rows on the wgmma's long side:
     for bn, bk, st in itertools.product((16, 32), (256, 512), (3, 4, 6))]
LAYOUTS = {"column": None, "block128": (128, 128)}
DEVICE, DTYPE = "cuda", torch.bfloat16


def _smoke_settings() -> None:
    """--smoke: everything on the CPU (Triton's interpreter, fp16) at 1/64th of the widths, one tile config."""
    global DEVICE, DTYPE, SHAPES, SWEEP, W8A8_SWEEP, ROTATION_BYTES, LAYOUTS
    DEVICE, DTYPE, bench_skinny_gemm.SMOKE = "cpu", torch.float16, True
    SHAPES = {name: (n // 64, k // 64) for name, (n, k) in FULL_SHAPES.items()}   # (again in a later run: the same)
    SWEEP = W8A8_SWEEP = [skinny.SkinnyConfig(block_n=16, block_k=32, stages=1)]
    ROTATION_BYTES, LAYOUTS = 0, {"column": None, "block128": (32, 32)}


def fp8_copies(w: torch.Tensor, block: tuple[int, int] | None, copies: int) -> list[Fp8Matrix]:
    """e4m3 copies of w with a scale per output column (block None) or per 128×128 block."""
    if block is None:
        q, s = quantize_rows(w)
        block = (1, w.shape[1])
    else:
        bn, bk = block
        n, k = w.shape
        padded = F.pad(w.float(), (0, -k % bk, 0, -n % bn))   # partial blocks at the edges (toy widths)
        grid = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk)).abs().amax(dim=(1, 3))
        s = (grid / 448).clamp(min=1e-12)
        full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        q = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return [Fp8Matrix(q.clone(), s.clone(), block) for _ in range(copies)]


def check(got: torch.Tensor, ref: torch.Tensor, tolerance: float = 2e-2) -> float:
    """The largest error relative to the largest |ref|; an error above `tolerance` (16-bit rounding for the weight-only
    kernel; 1/16, e4m3's rounding of each activation, for W8A8) stops the benchmark."""
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    if not err <= tolerance:
        raise RuntimeError(f"relative error {err:.2e} against the dequantized weight's cuBLAS product")
    return err


TOP = 3   # per-column tiles retried at the row counts after the first (the first sweeps them all)


def tile_name(c: skinny.SkinnyConfig) -> str:
    """A swept config's key in the results (`n64_k512_st3`, `n128_k256_st4_s4` with a K split, `n32_k256_st4_sw`
    with x's rows on the wgmma's long side, `_w8` at 8 warps)."""
    return (f"n{c.block_n}_k{c.block_k}_st{c.stages}" + (f"_s{c.split_k}" if c.split_k > 1 else "")
            + (f"_w{c.warps}" if c.warps != 4 else "") + ("_sw" if c.swap_ab else ""))


def swept(names, sweep: list | None = None) -> list:
    """The configs of these keys in `sweep` (default SWEEP), in sweep order."""
    wanted = set(names)
    return [c for c in (SWEEP if sweep is None else sweep) if tile_name(c) in wanted]


def sweep_tiles(x: torch.Tensor, ms: list, configs: list, ref: torch.Tensor, tolerance: float, **kw) -> dict:
    """{tile name: µs per call, or the error's text} of fp8_skinny_linear(x, m, config=c, **kw) over `configs`,
    each checked against `ref` first; configs that the GPU's shared memory would cut are skipped."""
    timed = {}
    read = x.to(torch.float8_e4m3fn) if kw.get("quantize_x") else x   # x as the kernel reads it
    for c in configs:
        if fp8_tiles.fitted_config(c, read) != c or c.block_k > ms[0].block[1] and ms[0].scale.shape[1] > 1:
            continue
        try:
            check(fp8_skinny_linear(x, ms[0], config=c, **kw), ref, tolerance)
            timed[tile_name(c)] = per_call_us([lambda m=m, c=c: fp8_skinny_linear(x, m, config=c, **kw) for m in ms])
        except Exception as err:  # noqa: BLE001 - one config's failure (resources, compile) is reported
            timed[tile_name(c)] = repr(err)[:200]
    return timed


def fastest(timed: dict) -> str | None:
    times = {k: v for k, v in timed.items() if isinstance(v, float)}
    return min(times, key=times.get) if times else None


def decode_entry(name: str, M: int, bf16: list, fp8: dict, copy_gbs: float, tiles: dict,
                 w8a8_only: bool = False) -> dict:
    """One shape at M decode rows. `tiles`: {"column" and "w8a8": the tiles to time (None: the whole sweep)}; the
    128×128 layout always sweeps its (few) tiles. `w8a8_only`: the weight-only layouts time their default tiles
    alone."""
    N, K = SHAPES[name]
    x = torch.randn(M, K, device=DEVICE).to(DTYPE)
    cfg = skinny.default_config(N, K, x.device)
    e = dict(N=N, K=K, rows=M, floor_bf16_us=N * K * 2 / copy_gbs / 1e3, floor_fp8_us=N * K / copy_gbs / 1e3,
             cublas_bf16=per_call_us([lambda w=w: F.linear(x, w) for w in bf16]),
             skinny_bf16=per_call_us([lambda w=w: skinny.skinny_linear(x, w, config=cfg) for w in bf16]),
             w8a8=per_call_us([lambda m=m: w8a8_linear(x, m) for m in fp8["column"]]))
    for layout, ms in fp8.items():
        ref = F.linear(x, ms[0].dequantize(DTYPE))
        timed = {} if w8a8_only else sweep_tiles(
            x, ms, SWEEP if layout != "column" or tiles["column"] is None else tiles["column"], ref, 2e-2)
        best = fastest(timed)
        e[f"fp8_{layout}"] = dict(best=best, us=timed.get(best), default_us=per_call_us(
            [lambda m=m: fp8_skinny_linear(x, m) for m in ms]), sweep=timed,
            default=fp8_tiles.default_config(N, K, x.device).__dict__)
    ms, ref = fp8["column"], F.linear(x, fp8["column"][0].dequantize(DTYPE))
    # W8A8 over its own tiles: quantize_rows_fused's launch, then the kernel on e4m3 products
    timed = sweep_tiles(x, ms, W8A8_SWEEP if tiles["w8a8"] is None else tiles["w8a8"], ref, 1 / 16, quantize_x=True)
    best = fastest(timed)
    e["fp8_w8a8_kernel"] = dict(best=best, us=timed.get(best), default_us=per_call_us(
        [lambda m=m: fp8_skinny_linear(x, m, quantize_x=True) for m in ms]), sweep=timed,
        default=fp8_tiles.default_config(N, K, x.device, w8a8=True).__dict__)
    return e


def prompt_entry(name: str, M: int, bf16: list, fp8: list) -> dict:
    N, K = SHAPES[name]
    x = torch.randn(M, K, device=DEVICE).to(DTYPE)
    err = check(w8a8_linear(x, fp8[0]), F.linear(x, fp8[0].dequantize(DTYPE)), 1 / 16)
    return dict(N=N, K=K, rows=M, w8a8_rel_err=err,
                cublas_bf16=per_call_us([lambda w=w: F.linear(x, w) for w in bf16]),
                w8a8=per_call_us([lambda m=m: w8a8_linear(x, m) for m in fp8]),
                dequantized=per_call_us([lambda m=m: F.linear(x, m.dequantize(DTYPE)) for m in fp8]))


def layer_sums(result: dict, M: int) -> dict:
    """µs of a layer's four projections (the sum of their per-call times) per system, at decode rows M, for the
    models whose four shapes ran."""
    out = {}
    for model, names in LAYERS.items():
        if not all(f"{n}@{M}" in result["decode"] for n in names):
            continue
        es = [result["decode"][f"{n}@{M}"] for n in names]
        out[model] = {k: round(sum(v(e) for e in es), 1) for k, v in (
            ("floor_bf16", lambda e: e["floor_bf16_us"]), ("floor_fp8", lambda e: e["floor_fp8_us"]),
            ("cublas_bf16", lambda e: e["cublas_bf16"]), ("skinny_bf16", lambda e: e["skinny_bf16"]),
            ("w8a8", lambda e: e["w8a8"]),
            ("fp8_column", lambda e: e["fp8_column"]["us"] or float("nan")),
            ("fp8_column_default", lambda e: e["fp8_column"]["default_us"]),
            ("fp8_w8a8_kernel", lambda e: e["fp8_w8a8_kernel"]["us"] or float("nan")),
            ("fp8_w8a8_kernel_default", lambda e: e["fp8_w8a8_kernel"]["default_us"]),
            ("fp8_block128", lambda e: e["fp8_block128"]["us"] or float("nan")))}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="32,16,1", help="decode row counts")
    ap.add_argument("--prompt-rows", default="128,512,1337,2048")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--tuned-out", type=Path, help="a folder: write each shape's fastest per-column and W8A8 tiles "
                    "there, in ops/gemm/fp8_tiles.py's files for this GPU")
    ap.add_argument("--w8a8-only", action="store_true", help="sweep only the W8A8 kernel's tiles (Hopper's decode "
                    "GEMMs); the weight-only layouts time their default tiles, and --tuned-out writes the W8A8 file "
                    "alone")
    ap.add_argument("--shapes", help=f"some of {', '.join(SHAPES)}, separated by ',' (default all): time these alone; "
                    "--tuned-out keeps the other shapes' entries of the files it writes")
    ap.add_argument("--smoke", action="store_true", help="a CPU run of everything at toy sizes (CI)")
    args = ap.parse_args(argv)
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"--shapes: {', '.join(map(repr, unknown))} not among {', '.join(SHAPES)}")
    if args.smoke:
        _smoke_settings()
    gpu = fp8_tiles.FALLBACK_GPU if args.smoke else fp8_tiles.tuned_gpu(torch.device(DEVICE))
    if args.tuned_out and gpu is None:   # refused before the sweep, rather than written over another GPU's files
        raise SystemExit(f"--tuned-out: ops/gemm/fp8_tiles.py reads tuned tiles for {', '.join(fp8_tiles.TUNED_GPUS)} "
                         f"only, not {torch.cuda.get_device_name()!r}; add it to TUNED_GPUS first")
    torch.manual_seed(0)
    copy_gbs = 1.0 if args.smoke else copy_bandwidth_gbs()
    result = dict(gpu="cpu (smoke run)" if args.smoke else torch.cuda.get_device_name(),
                  date=datetime.date.today().isoformat(), torch=torch.__version__,
                  triton=__import__("triton").__version__, settings=envs.snapshot(), copy_gbs=copy_gbs, decode={},
                  prompt={}, layer={})
    best_tiles: dict[str, dict] = {}
    for name, (N, K) in ((n, SHAPES[n]) for n in names):
        w = torch.randn(N, K, device=DEVICE).to(DTYPE) * K ** -0.5
        copies = max(2, -(-ROTATION_BYTES // (N * K)))
        bf16 = [w.clone() for _ in range(max(2, copies // 2))]
        fp8 = {layout: fp8_copies(w, block, copies) for layout, block in LAYOUTS.items()}
        for M in (int(r) for r in args.rows.split(",")):
            tiles = best_tiles.get(name, dict(column=None, w8a8=None))
            e = result["decode"][f"{name}@{M}"] = decode_entry(name, M, bf16, fp8, copy_gbs, tiles, args.w8a8_only)
            if name not in best_tiles:   # the first row count's fastest tiles, retried at the others
                best_tiles[name] = {key: swept((k for _, k in sorted(
                    (v, k) for k, v in e[entry]["sweep"].items() if isinstance(v, float))[:TOP]), sweep)
                    for key, entry, sweep in (("column", "fp8_column", SWEEP),
                                              ("w8a8", "fp8_w8a8_kernel", W8A8_SWEEP))}
            print(f"{name} @{M}: bf16 {e['skinny_bf16']:.1f} fp8 {e['fp8_column']['us']} / "
                  f"{e['fp8_block128']['us']} w8a8 kernel "
                  f"{e['fp8_w8a8_kernel']['us']} floor {e['floor_fp8_us']:.1f}", flush=True)
        for M in (int(r) for r in args.prompt_rows.split(",")):
            e = result["prompt"][f"{name}@{M}"] = prompt_entry(name, M, bf16, fp8["column"])
            print(f"{name} @{M}: bf16 {e['cublas_bf16']:.1f} w8a8 {e['w8a8']:.1f} deq {e['dequantized']:.1f}",
                  flush=True)
        del bf16, fp8
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    for M in (int(r) for r in args.rows.split(",")):
        result["layer"][M] = layer_sums(result, M)
    print("layer µs", json.dumps(result["layer"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.md:
        args.md.write_text(markdown(result))
    if args.tuned_out:
        write_tuned(result, args.tuned_out, int(args.rows.split(",")[0]), gpu, args.w8a8_only,
                    keep_others=args.shapes is not None)


def write_tuned(result: dict, folder: Path, M: int, gpu: str, w8a8_only: bool = False,
                keep_others: bool = False) -> None:
    """Each swept shape's fastest per-column and W8A8 tiles at M rows into `folder`, in the files
    ops/gemm/fp8_tiles.py reads for `gpu` (one of its TUNED_GPUS); the W8A8 file alone where only its tiles were
    swept. `keep_others`: the existing file's entries for shapes not swept stay, its note beside the new one."""
    kinds = (("weight-only", "fp8_column", SWEEP), ("w8a8", "fp8_w8a8_kernel", W8A8_SWEEP))
    for kind, entry, sweep in kinds[1:] if w8a8_only else kinds:
        path = folder / fp8_tiles.TUNED_FILES[(kind, gpu)].name
        tiles = fastest_tiles(result, M, entry, sweep)
        if keep_others and path.exists():
            earlier = json.loads(path.read_text())
            tiles = {"_note": f"{tiles['_note']}; the other shapes: {earlier.get('_note', 'an earlier sweep')}",
                     **{k: v for k, v in earlier.items() if not k.startswith("_")},
                     **{k: v for k, v in tiles.items() if not k.startswith("_")}}
        path.write_text(json.dumps(tiles, indent=1) + "\n")


def fastest_tiles(result: dict, M: int, entry: str, sweep: list) -> dict:
    """{"N,K": SkinnyConfig fields}: each swept shape's fastest tiles of `entry` at M rows (skinny.load_configs'
    format)."""
    swept_names = [name for name in SHAPES if f"{name}@{M}" in result["decode"]]
    out = {"_note": f"bench_fp8_gemm.py's fastest {entry} tiles at {M} rows of {', '.join(swept_names)}, "
                    f"{result['gpu']}, {result['date']}"}
    for name in swept_names:
        N, K = SHAPES[name]
        best = result["decode"][f"{name}@{M}"][entry]["best"]
        if best is not None:
            out[f"{N},{K}"] = swept([best], sweep)[0].__dict__
    return out


def markdown(r: dict) -> str:
    lines = [f"# FP8 weights in the projections' GEMMs — {r['gpu']}, {r['date']}", "",
             f"torch {r['torch']}, Triton {r['triton']}; copy bandwidth {r['copy_gbs']:.0f} GB/s; µs per call in "
             "CUDA graphs over rotating weight copies.", "", "A layer's four projections at decode rows:", "",
             "| model @ rows | bf16 floor | FP8 floor | cuBLAS bf16 | Triton bf16 | FP8 per column (best / default "
             "tiles) | FP8 128×128 | cuBLAS W8A8 | FP8 W8A8 kernel (best / default tiles) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for M, models in r["layer"].items():
        for model, s in models.items():
            lines.append(f"| {model} @ {M} | {s['floor_bf16']} | {s['floor_fp8']} | {s['cublas_bf16']} | "
                         f"{s['skinny_bf16']} | {s['fp8_column']} / {s['fp8_column_default']} | "
                         f"{s['fp8_block128']} | {s['w8a8']} | {s['fp8_w8a8_kernel']} / "
                         f"{s['fp8_w8a8_kernel_default']} |")
    lines += ["", "Each shape's W8A8 kernel at decode rows, its fastest tiles against today's (the tuned file's):", "",
              "| shape @ rows | FP8 floor | fastest tiles | µs | today's tiles, µs |", "|---|---:|---|---:|---:|"]
    for key, e in r["decode"].items():
        w = e["fp8_w8a8_kernel"]
        lines.append(f"| {key} | {e['floor_fp8_us']:.1f} | {w['best']} | "
                     + (f"{w['us']:.1f}" if w["us"] is not None else "—") + f" | {w['default_us']:.1f} |")
    lines += ["", "Prompt rows: cuBLAS bf16 against W8A8 (quantize + torch._scaled_mm) and the dequantized weight:", "",
              "| shape @ rows | cuBLAS bf16 | W8A8 | dequantized + cuBLAS |", "|---|---:|---:|---:|"]
    for key, e in r["prompt"].items():
        lines.append(f"| {key} | {e['cublas_bf16']:.1f} | {e['w8a8']:.1f} | {e['dequantized']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
