#!/usr/bin/env bash
# One device call (about 9 minutes on an H200): the GPU tests of the LoRA product left for the next op
# (ops/overlap.py "full"), the decode-forward benchmark of the three overlap modes, then 128 Punica
# requests at batch 32 with every adapter resident: "full" (the default), the backbone, "shrink".
#   OUT=/some/dir bash benchmarks/gpu_delta_check.sh
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
BENCH=(python3 -c 'import sys; from loraplex.cli import main; sys.exit(main())' bench --quiet --no-plots
       --requests 128 --lengths punica --popularity distinct --max-batch 32)
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_gpu.py tests/test_ops_gpu.py \
    tests/test_model_gpu.py tests/test_engine_gpu.py -k "delta or graph or eager" 2>&1 | tail -6 \
    | tee "$OUT/pytest_delta.log"
echo "== overlap benchmark at ${SECONDS}s"
timeout 210 python benchmarks/bench_lora_overlap.py --batches 1,32,64,128,256 --out "$OUT/lora_overlap.json" \
    --md "$OUT/lora_overlap.md" 2>&1 | grep -v Warning | tail -40
echo "== p128 resident, full, at ${SECONDS}s"
timeout 120 "${BENCH[@]}" --systems loraplex --gpu-adapters 128 --preload-adapters --out-dir "$OUT" \
    --name p128_resident_full 2>&1 | tail -3
echo "== p128 backbone at ${SECONDS}s"
timeout 100 "${BENCH[@]}" --systems loraplex-backbone --out-dir "$OUT" --name p128_backbone 2>&1 | tail -3
echo "== p128 resident, shrink, at ${SECONDS}s"
LORAPLEX_LORA_OVERLAP=shrink timeout $((590 - SECONDS)) "${BENCH[@]}" --systems loraplex --gpu-adapters 128 \
    --preload-adapters --out-dir "$OUT" --name p128_resident_shrink 2>&1 | tail -3
echo "== done at ${SECONDS}s"
