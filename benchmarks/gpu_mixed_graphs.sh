#!/usr/bin/env bash
# One device call (about 8 minutes on an H200): the GPU tests of mixed-step CUDA graphs (replay against
# eager; the engine's graph and eager tokens against transformers), then the paper's workload at max
# batch 32 for the backbone alone (SYSTEMS=loraplex-backbone) or loraplex (SYSTEMS=loraplex).
#   OUT=/some/dir SYSTEMS=loraplex-backbone MAX_BATCH=32 TESTS=1 bash benchmarks/gpu_mixed_graphs.sh
# EXTRA: more `loraplex bench` flags (e.g. "--loader-threads 4"); TAG: a suffix for the result's name;
# DEADLINE: the second of this script at which the benchmark is stopped (default 585).
# Triton's compile cache travels between calls (a fresh machine spent ~90 s of its ~110 s engine start-up
# compiling): the call leaves it in 15 MB parts ($OUT/triton-cache.tgz.part-aa, -ab, ...: a file over 16 MiB
# does not come back); `cat` them into the repo root's .triton-cache.tgz (git-ignored) and carry that.
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
restore_triton_cache
MAX_BATCH=${MAX_BATCH:-32}
SYSTEMS=${SYSTEMS:-loraplex-backbone}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests at ${SECONDS}s"
  # PYTEST_ARGS: other GPU tests instead (e.g. "tests/test_adapters_gpu.py tests/test_engine_gpu.py")
  timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -x ${PYTEST_ARGS:-tests/test_model_gpu.py \
      tests/test_engine_gpu.py -k "mixed_graph or decode_graph_replays or graphs_and_eager or seeded"} 2>&1 \
      | tee "$OUT/pytest_gpu_mixed_graphs.log" | tail -4
fi
echo "== Punica 1000, $SYSTEMS, max batch $MAX_BATCH, at ${SECONDS}s"
timeout $((${DEADLINE:-585} - SECONDS)) python3 -c 'import sys; from loraplex.cli import main; sys.exit(main())' bench --quiet --no-plots \
    --lengths punica --popularity distinct --requests 1000 --max-batch "$MAX_BATCH" --systems "$SYSTEMS" \
    --out-dir "$OUT" --name "punica_${MAX_BATCH}_${SYSTEMS}${TAG:-}" ${EXTRA:-} 2>&1 | tail -14
save_triton_cache
echo "== done at ${SECONDS}s"
