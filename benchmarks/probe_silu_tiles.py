"""gate/up's LoRA in prompt steps: the expand then SiLU-and-mul, against SiLU-and-mul expanding the tiles (GPU probe).

Issue 5's mixed steps carry 7–9 ms of LoRA GPU time each; gate/up's expand is a read-modify-write of the GEMM's
[rows, 22016] output that SiLU-and-mul then reads again. ops/silu_lora_tiles.py leaves the product to SiLU-and-mul
(LORAPLEX_LORA_SILU_TILES=on). Per Llama-2-7B layer, CUDA-graph replays over rotating inputs past the L2:
- `default`: the shrink, the tile expand into gate_up, SiLU-and-mul;
- `tiles_<variant>`: the shrink, then the tile consumer with those settings (VARIANTS);
- floors: the shrink alone, plain SiLU-and-mul alone (no LoRA), and the bytes SiLU-and-mul moves at the copy
  bandwidth.
Cases: `mixed` (six 300-token prompts and 20 decode rows, each its own rank-16 adapter: 64-row tiles), `mixed16`
(three 391-token prompts and 29 decode rows: the engine's mixed steps that take 16-row tiles), `prompts` (six
320-token prompts). Each variant's output is checked against the default's (bf16 rounding apart).

    python benchmarks/probe_silu_tiles.py --out benchmarks/results/probe_silu_tiles.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import copy_bandwidth_gbs, graphed, time_us  # noqa: E402

from loraplex.ops.fused import api as fused
from loraplex.ops.lora import sgmv
from loraplex.ops.fused import silu_lora_tiles_kernels  # noqa: E402
from loraplex.ops.lora.batch import LoraBatch  # noqa: E402
from loraplex.ops.lora.product import LoraProduct  # noqa: E402

RANK, K, I, ROTATIONS, LAYERS = 16, 4096, 11008, 3, 32
CASES = {"mixed": [300] * 6 + [1] * 20, "mixed16": [391] * 3 + [1] * 29, "prompts": [320] * 6}
# "<BLOCK_N>x<warps>[-nopf][-pps<programs an SM>]": silu_lora_tiles_kernels' settings (-nopf: PREFETCH off)
VARIANTS = ["64x4", "64x4-nopf", "64x4-pps8", "64x4-pps2", "32x4", "128x8", "32x2-pps8"]


def settings(variant: str) -> dict:
    head, *opts = variant.split("-")
    block_n, warps = map(int, head.split("x"))
    pps = next((float(o[3:]) for o in opts if o.startswith("pps")), 4.0)
    return dict(BLOCK_N=block_n, NUM_WARPS=warps, PREFETCH="nopf" not in opts, PROGRAMS_PER_SM=pps)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (see VARIANTS)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    copy_gbs = copy_bandwidth_gbs()
    rows_out = []
    for case in args.cases.split(","):
        seg_lens = CASES[case]
        slots = len(seg_lens)
        batch = LoraBatch.from_lengths(seg_lens, list(range(slots)), "cuda")
        T = sum(seg_lens)
        cfg = sgmv.config_for(batch.block_m)
        xs = [torch.randn(T, K, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(ROTATIONS)]
        ys = [torch.randn(T, 2 * I, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(ROTATIONS)]
        outs = [torch.empty(T, I, **bf) for _ in range(ROTATIONS)]
        a = [(torch.randn(slots, RANK, K, generator=gen, device="cuda") * K ** -0.5).to(**bf) for _ in range(2)]
        b = [(torch.randn(slots, I, RANK, generator=gen, device="cuda") * RANK ** -0.5).to(**bf) for _ in range(2)]
        ranks = [torch.full((slots,), RANK, dtype=torch.int32, device="cuda") for _ in range(2)]
        scalings = [torch.rand(slots, generator=gen, device="cuda") + 0.5 for _ in range(2)]
        parts = [sgmv.new_partials(x, a, batch, cfg) for x in xs]
        products = [LoraProduct(p, tuple(b), tuple(ranks), tuple(scalings), batch.row_slot, tiles=batch)
                    for p in parts]

        def shrink(i):
            sgmv.shrink_into(parts[i], xs[i], a, ranks, batch, cfg)

        def default(i):
            shrink(i)
            sgmv.expand_from(ys[i], parts[i], b, ranks, scalings, batch, 0, cfg)
            fused.silu_and_mul(ys[i], out=outs[i])

        def tiles(i, variant):
            shrink(i)
            for k, v in settings(variant).items():
                setattr(silu_lora_tiles_kernels, k, v)
            silu_lora_tiles_kernels.silu_and_mul(ys[i], outs[i], products[i])

        def timed(fn) -> float:
            return time_us([graphed(lambda i=i: fn(i)) for i in range(ROTATIONS)])

        row = dict(case=case, rows=T, block_m=batch.block_m, split_k=parts[0].shape[0],
                   shrink_us=timed(shrink), silu_us=timed(lambda i: fused.silu_and_mul(ys[i], out=outs[i])),
                   default_us=timed(default))
        row["silu_floor_us"] = T * 3 * I * 2 / copy_gbs / 1e3   # gate/up read, out written
        # the check: one pass from fresh copies of the same gate_up
        y0 = ys[0].clone()
        shrink(0)
        sgmv.expand_from(ys[0], parts[0], b, ranks, scalings, batch, 0, cfg)
        want = fused.silu_and_mul(ys[0]).float()
        ys[0].copy_(y0)
        defaults = {k: getattr(silu_lora_tiles_kernels, k) for v in variants for k in settings(v)}
        for variant in variants:
            name = f"tiles_{variant}"
            row[f"{name}_us"] = timed(lambda i, v=variant: tiles(i, v))
            ys[0].copy_(y0)
            tiles(0, variant)
            got = outs[0].float()
            err = ((got - want).norm() / want.norm()).item()
            row[f"{name}_rel_err"] = err
            row[f"{name}_same_bits"] = (got == want).float().mean().item()
            if not err < 1e-2:
                raise SystemExit(f"{case} {name}: output differs from the default's by {err:.2e}")
        for k, v in defaults.items():
            setattr(silu_lora_tiles_kernels, k, v)
        best = min((k for k in row if k.startswith("tiles_") and k.endswith("_us")), key=row.get)
        row.update(best=best, saved_per_step_ms=(row["default_us"] - row[best]) * LAYERS / 1e3)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, rank=RANK, copy_gbs=copy_gbs, rows=rows_out)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
