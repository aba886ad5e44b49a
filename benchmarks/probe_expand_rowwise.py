"""The decode shrink and expand, tile product against row by row (sgmv `_shrink_tile_rows`, `_expand_tile_rows`), on
Llama-2-7B's LoRA shapes (GPU).

At batch 160 with distinct adapters, the profile of a decode forward (`results/decode_kernels_b160.txt`)
has the expand reading B at ~1.4 TB/s and the shrink A at ~2.2: 7.8 ms of LoRA per forward where the
adapters' bytes take ~3.1 ms at the copy bandwidth. This times shrink and expand apart, in CUDA graphs,
on 4 rotating inputs and adapter blocks, for the four projection groups of a layer (q/k/v, o, gate/up,
down), decode rows with one adapter each (`distinct`) or all sharing one (`shared`: 16-row tiles, which
the row-wise kernels leave to the tile product), and for each variant checks the result against the
tile product's (max relative difference) and reports GB/s of the bytes it must move.

    python benchmarks/probe_expand_rowwise.py --out results/probe_expand_rowwise.json
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
from bench_lora_ops import ROTATIONS, copy_bandwidth_gbs, graphed, time_us  # noqa: E402

from loraplex import ops  # noqa: E402
from loraplex.ops.lora import sgmv  # noqa: E402

GROUPS = {"qkv": (4096, (4096, 4096, 4096)), "o": (4096, (4096,)), "gate_up": (4096, (11008, 11008)),
          "down": (11008, (4096,))}
RANK = 16


def variants() -> dict[str, sgmv.KernelConfig]:
    # 256 columns a row-wise step unless a variant says otherwise (the default's 512 is the "_n512" ones)
    base = dataclasses.replace(sgmv.config_for(16), shrink_rowwise=0, expand_rowwise=0, rows_block_n=256)
    rows = dataclasses.replace(base, shrink_rowwise=2, expand_rowwise=2)   # every tile: one path compiled
    branched = dataclasses.replace(base, shrink_rowwise=1, expand_rowwise=1)   # tiles of ≤ 4 rows, both compiled
    out = {"tile": base, "rows": rows, "rows_branched": branched,
           # the tile product with fewer registers per thread (sm_90 builds: 239 at 4 warps and BLOCK_N 256,
           # 128 at 8 warps, 102 at BLOCK_N 128; the shrink 255 at BLOCK_K 256, 186 at 8 warps, 96 at 128)
           "tile_w8": dataclasses.replace(base, shrink_warps=8, expand_warps=8),
           "tile_128": dataclasses.replace(base, shrink_block_k=128, expand_block_n=128)}
    # (2026-12-01, eighth session: 512 columns a program step was 5–10% faster than 256; the others no better)
    for block_n, per_sm, warps in ((512, 16.0, 4), (256, 8.0, 4)):
        out[f"rows_n{block_n}_p{int(per_sm)}_w{warps}"] = dataclasses.replace(
            rows, expand_block_n=block_n, expand_programs_per_sm=per_sm, expand_warps=warps, rows_block_n=block_n)
    # mode 1 (the default) with the row-wise loads a step ahead, and/or 512 columns a row-wise step
    out["branched_pf"] = dataclasses.replace(branched, rows_prefetch=True)
    out["branched_n512"] = dataclasses.replace(branched, rows_block_n=512)
    out["branched_pf_n512"] = dataclasses.replace(branched, rows_prefetch=True, rows_block_n=512)
    for per_sm in (8.0, 32.0):
        out[f"branched_pf_n512_p{int(per_sm)}"] = dataclasses.replace(out["branched_pf_n512"],
                                                                     expand_programs_per_sm=per_sm)
    return out


def run_group(name: str, M: int, popularity: str, gen: torch.Generator, copy_gbs: float) -> dict:
    K, Ns = GROUPS[name]
    slots = M * ROTATIONS
    a = [(torch.randn(slots, RANK, K, generator=gen, device="cuda") * K ** -0.5).to(torch.bfloat16) for _ in Ns]
    b = [(torch.randn(slots, n, RANK, generator=gen, device="cuda") * RANK ** -0.5).to(torch.bfloat16) for n in Ns]
    ranks = [torch.full((slots,), RANK, dtype=torch.int32, device="cuda") for _ in Ns]
    scal = [torch.rand(slots, generator=gen, device="cuda") + 0.5 for _ in Ns]
    xs = [torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(ROTATIONS)]
    y0 = [torch.randn(M, sum(Ns), generator=gen, device="cuda").to(torch.bfloat16) for _ in range(ROTATIONS)]
    ys = [y.clone() for y in y0]
    slots = [list(range(k * M, (k + 1) * M)) if popularity == "distinct" else [k * M] * M for k in range(ROTATIONS)]
    batches = [ops.LoraBatch.from_lengths([1] * M, slots[k], "cuda") for k in range(ROTATIONS)]
    used = M if popularity == "distinct" else 1
    cfgs = variants()
    parts = [sgmv.new_partials(xs[k], a, batches[k], cfgs["tile"]) for k in range(ROTATIONS)]
    row = dict(group=name, M=M, popularity=popularity, K=K, N=list(Ns), split_k=parts[0].shape[0])
    a_bytes = used * RANK * K * 2 * len(Ns) + M * K * 2
    shrunk = {}
    for vname in ("tile", "rows", "rows_branched", "branched_pf", "tile_w8", "tile_128"):
        shrinks = [lambda k=k, cfg=cfgs[vname]: sgmv.shrink_into(parts[k], xs[k], a, ranks, batches[k], cfg)
                   for k in range(ROTATIONS)]
        shrinks[0]()
        shrunk[vname] = parts[0].sum(0).double()
        row[f"shrink_{vname}_us"] = time_us([graphed(f) for f in shrinks])
        row[f"shrink_{vname}_gbs"] = a_bytes / row[f"shrink_{vname}_us"] / 1e3
    row["shrink_rows_rel_diff"] = max(((shrunk[v] - shrunk["tile"]).norm() / shrunk["tile"].norm()).item()
                                      for v in ("rows", "rows_branched", "branched_pf"))
    for f in [lambda k=k: sgmv.shrink_into(parts[k], xs[k], a, ranks, batches[k], cfgs["tile"])
              for k in range(ROTATIONS)]:
        f()
    b_bytes = used * RANK * sum(Ns) * 2 + 2 * M * sum(Ns) * 2
    results = {}
    for vname, cfg in cfgs.items():
        ys[0].copy_(y0[0])
        sgmv.expand_from(ys[0], parts[0], b, ranks, scal, batches[0], 0, cfg)
        results[vname] = (ys[0].double() - y0[0].double())
        fns = [lambda k=k, cfg=cfg: sgmv.expand_from(ys[k], parts[k], b, ranks, scal, batches[k], 0, cfg)
               for k in range(ROTATIONS)]
        us = time_us([graphed(f) for f in fns])
        row[f"expand_{vname}_us"] = us
        row[f"expand_{vname}_gbs"] = b_bytes / us / 1e3
    ref = results["tile"]
    row["max_rel_diff_vs_tile"] = max(((r - ref).norm() / ref.norm()).item() for r in results.values())
    row["floor_us"] = (a_bytes + b_bytes) / copy_gbs / 1e3
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--batches", default="32,160")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for M in (int(m) for m in args.batches.split(",")):
        for popularity in ("distinct", "shared"):
            for name in GROUPS:
                row = run_group(name, M, popularity, gen, copy_gbs)
                rows.append(row)
                best = min((k for k in row if k.startswith("expand_") and k.endswith("_us")), key=row.get)
                print(f"M={M:4d} {popularity:8s} {name:8s} shrink tile {row['shrink_tile_us']:6.1f} rows "
                      f"{row['shrink_rows_us']:6.1f} branched {row['shrink_rows_branched_us']:6.1f} +prefetch "
                      f"{row['shrink_branched_pf_us']:6.1f} µs | expand "
                      f"tile {row['expand_tile_us']:6.1f} rows {row['expand_rows_us']:6.1f} branched "
                      f"{row['expand_rows_branched_us']:6.1f} +prefetch {row['expand_branched_pf_us']:6.1f} "
                      f"+512 {row['expand_branched_pf_n512_us']:6.1f} best {best[7:-3]} {row[best]:6.1f} | "
                      f"floor {row['floor_us']:6.1f} | "
                      f"diff {max(row['max_rel_diff_vs_tile'], row['shrink_rows_rel_diff']):.1e}", flush=True)
    out = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), torch=torch.__version__,
               copy_gbs=copy_gbs, rank=RANK, rows=rows)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
