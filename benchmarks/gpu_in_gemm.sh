#!/usr/bin/env bash
# One device call (~4 minutes on an H200): LoRA's shrink inside each projection's GEMM (adapters/active_area.py
# attached to the model, ops/lora_in_gemm.py's expand; the model's "in-gemm" LoRA path) in whole decode
# forwards, side by side with today's path (bench_model.py --in-gemm: backbone, distinct, shared, then both
# in-gemm variants, at 1, 32 and 160 rows), then its GPU test against transformers + PEFT (eager and graph).
# benchmarks/probe_lora_in_gemm.py measured the projections alone (naug: -0.34 ms at 32 rows); this is the
# whole forward, before the engine keeps an area.
#   OUT=/some/dir bash benchmarks/gpu_in_gemm.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
restore_triton_cache
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
echo "== decode forwards with and without the shrink in the GEMMs, at ${SECONDS}s"
timeout 240 python benchmarks/bench_model.py --batches 1,32,160 --prefill 1x16 --in-gemm \
    --out "$OUT/model_forward_in_gemm.json" 2>&1 | grep -E "^decode|Error|error"
save_triton_cache
echo "== GPU tests at ${SECONDS}s"
timeout $((560 - SECONDS)) python -m pytest -m gpu -q -p no:cacheprovider tests/test_model_gpu.py tests/test_ops_gpu.py \
    -k "inside_the_gemms or in_gemm or mixed_bf16" 2>&1 | tee "$OUT/pytest_gpu_in_gemm.log" | tail -3
echo "== done at ${SECONDS}s"
