#!/usr/bin/env bash
# One device call (~8 minutes on an H200 with the carried Triton cache): the prompt tiles' LoRA kernels.
# 1. GPU tests of the large tiles' settings against the float64 loop, "rows" among them (test_ops_gpu.py);
# 2. probe_prefill_expand.py: shrink and expand alone per 7B projection for LORAPLEX_LORA_PREFILL values (the
#    mixed steps' one-row decode tiles row by row: "rows"; fewer registers a thread: n32, ew8, ...), beside the
#    bandwidth floor of the expand's read-modify-write;
# 3. issue 5's engine benchmark at batch 32 (backbone, distinct; REPEATS runs each, interleaved, one process) with
#    the default, the probe's best (ts3 where that is the default) and, where the best has no "rows" and is not
#    the default, "rows" with it.
# (First run 2026-12-02 with "rows" and "rows,rn128" only: results/engine_prefill_rows.md.)
#   OUT=/some/dir bash benchmarks/gpu_prefill_rows.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-570}
gpu_tests pytest_gpu_prefill_${TAG:-rows}.log "${TEST_S:-120}" tests/test_ops_gpu.py -k prefill_expand
rm -f /tmp/best.txt
echo "== probe at ${SECONDS}s"
timeout $(($(left) - 200)) python benchmarks/probe_prefill_expand.py --out "$OUT/probe_prefill_expand${TAG:+_$TAG}.json" \
    --best /tmp/best.txt 2>&1 | grep -E "^total|Error|error" | tail -5
best=$(cat /tmp/best.txt 2>/dev/null || echo "")
prefills=";$best"
[ -n "$best" ] || prefills=";ts3"
case "$best" in ""|*rows*) ;; *) prefills="$prefills;rows,$best" ;; esac
echo "== engine at ${SECONDS}s, prefill values '$prefills'"
nvidia-smi dmon -s pucv -d 1 -o T > "$OUT/dmon_prefill_${TAG:-rows}.log" 2>&1 &
dmon=$!
timeout $(($(left) - 10)) python benchmarks/bench_engine.py --batches 32 --modes graphs --variants backbone,distinct \
    --repeats "${REPEATS:-5}" --prefill "$prefills" --out "$OUT/engine_prefill_${TAG:-rows}.json" \
    --md "$OUT/engine_prefill_${TAG:-rows}.md" 2>&1 | grep -E "^\| 32|Error"
kill "$dmon" 2>/dev/null
save_triton_cache
echo "== done at ${SECONDS}s"
