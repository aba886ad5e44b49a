#!/usr/bin/env bash
# One device call (~9 minutes on an H200): B blocks read 16 bytes at a time (sgmv_kernels._load_rank_block,
# LORAPLEX_LORA_VECTOR_LOADS) against the 2-byte loads before, each setting in its own processes (the setting is
# read at import). First the GPU tests of the kernels that read B, against their oracles; then a batch-32 decode
# forward in a CUDA graph (trace_decode_graph.py: backbone and today's path, paired rounds, and the timeline of
# today's path) on, off, on; then issue 5's engine benchmark at batch 32 off and on.
#   OUT=/some/dir bash benchmarks/gpu_vector_loads.sh
# TESTS=0 / TRACE=0 / ENGINE=0 skip a part; DEADLINE: the second of this script after which no part starts.
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
gpu_tests pytest_gpu_vector_loads.log 200 tests/test_ops_gpu.py tests/test_lora_product_gpu.py \
    tests/test_fused_gpu.py tests/test_model_gpu.py -k "${TEST_K:-not in_gemm}"
if [ "${TRACE:-1}" = 1 ]; then
  for setting in on off on2; do
    [ "$(left)" -gt 100 ] || break
    echo "== decode forward, LORAPLEX_LORA_VECTOR_LOADS=${setting%2} at ${SECONDS}s"
    LORAPLEX_LORA_VECTOR_LOADS=${setting%2} timeout $(($(left) - 60)) python benchmarks/trace_decode_graph.py \
        --variants backbone,fused --trace-variants fused --paired 7 \
        --out "$OUT/decode_graph_trace_vector_${setting}.json" 2>&1 | grep -E "^(backbone|fused) |^paired" | tail -4
  done
  python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("decode_graph_trace_vector_*.json")):
    d = json.loads(f.read_text())
    t = d.get("timelines", {}).get("fused", {})
    print(f.stem, {k: v.get("graph_us") for k, v in d["variants"].items()}, d.get("paired", {}).get("backbone"))
    print("  busy", {k: round(v) for k, v in t.get("busy_us", {}).items()})
    print("  alone", {k: round(v) for k, v in t.get("alone_us", {}).items()})
PY
fi
if [ "${ENGINE:-1}" = 1 ]; then
  for setting in off on; do
    [ "$(left)" -gt 90 ] || break
    echo "== engine, LORAPLEX_LORA_VECTOR_LOADS=$setting at ${SECONDS}s"
    LORAPLEX_LORA_VECTOR_LOADS=$setting timeout $(($(left) - 10)) python benchmarks/bench_engine.py --batches 32 \
        --modes graphs --variants backbone,distinct --repeats 3 --out "$OUT/engine_vector_${setting}.json" \
        --md "$OUT/engine_vector_${setting}.md" 2>&1 | grep "^| 32"
  done
fi
save_triton_cache
echo "== done at ${SECONDS}s"
