#!/usr/bin/env bash
# One device call (about 9 minutes on an H200): a 128-request check of adapter loads during the run
# (compare its mixed-step time with p128_resident), then the paper's workload at one max batch.
#   OUT=/some/dir MAX_BATCH=32 bash benchmarks/gpu_punica_run.sh
# (committed as textgen_runs/p128_b32_loads_during_run_priority.json (p128_cold_fixed) and
# textgen_runs/punica_b32_loraplex.json (punica_32_loraplex))
set -u
OUT=${OUT:-benchmarks/results}
MAX_BATCH=${MAX_BATCH:-32}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
BENCH=(python3 -c 'import sys; from loraplex.cli import main; sys.exit(main())' bench --quiet --no-plots
       --lengths punica --popularity distinct)
if [ "${SKIP_CHECK:-0}" != 1 ]; then
  timeout 170 "${BENCH[@]}" --requests 128 --max-batch 32 --systems loraplex --out-dir "$OUT" --name p128_cold_fixed \
      2>&1 | tail -3
fi
echo "== Punica 1000 at max batch $MAX_BATCH, at ${SECONDS}s"
timeout $((590 - SECONDS)) "${BENCH[@]}" --requests 1000 --max-batch "$MAX_BATCH" --systems loraplex \
    --out-dir "$OUT" --name "punica_${MAX_BATCH}_loraplex" 2>&1 | tail -8
echo "== done at ${SECONDS}s"
