#!/usr/bin/env bash
# `loraplex bench` (src/loraplex/bench/: the Punica paper's offline workload, 1,000 requests queued at once) for
# one system per call: a Punica run takes ~260-300 s a system on an H200, so one call holds one of them.
#   OUT=$OUT SYSTEMS=loraplex POPULARITY=distinct MAX_BATCH=32 bash benchmarks/gpu_textgen.sh
#   OUT=$OUT SYSTEMS=loraplex-backbone bash benchmarks/gpu_textgen.sh
#   OUT=$OUT bash benchmarks/gpu_textgen.sh --requests 32 --lengths fixed --prompt-len 128 --output-len 64 \
#       --systems loraplex,loraplex-backbone,hf-peft,hf-backbone,hf-peft-grouped --preload-adapters
# Arguments go to `loraplex bench` after the defaults (a later flag wins). Merge the runs into one report here:
#   python -m loraplex.bench.report benchmarks/results/textgen_runs/*.json --out-dir benchmarks/results --name textgen_7b
. "$(dirname "$0")/gpu_common.sh"
SYSTEMS=${SYSTEMS:-loraplex} POPULARITY=${POPULARITY:-distinct} MAX_BATCH=${MAX_BATCH:-32}
NAME=${NAME:-punica_b${MAX_BATCH}_${SYSTEMS//,/+}_${POPULARITY//,/+}}
timeout "$(left)" python -m loraplex.cli bench --quiet --no-plots --requests 1000 --systems "$SYSTEMS" \
    --popularity "$POPULARITY" --max-batch "$MAX_BATCH" --out-dir "$OUT" --name "$NAME" "$@" 2>&1 | grep -v '^{'
finish
