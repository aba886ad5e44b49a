#!/usr/bin/env bash
# The GPU tests (pytest -m gpu: kernels against their float64 loops in bf16/fp16, CUDA-graph replays, the engine
# against transformers + PEFT) on a lent GPU machine; the whole log in $OUT/pytest_gpu.log. Modules that need
# packages the image lacks (openai, textual) fail to collect and are reported, not fatal: they hold no GPU tests.
#   OUT=$OUT bash benchmarks/gpu_tests.sh                        # every GPU test under tests/
#   OUT=$OUT bash benchmarks/gpu_tests.sh tests/test_ops_gpu.py  # some of them (any pytest arguments)
. "$(dirname "$0")/gpu_common.sh"
[ $# -gt 0 ] || set -- tests
echo "== GPU tests: $*"
timeout -s INT -k 15 "$(left)" python -m pytest -m gpu -q -rfE -p no:cacheprovider --continue-on-collection-errors "$@" 2>&1 | tee "$OUT/pytest_gpu.log" \
    | grep -E "FAILED|ERROR|passed|failed|deselected" | tail -20
finish
