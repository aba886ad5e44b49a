#!/usr/bin/env bash
# The GPU tests (pytest -m gpu: kernels against their float64 loops in bf16/fp16, CUDA-graph replays, the engine
# against transformers + PEFT) on a lent GPU machine; the whole log in $OUT/pytest_gpu.log. Modules that need
# packages the image lacks (openai, textual) fail to collect and are reported, not fatal: they hold no GPU tests.
#   OUT=$OUT bash benchmarks/gpu_tests.sh                        # every GPU test under tests/
#   OUT=$OUT bash benchmarks/gpu_tests.sh tests/test_ops_gpu.py  # some of them (any pytest arguments)
# With no arguments it runs in two phases: every GPU test but those marked gpu_memory in WORKERS (default 8)
# pytest-xdist processes (their time is mostly Triton's first compiles, which run on the CPU; each group of
# tests that share engines stays in one process), then the gpu_memory tests alone: they size KV caches from the
# memory other processes leave. Each phase stops 20 s before the call's deadline, for `finish`.
. "$(dirname "$0")/gpu_common.sh"
PYTEST=(python -m pytest -q -rfE -p no:cacheprovider --continue-on-collection-errors --durations=25)
run_pytest() {
  [ "$(left)" -gt 30 ] || { echo "== no time left for: $*"; return; }
  timeout -s INT -k 15 "$(($(left) - 20))" "${PYTEST[@]}" "$@" 2>&1 | tee -a "$OUT/pytest_gpu.log" \
      | grep -E "FAILED|ERROR|passed|failed|deselected|^[0-9.]+s (call|setup)" | tail -40
}
: >"$OUT/pytest_gpu.log"
if [ $# -gt 0 ]; then
  echo "== GPU tests: $*"
  run_pytest -m gpu "$@"
else
  echo "== GPU tests: ${WORKERS:-8} workers"
  run_pytest -m "gpu and not gpu_memory" -n "${WORKERS:-8}" tests
  echo "== GPU tests that size themselves from free memory, alone ($SECONDS s so far)"
  run_pytest -m "gpu and gpu_memory" -n 0 tests -o log_cli=true --log-cli-level=INFO
fi
echo "== $SECONDS s"
finish
