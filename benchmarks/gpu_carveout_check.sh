#!/usr/bin/env bash
# One device call for the next session (about 9 minutes on an H200), best as the first call on a fresh
# machine: the decode forward with cuBLAS's SM carve-out during capture (SMs left to the LoRA kernels
# beside the GEMMs, bench_lora_overlap.py --carveouts), then the paper's workload at batch 32 as the
# machine's first engine process (do mixed steps still compile kernels mid-run? compare the mixed-step
# time with results/textgen_runs/punica_b32_loraplex.json's 46.1 ms and p128_b32_cold_full_b's 37.8 ms).
#   OUT=/some/dir bash benchmarks/gpu_carveout_check.sh
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
echo "== Punica 1000 at max batch 32, first engine process, at ${SECONDS}s"
timeout 450 python3 -c 'import sys; from loraplex.cli import main; sys.exit(main())' bench --quiet --no-plots \
    --lengths punica --popularity distinct --requests 1000 --max-batch 32 --systems loraplex \
    --out-dir "$OUT" --name punica_32_fresh 2>&1 | grep "| distinct"
echo "== carve-out at ${SECONDS}s"
timeout $((590 - SECONDS)) python3 benchmarks/bench_lora_overlap.py --batches 1,32 --carveouts 0,8,16,32 \
    --out "$OUT/lora_overlap_carveout.json" --md "$OUT/lora_overlap_carveout.md" 2>&1 | grep -v Warning | tail -30
echo "== done at ${SECONDS}s"
