"""Launch Triton kernels without the JIT's per-call argument binding.

Triton's `kernel[grid](...)` re-derives every argument's specialization on each call; with
our ~30 arguments that costs tens of µs of host time per launch, more than the GPU work of a
decode step. A compiled kernel depends only on its constexprs and options, each tensor's
dtype and 16-byte alignment, and each int's being 1, its divisibility by 16 and its width
(exactly what `triton._C.libtriton.native_specialize_impl` derives; only the width for an int
marked `do_not_specialize`). We key on those: the
first call per key goes through Triton (compiling if needed) and returns the compiled kernel,
later calls hand the arguments to its launcher directly.

Used on CUDA with the Triton versions this was checked against (see FAST_TRITON_VERSIONS);
anywhere else — the CPU interpreter, launch hooks installed by a profiler, another Triton,
or LORAPLEX_FAST_LAUNCH=off (envs.py) — every launch goes through Triton as usual; LORAPLEX_FAST_LAUNCH=on
takes direct launches with other Triton versions too.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import triton
from triton.runtime import driver

from . import pdl
from .. import envs

# Host-side sizes of launches. Not triton.cdiv / triton.next_power_of_2: those are JIT constexpr functions, ~2 µs a
# call from the host, and eager steps size hundreds of launches.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """The GPU's SM count, which launch rules size their grids by; on the CPU (Triton's interpreter) a small GPU's 4,
    so that the rules' split and chunked paths run in the CPU tests."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


try:
    from triton import knobs
except ImportError:  # older Triton: no knobs module, and no direct launches either
    knobs = None

FAST_TRITON_VERSIONS = ("3.6.",)
# every kernel of the package starts with ops/pdl.py's pdl_start() (or, with its early reads or late wait, the helpers
# beside it), so with PDL on each is launched with CUDA's programmatic stream serialization (the compiled kernel's
# metadata carries it into direct launches too)
_PDL_OPTIONS = {"launch_pdl": True} if pdl.PDL else {}
_INT32 = range(-2**31, 2**31)
_AHEAD: list[bool] = []   # inside `compile_ahead`: Launcher calls compile, they do not launch


@contextlib.contextmanager
def compile_ahead(workers: int | None = None):
    """Within it, every Launcher call compiles its kernel variant on one of `workers` threads (default: the CPUs
    this process may use) instead of launching it; on leaving, every compile has finished and sits in Triton's
    caches, so the same calls made again launch at once. Triton compiles on the CPU and releases the interpreter
    lock in its passes and ptxas: a kernel's 16 variants compiled 1.9× faster on 2 threads than on one (sm_90,
    Triton 3.6). Calls into kernels that do not go through a Launcher still run. Where Triton has no
    AsyncCompileMode, or in its interpreter, Launcher calls do nothing inside it (the calls after it compile)."""
    mode = getattr(triton, "AsyncCompileMode", None)
    workers = workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    _AHEAD.append(True)
    try:
        if mode is None:
            yield
            return
        with ThreadPoolExecutor(workers) as pool, mode(pool):
            yield
    finally:
        _AHEAD.pop()


def precompile(calls: Callable[[], object]) -> None:
    """`calls()` under `compile_ahead`, as a head start only: where compiling ahead fails, it says so and returns
    (the same calls, made for real afterwards, compile one by one and raise what is really wrong)."""
    try:
        with compile_ahead():
            calls()
    except Exception as e:  # noqa: BLE001 - a head start; the real launches that follow report real failures
        logging.getLogger("loraplex.ops").warning("compiling kernels ahead failed (%s: %s); they compile as they "
                                                  "launch", type(e).__name__, e)


def _fast_enabled() -> bool:
    setting = envs.fast_launch()
    if setting != "auto":
        return setting == "on"
    return triton.__version__.startswith(FAST_TRITON_VERSIONS)


def _hooks_installed() -> bool:
    """A profiler's launch hook (Triton's default is None or an empty HookChain), or Triton's debug
    mode, needs Triton's own launch path."""
    if knobs is None or knobs.runtime.debug:  # Triton's debug mode compiles other kernels: let it
        return True
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def _spec(arg, _tensor=torch.Tensor, _int32=_INT32):
    """What Triton specializes a runtime argument on (see the module docstring). Called ~60 times
    per add_lora, so the common types are tested first and cheaply."""
    if type(arg) is int:
        return 1 if arg == 1 else (arg % 16 == 0, arg in _int32)
    if isinstance(arg, _tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool):
        return "u1"
    if isinstance(arg, int):
        return 1 if arg == 1 else (arg % 16 == 0, arg in _int32)
    return type(arg), arg


def _plain_spec(arg, _int32=_INT32):
    """The same for a parameter marked `do_not_specialize`: Triton keeps only an int's width."""
    if type(arg) is int:
        return ("plain", arg in _int32, arg < 2**63)
    return _spec(arg)


class Launcher:
    """`Launcher(kernel)(grid, args, constexprs, num_warps, num_stages)` ≡ `kernel[grid](*args, **constexprs, ...)`
    (with `launch_pdl=True` where LORAPLEX_PDL=on: ops/pdl.py).

    `args` are the kernel's runtime parameters in order; its constexpr parameters follow them.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiles = type(kernel).__name__ == "JITFunction"   # (not Triton's interpreter)
        self.enabled = _fast_enabled() and self.compiles
        self._compiled: dict = {}
        self.direct_launches = 0  # launches that skipped Triton's binding (for tests and diagnostics)
        if self.enabled:
            const_names = [kernel.arg_names[i] for i in sorted(kernel.constexprs)]
            if kernel.arg_names[len(kernel.arg_names) - len(const_names):] != const_names:
                raise TypeError(f"{kernel.fn.__name__}: constexpr parameters must come last")
            self._const_names = const_names
            # Runtime parameters marked do_not_specialize: Triton compiles one variant for every value.
            self._plain = [i for i, p in enumerate(kernel.params[:len(kernel.arg_names) - len(const_names)])
                           if p.do_not_specialize]

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, num_warps: int, num_stages: int) -> None:
        if _AHEAD:
            if self.compiles and hasattr(triton, "AsyncCompileMode"):
                self.kernel.warmup(*args, grid=grid, **constexprs, num_warps=num_warps, num_stages=num_stages,
                                   **_PDL_OPTIONS)
            return
        if not self.enabled or _hooks_installed():
            self.kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages, **_PDL_OPTIONS)
            return
        self._launch(grid, args, constexprs, num_warps, num_stages, self.specs(args), self.in_order(constexprs))

    def specs(self, args) -> tuple:
        """What Triton specializes each argument on (`_spec`; `_plain_spec` for parameters marked
        do_not_specialize)."""
        specs = tuple(map(_spec, args))
        if self._plain:
            specs = tuple(_plain_spec(a) if i in self._plain else sp for i, (a, sp) in enumerate(zip(args, specs)))
        return specs

    def in_order(self, constexprs: dict) -> tuple:
        """The constexpr values in the kernel's parameter order (how the compiled kernel takes them)."""
        return tuple(constexprs[name] for name in self._const_names)

    def _launch(self, grid: tuple, args, constexprs: dict, num_warps: int, num_stages: int, specs,
                ordered: tuple, raw=None) -> None:
        """The direct launch of the variant keyed by `specs` (each argument's `_spec`), through Triton the first
        time (compiling it if needed); `ordered`: `in_order(constexprs)`. `raw`: the arguments with each tensor as
        its address, for the compiled kernel (where given): Triton's launcher takes an int address as it is, but
        asks the CUDA driver about a tensor's (cuPointerGetAttribute), a call per pointer argument."""
        device = torch.cuda.current_device()
        key = (device, num_warps, num_stages, *constexprs.values(), *specs)
        compiled = self._compiled.get(key)
        if compiled is None:
            self._compiled[key] = self.kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages,
                                                    **_PDL_OPTIONS)
            return
        self.direct_launches += 1
        grid = tuple(grid) + (1, 1)
        compiled.run(grid[0], grid[1], grid[2], driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *(args if raw is None else raw), *ordered)

    def prepare(self, grid: tuple, args: tuple, constexprs: dict, num_warps: int, num_stages: int,
                dynamic: range | tuple[int, ...]) -> "PreparedLaunch":
        """This launch with every argument but those at positions `dynamic` fixed (see PreparedLaunch)."""
        return PreparedLaunch(self, grid, args, constexprs, num_warps, num_stages, dynamic)


class PreparedLaunch:
    """A launch whose grid, constexprs and arguments are fixed but for those at positions `dynamic`:
    `prepared(*values)` ≡ `launcher(grid, args with values at dynamic, constexprs, num_warps, num_stages)`.

    Eager prompt steps launch hundreds of kernels whose arguments repeat from layer to layer but for a few tensors
    (the LoRA kernels: ~35 arguments, ~10 of them tensors that change). Keying only those each call keeps the
    direct launch's check of what Triton specializes on (`_spec`) for every argument that can change.
    """

    def __init__(self, launcher: Launcher, grid: tuple, args: tuple, constexprs: dict, num_warps: int,
                 num_stages: int, dynamic: range | tuple[int, ...]) -> None:
        dynamic = tuple(dynamic)
        if list(dynamic) != sorted(set(dynamic)) or (dynamic and not 0 <= dynamic[0] <= dynamic[-1] < len(args)):
            raise ValueError(f"dynamic positions must be distinct, ascending and below {len(args)}, got {dynamic}")
        self.launcher, self.grid, self.constexprs = launcher, grid, constexprs
        self.num_warps, self.num_stages = num_warps, num_stages
        self.args, self.dynamic, self.runs = list(args), dynamic, _runs(dynamic)
        self.specs: list | None = None   # None: prepared without direct launches, every call goes through Triton
        if launcher.enabled:
            self.specs = list(launcher.specs(args))
            self._spec_of = [(_plain_spec if i in launcher._plain else _spec) for i in dynamic]
            self._ordered = launcher.in_order(constexprs)
        for i in dynamic:   # not kept alive by the launch: each call brings its own
            self.args[i] = None
        # the compiled kernel's arguments: the fixed tensors' addresses (self.args keeps the tensors alive)
        self.raw = [_address(a) for a in self.args]

    def __call__(self, *values) -> None:
        if len(values) != len(self.dynamic):
            raise TypeError(f"this launch takes {len(self.dynamic)} dynamic arguments, got {len(values)}")
        launcher, args = self.launcher, self.args.copy()
        for start, stop, first in self.runs:   # slices: ~2x faster than position by position
            args[start:stop] = values[first:first + stop - start]
        if _AHEAD or self.specs is None or not launcher.enabled or _hooks_installed():
            launcher(self.grid, tuple(args), self.constexprs, self.num_warps, self.num_stages)
            return
        specs, dynamic_specs = self.specs.copy(), list(map(_call, self._spec_of, values))
        raw, addresses = self.raw.copy(), list(map(_address, values))
        for start, stop, first in self.runs:
            specs[start:stop] = dynamic_specs[first:first + stop - start]
            raw[start:stop] = addresses[first:first + stop - start]
        launcher._launch(self.grid, args, self.constexprs, self.num_warps, self.num_stages, specs, self._ordered,
                         raw)


def _call(f, value):
    return f(value)


def _address(arg, _tensor=torch.Tensor):
    return arg.data_ptr() if isinstance(arg, _tensor) else arg


def _runs(positions: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Ascending positions as runs of consecutive ones: (start, stop, index of start among the positions)."""
    runs: list[tuple[int, int, int]] = []
    for j, i in enumerate(positions):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1, runs[-1][2])
        else:
            runs.append((i, i + 1, j))
    return runs
