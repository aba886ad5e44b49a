"""The Triton kernels compile for Hopper (sm_90) on a machine without a GPU.

Triton's CPU interpreter runs kernel logic but accepts code its compiler rejects (a constexpr
branch returning another shape, say), so each variant is also compiled here, in a subprocess
without TRITON_INTERPRET (this session's kernels may be the interpreter's).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile


# bf16 (the served dtype) at both tile heights; fp16 and fp32 at one each (their code differs from bf16's in the
# dots' precision and the loads' types, not in the tile height)
@pytest.mark.parametrize("kind", ["shrink", "expand"])
@pytest.mark.parametrize("dtype, block_m", [("bf16", 16), ("bf16", 64), ("fp16", 16), ("fp32", 64)])
def test_kernel_compiles_for_sm90(kind, dtype, block_m):
    env = dict(os.environ, TRITON_INTERPRET="0")
    script = Path(__file__).with_name("compile_kernels.py")
    proc = subprocess.run([sys.executable, str(script), kind, dtype, str(block_m)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

