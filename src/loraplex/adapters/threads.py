"""Adapter loader threads run their CPU ops on one core each, not on an OpenMP team of all of them.

PyTorch splits a large CPU op (a copy of more than 32K elements) over an OpenMP team as large as the
machine has cores, and every calling thread gets a team of its own. A 7B adapter load makes ~450 such
copies (packing, casting) on each loader thread, so two or four loaders bring two or four teams of 16
threads onto a 16-core host, each team spinning between ops, beside the engine's own thread. On the
H200 host (`benchmarks/results/probe_loads*.json`, no engine running) one reader went from 25 to 44 7B
reads/s with one core, two from 31–33 to 44, four from 17–19 to 22. (Beside an unlimited-batch engine run,
the median read went 0.27 → 0.22 s; that run's throughput did not move, because loads were not what
limited it: benchmarks/NOTES.md.)

`torch.set_num_threads` would not do: it also changes the count every thread started later takes
(the server's and the engine's), so this sets the calling thread's OpenMP team size only, through the
OpenMP runtime PyTorch loaded. Where there is none (another threading backend), it does nothing.
"""
from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path

import torch


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process loaded (GNU's libgomp or LLVM's libomp), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:   # not Linux
        return None
    for path in sorted(set(re.findall(r"(/\S*/lib(?:gomp|omp|iomp5)[^/\s]*\.so[^/\s]*)", maps))):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def one_core_per_thread() -> bool:
    """Make the calling thread's CPU torch ops run on it alone (a thread pool's initializer).
    Whether it could (an OpenMP runtime was found)."""
    # ATen sizes a thread's team at its first parallel op, from the process-wide count: let that happen
    # now, so it cannot undo the setting below later
    torch.get_num_threads()
    lib = _openmp_runtime()
    if lib is None:
        return False
    lib.omp_set_num_threads(1)
    return torch.get_num_threads() == 1
