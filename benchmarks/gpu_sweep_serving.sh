#!/usr/bin/env bash
# One device call (about 8 minutes on an H200): the sweep of the LoRA kernel settings beside the GEMMs
# (sweep_overlap_configs.py), then the online benchmark (bench_serving.py) against `loraplex serve`.
# Needs the server's wheels, fetched here first: `bash benchmarks/fetch_device_wheels.sh`, carry [".whl"].
#   OUT=/some/dir bash benchmarks/gpu_sweep_serving.sh
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1
pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src
python3 -c 'import fastapi, uvicorn, openai; print("fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__, "openai", openai.__version__)'
echo "== sweep at ${SECONDS}s"
timeout 230 python3 benchmarks/sweep_overlap_configs.py --out "$OUT/overlap_sweep.json" 2>&1 | grep -v Warning | tail -16
echo "== serving at ${SECONDS}s"
timeout $((585 - SECONDS)) python3 benchmarks/bench_serving.py \
    --launch "python3 -m loraplex.cli serve --model dummy:llama-2-7b --synthetic-adapters 100 --max-lora-rank 16 \
              --max-gpu-adapters 64 --max-model-len 2048 --log-level warning" \
    --server-log "$OUT/serve.log" --rates 2,4,8,16 --requests 100 --popularity skewed --lengths punica \
    --max-len 2048 --out "$OUT/serving.json" --md "$OUT/serving.md" 2>&1 | grep -v Warning | tail -20
echo "== done at ${SECONDS}s"
