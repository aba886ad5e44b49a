#!/usr/bin/env bash
# One device call: the LoRA-in-the-GEMM probe (benchmarks/probe_lora_in_gemm.py, ~2 minutes; PROBE=0 skips
# it), then the paper's workload at max batch 32 for loraplex with each popularity in POPULARITIES
# (e.g. "skewed uniform", one `loraplex bench` run, ~5 minutes each at 1,000 requests).
#   OUT=/some/dir PROBE=1 POPULARITIES="skewed" bash benchmarks/gpu_probe_popularities.sh
# Triton's compile cache comes back in 15 MB parts ($OUT/triton-cache.tgz.part-aa, -ab, ...; a file over
# 16 MiB does not come back): `cat` them into the repo root's .triton-cache.tgz (git-ignored) and carry it.
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
restore_triton_cache
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
if [ "${PROBE:-1}" = 1 ]; then
  echo "== probe at ${SECONDS}s"
  timeout 300 python benchmarks/probe_lora_in_gemm.py --out "$OUT/probe_lora_in_gemm.json" 2>&1 | tee "$OUT/probe_lora_in_gemm.log"
fi
if [ -n "${POPULARITIES:-}" ]; then
  pops=$(echo "$POPULARITIES" | tr ' ' ',')
  echo "== Punica 1000, loraplex, max batch 32, $pops, at ${SECONDS}s"
  timeout $((585 - SECONDS)) python3 -c 'import sys; from loraplex.cli import main; sys.exit(main())' bench --quiet \
      --no-plots --lengths punica --popularity "$pops" --requests 1000 --max-batch 32 --systems loraplex \
      --out-dir "$OUT" --name "punica_32_loraplex_$(echo "$pops" | tr ',' '_')" 2>&1 | tail -14
fi
save_triton_cache
echo "== done at ${SECONDS}s"
