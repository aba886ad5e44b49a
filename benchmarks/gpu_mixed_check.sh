#!/usr/bin/env bash
# One device call (about 7 minutes on an H200): 128 Punica requests at batch 32, adapters loaded during
# the run, with the LoRA products beside the GEMMs ("full", twice: run-to-run spread) and with only the
# shrink beside them ("shrink"), to see whether the mode moves the eager mixed steps.
#   OUT=/some/dir bash benchmarks/gpu_mixed_check.sh
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
BENCH=(python3 -c 'import sys; from loraplex.cli import main; sys.exit(main())' bench --quiet --no-plots
       --requests 128 --lengths punica --popularity distinct --max-batch 32 --systems loraplex)
for run in full_a shrink full_b; do
  echo "== $run at ${SECONDS}s"
  LORAPLEX_LORA_OVERLAP=${run%_*} timeout $((590 - SECONDS)) "${BENCH[@]}" --out-dir "$OUT" --name "p128_cold_$run" \
      2>&1 | grep "| distinct"
done
echo "== done at ${SECONDS}s"
