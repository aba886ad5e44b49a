"""A decode projection with its LoRA on the GPU: ops/skinny_lora.py's one launch (and its parts apart) against the
GEMM alone and the GEMM followed by the SGMV shrink and expand, at Llama-2-7B's four projection shapes, 32 rows
each with its own rank-16 adapter.

Each timing replays a CUDA graph of calls on rotating copies of the weight and of the adapters' A and B (together
well past the L2, as in a forward, where every layer reads its own), so a call's time is what it takes to stream
them from HBM. The floor: the weight's bytes plus the 32 adapters' A and B, over the copy bandwidth measured in
the same run. Parts (the kernel's PARTS): "no_expand" (shrink and wait), "no_wait" (shrink and expand, the GEMM's
programs not waiting: their products are wrong, only the time counts), "expand_only" (no shrink, no wait) and
"idle" (the LoRA programs do nothing).

    python benchmarks/bench_skinny_lora.py --out benchmarks/results/skinny_lora.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import copy_bandwidth_gbs, time_us  # noqa: E402

from loraplex.ops.lora import sgmv
from loraplex.ops.gemm import skinny_lora  # noqa: E402
from loraplex.ops.lora.batch import LoraBatch  # noqa: E402
from loraplex.ops.gemm.skinny import skinny_linear  # noqa: E402

# name -> (K, slice widths)
SHAPES = {"qkv": (4096, (4096, 4096, 4096)), "o": (4096, (4096,)), "gate_up": (4096, (11008, 11008)),
          "down": (11008, (4096,))}
PARTS = {"fused": 7, "no_expand": 3, "no_wait": 5, "expand_only": 4, "idle": 0}
ROTATION_BYTES = 600 << 20
SLOTS, RANK, ROWS = 64, 16, 32


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default="gemm,sgmv," + ",".join(PARTS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    dtype, dev = torch.bfloat16, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    bandwidth = copy_bandwidth_gbs()
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), torch=torch.__version__,
                  rows=ROWS, rank=RANK, copy_gbs=round(bandwidth), shapes={})
    lora = LoraBatch.from_lengths([1] * ROWS, list(range(ROWS)), dev, block_m=16)
    ranks = torch.full((SLOTS,), RANK, dtype=torch.int32, device=dev)
    scalings = torch.full((SLOTS,), 0.5, dtype=torch.float32, device=dev)
    for name in args.shapes.split(","):
        K, widths = SHAPES[name]
        N = sum(widths)
        per_copy = (N * K + SLOTS * RANK * (K * len(widths) + N)) * 2
        copies = max(2, ROTATION_BYTES // per_copy)
        ws = [torch.randn(N, K, generator=g, device=dev).to(dtype) * K ** -0.5 for _ in range(copies)]
        As = [[torch.randn(SLOTS, RANK, K, generator=g, device=dev).to(dtype) * K ** -0.5 for _ in widths]
              for _ in range(copies)]
        Bs = [[torch.randn(SLOTS, n, RANK, generator=g, device=dev).to(dtype) * 0.25 for n in widths]
              for _ in range(copies)]
        x = torch.randn(ROWS, K, generator=g, device=dev).to(dtype)
        y = torch.empty(ROWS, N, dtype=dtype, device=dev)
        floor_bytes = (N * K + ROWS * RANK * (K * len(widths) + N)) * 2
        row = dict(copies=copies, floor_us=round(floor_bytes / bandwidth / 1e3, 2), us={})

        def calls(variant: str) -> list:
            if variant == "gemm":
                return [lambda i=i: skinny_linear(x, ws[i], out=y) for i in range(copies)]
            if variant == "sgmv":
                return [lambda i=i: sgmv.add_lora(skinny_linear(x, ws[i], out=y), x, As[i], Bs[i], lora,
                                                  [ranks] * len(widths), [scalings] * len(widths), 0)
                        for i in range(copies)]
            return [lambda i=i: skinny_lora.skinny_lora_linear(x, ws[i], None, As[i], Bs[i], lora,
                                                               [ranks] * len(widths), [scalings] * len(widths),
                                                               out=y, parts=PARTS[variant]) for i in range(copies)]

        ref = None
        for variant in args.variants.split(","):
            fns = calls(variant)
            skinny_lora._workspace(x.device, 16, N)[2].zero_()   # parts without the waits leave the counters off zero
            for f in fns:   # warm-up (compiles, allocates workspaces) outside the capture
                f()
            torch.cuda.synchronize()
            if variant in ("sgmv", "fused"):
                out = y.clone()
                if ref is None:
                    ref = out
                else:
                    row["fused_vs_sgmv_max_abs"] = (out.float() - ref.float()).abs().max().item()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for f in fns:
                    f()
            us = time_us([graph.replay], target_ms=20, reps=7) / copies
            row["us"][variant] = round(us, 2)
            print(f"{name:8s} {variant:12s} {us:8.2f} µs (floor {row['floor_us']})", flush=True)
            del graph
        result["shapes"][name] = row
        ws = As = Bs = None   # the copies freed before the next shape
        torch.cuda.empty_cache()
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
