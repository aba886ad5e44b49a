"""GPU probe: does the decode attention kernel read the KV cache faster head-major, and with which tiles?

At the unlimited batch the decode step is mostly attention (a 160-row Llama-2-7B forward at context
512 spent 12.5 of ~17.5 ms in `_decode_kernel`, reading K/V at ~3.4 TB/s against a ~4.2 TB/s copy:
results/decode_kernels_b160.txt). A token-major cache (`[num_blocks, block_size, Hkv, D]` contiguous)
gives each (token, kv head) 256 contiguous bytes, strided by Hkv · D; a head-major one (`[num_blocks,
Hkv, block_size, D]`, viewed in the ops' order, as `KVCache` now keeps it) gives each (block, kv head)
block_size · 256 bytes. This times `attention_kernels.decode` on both layouts and a few tile settings
(`DecodeConfig`), replayed from CUDA graphs, on Llama-2-7B and Llama-3-8B head shapes, contexts drawn
around a mean, pages shuffled across sequences; also the prefill kernel on both layouts. Every output
is checked against the reference backend on the same inputs.

    python benchmarks/probe_kv_layout.py --out benchmarks/results/probe_kv_layout.json
    TRITON_INTERPRET=1 python benchmarks/probe_kv_layout.py --smoke   # tiny shapes on the CPU, no timing
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lora_ops import copy_bandwidth_gbs, graphed, time_us  # noqa: E402
from loraplex import ops  # noqa: E402
from loraplex.ops.attention import kernels as ak  # noqa: E402

PAGE = 16
DEVICE, DTYPE = "cuda", torch.bfloat16  # --smoke: "cpu", float16 (Triton's interpreter)
SETS = 2  # input sets per case, used round robin (each > L2 at these sizes)
CASES = [  # name, Hq, Hkv, D, sequences, mean context
    ("llama2-7b", 32, 32, 128, 32, 512), ("llama2-7b", 32, 32, 128, 32, 1024),
    ("llama2-7b", 32, 32, 128, 160, 512), ("llama2-7b", 32, 32, 128, 160, 1024),
    ("llama3-8b", 32, 8, 128, 160, 1024),
]
BASE = ak.DECODE_CONFIGS[128]
VARIANTS = {  # name: (config, forced splits or None for the plan's)
    "base": (BASE, None),
    "n64_st4": (dataclasses.replace(BASE, num_stages=4), None),
    "n32_st4": (dataclasses.replace(BASE, block_n=32, num_stages=4), None),
    "n32_st6": (dataclasses.replace(BASE, block_n=32, num_stages=6), None),
    "n128_st2": (dataclasses.replace(BASE, block_n=128, num_stages=2), None),
    "n128_w8_st2": (dataclasses.replace(BASE, block_n=128, num_warps=8, num_stages=2), None),
    "n64_w2": (dataclasses.replace(BASE, num_warps=2), None),
    "split2": (BASE, 2),
    "split4": (BASE, 4),
}


def _randn(shape) -> torch.Tensor:
    """bf16 normal values drawn on the GPU (GBs of them: the CPU would take minutes)."""
    return torch.randn(shape, device=DEVICE, dtype=DTYPE)


class DecodeInputs:
    """SETS sets of S one-row sequences over one shared cache in the given layout, pages shuffled."""

    def __init__(self, Hq: int, Hkv: int, D: int, S: int, ctx: int, head_major: bool, gen: torch.Generator):
        lens = torch.randint(ctx // 2, ctx * 3 // 2 + 1, (SETS, S), generator=gen)
        pages = (lens + PAGE - 1) // PAGE
        nb = int(pages.sum())
        shape = (nb, Hkv, PAGE, D) if head_major else (nb, PAGE, Hkv, D)
        self.k_cache, self.v_cache = [_randn(shape) for _ in range(2)]
        if head_major:
            self.k_cache, self.v_cache = self.k_cache.transpose(1, 2), self.v_cache.transpose(1, 2)
        order = torch.randperm(nb, generator=gen)
        width = int(pages.max())
        self.sets = []
        used = 0
        for i in range(SETS):
            tables = torch.zeros((S, width), dtype=torch.int32)
            for s in range(S):
                n = int(pages[i, s])
                tables[s, :n] = order[used:used + n].to(torch.int32)
                used += n
            q = _randn((S, Hq, D))
            self.sets.append(dict(q=q, tables=tables.to(DEVICE), seq_lens=lens[i].to(DEVICE, torch.int32),
                                  out=torch.empty_like(q)))
        self.query_start = torch.arange(S + 1, dtype=torch.int32, device=DEVICE)
        self.max_seq_len = int(lens.max())
        self.kv_bytes = [int(lens[i].sum()) * Hkv * D * 2 * 2 for i in range(SETS)]

    def launch(self, i: int, cfg: ak.DecodeConfig, splits: int | None, scale: float):
        st = self.sets[i]
        return lambda: ak.decode(st["q"], self.k_cache, self.v_cache, st["tables"], st["seq_lens"], self.query_start,
                                 st["out"], max_seq_len=self.max_seq_len, scale=scale, window=0, num_splits=splits,
                                 cfg=cfg)

    def reference(self, i: int, scale: float) -> torch.Tensor:
        st = self.sets[i]
        return ops.paged_attention(st["q"], self.k_cache, self.v_cache, st["tables"], st["seq_lens"],
                                   self.query_start, max_query_len=1, max_seq_len=self.max_seq_len, scale=scale,
                                   backend="reference").float()


def time_decode(name: str, Hq: int, Hkv: int, D: int, S: int, ctx: int, copy_gbs: float,
                gen: torch.Generator) -> list[dict]:
    rows = []
    scale = D ** -0.5
    for head_major in (False, True):
        inputs = DecodeInputs(Hq, Hkv, D, S, ctx, head_major, gen)
        refs = [inputs.reference(i, scale) for i in range(SETS)]
        for variant, (cfg, splits) in VARIANTS.items():
            fns = [inputs.launch(i, cfg, splits, scale) for i in range(SETS)]
            fns = fns if DEVICE == "cpu" else [graphed(f) for f in fns]
            for f in fns:
                f()
            if DEVICE != "cpu":
                torch.cuda.synchronize()
            diff = max(float((inputs.sets[i]["out"].float() - refs[i]).abs().max()) for i in range(SETS))
            us = time_us(fns) if DEVICE != "cpu" else float("nan")
            gbs = sum(inputs.kv_bytes) / SETS / us / 1e3
            row = dict(model=name, seqs=S, mean_context=ctx, layout="head-major" if head_major else "token-major",
                       variant=variant, block_n=cfg.block_n, warps=cfg.num_warps, stages=cfg.num_stages,
                       splits=splits, us=round(us, 2), kv_gbs=round(gbs, 1), of_copy=round(gbs / copy_gbs, 3),
                       max_abs_diff=diff)
            rows.append(row)
            print(f"decode {name} S={S:4d} ctx~{ctx:5d} {row['layout']:11s} {variant:12s} {us:8.1f} µs "
                  f"{gbs:7.0f} GB/s ({gbs / copy_gbs:.2f} of copy) diff {diff:.1e}", flush=True)
        del inputs
        if DEVICE != "cpu":
            torch.cuda.empty_cache()
    return rows


def time_prefill(copy_gbs: float, gen: torch.Generator) -> list[dict]:
    """8 sequences × 512 new tokens over 512 cached ones, Llama-2-7B heads, both layouts."""
    rows = []
    Hq = Hkv = 32 if DEVICE != "cpu" else 2
    D, S, new, cached = (128, 8, 512, 512) if DEVICE != "cpu" else (32, 2, 24, 40)
    L = new + cached
    nb = S * L // PAGE
    scale = D ** -0.5
    for head_major in (False, True):
        shape = (nb, Hkv, PAGE, D) if head_major else (nb, PAGE, Hkv, D)
        caches = [_randn(shape) for _ in range(2)]
        if head_major:
            caches = [c.transpose(1, 2) for c in caches]
        tables = torch.randperm(nb, generator=gen).to(torch.int32).view(S, L // PAGE).to(DEVICE)
        q = _randn((S * new, Hq, D))
        seq_lens = torch.full((S,), L, dtype=torch.int32, device=DEVICE)
        query_start = torch.arange(0, S * new + 1, new, dtype=torch.int32, device=DEVICE)
        out = torch.empty_like(q)
        fn = lambda: ak.prefill(q, *caches, tables, seq_lens, query_start, out, scale=scale, window=0)  # noqa: E731
        fn()
        ref = ops.paged_attention(q, *caches, tables, seq_lens, query_start, max_query_len=new, max_seq_len=L,
                                  scale=scale, backend="reference").float()
        diff = float((out.float() - ref).abs().max())
        us = time_us([fn]) if DEVICE != "cpu" else float("nan")
        flops = 4 * S * Hq * D * sum(cached + i + 1 for i in range(new))
        row = dict(kind="prefill", layout="head-major" if head_major else "token-major", us=round(us, 2),
                   tflops=round(flops / us / 1e6, 1), max_abs_diff=diff)
        rows.append(row)
        print(f"prefill 8x512 over 512 {row['layout']:11s} {us:8.1f} µs {row['tflops']:6.1f} TFLOP/s diff {diff:.1e}",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/probe_kv_layout.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1), no timing")
    args = parser.parse_args()
    global DEVICE, DTYPE, CASES
    if args.smoke:
        DEVICE, DTYPE, CASES = "cpu", torch.float16, [("tiny-gqa", 4, 2, 32, 3, 40), ("tiny-mha", 2, 2, 32, 2, 70)]
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs() if DEVICE != "cpu" else float("nan")
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    for case in CASES:
        rows += time_decode(*case, copy_gbs, gen)
    prefill = time_prefill(copy_gbs, gen)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        worst = max(r["max_abs_diff"] for r in rows + prefill)
        print(f"smoke: worst difference from the reference {worst:.1e}")
        if not worst < 1e-2:
            raise SystemExit("smoke: outputs differ from the reference")
        return
    args.out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                                        torch=torch.__version__, page=PAGE, copy_gbs=copy_gbs, decode=rows,
                                        prefill=prefill), indent=1))


if __name__ == "__main__":
    main()
