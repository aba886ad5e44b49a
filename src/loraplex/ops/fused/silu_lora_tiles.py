"""SiLU-and-mul that expands gate/up's LoRA product over the SGMV work tiles: the prompt rows' consumer.

In a forward of many rows (prompts), gate/up's expand (`sgmv.expand_from`) reads the GEMM's output, adds the
product and writes it back; SiLU-and-mul then reads it again. Here the expand is not launched: after the GEMM
and the shrink (`sgmv.shrink_into`, which writes `part`), one kernel reads gate and up once, adds each
tile's product and stores `silu(gate) · up`. A LoraProduct that carries the batch (`LoraProduct.tiles`)
takes this kernel (fused_lora_kernels.silu_and_mul dispatches); the decode consumers expand row by row,
where each row has its own adapter, and a tile would read B once per row anyway.

Programs `(w, chunk)`, each over a chunk of I's columns, BLOCK_N at a time:
- `w < num_work`: the batch's work tile w, rows `sorted_rows[work_start[w]:work_end[w]]` of slot
  `work_slot[w]` (tiles of one adapter's rows, the shrink's and expand's); per slice i (gate, up) of rank
  `rank_i = min(ranks_i[slot], R)`, in fp32:

      delta_i[m, n] = scalings_i[slot] · Σ_{r < rank_i} (Σ_split part[split, i, m, r]) · B_i[slot, n, r]
      gate = round(gate + delta_0);  up = round(up + delta_1)          # to gate_up's dtype

  the product computed as the tile expand computes it (`sgmv_kernels._dot_v_b`, the same precision), so
  these are the bits the expand would have written;
- `w ≥ num_work`: the rows `(w - num_work) · BLOCK_M + [0, BLOCK_M)` whose slot is -1, unchanged. A batch
  where every row has an adapter (eager) launches none of these; a capacity batch (CUDA graphs) launches
  them all, and those with no such row load only their slots.

then `out[m, n] = round(round(silu(gate)) · up)` (fused_kernels._silu_mul), as `fused.silu_and_mul`.

Measured slower, so off (LORAPLEX_LORA_SILU_TILES=on to use it). On an H200 (2026-12-03, benchmarks/results/
probe_silu_tiles.md: Llama-2-7B's gate/up, rank 16, each sequence its own adapter, per layer in CUDA graphs) the
shrink and this kernel took 195–392 µs where the shrink, the expand and SiLU-and-mul take 120–136 (1,820–1,920
rows; 122 against 99 µs on 16-row tiles). Its programs hold both slices' tiles and products (245 registers at
64 columns and 4 warps: two programs an SM), and each column step waits for its gate and up blocks, their two
tensor-core products and their conversion to the products' layout in turn: the expand's latency-bound step,
twice, with fewer programs to hide it. Products on the CUDA cores (outer products over the rank, or each
row's sum as the decode consumers take it) measured slower still (309–535 µs) and were removed.
"""
from __future__ import annotations

from ...env_switch import env_switch

# LORAPLEX_LORA_SILU_TILES: "on" leaves gate/up's product to this kernel in the forwards that expand after each
# GEMM (models/llama.py's "direct" and "stored" paths: prompts, eager or captured).
SETTING = env_switch("LORAPLEX_LORA_SILU_TILES", "off", on="on", off="off")


def enabled() -> bool:
    """Is the setting on (read at call time: tests and benchmarks set SETTING)?"""
    return SETTING == "on"
