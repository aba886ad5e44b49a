"""Test set-up: without CUDA, Triton kernels run in its CPU interpreter (set before any import)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if not HAS_CUDA:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    elif int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        # other test processes hold GPU memory that these tests would count as taken
        alone = pytest.mark.skip(reason="sizes itself from the GPU's free memory: run alone, "
                                        "`pytest -m gpu_memory -n 0`")
        for item in items:
            if "gpu_memory" in item.keywords:
                item.add_marker(alone)
