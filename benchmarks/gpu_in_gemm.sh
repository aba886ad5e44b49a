#!/usr/bin/env bash
# One device call (~4 minutes on an H200): LoRA's shrink inside each projection's GEMM (adapters/active_area.py
# attached to the model, ops/lora_in_gemm.py's expand; the model's "in-gemm" LoRA path) in whole decode
# forwards, side by side with today's path (bench_model.py --in-gemm: backbone, distinct, shared, then both
# in-gemm variants, at 1, 32 and 160 rows), then its GPU tests against transformers + PEFT: the model (eager
# and graph) and the engine (EngineConfig.lora_in_gemm: graphs per active count against eager steps).
# Then the paper's workload: SYSTEMS=loraplex TESTS=0 EXTRA="--lora-in-gemm 32" TAG=_in_gemm
#   bash benchmarks/gpu_mixed_graphs.sh (at max batch 32, a second call).
# benchmarks/probe_lora_in_gemm.py measured the projections alone (its naug-rope design, which this is: q/k/v's
# product expanded by RoPE from the GEMM's columns, the others by the in-gemm expand; -0.72 ms against the
# kernels after the GEMM at 32 rows, about -0.5 ms against today's default); this is the
# whole forward (the engine keeps an area when EngineConfig.lora_in_gemm is set).
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
timeout $((560 - SECONDS)) python -m pytest -m gpu -q -p no:cacheprovider tests/test_model_gpu.py \
    tests/test_engine_gpu.py tests/test_lora_in_gemm.py -k "inside_the_gemms or mixed_bf16 or in_gemm" 2>&1 | tee "$OUT/pytest_gpu_in_gemm.log" | tail -3
echo "== done at ${SECONDS}s"
