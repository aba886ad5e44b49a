"""GPU benchmark of compositions in the LoRA op: rows that combine two adapters against the batches they could be.

Side by side in one run, bf16, Llama-2-7B's four LoRA calls of a layer (q/k/v fused, o, gate/up fused, down),
`ops.add_lora` eager and replayed from a CUDA graph, each over `--rows` decode rows:
- composed:  each row combines two distinct rank-16 adapters (weights 0.7 / 0.3): 2 × rows (row, member) entries
- single×2:  2 × rows rows, each with its own rank-16 adapter (the same entries as plain rows: the op-level target)
- merged:    rows rows, each with its own rank-32 adapter (the "cat" merge a user would build offline: same bytes)
- single:    rows rows, each with its own rank-16 adapter (what one adapter a request costs)
Times are medians of CUDA-event timings after warm-up, rotating over input and adapter sets so that L2 holds
none of them. The stacks are R = 32 wide for every variant, as one pool serving both ranks is.

    python benchmarks/bench_compose_ops.py --out benchmarks/results/compose_ops.json --md benchmarks/results/compose_ops.md
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from bench_lora_ops import ROTATIONS, graphed, time_us
from loraplex import ops

# Llama-2-7B: (K, slice widths) of the four calls of a layer
CALLS = {"qkv": (4096, (4096, 4096, 4096)), "o": (4096, (4096,)), "gate_up": (4096, (11008, 11008)),
         "down": (11008, (4096,))}
R = 32


def stacks(K: int, ns: tuple[int, ...], slots: int, gen: torch.Generator):
    a = [(torch.randn(slots, R, K, generator=gen, device="cuda") * K ** -0.5).to(torch.bfloat16) for _ in ns]
    b = [(torch.randn(slots, n, R, generator=gen, device="cuda") * R ** -0.5).to(torch.bfloat16) for n in ns]
    scal = [torch.rand(slots, generator=gen, device="cuda") + 0.5 for _ in ns]
    return a, b, scal


def variants(rows: int) -> dict[str, tuple[int, list, list | None, int]]:
    """name → (rows, slot_ids, weights, rank) per rotation block of 2 × rows slots."""
    return {"composed": (rows, [[2 * i, 2 * i + 1] for i in range(rows)], [[0.7, 0.3]] * rows, 16),
            "single×2": (2 * rows, list(range(2 * rows)), None, 16),
            "merged": (rows, list(range(rows)), None, 32),
            "single": (rows, list(range(rows)), None, 16)}


def bench(rows: int, gen: torch.Generator) -> list[dict]:
    out = []
    per_rot = 2 * rows
    for call, (K, ns) in CALLS.items():
        a, b, scal = stacks(K, ns, per_rot * ROTATIONS, gen)
        for name, (T, slots, weights, rank) in variants(rows).items():
            ranks = [torch.full((per_rot * ROTATIONS,), rank, dtype=torch.int32, device="cuda") for _ in ns]
            fns = []
            for k in range(ROTATIONS):
                shift = lambda s: [v + k * per_rot for v in s] if isinstance(s, list) else s + k * per_rot  # noqa: E731
                batch = ops.LoraBatch.from_lengths([1] * T, [shift(s) for s in slots], "cuda", weights=weights)
                x = torch.randn(T, K, generator=gen, device="cuda").to(torch.bfloat16)
                y = torch.randn(T, sum(ns), generator=gen, device="cuda").to(torch.bfloat16)
                fns.append(lambda x=x, y=y, batch=batch: ops.add_lora(y, x, a, b, batch, ranks, scal))
            eager = time_us(fns)
            replay = time_us([graphed(f) for f in fns])
            out.append(dict(call=call, variant=name, rows=T, eager_us=round(eager, 2), graph_us=round(replay, 2)))
            print(json.dumps(out[-1]), flush=True)
        del a, b, scal
    return out


def markdown(res: dict) -> str:
    by = {}
    for r in res["rows"]:
        by.setdefault(r["variant"], {})[r["call"]] = r
    lines = [f"# Compositions in the LoRA op — {res['gpu']}, {res['date']}", "",
             f"Llama-2-7B's four LoRA calls of one layer, bf16, {res['decode_rows']} decode rows; µs per layer (sum of "
             "the four calls), median of CUDA-event timings; stacks R = 32 wide.", "",
             "| variant | entries | eager µs | graph µs | graph vs composed |", "|---|---|---|---|---|"]
    total = {v: sum(c["graph_us"] for c in calls.values()) for v, calls in by.items()}
    for v, calls in by.items():
        eager = sum(c["eager_us"] for c in calls.values())
        entries = next(iter(calls.values()))["rows"] * (2 if v == "composed" else 1)
        lines.append(f"| {v} | {entries} | {eager:.1f} | {total[v]:.1f} | {total[v] / total['composed']:.3f} |")
    lines += ["", f"Targets: composed ≤ 1.1 × single×2 (the same entries as plain rows): "
              f"{total['composed'] / total['single×2']:.3f}×; composed vs merged rank 32: "
              f"{total['composed'] / total['merged']:.3f}×."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--out")
    ap.add_argument("--md")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), decode_rows=args.rows,
               rows=bench(args.rows, gen))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    table = markdown(res)
    print(table)
    if args.md:
        Path(args.md).write_text(table)


if __name__ == "__main__":
    main()
