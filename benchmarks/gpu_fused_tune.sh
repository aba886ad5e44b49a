#!/usr/bin/env bash
# One device call (about 5 minutes on an H200), after gpu_fused_check.sh: the "fused" consumers with one rank
# tile loaded once per program and the RMSNorm row walk pipelined, checked and timed again against the other
# modes; then which projections should leave their product to the next op (the rest expand beside the GEMM).
#   OUT=/some/dir bash benchmarks/gpu_fused_tune.sh
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
echo "== GPU tests at ${SECONDS}s"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_gpu.py tests/test_ops_gpu.py \
    tests/test_model_gpu.py -k "product or replay" 2>&1 | tail -6 | tee "$OUT/pytest_gpu_fused.log"
echo "== decode forwards, every mode, at ${SECONDS}s"
timeout 200 python3 benchmarks/bench_lora_overlap.py --batches 1,32,64,128 \
    --out "$OUT/lora_overlap_fused2.json" --md "$OUT/lora_overlap_fused2.md" 2>&1 | grep -v Warning | grep -E "distinct|shared|backbone" | grep -v "B=   1 shared"
echo "== projections at ${SECONDS}s"
timeout $((480 - SECONDS)) python3 benchmarks/sweep_fused_consumers.py --what projections \
    --out "$OUT/fused_projections.json" 2>&1 | grep -v Warning | tail -40
echo "== kernel profile at ${SECONDS}s"
timeout 60 python3 benchmarks/profile_decode_kernels.py --modes fused --out "$OUT/decode_kernels_fused2.txt" \
    2>&1 | grep -E "lora|shrink|expand|rope|rms|silu" | cut -c1-60,100-200 | head -12
echo "== done at ${SECONDS}s"
