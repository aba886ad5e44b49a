#!/usr/bin/env bash
# One device call (~10 minutes on an H200): ops/pdl.py's programmatic dependent launch (LORAPLEX_PDL=on; built
# 2026-12-02, eighteenth session, compiled but not yet run on a GPU). Every Triton kernel waits at its first
# instruction for the grids before it, so with PDL a kernel's programs are placed on the SMs while the one
# before it finishes: ~330 kernels in a row per Llama-2-7B decode forward. PDL is a compile-time constant read
# at import, so each setting runs in its own process: (1) batch-32 decode forwards in CUDA graphs, backbone and
# distinct adapters ("fused"), off, on, off, on (trace_decode_graph.py, four processes); (2) GPU
# tests with it on (graph replays against eager, the engine against transformers); (3) issue 5's engine
# benchmark with it on, then off. Returns the Triton cache entries it compiled.
#   OUT=/some/dir bash benchmarks/gpu_pdl.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-570}
# off, on, off, on: PDL is fixed per process, so its effect is read across processes (their spread shows in the
# repeats); the first of each setting compiles (~1 min)
for setting in off on off on; do
  [ "$(left)" -gt 240 ] || break
  n=$(ls "$OUT"/decode_graph_trace_pdl_"$setting"*.json 2>/dev/null | wc -l)
  echo "== decode forwards, LORAPLEX_PDL=$setting, at ${SECONDS}s"
  LORAPLEX_PDL=$setting timeout 150 python benchmarks/trace_decode_graph.py --variants backbone,fused --paired 7 \
      --out "$OUT/decode_graph_trace_pdl_${setting}_$n.json" 2>&1 | grep -E "^[a-z_0-9+]+ +[0-9]+ µs|^paired|Error" \
      | tail -6
done
if [ "$(left)" -gt 200 ]; then
  which="pdl or decode_graph_replays_new or mixed_graph_replays or mixed_bf16 or graphs_and_eager_give or seeded"
  LORAPLEX_PDL=on gpu_tests pytest_gpu_pdl.log "${TEST_S:-150}" tests/test_pdl.py tests/test_model_gpu.py \
      tests/test_engine_gpu.py -k "$which"
fi
engine_each LORAPLEX_PDL pdl on off
save_triton_cache
echo "== done at ${SECONDS}s"
