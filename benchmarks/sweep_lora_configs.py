"""Sweep the Triton kernels' settings on representative cases (GPU), timing shrink and expand apart.

    python benchmarks/sweep_lora_configs.py --out benchmarks/results/config_sweep.json

Times are graph replays on rotating inputs (see bench_lora_ops). Also measures the host-side
cost of one eager call, split into argument checks and the two launches.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench_lora_ops import ROTATIONS, Pool, _empty_kernel, graphed, time_us
from loraplex import ops
from loraplex.ops.lora import sgmv
from loraplex.workloads import popularity_slots

CASES = [  # (K, N, regime, batch, popularity)
    (4096, 4096, "decode", 256, "distinct"), (4096, 4096, "decode", 64, "distinct"),
    (4096, 4096, "decode", 16, "distinct"), (4096, 4096, "decode", 64, "identical"),
    (4096, 11008, "decode", 256, "distinct"), (4096, 4096, "prefill", 1, "identical"),
    (4096, 4096, "prefill", 16, "identical"), (4096, 4096, "prefill", 64, "distinct"),
    (4096, 11008, "prefill", 32, "identical"),
]


def shrink_variants(base):
    yield "default", base
    for sk in (1, 2, 4, 8):
        yield f"split_k={sk}", dataclasses.replace(base, split_k=sk)


def expand_variants(base):
    yield "default", base
    for bn, w, pps in itertools.product((64, 128, 256), (4, 8), (1, 2, 4)):
        yield f"bn={bn} w={w} pps={pps}", dataclasses.replace(base, expand_block_n=bn, expand_warps=w,
                                                              expand_programs_per_sm=pps)
    yield "tf32x3", dataclasses.replace(base, expand_precision="tf32x3")


def host_overheads(pool, gen) -> dict:
    """µs of host time per eager call (GPU work is tiny here, so the host is the bottleneck)."""
    from loraplex.ops.lora.checks import check_batch, check_slices, check_x, check_y
    x = torch.randn(16, 4096, device="cuda").bfloat16()
    y = torch.randn(16, 4096, device="cuda").bfloat16()
    batch = ops.LoraBatch.from_lengths([1] * 16, list(range(16)), "cuda")
    one = (pool.a, pool.b, batch, pool.ranks, pool.scalings)
    three = ([pool.a] * 3, [pool.b[:, :1024].contiguous()] * 3, batch, [pool.ranks] * 3, [pool.scalings] * 3)
    y3 = torch.randn(16, 3072, device="cuda").bfloat16()

    def host_us(fn, n=300):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e6

    def checks(args, yy):
        check_x(x)
        sl, n = check_slices(x, args[0], args[1], args[3], args[4])
        check_y(yy, x, sl.lora_b, 0)
        check_batch(batch, x, n)
    cfg = sgmv.config_for(16)
    part = torch.empty((1, 1, 16, 16), dtype=torch.float32, device="cuda")
    return {
        "add_lora_1_slice": host_us(lambda: ops.add_lora(y, x, *one)),
        "add_lora_3_slices": host_us(lambda: ops.add_lora(y3, x, *three)),
        "checks_1_slice": host_us(lambda: checks(one, y)),
        "checks_3_slices": host_us(lambda: checks(three, y3)),
        "sgmv_add_lora_1_slice": host_us(lambda: sgmv.add_lora(y, x, [one[0]], [one[1]], batch, [one[3]], [one[4]],
                                                               0, cfg)),
        "shrink_launch": host_us(lambda: sgmv.shrink_into(part, x, [one[0]], [one[3]], batch, cfg)),
        "expand_launch": host_us(lambda: sgmv.expand_from(y, part, [one[1]], [one[3]], [one[4]], batch, 0, cfg)),
        "empty_triton_launch": host_us(lambda: _empty_kernel[(1,)]()),
        "torch_empty": host_us(lambda: torch.empty((2, 1, 16, 16), dtype=torch.float32, device="cuda")),
        "torch_addmm_bs1": host_us(lambda: y[0:1].addmm_(x[0:1] @ pool.a[0].T, pool.b[0].T, alpha=0.5)),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("config_sweep.json"))
    p.add_argument("--host-only", action="store_true", help="only the host-side cost of eager calls")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(1)
    if args.host_only:
        hosts = host_overheads(Pool(4096, 4096, 16, 256, gen), gen)
        print("host µs per call: " + ", ".join(f"{k} {v:.1f}" for k, v in hosts.items()))
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "host_us": hosts}, indent=1))
        return
    rng = np.random.default_rng(1)
    pools = {}
    results = []
    for K, N, regime, bs, pop in CASES:
        if (K, N) not in pools:
            pools[(K, N)] = Pool(K, N, 16, 256, gen)
        pool = pools[(K, N)]
        seg_lens = [1 if regime == "decode" else 128] * bs
        slots = popularity_slots(pop, bs, rng)
        T = sum(seg_lens)
        xs = [torch.randn(T, K, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(ROTATIONS)]
        ys = [torch.randn(T, N, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(ROTATIONS)]
        batches = [ops.LoraBatch.from_lengths(seg_lens, [s + k * 256 for s in slots], "cuda")
                   for k in range(ROTATIONS)]
        base = sgmv.config_for(batches[0].block_m)
        case = f"K={K} N={N} {regime} bs={bs} {pop}"
        timings = {"full": time_us([graphed(lambda k=k: sgmv.add_lora(
            ys[k], xs[k], [pool.a], [pool.b], batches[k], [pool.ranks], [pool.scalings], 0, base))
            for k in range(ROTATIONS)])}
        split = sgmv.choose_split_k(batches[0].num_work, K, xs[0].device, base)
        parts = [torch.randn((split, 1, T, 16), device="cuda", generator=gen) for _ in range(ROTATIONS)]
        for kind, variants in (("shrink", shrink_variants(base)), ("expand", expand_variants(base))):
            for name, cfg in variants:
                def fn(k, cfg=cfg, kind=kind):
                    if kind == "shrink":
                        sk = sgmv.choose_split_k(batches[k].num_work, K, xs[k].device, cfg)
                        part = parts[k] if sk == split else torch.empty((sk, 1, T, 16), device="cuda")
                        return lambda: sgmv.shrink_into(part, xs[k], [pool.a], [pool.ranks], batches[k], cfg)
                    return lambda: sgmv.expand_from(ys[k], parts[k], [pool.b], [pool.ranks], [pool.scalings],
                                                    batches[k], 0, cfg)
                try:
                    timings[f"{kind} {name}"] = time_us([graphed(fn(k)) for k in range(ROTATIONS)])
                except Exception as exc:  # a variant that fails to compile is reported, not fatal
                    timings[f"{kind} {name}"] = None
                    print(f"  {case} {kind} {name}: {type(exc).__name__}: {str(exc)[:160]}")
        best = {}
        for kind in ("shrink", "expand"):
            ok = sorted((v, k) for k, v in timings.items() if k.startswith(kind) and v is not None)
            best[kind] = ok[:6]
        print(f"{case}: full {timings['full']:.2f}  shrink default {timings['shrink default']:.2f} best " +
              ", ".join(f"{k[7:]} {v:.2f}" for v, k in best["shrink"]) + f" | expand default "
              f"{timings['expand default']:.2f} best " + ", ".join(f"{k[7:]} {v:.2f}" for v, k in best["expand"]),
              flush=True)
        results.append(dict(case=case, split_k=split, timings=timings))
    hosts = host_overheads(pools[(4096, 4096)], gen)
    print("host µs per call: " + ", ".join(f"{k} {v:.1f}" for k, v in hosts.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results, "host_us": hosts},
                                   indent=1))


if __name__ == "__main__":
    main()
