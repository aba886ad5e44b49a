#!/usr/bin/env bash
# One device call (~6 minutes on an H200; the kernel compiles first): (1) the GPU tests of ops/skinny_lora.py (a
# decode projection's GEMM, shrink and expand in one launch; twentieth session); (2) its parts timed apart at
# Llama-2-7B's projection shapes (bench_skinny_lora.py); (3) batch-32 decode forwards in CUDA graphs: backbone,
# today's "fused" path and skinny_lora, paired rounds, with a profiler trace of skinny_lora.
#   OUT=/some/dir bash benchmarks/gpu_skinny_lora.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-575}
gpu_tests pytest_gpu_skinny_lora.log "${TEST_S:-150}" tests/test_skinny_lora.py ${EXTRA_TESTS:-}
echo "== projections at ${SECONDS}s"
timeout $(($(left) - 150)) python benchmarks/bench_skinny_lora.py --out "$OUT/skinny_lora.json" 2>&1 \
    | grep -E "µs|Error"
echo "== decode forwards at ${SECONDS}s"
mkdir -p /tmp/traces
timeout $(($(left) - 10)) python benchmarks/trace_decode_graph.py --variants backbone,fused,skinny_lora \
    --trace-variants skinny_lora --trace-dir /tmp/traces --paired 12 --out "$OUT/decode_graph_trace_skinny_lora.json" \
    2>&1 | grep -E "µs|paired|failed|Error"
tar -czf "$OUT/decode_graph_traces_skinny_lora.tgz" -C /tmp/traces . 2>/dev/null
save_triton_cache
echo "== done at ${SECONDS}s"
