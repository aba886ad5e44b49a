#!/usr/bin/env bash
# One device call (~9.5 minutes on an H200; the new kernels compile first): (1) the GPU tests of ops/skinny_lora.py
# (a decode projection's GEMM, shrink and expand in one launch; twentieth session), of the prompt tiles' expand
# with y through the identity's dot (KernelConfig.tile_y_dot) and of the adapter tier (the release-event change of
# the nineteenth session had not run); (2) batch-32 Llama-2-7B decode forwards in CUDA graphs: backbone, today's
# "fused" path and skinny_lora, paired rounds, with a profiler trace of skinny_lora; (3) the eager prompt forwards
# with the expand's y through the dot, 2-4 stages, against the default (probe_prefill_lora.py).
#   OUT=/some/dir bash benchmarks/gpu_skinny_lora.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-575}
gpu_tests pytest_gpu_skinny_lora.log "${TEST_S:-230}" tests/test_skinny_lora.py tests/test_adapters_gpu.py \
    tests/test_ops_gpu.py -k "test_skinny_lora or test_adapters_gpu or prefill_expand"
echo "== decode forwards at ${SECONDS}s"
mkdir -p /tmp/traces
timeout $(($(left) - 150)) python benchmarks/trace_decode_graph.py --variants backbone,fused,skinny_lora \
    --trace-variants skinny_lora --trace-dir /tmp/traces --paired 12 --out "$OUT/decode_graph_trace_skinny_lora.json" \
    2>&1 | grep -E "µs|paired|failed|Error|busy"
tar -czf "$OUT/decode_graph_traces_skinny_lora.tgz" -C /tmp/traces . 2>/dev/null
echo "== prompt forwards at ${SECONDS}s"
timeout $(($(left) - 5)) python benchmarks/probe_prefill_lora.py --cases prompts6,mixed20 \
    --variants ";ydot;ydot,es3;ydot,es4" --rounds 3 --out "$OUT/probe_prefill_ydot.json" 2>&1 \
    | grep -E "forward|backbone|Error"
save_triton_cache
echo "== done at ${SECONDS}s"
