"""The prompt tiles' LoRA kernels alone, per projection of Llama-2-7B, for LORAPLEX_LORA_PREFILL values (GPU probe).

Issue 5's engine benchmark (batch 32, prompts 128–512) spends ~10 ms more a mixed step with distinct adapters than
with none, and the expand's read-modify-write of each projection's output is most of it: ~50% of the copy
bandwidth in eager forwards (results/probe_prefill_lora_*.json). Two suspects, both measured here:
- the decode rows such a step carries (each its own adapter) are tiles of one row in the 64-row config, which runs
  them through the tile product ("rows": the row-wise paths take tiles of up to ROWWISE_MAX_ROWS rows);
- each step's y tile passes through registers (loaded a step ahead), so few bytes are in flight an SM:
  "ts<stages>" pipelines the column loop with Triton's `tl.range` instead (y's loads become asynchronous copies
  into shared memory), "epps8" asks for more programs, n32 halves the registers a program. A row records the
  registers and spills of the expand kernels first compiled for it (None where its kernels had been compiled for
  an earlier row: "epps8" changes only the grid; on the H200 the default's were 126–128, four programs an SM; an
  offline ptxas run without the launch's specializations had suggested ~220).

Cases: `mixed` (six 300-token prompts and 20 decode rows, each sequence its own adapter: the engine's mixed steps)
and `prompts` (six 320-token prompts). For each case, projection (q/k/v, o, gate/up, down: their slices and K) and
value: the shrink's and the expand's µs, each a CUDA-graph replay over rotating x and y (past the L2), and the
in-place read-modify-write of the same y columns by PyTorch (`y.add_(1)`, the bandwidth floor of the expand).
Every value's output is checked against the first value's (the default unless --variants says otherwise;
`rel_err_vs_default`), bf16 rounding apart. The value with the least summed
time over cases and projections is written to `--best`.

    python benchmarks/probe_prefill_expand.py --out benchmarks/results/probe_prefill_expand.json --best best.txt
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import copy_bandwidth_gbs, graphed, time_us  # noqa: E402

from loraplex.ops.lora import sgmv  # noqa: E402
from loraplex.ops.lora.batch import LoraBatch  # noqa: E402

RANK = 16
ROTATIONS = 3
PROJECTIONS = {"qkv": (4096, (4096, 4096, 4096)), "o": (4096, (4096,)), "gate_up": (4096, (11008, 11008)),
               "down": (11008, (4096,))}
CASES = {"mixed": [300] * 6 + [1] * 20, "prompts": [320] * 6}
VARIANTS = ["", "rows", "epps8", "ts2", "ts3", "ts4", "ts3,epps8", "ts3,n32", "ts3,n32,epps8", "ts4,n32,epps8",
            "ts3,rows", "n32,epps8"]


def tensors(K: int, Ns: tuple, rows: int, slots: int, gen: torch.Generator) -> dict:
    bf = dict(dtype=torch.bfloat16, device="cuda")
    return dict(
        xs=[torch.randn(rows, K, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(ROTATIONS)],
        ys=[torch.randn(rows, sum(Ns), generator=gen, device="cuda").to(torch.bfloat16) for _ in range(ROTATIONS)],
        a=[(torch.randn(slots, RANK, K, generator=gen, device="cuda") * K ** -0.5).to(**bf) for _ in Ns],
        b=[(torch.randn(slots, n, RANK, generator=gen, device="cuda") * RANK ** -0.5).to(**bf) for n in Ns],
        ranks=[torch.full((slots,), RANK, dtype=torch.int32, device="cuda") for _ in Ns],
        scalings=[torch.rand(slots, generator=gen, device="cuda") + 0.5 for _ in Ns])


def registers(launcher, before: set) -> dict:
    """ptxas's registers and spills of the kernels `launcher` compiled since `before` (its keys then)."""
    new = [k for key, k in launcher._compiled.items() if key not in before]
    return dict(regs=max((getattr(k, "n_regs", 0) for k in new), default=None),
                spills=max((getattr(k, "n_spills", 0) for k in new), default=None))


def time_variant(t: dict, batch: LoraBatch, cfg: sgmv.KernelConfig) -> dict:
    parts = [sgmv.new_partials(x, t["a"], batch, cfg) for x in t["xs"]]
    compiled_before = set(sgmv._EXPAND._compiled)

    def shrink(i):
        return lambda: sgmv.shrink_into(parts[i], t["xs"][i], t["a"], t["ranks"], batch, cfg)

    def expand(i):
        return lambda: sgmv.expand_from(t["ys"][i], parts[i], t["b"], t["ranks"], t["scalings"], batch, 0, cfg)

    for i in range(ROTATIONS):
        shrink(i)()
        expand(i)()
    expand_regs = registers(sgmv._EXPAND, compiled_before)
    shrink_us = time_us([graphed(shrink(i)) for i in range(ROTATIONS)])
    expand_us = time_us([graphed(expand(i)) for i in range(ROTATIONS)])
    # one exact pass for the check: fresh y from the same values for every variant
    y = torch.zeros_like(t["ys"][0])
    sgmv.shrink_into(parts[0], t["xs"][0], t["a"], t["ranks"], batch, cfg)
    sgmv.expand_from(y, parts[0], t["b"], t["ranks"], t["scalings"], batch, 0, cfg)
    return dict(shrink_us=shrink_us, expand_us=expand_us, expand_regs=expand_regs), y


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=";".join(VARIANTS), help="LORAPLEX_LORA_PREFILL values, ';'-separated")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--best", type=Path, help="write the value of least summed time here")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(";")]
    configs = {v: dataclasses.replace(sgmv.PREFILL_DEFAULT, **sgmv._prefill_options(v)) for v in variants}
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    rows_out, totals = [], {v: 0.0 for v in variants}
    for case in args.cases.split(","):
        seg_lens = CASES[case]
        slots = list(range(len(seg_lens)))
        batch = LoraBatch.from_lengths(seg_lens, slots, "cuda")
        if batch.block_m != 64:
            raise SystemExit(f"case {case}: the engine would take tiles of {batch.block_m} rows, not 64")
        rows = sum(seg_lens)
        for proj, (K, Ns) in PROJECTIONS.items():
            t = tensors(K, Ns, rows, len(slots), gen)
            floor_us = time_us([graphed(lambda y=y: y.add_(1)) for y in t["ys"]])
            reference = None
            for v in variants:
                times, y = time_variant(t, batch, configs[v])
                if reference is None:
                    reference = y.float()
                err = ((y.float() - reference).norm() / reference.norm()).item()
                if not err < 1e-2:
                    raise SystemExit(f"{case} {proj} {v!r}: output differs from the default's by {err:.2e}")
                totals[v] += times["shrink_us"] + times["expand_us"]
                rmw_bytes = rows * sum(Ns) * 2 * 2
                row = dict(case=case, projection=proj, prefill=v, rows=rows, **times, rmw_floor_us=floor_us,
                           expand_gbs=rmw_bytes / times["expand_us"] / 1e3, vs_floor=times["expand_us"] / floor_us,
                           rel_err_vs_default=err)
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    best = min(variants, key=totals.get)
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, rank=RANK, copy_gbs=copy_gbs,
                  base_config=sgmv.describe_prefill(sgmv.PREFILL_DEFAULT),
                  configs={v: sgmv.describe_prefill(c) for v, c in configs.items()},
                  total_us=totals, best=best, rows=rows_out)
    print("total µs (shrink + expand, all cases and projections):",
          ", ".join(f"{v or 'default'} {us:.0f}" for v, us in sorted(totals.items(), key=lambda kv: kv[1])))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if args.best:
        args.best.write_text(best)
    return result


if __name__ == "__main__":
    main()
