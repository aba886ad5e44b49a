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


@pytest.mark.parametrize("kind", ["shrink", "expand"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("block_m", [16, 64])
def test_kernel_compiles_for_sm90(kind, dtype, block_m):
    env = dict(os.environ, TRITON_INTERPRET="0")
    script = Path(__file__).with_name("compile_kernels.py")
    proc = subprocess.run([sys.executable, str(script), kind, dtype, str(block_m)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

