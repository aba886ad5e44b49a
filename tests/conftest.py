"""Test set-up: without CUDA, Triton kernels run in its CPU interpreter (set before any import); an xdist worker's
CPU thread pools are its share of the cores."""
import os


def _worker_share_of_the_cores() -> int | None:
    """The cores per xdist worker where the workers are several (at least one each); None otherwise."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))   # (xdist sets it before conftest loads)
    if not os.environ.get("PYTEST_XDIST_WORKER") or workers < 2:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // workers)


# Thread pools as large as the machine in each worker spin against each other's and slow every CPU op several
# times over. numpy's OpenBLAS (the Triton interpreter's dots) reads its count once, when it loads.
WORKER_THREADS = _worker_share_of_the_cores()
if WORKER_THREADS is not None:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(WORKER_THREADS))

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
# torch's own count of intra-op threads, before pytest_configure lowers it to the worker's share
# (tests/test_adapter_threads.py runs with this count)
TORCH_THREADS = torch.get_num_threads()


# Modules of few but long tests (tens of seconds each module). xdist's loadfile hands out modules by their count of
# tests, most first, which leaves these to the end, where the last one runs while the other workers wait: they go
# first instead (pytest_collection_modifyitems), longest first.
LONG_MODULES = ("test_cluster_ray.py", "test_demo_model.py", "test_first_run.py", "test_compositions.py",
                "test_server_errors.py", "test_server_faults.py", "test_step_profile.py")


def pytest_configure(config):
    if config.getoption("dist", "no") == "loadfile" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False   # (the controller's) the workers' collection order is the order
    if WORKER_THREADS is not None and WORKER_THREADS < TORCH_THREADS:
        torch.set_num_threads(WORKER_THREADS)
        # and the servers and scripts a test starts
        os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))


def _long_modules_first(items: list) -> None:
    """Modules in LONG_MODULES' order, then by their count of tests, most first (as xdist orders them); each
    module's tests in their own order."""
    count: dict[str, int] = {}
    for item in items:
        count[item.path.name] = count.get(item.path.name, 0) + 1
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -count[item.path.name], item.path.name))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _long_modules_first(items)
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
