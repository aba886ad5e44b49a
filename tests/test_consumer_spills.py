"""The consumers' composed variants (ops/fused/lora_kernels.py's `_lane_products`) keep their registers: compiled
for sm_90 at a rank-32 pool (one rank tile of 32, the early reads), each spills at most a few hundred bytes a
thread, as the plain variants do (Triton's own ptxas reports it). Adding a composed row's other members a whole rank
tile at a time had spilled tens of KB (RoPE's 30.9 KB) beside the first member's B block."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

MAX_SPILL_BYTES = 1024


def _consumer_ptx(which: str) -> str:
    from test_fused_compile import LORA_POINTERS, _compile
    from loraplex.ops.fused import lora_kernels, rms_split, rope_lora
    common = dict(ONE_R_TILE=True, SPLIT_K=8, BLOCK_R=32, COMPILED=True, EARLY=True, EXTRAS=True)
    if which == "rope":
        types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", pos_ptr="*i64", inv_freq_ptr="*fp32",
                     **{f"b{i}": "*bf16" for i in range(3)}, **{f"rk{i}": "*i32" for i in range(3)},
                     **{f"sc{i}": "*fp32" for i in range(3)}, **LORA_POINTERS)
        return _compile(rope_lora._rope_lora_kernel, types, dict(common, BLOCK_H=rope_lora.ROPE_HEADS, BLOCK_D=64),
                        90, 2)
    if which == "silu":
        types = dict(gu_ptr="*bf16", out_ptr="*bf16", b0="*bf16", b1="*bf16", rk0="*i32", rk1="*i32", sc0="*fp32",
                     sc1="*fp32", **LORA_POINTERS)
        return _compile(lora_kernels._silu_and_mul_lora_kernel, types, dict(common, BLOCK=lora_kernels.SILU_BLOCK),
                        90, 4)
    types = dict(x_ptr="*bf16", r_ptr="*bf16", s_ptr="*bf16", sumsq_ptr="*fp32", b_ptr="*bf16", rank_ptr="*i32",
                 scale_ptr="*fp32", **LORA_POINTERS)
    return _compile(rms_split._rms_lora_sums_kernel, types,
                    dict(common, HAS_RESIDUAL=True, BLOCK=lora_kernels.RMS_SPLIT), 90, 4)


@pytest.mark.parametrize("which", ["rope", "silu", "rms_sums"])
def test_composed_consumers_do_not_spill(which):
    # compiled (not interpreted) in a process of its own, where Triton prints its ptxas's report
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DUMP_PTXAS_LOG="1", TRITON_ALWAYS_COMPILE="1")
    proc = subprocess.run([sys.executable, __file__, which], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spilled = [int(n) for n in re.findall(r"(\d+) bytes spill stores", proc.stdout + proc.stderr)]
    assert spilled, f"no ptxas report in the compile's output: {(proc.stdout + proc.stderr)[-2000:]}"
    assert max(spilled) <= MAX_SPILL_BYTES, f"{which}'s composed early variant spills {max(spilled)} bytes a thread"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _consumer_ptx(sys.argv[1])
