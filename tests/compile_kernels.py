"""Compile loraplex's Triton kernels for Hopper (sm_90) without a GPU; run by test_kernels_compile.py.

    TRITON_INTERPRET=0 python tests/compile_kernels.py shrink bf16 16
"""
from __future__ import annotations

import dataclasses
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loraplex.ops.lora import b_blocks, sgmv

TARGET = GPUTarget("cuda", 90, 32)


def _compile(kernel, pointer_types: dict, constexprs: dict, num_warps: int, num_stages: int) -> None:
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = next((t for prefix, t in pointer_types.items() if name.startswith(prefix)), "i32")
    triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=TARGET,
                   options=dict(num_warps=num_warps, num_stages=num_stages))


def shrink(dtype: str, block_m: int) -> None:
    cfg = sgmv.config_for(block_m)
    types = {"x_": "*" + dtype, "part_": "*fp32", "sorted_": "*i32", "entries_": "*i32", "weights_": "*fp32",
             "work_": "*i32", "a": "*" + dtype, "rk": "*i32"}
    # ROWWISE: shrink_kernels._shrink_tile_rows for tiles of up to ROWWISE_MAX_ROWS rows (rank tiles of ≤ 32)
    # AFTER_GEMM: launched after the GEMM over the same x (ops/lora/overlap.py's "after" order)
    # COMPOSED: a composed batch's weighted entries (ops/lora/batch.py)
    for num_slices, block_r, rowwise, after, composed in (
            (1, 16, False, False, False), (1, 16, True, False, False), (3, 32, True, False, False),
            (3, 16, True, True, False), (1, 16, False, True, False), (3, 16, True, True, True),
            (1, 16, False, False, True)):
        consts = dict(NUM_SLICES=num_slices, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=cfg.shrink_block_k,
                      PRECISION="tf32x3" if dtype == "fp32" else "tf32", ROWWISE=rowwise, AFTER_GEMM=after,
                      COMPOSED=composed)
        _compile(sgmv._sgmv_shrink_kernel, types, consts, cfg.shrink_warps, cfg.shrink_stages)


def expand(dtype: str, block_m: int) -> None:
    cfg = sgmv.config_for(block_m)
    # ACCUMULATE=False: y is the fp32 buffer of LoRA products (a LoraDelta) that ops/lora/overlap.py leaves for the
    # next op; ROWWISE: expand_kernels._expand_tile_rows for tiles of up to ROWWISE_MAX_ROWS rows, one rank tile only,
    # the row-wise steps' columns sgmv.rows_block_n_for's (512 for the rank tile of 16).
    # TILE_PREFETCH: the tile expand's y a step ahead (expand_kernels._expand_tile's PREFETCH: the prompt tiles')
    # COMPOSED: a composed batch's members, added before y rounds (ops/lora/batch.py), two at a time: MEMBER_R
    # rank columns each (ops/lora/b_blocks.py; the row-wise steps' columns those of a 32-wide rank tile)
    variants = ((True, True, False, False, False), (True, True, True, False, False), (False, True, True, False, False),
                (True, False, True, False, False), (True, True, False, True, False), (False, True, False, True, False),
                (True, False, False, True, False), (True, True, True, True, False), (True, True, True, False, True),
                (True, False, True, False, True), (True, True, False, True, True), (False, True, False, True, True),
                (False, False, False, False, True))
    for one_r, accumulate, rowwise, tile_prefetch, composed in variants:
        member_r = b_blocks.member_r(16 if one_r else 64)
        types = {"y_": "*" + (dtype if accumulate else "fp32"), "part_": "*fp32", "sorted_": "*i32", "work_": "*i32",
                 "extra_slot": "*i32", "b": "*" + dtype, "rk": "*i32", "sc": "*fp32"}
        consts = dict(NUM_SLICES=2, SPLIT_K=2, BLOCK_M=block_m, BLOCK_N=cfg.expand_block_n,
                      BLOCK_R=16 if one_r else 64, ONE_R_TILE=one_r, PRECISION="split" if dtype == "bf16" else "tf32x3",
                      ACCUMULATE=accumulate, ROWWISE=rowwise,
                      ROWS_BLOCK_N=sgmv.rows_block_n_for(dataclasses.replace(cfg, rowwise=rowwise),
                                                         2 * member_r if composed else 16 if one_r else 64),
                      TILE_PREFETCH=tile_prefetch, COMPOSED=composed, MEMBER_R=member_r)
        _compile(sgmv._sgmv_expand_kernel, types, consts, cfg.expand_warps, cfg.expand_stages)


if __name__ == "__main__":
    kind, dtype, block_m = sys.argv[1], sys.argv[2], int(sys.argv[3])
    {"shrink": shrink, "expand": expand}[kind](dtype, block_m)
    print("compiled", kind, dtype, block_m)
