"""Decode-step projections on the GPU: cuBLAS (torch.nn.functional.linear, with PyTorch's BLAS settings) against
`ops.skinny_gemm.skinny_linear` over a sweep of its tiles, at Llama-2-7B's four projection shapes.

Each timing replays a CUDA graph of calls on rotating copies of the weight (together well past the 60 MB L2, as
in a forward, where every layer reads its own weights), so a call's time is what it takes to stream its weight
from HBM; the floor is the weight's bytes over the copy bandwidth measured in the same run. Then a layer's four
projections in order (qkv, o, gate/up, down) over as many layers as the rotation has copies, each system with its
best config per shape. Every skinny config is checked against cuBLAS's output first (bf16: relative error ≤ 1e-2;
it sums in fp32 in another order).

    python benchmarks/bench_skinny_gemm.py --out benchmarks/results/skinny_gemm.json \
        --md benchmarks/results/skinny_gemm.md
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import copy_bandwidth_gbs, time_us  # noqa: E402

from loraplex import envs  # noqa: E402
from loraplex.ops.gemm.skinny import SkinnyConfig, launched_config, skinny_linear  # noqa: E402

# Llama-2-7B: name -> (N, K) of the weight
SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
          "lm_head": (32000, 4096)}
LAYER = ("qkv", "o", "gate_up", "down")   # a decoder layer's projections, in order
ROTATION_BYTES = 600 << 20   # each shape's copies together, ten times the L2
# (a config whose tiles need more shared memory than the GPU has at a row count is reported as skipped there:
# skinny_linear would launch it cut down by fit_config, not as named; 128 × 256 tiles on an H200, for one)
SWEEP = [SkinnyConfig(block_n=bn, block_k=bk, split_k=s, stages=st, warps=w)
         for bn, bk, s, st, w in itertools.product((64, 128), (128, 256), (1, 2, 4, 8), (3, 4), (4,))]
# settings of PyTorch's own GEMM to try beside its default
BLAS = ("default", "cublaslt", "cublas", "no_reduced_precision")


@contextlib.contextmanager
def blas_setting(name: str):
    """PyTorch's BLAS choice for the GEMMs captured inside (its preferred library, or split-K's bf16 reduction)."""
    m = torch.backends.cuda.matmul
    if name == "no_reduced_precision":
        old = m.allow_bf16_reduced_precision_reduction
        m.allow_bf16_reduced_precision_reduction = False
        try:
            yield
        finally:
            m.allow_bf16_reduced_precision_reduction = old
        return
    if name == "default":
        yield
        return
    old = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(old)


def graph_of(calls: list) -> torch.cuda.CUDAGraph:
    for c in calls:   # warm-up (compiles, allocates the split-K workspaces) outside the capture
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return g


def per_call_us(calls: list) -> float:
    if SMOKE:   # the CPU smoke run: wall time of one pass (Triton's interpreter compiles nothing to warm up)
        start = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - start) * 1e6 / len(calls)
    g = graph_of(calls)
    return time_us([g.replay], target_ms=20, reps=7) / len(calls)


# --smoke: the whole script on the CPU (Triton's interpreter, fp16, shapes 1/128th, two configs, few rows), for CI
SMOKE = False
DEVICE, DTYPE = "cuda", torch.bfloat16


def _smoke_settings() -> None:
    global SMOKE, DEVICE, DTYPE, SHAPES, SWEEP, BLAS, ROTATION_BYTES
    SMOKE, DEVICE, DTYPE = True, "cpu", torch.float16
    SHAPES = {name: (n // 128, k // 128) for name, (n, k) in SHAPES.items()}
    SWEEP = [SkinnyConfig(block_n=16, block_k=16, split_k=s, stages=1) for s in (1, 2)]
    BLAS, ROTATION_BYTES = ("default",), 0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="32,16,8,1", help="M values; the first gets the full sweep")
    ap.add_argument("--top", type=int, default=3, help="configs per shape retried at the other row counts")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--configs-out", type=Path,
                    help="the fastest config per shape at the first row count, as LORAPLEX_SKINNY_CONFIGS reads it")
    ap.add_argument("--smoke", action="store_true", help="a CPU run of everything at toy sizes (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        _smoke_settings()
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    copy_gbs = 1.0 if SMOKE else copy_bandwidth_gbs()
    result = dict(gpu="cpu (smoke run)" if SMOKE else torch.cuda.get_device_name(),
                  date=datetime.date.today().isoformat(), torch=torch.__version__,
                  triton=__import__("triton").__version__, settings=envs.snapshot(), copy_gbs=copy_gbs, shapes={},
                  layer={})
    weights = {}
    for name, (N, K) in SHAPES.items():
        copies = max(2, -(-ROTATION_BYTES // (N * K * 2)))
        weights[name] = [torch.randn(N, K, device=DEVICE).to(DTYPE) * K ** -0.5 for _ in range(copies)]
    best: dict[str, list[SkinnyConfig]] = {}   # per shape, the first row count's fastest configs, fastest first
    for M in rows:
        for name, (N, K) in SHAPES.items():
            ws = weights[name]
            x = torch.randn(M, K, device=DEVICE).to(DTYPE)
            outs = [torch.empty(M, N, device=DEVICE, dtype=DTYPE) for _ in ws]
            floor_us = N * K * 2 / copy_gbs / 1e3
            entry = dict(N=N, K=K, floor_us=floor_us, blas={}, skinny={})
            for blas in BLAS if M == rows[0] else ("default",):
                try:
                    with blas_setting(blas):
                        us = per_call_us([lambda w=w, o=o: torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)])
                    entry["blas"][blas] = round(us, 2)
                except (RuntimeError, AttributeError) as e:   # a setting this torch or GPU lacks
                    entry["blas"][blas] = repr(e)[:200]
            ref = torch.nn.functional.linear(x, ws[0]).float()
            configs = SWEEP if M == rows[0] else best.get(name, [])
            for cfg in configs:
                key = f"n{cfg.block_n}_k{cfg.block_k}_s{cfg.split_k}_st{cfg.stages}_w{cfg.warps}"
                if launched_config(cfg, M, x) != cfg:
                    entry["skinny"][key] = dict(error="its tiles need more shared memory than the GPU has")
                    continue
                try:
                    got = skinny_linear(x, ws[0], config=cfg).float()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    if not err <= 1e-2:
                        entry["skinny"][key] = dict(error=f"relative error {err:.2e} against cuBLAS")
                        continue
                    us = per_call_us([lambda w=w, o=o, c=cfg: skinny_linear(x, w, out=o, config=c)
                                      for w, o in zip(ws, outs)])
                    entry["skinny"][key] = dict(us=round(us, 2), rel_err=err, config=cfg.__dict__)
                except Exception as e:  # noqa: BLE001 - one config's failure (resources, compile) is reported
                    entry["skinny"][key] = dict(error=repr(e)[:300])
            timed = sorted((v["us"], k) for k, v in entry["skinny"].items() if "us" in v)
            if M == rows[0]:
                best[name] = [SkinnyConfig(**entry["skinny"][k]["config"]) for _, k in timed[:args.top]]
            entry["best"] = timed[0][1] if timed else None
            cublas = entry["blas"].get("default")
            if timed and isinstance(cublas, float):
                entry["best_over_cublas"] = round(timed[0][0] / cublas, 3)
                entry["cublas_of_floor"] = round(floor_us / cublas, 3)
                entry["best_of_floor"] = round(floor_us / timed[0][0], 3)
            result["shapes"][f"{name}@{M}"] = entry
            print(f"{name:8s} M={M:3d} floor {floor_us:6.1f} µs  cuBLAS {entry['blas']}  best skinny "
                  f"{timed[0] if timed else None}", flush=True)
            if args.out:
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    # a layer's four projections in order, over as many layers as every shape has copies, at the first row count
    M = rows[0]
    xs = {name: torch.randn(M, SHAPES[name][1], device=DEVICE).to(DTYPE) for name in LAYER}
    layers = min(len(weights[name]) for name in LAYER)
    for system in ("cublas", "skinny"):
        calls = []
        for i in range(layers):
            for name in LAYER:
                w, x = weights[name][i], xs[name]
                if system == "cublas":
                    calls.append(lambda w=w, x=x: torch.nn.functional.linear(x, w))
                else:
                    if not best.get(name):
                        break
                    calls.append(lambda w=w, x=x, c=best[name][0]: skinny_linear(x, w, config=c))
        if len(calls) == 4 * layers:
            result["layer"][system] = round(per_call_us(calls) * 4, 2)
    result["layer"]["floor_us"] = sum(SHAPES[name][0] * SHAPES[name][1] * 2 for name in LAYER) / copy_gbs / 1e3
    print("layer µs", result["layer"], flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.md:
        args.md.write_text(markdown(result))
    if args.configs_out:
        args.configs_out.write_text(json.dumps({f"{N},{K}": best[name][0].__dict__ for name, (N, K) in SHAPES.items()
                                                if best.get(name)}, indent=1) + "\n")


def markdown(result: dict) -> str:
    lines = [f"# Decode projections: cuBLAS against skinny_linear — {result['gpu']}, {result['date']}", "",
             f"torch {result['torch']}, Triton {result['triton']}; copy bandwidth {result['copy_gbs']:.0f} GB/s; "
             "per call, CUDA graphs over rotating weight copies (past the L2).", "",
             "| shape @ rows | floor µs | cuBLAS µs | best skinny µs | config | skinny / cuBLAS |",
             "|---|---:|---:|---:|---|---:|"]
    for key, e in result["shapes"].items():
        b = e.get("best")
        us = e["skinny"][b]["us"] if b else None
        cub = e["blas"].get("default")
        lines.append(f"| {key} | {e['floor_us']:.1f} | {cub if isinstance(cub, float) else '–'} | "
                     f"{us if us else '–'} | {b or '–'} | {e.get('best_over_cublas', '–')} |")
    lay = result.get("layer", {})
    if lay:
        lines += ["", "A layer's four projections (in order, over the rotation's layers): "
                      f"cuBLAS {lay.get('cublas')} µs, skinny {lay.get('skinny')} µs, "
                      f"floor {lay.get('floor_us', 0):.1f} µs."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
