#!/usr/bin/env bash
# One device call (~6 minutes on an H200): the prompt tiles' expand options (LORAPLEX_LORA_PREFILL). Their GPU
# test against the float64 loop, the probe that times the LoRA kernels of prompt forwards with each value
# (benchmarks/probe_prefill_lora.py) and picks the fastest, then the engine benchmark at batch 32 with the
# default and that value (the old default, sgmv.PREFILL_PLAIN, if the default won) in the same engine, runs
# interleaved (bench_engine.py --prefill).
#   OUT=/some/dir bash benchmarks/gpu_prefill_check.sh
# PROBE_VARIANTS: the values the probe tries (';'-separated changes to sgmv.PREFILL_DEFAULT, the empty one
# it); DEADLINE: the second of this script at which the engine benchmark is stopped (default 560).
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
restore_triton_cache
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
echo "== GPU tests at ${SECONDS}s"
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_ops_gpu.py -k prefill_expand 2>&1 \
    | tee "$OUT/pytest_gpu_prefill.log" | tail -2
echo "== probe at ${SECONDS}s"
timeout 150 python benchmarks/probe_prefill_lora.py --variants "${PROBE_VARIANTS:-;noprefetch,n128,epps2;n128;epps8}" \
    --out "$OUT/probe_prefill_lora.json" --best "$OUT/best_prefill.txt" 2>&1 | grep -v -i warn | tail -16
best=$(cat "$OUT/best_prefill.txt" 2>/dev/null || true)
best=${best:-noprefetch,n128,epps2}   # the default won the probe: set it against sgmv.PREFILL_PLAIN
echo "== engine at ${SECONDS}s, prefill options: default and [${best}]"
timeout $((${DEADLINE:-560} - SECONDS)) python benchmarks/bench_engine.py --batches 32 --modes graphs \
    --variants backbone,distinct,shared --repeats 3 --prefill ";$best" \
    --out "$OUT/engine_prefill.json" --md "$OUT/engine_prefill.md" 2>&1 | grep "^|"
save_triton_cache
echo "== done at ${SECONDS}s"
