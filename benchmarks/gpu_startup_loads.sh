#!/usr/bin/env bash
# One device call (~5 minutes on an H200): the start-up of the paper's workload at batch 32 with distinct
# adapters (the first REQUESTS requests), once per loader setting, to see what holds the first batch back
# (bench rows: first_step_s, steps/rows_short_on_adapters, last_short_on_adapters_s, adapter_load_*_first_*).
#   OUT=/some/dir REQUESTS=120 bash benchmarks/gpu_startup_loads.sh
# VARIANTS: space-separated name=setting pairs; a setting is "threadsN", "adaptive", "noreserve" (no pinned host
# memory reserved at start-up: --adapter-host-reserve-gib 0) or several joined by ",".
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
restore_triton_cache
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
for pair in ${VARIANTS:-default= threads4=threads4 adaptive=adaptive both=threads4,adaptive}; do
  name=${pair%%=*}; setting=${pair#*=}
  threads=2; host=1; reserve=""
  case ",$setting," in *,threads*) threads=$(echo "$setting" | sed -E 's/.*threads([0-9]+).*/\1/');; esac
  case ",$setting," in *,adaptive,*) host=adaptive;; esac
  case ",$setting," in *,noreserve,*) reserve="--adapter-host-reserve-gib 0";; esac
  echo "== $name (loader threads $threads, LORAPLEX_HOST_PRIORITY=$host ${reserve}) at ${SECONDS}s"
  left=$((${DEADLINE:-585} - SECONDS)); [ "$left" -gt 0 ] || { echo "== out of time before $name"; break; }
  LORAPLEX_HOST_PRIORITY=$host timeout "$left" python3 -c \
      'import sys; from loraplex.cli import main; sys.exit(main())' bench --quiet --no-plots \
      --lengths punica --popularity distinct --requests "${REQUESTS:-120}" --max-batch 32 --systems loraplex \
      --loader-threads "$threads" $reserve --out-dir "$OUT" --name "startup_${name}" 2>&1 | grep -E "^\| distinct \| 32 \| loraplex \| [0-9]" | head -2
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print({k: r.get(k) for k in ('seconds', 'tokens_per_s', 'first_step_s', 'steps_short_on_adapters', 'rows_short_on_adapters', 'last_short_on_adapters_s', 'mean_batch', 'other_seconds', 'pinned_host_allocs', 'pinned_host_alloc_s', 'decode_gpu_ms_max', 'decode_gpu_ms_max_at_s') + tuple(k for k in r if k.startswith('adapter_load_') and 'first' in k)})" "$OUT/startup_${name}.json"
done
echo "== done at ${SECONDS}s"
