#!/usr/bin/env bash
# One device call's worth of engine checks on a CUDA machine (about 8 minutes on an H200):
# the engine, model and sampler GPU tests, then the engine benchmark at 32 and 256 sequences.
#   OUT=/some/dir bash benchmarks/gpu_engine_check.sh
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD/src
timeout 200 python -m pytest -m gpu -q -x tests/test_engine_gpu.py tests/test_sampling.py tests/test_model_gpu.py \
    2>&1 | tail -5 | tee "$OUT/pytest_gpu_engine.log"
timeout 380 python benchmarks/bench_engine.py --batches 32,256 --modes graphs,eager --eager-batches 32 --repeats 3 \
    --out "$OUT/engine.json" --md "$OUT/engine.md" 2>&1 | grep -v '^{' | tail -16
