#!/usr/bin/env bash
# One device call (a whole one: about 9.5 minutes on an H200): the paper's workload at max batch 32 with the
# default LoRA path ("fused": q/k/v's product expanded by RoPE, the others beside the GEMM).
# The 2026-12-01 third-session run of this script gave the run 470 s and ran the GPU tests of the model and
# engine paths after it (8 passed, results/pytest_gpu_fused_engine.log); the run needs more than 470 s
# (start-up, warm-up and graph capture included), so it was cut off: it now has the call to itself.
#   OUT=/some/dir bash benchmarks/gpu_punica_fused.sh
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
echo "== Punica 1000 at max batch 32, at ${SECONDS}s"
timeout $((592 - SECONDS)) python3 -c 'import sys; from loraplex.cli import main; sys.exit(main())' bench --quiet \
    --no-plots --lengths punica --popularity distinct --requests 1000 --max-batch 32 --systems loraplex \
    --out-dir "$OUT" --name punica_b32_fused 2>&1 | tail -8
echo "== done at ${SECONDS}s"
