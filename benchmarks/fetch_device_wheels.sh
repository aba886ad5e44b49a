#!/usr/bin/env bash
# Fetch (here, where pip reaches an index) the wheels that `loraplex serve` and bench_serving.py need
# on a GPU machine without a package index whose image lacks them: the versions CI tests with, for
# CPython 3.12 on x86-64. Packages such an image already holds (anyio, click, h11, httpx, idna,
# typing-extensions, annotated-doc) are left out: two copies would clash.
#   bash benchmarks/fetch_device_wheels.sh      # writes .whl/ (git-ignored through .git/info/exclude)
# Carry .whl/ to the GPU machine: the gpu_*.sh launchers install what it holds (gpu_common.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 \
    typing-inspection==0.4.2 opentelemetry-api==1.45.2 uvicorn==0.54.0 openai==3.57.0 jiter==0.19.0 \
    sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
ls .whl
