#!/usr/bin/env bash
# One device call (~5 minutes on an H200): the GPU tests of steps queued ahead that admit prompts
# (EngineConfig.overlap_admissions: mixed graphs whose decode rows take their tokens from the step in flight)
# and of the steps' GPU spans, then what an unlimited-batch mixed step costs on the GPU as the engine's graphs
# hold it: 162 decodes (the unlimited run's mean batch) beside a 64-token prompt, replayed as built and
# padded to graph batches of 176, 192 and 256 sequences (time_mixed_step.py --graph-seqs). Then the paper's
# workload in a second call (overlap_admissions is on by default since 2026-12-01's tenth session;
# EXTRA=--no-overlap-admissions for the run without it): SYSTEMS=loraplex TESTS=0 MAX_BATCH=unlimited
#   bash benchmarks/gpu_mixed_graphs.sh
#   OUT=/some/dir bash benchmarks/gpu_admissions_check.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
restore_triton_cache
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
echo "== GPU tests at ${SECONDS}s"
timeout 300 python -m pytest -m gpu -q -p no:cacheprovider tests/test_engine_gpu.py \
    -k "admitted_beside or graphs_and_eager_give" 2>&1 | tee "$OUT/pytest_gpu_admissions.log" | tail -3
echo "== mixed steps at unlimited-batch shapes at ${SECONDS}s"
timeout $((570 - SECONDS)) python benchmarks/time_mixed_step.py --decodes 162 --prompts 0,64 \
    --graph-seqs 176,192,256 --out "$OUT/mixed_step_unlimited.json" 2>&1 | grep -E "^prompt|Error"
save_triton_cache
echo "== done at ${SECONDS}s"
