"""Probe: what would a decode step's LoRA cost if it rode inside the projections' GEMMs? (one H200 run)

Today each projection's LoRA is its own small kernels (shrink, expand; then a zero fill too), each a few µs of
dependent loads for a few MB (benchmarks/NOTES.md): at batch 32 with distinct adapters they add ~1.85 ms
to a 6.5 ms Llama-2-7B decode forward, against 0.6 ms of adapter bytes. If the batch's C adapters were
kept side by side ("active" copies, C = the batch bound), their weights could join the GEMM itself:

- N-augmented: the projection's weight gets the C adapters' A rows below it, `[N + S·C·r, K]` (S slices,
  rows in [slice][adapter][r] order), so one GEMM returns the base output and every adapter's shrink;
  row m's own shrink is its adapter's r columns. Then an expand adds `s · v @ Bᵀ` into the base columns.
- K-augmented (o and down): the input gets each row's scaled shrink in its adapter's block of C·r
  extra columns (zero elsewhere), the weight gets the C adapters' B side by side, `[N, K + C·r]`, so the
  projection's own GEMM adds the expand; the shrink is a small GEMM before it.

This script times, per batch size M with M distinct adapters (C = M), the four projections of all 32
layers in one CUDA graph, one stream (no attention, norms or other ops: only what differs):

    plain     the four GEMMs (the backbone)
    sgmv      GEMM, then sgmv.add_lora in place (shrink + expand kernels after it)
    full      ops/overlap.py's "full" path beside the GEMM (shrink and expand on a side stream;
              the consumer's add of the product is not counted)
    naug      N-augmented GEMM, then sgmv's expand reading each row's shrink from the GEMM's output
    naug-rope as naug, without q/k/v's expand (which RoPE would do as it loads q/k/v, as today)
    cublas    N-augmented GEMM, then per slice a masked scale and an addmm into the base columns
    kaug      q/k/v and gate/up as naug-rope and naug, o and down K-augmented (shrink GEMM, masked
              scale into the input's extra columns, one GEMM)

and checks each design's layer-0 outputs against a float64 loop of `x @ Wᵀ + s · (x @ Aᵀ) @ Bᵀ` per row.

    python benchmarks/probe_lora_in_gemm.py --out benchmarks/results/probe_lora_in_gemm.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import copy_bandwidth_gbs, time_us  # noqa: E402

from loraplex.ops.lora import overlap
from loraplex.ops.lora import sgmv  # noqa: E402
from loraplex.ops.lora.batch import LoraBatch  # noqa: E402

R = 16
DEV, DTYPE = "cuda", torch.bfloat16


def projections(hidden: int, inter: int) -> tuple:
    """(name, input width K, slice widths): the projection's output is its slices side by side."""
    return (("qkv", hidden, (hidden,) * 3), ("o", hidden, (hidden,)), ("gate_up", hidden, (inter, inter)),
            ("down", inter, (hidden,)))


PROJS = projections(4096, 11008)   # Llama-2-7B; --tiny: a CPU check of the layouts in Triton's interpreter
DESIGNS = ("plain", "sgmv", "full", "naug", "naug-rope", "cublas", "kaug")


class Layer:
    """One layer's four projections with C active adapters, in every layout the designs read."""

    def __init__(self, C: int, gen: torch.Generator) -> None:
        self.C = C
        self.p = {}
        for name, K, ns in PROJS:
            N, S = sum(ns), len(ns)
            w = torch.empty(N + S * C * R, K, device=DEV, dtype=DTYPE).normal_(0, K ** -0.5, generator=gen)
            a = [w[N + i * C * R:N + (i + 1) * C * R].view(C, R, K) for i in range(S)]   # views of the tail
            b = [torch.empty(C, n, R, device=DEV, dtype=DTYPE).normal_(0, 0.05, generator=gen) for n in ns]
            d = dict(K=K, ns=ns, N=N, S=S, w_ext=w, w=w[:N], a=a, b=b,
                     b_cat=[bi.permute(1, 0, 2).reshape(bi.shape[1], C * R).contiguous() for bi in b])
            if S == 1:   # K-augmented copies: weight [N, K + C·r] = [W | B_cat]
                d["w_kaug"] = torch.cat([w[:N], d["b_cat"][0]], dim=1).contiguous()
                d["a_cat"] = w[N:].contiguous()                       # [C·r, K]
            self.p[name] = d


def _capturing() -> bool:
    return DEV == "cuda" and torch.cuda.is_current_stream_capturing()


def make_inputs(M: int, gen: torch.Generator) -> dict:
    inputs = {}
    for name, K, _ in PROJS:
        x = torch.empty(M, K + M * R, device=DEV, dtype=DTYPE)   # room for K-augmentation
        x[:, :K].normal_(0, 1, generator=gen)
        inputs[name] = x
    return inputs


def run_design(design: str, layers: list[Layer], xs: dict, batch: LoraBatch, ranks, scalings, mask_scale) -> list:
    """One forward's projections over every layer; returns layer 0's outputs [(name, y)] for the check."""
    C = layers[0].C
    cfg = sgmv.config_for(batch.block_m)
    outs = []
    for li, layer in enumerate(layers):
        for name, K, ns in PROJS:
            d, x_full = layer.p[name], xs[name]
            x = x_full[:, :K]
            N, S = d["N"], d["S"]
            rk, sc = [ranks] * S, [scalings] * S
            if design == "plain":
                y = F.linear(x, d["w"])
            elif design == "sgmv":
                y = sgmv.add_lora(F.linear(x, d["w"]), x, d["a"], d["b"], batch, rk, sc, 0, cfg)
            elif design == "full":
                y, delta = overlap.linear_with_lora_delta(x, d["w"], None, d["a"], d["b"], batch, rk, sc,
                                                          side=_capturing())
                if li == 0 and not _capturing():
                    y = (y.float() + delta.dense()).to(y.dtype)   # the consumer's add, for the check only
            elif design in ("naug", "naug-rope") or (design == "kaug" and S > 1):
                y_ext = F.linear(x, d["w_ext"])
                if not (design != "naug" and name == "qkv"):
                    # row m's adapter is active index m: its shrink of slice i sits at column N + i·C·r + m·r
                    part = y_ext.as_strided((1, S, x.shape[0], R), (1, C * R, y_ext.stride(0) + R, 1), N)
                    sgmv.expand_from(y_ext, part, d["b"], rk, sc, batch, 0, cfg)
                y = y_ext[:, :N]
            elif design == "cublas":
                y_ext = F.linear(x, d["w_ext"])
                col = 0
                for i, n in enumerate(ns):
                    v = y_ext[:, N + i * C * R:N + (i + 1) * C * R] * mask_scale
                    y_ext[:, col:col + n].addmm_(v, d["b_cat"][i].t())
                    col += n
                y = y_ext[:, :N]
            elif design == "kaug":   # o and down: shrink GEMM, masked scale into x's extra columns, one GEMM
                torch.mul(F.linear(x, d["a_cat"]), mask_scale, out=x_full[:, K:K + C * R])
                y = F.linear(x_full[:, :K + C * R], d["w_kaug"])
            else:
                raise ValueError(design)
            if li == 0:
                outs.append((name, y))
    return outs


def reference(layer: Layer, xs: dict, scalings: torch.Tensor) -> dict:
    """float64 loop: y[m] = x[m] @ Wᵀ + s[m] · (x[m] @ A_i[m]ᵀ) @ B_i[m]ᵀ per slice i."""
    out = {}
    for name, K, ns in PROJS:
        d = layer.p[name]
        x = xs[name][:, :K].double()
        y = x @ d["w"].double().t()
        col = 0
        for i, n in enumerate(ns):
            for m in range(x.shape[0]):
                v = x[m] @ d["a"][i][m].double().t()
                y[m, col:col + n] += float(scalings[m]) * (d["b"][i][m].double() @ v)
            col += n
        out[name] = y
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="16,32,64,128")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="CPU (TRITON_INTERPRET=1): check the layouts, time nothing")
    args = ap.parse_args(argv)
    global PROJS, DEV, DTYPE
    if args.tiny:
        PROJS, DEV, DTYPE = projections(64, 96), "cpu", torch.float32
    saved = overlap.MAX_ROWS, overlap.SHRINK_MAX_ROWS
    overlap.MAX_ROWS = overlap.SHRINK_MAX_ROWS = 1 << 30   # "full" at every batch size (restored below)
    try:
        return _run(args)
    finally:
        overlap.MAX_ROWS, overlap.SHRINK_MAX_ROWS = saved


def _run(args) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(0)
    copy_gbs = 1.0 if args.tiny else copy_bandwidth_gbs()
    name = "cpu" if args.tiny else torch.cuda.get_device_name()
    print(f"{name}: copy {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    for M in (int(b) for b in args.batches.split(",")):
        layers = [Layer(M, gen) for _ in range(args.layers)]
        xs = make_inputs(M, gen)
        batch = LoraBatch.from_lengths([1] * M, list(range(M)), DEV, block_m=16)
        ranks = torch.full((M,), R, dtype=torch.int32, device=DEV)
        scalings = torch.rand(M, generator=gen, device=DEV, dtype=torch.float32) + 0.5
        mask_scale = torch.zeros(M, M * R, device=DEV, dtype=DTYPE)
        for m in range(M):
            mask_scale[m, m * R:(m + 1) * R] = scalings[m]
        ref = reference(layers[0], xs, scalings)
        base_bytes = sum(d["w"].numel() * 2 for la in layers for d in la.p.values())
        lora_bytes = sum((sum(t.numel() for t in d["a"]) + sum(t.numel() for t in d["b"])) * 2
                         for la in layers for d in la.p.values())
        for design in DESIGNS:
            fn = lambda: run_design(design, layers, xs, batch, ranks, scalings, mask_scale)  # noqa: E731
            with torch.inference_mode():
                outs = fn()
                errs = {name: ((y.double() - ref[name]).abs().max() / ref[name].abs().max()).item()
                        for name, y in outs if design != "plain" and not (design in ("naug-rope", "kaug")
                                                                           and name == "qkv")}
                if args.tiny:
                    us = 0.0
                else:
                    fn()
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        fn()
                    us = time_us([graph.replay], target_ms=30, reps=7)
                    del graph
            floor = (base_bytes + (0 if design == "plain" else lora_bytes)) / copy_gbs / 1e3
            rows.append(dict(batch=M, design=design, graph_us=us, floor_us=floor, max_rel_err=errs))
            worst = max(errs.values()) if errs else 0.0
            if worst > (1e-4 if args.tiny else 3e-2):   # fp32 on the CPU, bf16 on the GPU: beyond is a mistake
                raise SystemExit(f"M={M} {design}: relative error {worst:.1e} against the float64 loop: {errs}")
            print(f"M={M:4d} {design:10s} {us:8.0f} µs  floor {floor:7.0f} µs  worst rel err {worst:.1e}", flush=True)
        layers = xs = None   # freed before the next batch size
        if not args.tiny:
            torch.cuda.empty_cache()
    result = dict(gpu=name, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, layers=args.layers, rank=R, copy_gbs=copy_gbs, rows=rows)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
