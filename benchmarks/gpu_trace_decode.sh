#!/usr/bin/env bash
# One device call (~7 minutes on an H200): every GPU test, then benchmarks/trace_decode_graph.py (a batch-32
# decode forward in a CUDA graph: variants timed apart, and the kernel timeline of a few).
#   OUT=/some/dir TESTS=1 bash benchmarks/gpu_trace_decode.sh
# TESTS=0 / TRACE=0 skip either part; TRACE_ARGS: trace_decode_graph.py's flags; TAG: a suffix for the files.
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
restore_triton_cache
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests at ${SECONDS}s"
  # PYTEST_ARGS: files (word-split); PYTEST_K: a -k expression
  timeout ${TEST_TIMEOUT:-330} python -m pytest -m gpu -q -p no:cacheprovider ${PYTEST_ARGS:-tests} \
      ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
      | tee "$OUT/pytest_gpu_${TAG:-all}.log" | tail -6
fi
if [ "${TRACE:-1}" = 1 ]; then
  echo "== decode graph trace at ${SECONDS}s"
  mkdir -p /tmp/traces
  timeout $((590 - SECONDS)) python benchmarks/trace_decode_graph.py --out "$OUT/decode_graph_trace${TAG:-}.json" \
      --trace-dir /tmp/traces ${TRACE_ARGS:-} 2>&1 | tail -120
  (cd /tmp/traces && tar -czf "$OUT/decode_graph_traces${TAG:-}.tgz" . 2>/dev/null; ls -la "$OUT"/*.tgz)
fi
echo "== done at ${SECONDS}s"
