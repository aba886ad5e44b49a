#!/usr/bin/env bash
# One device call (about 4 minutes on an H200): what capturing mixed steps could save (time_mixed_step.py),
# RMSNorm's several-programs consumer (its GPU test, then sweep_fused_consumers.py --what rms).
#   OUT=/some/dir bash benchmarks/gpu_mixed_probe.sh
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "== mixed steps at ${SECONDS}s"
timeout 200 python benchmarks/time_mixed_step.py --out "$OUT/mixed_step.json" 2>&1 | tail -8
echo "== GPU test at ${SECONDS}s"
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_lora_product_gpu.py -k several_programs 2>&1 | tail -3
echo "== RMS split sweep at ${SECONDS}s"
timeout $((560 - SECONDS)) python benchmarks/sweep_fused_consumers.py --what rms --out "$OUT/fused_rms_split.json" 2>&1 | tail -30
echo "== done at ${SECONDS}s"
