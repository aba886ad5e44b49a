"""Adapter loader threads run their CPU ops on one core each, not on an OpenMP team of all of them.

PyTorch splits a large CPU op (a copy of more than 32K elements) over an OpenMP team as large as the
machine has cores, and every calling thread gets a team of its own. A 7B adapter load makes ~450 such
copies (packing, casting) on each loader thread, so two or four loaders bring two or four teams of 16
threads onto a 16-core host, each team spinning between ops, beside the engine's own thread. On the
H200 host (docs/design-notes.md, no engine running) one reader went from 25 to 44 7B
reads/s with one core, two from 31–33 to 44, four from 17–19 to 22. (Beside an unlimited-batch engine run,
the median read went 0.27 → 0.22 s; that run's throughput did not move, because loads were not what
limited it: docs/design-notes.md.)

`torch.set_num_threads` would not do: it also changes the count every thread started later takes
(the server's and the engine's), so this sets the calling thread's OpenMP team size only, through the
OpenMP runtime PyTorch loaded. Where there is none (another threading backend), it does nothing.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import re
from pathlib import Path

import torch

log = logging.getLogger("loraplex.adapters")
_RUNTIME = re.compile(r"/lib(?:gomp|omp|iomp5)[^/]*\.so")
_working: str | None = None   # the runtime whose setting took, once one did
_warned = False


@functools.cache
def _openmp_runtimes() -> tuple[str, ...]:
    """Paths of the OpenMP runtimes this process loaded (GNU's libgomp, LLVM's libomp, Intel's libiomp5),
    PyTorch's own first; empty where /proc/self/maps is missing (not Linux)."""
    try:
        lines = Path("/proc/self/maps").read_text(errors="replace").splitlines()
    except OSError:
        return ()
    paths: list[str] = []
    for line in lines:
        fields = line.split(maxsplit=5)   # the sixth field is the path, spaces and all
        if len(fields) == 6 and _RUNTIME.search(fields[5]) and fields[5].strip() not in paths:
            paths.append(fields[5].strip())
    return tuple(sorted(paths, key=lambda p: "torch" not in p))


def one_core_per_thread() -> bool:
    """Make the calling thread's CPU torch ops run on it alone (a thread pool's initializer). Whether it
    could; never raises (a pool whose initializer raises takes no more work)."""
    global _working, _warned
    try:
        # ATen sizes a thread's team at its first parallel op, from the process-wide count: let that happen
        # now, so it cannot undo the setting below later
        if torch.get_num_threads() == 1:
            return True
        # the runtime PyTorch uses is the one whose setting PyTorch then reports
        failures = []
        for path in [_working] if _working else _openmp_runtimes():
            try:
                lib = ctypes.CDLL(path)
                lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                lib.omp_set_num_threads(1)
            except (OSError, AttributeError) as e:   # not loadable here, or not a runtime (libomptarget)
                failures.append(f"{path}: {type(e).__name__}")
                continue
            if torch.get_num_threads() == 1:
                _working = path
                return True
            failures.append(f"{path}: not PyTorch's")
        reason = "; ".join(failures) or "no OpenMP runtime found"
    except Exception as e:  # noqa: BLE001 (an adapter loader must start whatever this meets)
        reason = f"{type(e).__name__}: {e}"
    if not _warned:
        _warned = True
        log.warning("adapter loader threads keep PyTorch's %d CPU threads each: %s", torch.get_num_threads(), reason)
    return False
