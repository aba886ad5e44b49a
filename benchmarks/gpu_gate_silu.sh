#!/usr/bin/env bash
# One device call (~7 minutes on an H200), after gpu_vector_loads.sh measured the 16-byte B loads (2026-12-02,
# seventeenth session): (1) the GPU tests of the kernels that read B 16 bytes at a time (that call's time limit
# cut its tests); (2) gate/up's product left to SiLU-and-mul ("all_split512": measured level with today's path
# with 2-byte loads, when SiLU's product took 19 µs a layer) at 256/512/1024 columns a program, against today's
# path in paired rounds; (3) RoPE with the exact mask (LORAPLEX_LORA_VECTOR_LOADS=no-rope: its busy time rose
# 274 -> 289 µs a forward with the 16-byte loads) against today's path.
#   OUT=/some/dir bash benchmarks/gpu_gate_silu.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
gpu_tests pytest_gpu_vector_loads_b.log "${TEST_S:-200}" tests/test_lora_product_gpu.py tests/test_fused_gpu.py \
    tests/test_ops_gpu.py -k "${TEST_K:-product or lora_deltas or (rowwise and distinct)}"
run_trace() {   # setting, name, variants, trace variant
  [ "$(left)" -gt 60 ] || return 0
  echo "== decode forward $2 (LORAPLEX_LORA_VECTOR_LOADS=$1) at ${SECONDS}s"
  LORAPLEX_LORA_VECTOR_LOADS=$1 timeout $(($(left) - 20)) python benchmarks/trace_decode_graph.py --variants "$3" \
      --trace-variants "$4" --paired 7 --out "$OUT/decode_graph_trace_$2.json" 2>&1 | grep -E "^[a-z_0-9+]+ +[0-9]+ µs|^paired" | tail -12
}
if [ "${TRACE:-1}" = 1 ]; then
  run_trace on gate_silu backbone,fused,all_split512,all_split512+silu256,all_split512+silu1024 all_split512
  run_trace no-rope rope_exact backbone,fused fused
  python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for name in ("gate_silu", "rope_exact"):
    f = Path(sys.argv[1]) / f"decode_graph_trace_{name}.json"
    if not f.exists():
        continue
    d = json.loads(f.read_text())
    print(name, {k: v.get("graph_us") for k, v in d["variants"].items()})
    for v, t in d.get("timelines", {}).items():
        print(" ", v, "busy", {k: round(x) for k, x in t.get("busy_us", {}).items()})
        print(" ", v, "alone", {k: round(x) for k, x in t.get("alone_us", {}).items()})
PY
fi
echo "== done at ${SECONDS}s"
