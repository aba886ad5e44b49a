#!/usr/bin/env bash
# One device call (about 9 minutes on an H200): the "fused" LoRA path (ops/lora_product.py: the shrink
# beside the GEMM, the expand inside the op that reads the projection) checked and timed against the others.
#   OUT=/some/dir bash benchmarks/gpu_fused_check.sh
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== GPU tests at ${SECONDS}s"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_gpu.py tests/test_ops_gpu.py \
    tests/test_model_gpu.py -k "product or delta or replay" 2>&1 | tail -15
echo "== decode forwards, every mode, at ${SECONDS}s"
timeout 230 python3 benchmarks/bench_lora_overlap.py --batches 1,32,64,128 --carveouts 0,16 --carveout-mode fused \
    --out "$OUT/lora_overlap_fused.json" --md "$OUT/lora_overlap_fused.md" 2>&1 | grep -v Warning | tail -40
echo "== kernel profile at ${SECONDS}s"
timeout 60 python3 benchmarks/profile_decode_kernels.py --modes full,fused --out "$OUT/decode_kernels_fused.txt" \
    2>&1 | grep -E "^#|Self CUDA|_kernel|gemm|nvjet|sm90|Memset|void" | head -60
echo "== consumer tile sweep at ${SECONDS}s"
timeout $((585 - SECONDS)) python3 benchmarks/sweep_fused_consumers.py --out "$OUT/fused_sweep.json" 2>&1 \
    | grep -v Warning | tail -12
echo "== done at ${SECONDS}s"
