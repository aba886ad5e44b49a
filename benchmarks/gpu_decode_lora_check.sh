#!/usr/bin/env bash
# One device call (about 9 minutes on an H200): the LoRA-beside-the-GEMM GPU tests and benchmark
# (ops/overlap.py), then where the distinct-adapter gap of the Punica workload goes: 128 requests at
# batch 32 with adapters loaded during the run (and the backbone), then with all of them resident.
#   OUT=/some/dir bash benchmarks/gpu_decode_lora_check.sh
# (committed as results/lora_overlap.*, textgen_runs/p128_b32_loads_during_run.json (p128_cold) and
# textgen_runs/p128_b32_all_resident.json (p128_resident))
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
BENCH=(python3 -c 'import sys; from loraplex.cli import main; sys.exit(main())' bench --quiet --no-plots
       --requests 128 --lengths punica --popularity distinct --max-batch 32)
timeout 130 python -m pytest -m gpu -q tests/test_model_gpu.py tests/test_engine_gpu.py -k "graph or eager" 2>&1 \
    | tail -4 | tee "$OUT/pytest_overlap.log"
echo "== overlap benchmark at ${SECONDS}s"
timeout 170 python benchmarks/bench_lora_overlap.py --batches 1,32,256 --out "$OUT/lora_overlap.json" \
    --md "$OUT/lora_overlap.md" 2>&1 | grep -v Warning | tail -24
echo "== loads during the run, at ${SECONDS}s"
timeout 170 "${BENCH[@]}" --systems loraplex,loraplex-backbone --out-dir "$OUT" --name p128_cold 2>&1 | tail -5
echo "== all resident, at ${SECONDS}s"
timeout $((585 - SECONDS)) "${BENCH[@]}" --systems loraplex --gpu-adapters 128 --preload-adapters --out-dir "$OUT" \
    --name p128_resident 2>&1 | tail -3
echo "== done at ${SECONDS}s"
