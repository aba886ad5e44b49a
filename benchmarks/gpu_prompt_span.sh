#!/usr/bin/env bash
# One device call (~5 minutes on an H200 with the carried Triton cache): issue 5's engine benchmark at batch 32
# (backbone and distinct adapters, 5 runs each), now reporting the eager prompt steps' GPU span beside their wall
# time and the host time of queueing them (bench_engine.py's `prefill_gpu_ms`, `prompt_steps_gpu_seconds`,
# `eager_launches_host_seconds`), with the GPU's clocks, power and throttling logged each second (nvidia-smi
# dmon): in the nineteenth session the distinct prompt steps cost 9-13 ms more than the backbone's in the engine
# and varied run to run, but ~6 ms when their forward was timed alone, where a 20-decode case jumped from ~54 to
# ~42.6 ms partway through the probe whatever its variant (results/probe_prefill_store.json).
# First the adapter tier's GPU tests (the nineteenth session's release-event change has not run on a GPU).
#   OUT=/some/dir bash benchmarks/gpu_prompt_span.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-420}
gpu_tests pytest_gpu_adapters.log "${TEST_S:-60}" tests/test_adapters_gpu.py
nvidia-smi dmon -s pucv -d 1 -o T > "$OUT/dmon_prompt_span.log" 2>&1 &
dmon=$!
REPEATS=5 engine_each LORAPLEX_PDL prompt_span on
kill "$dmon" 2>/dev/null
save_triton_cache
echo "== done at ${SECONDS}s"
