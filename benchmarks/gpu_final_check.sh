#!/usr/bin/env bash
# One device call (about 8 minutes on an H200): the GPU tests of the engine and adapter tiers, the
# load-interference benchmark, then the paper's workload at unlimited batch.
#   OUT=/some/dir bash benchmarks/gpu_final_check.sh
# (committed as results/load_interference.json, textgen_runs/punica_unl_loraplex.json)
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
timeout 100 python -m pytest -m gpu -q tests/test_engine_gpu.py tests/test_adapters_gpu.py 2>&1 | tail -4 \
    | tee "$OUT/pytest_gpu_final.log"
echo "== interference at ${SECONDS}s"
timeout 110 python benchmarks/bench_load_interference.py --forwards 11 --out "$OUT/load_interference.json" 2>&1 \
    | grep -v Warning | tail -12
echo "== Punica 1000 unlimited, at ${SECONDS}s"
timeout $((585 - SECONDS)) python3 -c 'import sys; from loraplex.cli import main; sys.exit(main())' bench --quiet \
    --no-plots --lengths punica --popularity distinct --requests 1000 --max-batch unlimited --systems loraplex \
    --out-dir "$OUT" --name punica_unl_loraplex 2>&1 | tail -6
echo "== done at ${SECONDS}s"
