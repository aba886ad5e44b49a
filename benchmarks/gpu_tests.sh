#!/usr/bin/env bash
# The GPU tests (pytest -m gpu: kernels against their float64 loops in bf16/fp16, CUDA-graph replays, the engine
# against transformers + PEFT) on a lent GPU machine; the whole log in $OUT/pytest_gpu.log.
#   OUT=$OUT bash benchmarks/gpu_tests.sh                        # every GPU test under tests/
#   OUT=$OUT bash benchmarks/gpu_tests.sh tests/test_ops_gpu.py  # some of them (any pytest arguments)
. "$(dirname "$0")/gpu_common.sh"
[ $# -gt 0 ] || set -- tests
echo "== GPU tests: $*"
timeout "$(left)" python -m pytest -m gpu -q -rA -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest_gpu.log" \
    | grep -E "FAILED|ERROR|passed|failed|deselected" | tail -20
finish
