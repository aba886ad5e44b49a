#!/usr/bin/env bash
# The other benchmarks the docs cite, by name, in one call while time is left (DEADLINE, default 570 s):
#   ops           bench_lora_ops.py: add_lora against a loop, gather-BMM and plain matmuls (~5 min on an H200)
#   attention     bench_attention.py: paged attention against torch SDPA
#   model         bench_model.py: one decode and prefill forward beside its floors
#   gemm          bench_skinny_gemm.py: the decode GEMM against cuBLAS, and its tuned tiles (~9 min)
#   fp8_gemm      bench_fp8_gemm.py: FP8 weights' GEMMs against bf16, and the FP8 kernel's tuned tiles
#                 ($OUT/tuned_fp8_<gpu>.json, tuned_fp8_w8a8_<gpu>.json: copy them to src/loraplex/ops/gemm/)
#   fp8_attention bench_fp8_attention.py: decode attention over an e4m3 KV cache, its tiles swept
#   compose_ops   bench_compose_ops.py: a layer's LoRA calls with two adapters a row against single and merged ones
#   adapter_load  bench_adapter_load.py: disk → host → GPU slot, and 100 adapters through the cache
#   serving       bench_serving.py against `loraplex serve` (carry .whl/ from fetch_device_wheels.sh)
#   OUT=$OUT bash benchmarks/gpu_bench.sh model attention
# ARGS (word-split) go to every benchmark named, e.g. ARGS="--layers 2 --batches 1,8" for a quick model check.
. "$(dirname "$0")/gpu_common.sh"
SERVE="loraplex serve --model dummy:llama-2-7b --synthetic-adapters 100 --max-lora-rank 16 --max-gpu-adapters 64"
for name in "$@"; do
  [ "$(left)" -gt 30 ] || { echo "== no time left for $name"; continue; }
  echo "== $name at ${SECONDS}s"
  case $name in
    ops) cmd=(benchmarks/bench_lora_ops.py --out "$OUT" --budget-s $(($(left) - 60))) ;;
    attention) cmd=(benchmarks/bench_attention.py --out "$OUT/attention.json" --md "$OUT/attention.md") ;;
    model) cmd=(benchmarks/bench_model.py --out "$OUT/model_forward.json" --md "$OUT/model_forward.md") ;;
    gemm) cmd=(benchmarks/bench_skinny_gemm.py --out "$OUT/skinny_gemm.json" --md "$OUT/skinny_gemm.md"
               --configs-out "$OUT/skinny_configs.json") ;;
    fp8_gemm) cmd=(benchmarks/bench_fp8_gemm.py --out "$OUT/fp8_gemm.json" --md "$OUT/fp8_gemm.md"
                   --tuned-out "$OUT") ;;
    fp8_attention) cmd=(benchmarks/bench_fp8_attention.py --out "$OUT/fp8_attention.json" --md "$OUT/fp8_attention.md") ;;
    compose_ops) cmd=(benchmarks/bench_compose_ops.py --out "$OUT/compose_ops.json" --md "$OUT/compose_ops.md") ;;
    adapter_load) cmd=(benchmarks/bench_adapter_load.py --out "$OUT/adapter_load.json" --md "$OUT/adapter_load.md") ;;
    serving) cmd=(benchmarks/bench_serving.py --launch "$SERVE" --rates 2,4,8,16 --requests 100 --popularity skewed
                  --lengths punica --max-len 2048 --out "$OUT/serving.json" --md "$OUT/serving.md"
                  --plot "$OUT/serving.png" --server-log "$OUT/serving_server.log") ;;
    *) echo "unknown benchmark $name (ops, attention, model, gemm, fp8_gemm, fp8_attention, compose_ops," \
            "adapter_load, serving)"
       continue ;;
  esac
  # shellcheck disable=SC2086
  timeout "$(left)" python "${cmd[@]}" ${ARGS:-} 2>&1 | grep -v '^{' | tail -40
done
finish
