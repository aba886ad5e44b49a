#!/usr/bin/env bash
# The engine benchmark (benchmarks/bench_engine.py) in one process: backbone, distinct and shared adapters at
# max_num_seqs 32 and 256 in CUDA graphs (eager too at 32), 3 interleaved runs of each; ~6 minutes on an H200.
#   OUT=$OUT bash benchmarks/gpu_engine.sh
#   OUT=$OUT BATCHES=32 MODES=graphs VARIANTS=backbone,distinct bash benchmarks/gpu_engine.sh   # the headline pair
# NAME (default engine) names the results, $OUT/NAME.json and .md (and NAME.gpu.csv, the GPU's clocks); arguments
# go to bench_engine.py after these.
# BASELINE=DIR runs DIR/src with DIR/benchmarks/bench_engine.py instead (an older revision, `git archive REV src
# benchmarks | tar -x -C DIR`, carried): the before of a before/after pair, on the same machine.
. "$(dirname "$0")/gpu_common.sh"
NAME=${NAME:-engine}
BENCH=benchmarks/bench_engine.py
if [ -n "${BASELINE:-}" ]; then
  export PYTHONPATH=$PWD/$BASELINE/src:$PYTHONPATH
  BENCH=$BASELINE/benchmarks/bench_engine.py
fi
# the GPU's clocks, power and temperature every 250 ms beside the run ($OUT/NAME.gpu.csv; the JSON's
# repeats_started say when each run began): whether a slow run ran at lower clocks
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,nounits -lms 250 \
      >"$OUT/$NAME.gpu.csv" 2>/dev/null &
  LOGGER=$!
fi
timeout "$(left)" python "$BENCH" --batches "${BATCHES:-32,256}" --modes "${MODES:-graphs,eager}" \
    --variants "${VARIANTS:-backbone,distinct,shared}" --repeats "${REPEATS:-3}" \
    --out "$OUT/$NAME.json" --md "$OUT/$NAME.md" "$@" 2>&1
[ -n "${LOGGER:-}" ] && kill "$LOGGER" 2>/dev/null
finish
