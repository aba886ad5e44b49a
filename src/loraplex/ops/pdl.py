"""Programmatic dependent launch (PDL) for the Triton kernels: on by default where the GPU has it (compute
capability 9.0 on, Triton 3.4 on); LORAPLEX_PDL=off turns it off (envs.py).

On an H200 (issue 5's engine benchmark at batch 32) the decode step took 5.89 against 5.98 ms without it for the
backbone, and 7.02 against 7.16 with distinct adapters.

A decode forward is ~330 short kernels in a row (Llama-2-7B, 32 layers), each waiting for the one before it to
finish and its memory to be flushed before its first program may start. With PDL (Hopper on, CUDA 12.3 on;
kept by CUDA graph capture as programmatic edges) a kernel is launched with CUDA's programmatic stream
serialization: its programs may be placed on SMs while the kernel before it is still finishing, and each waits
at its first instruction (`griddepcontrol.wait`: every prerequisite grid complete and its writes visible)
before reading or writing anything; it then lets the next kernel launch (`griddepcontrol.launch_dependents`).
So what overlaps is the launch and the placing of programs and, where a kernel reads early or waits late (the
two exceptions below), those accesses: every other load and store follows the wait, so no ordering the model
relies on changes (including a buffer the caching allocator hands from one kernel's input to the next one's
output).

Early reads (ops/fused/lora_kernels.py's consumers and rms_split.py's first launch): a kernel may read, before its wait,
what no kernel of a forward writes: the batch's rows' slots and a composed batch's other members' (written by
copies before the forward's first kernel) and the adapter pool's ranks, scalings and B stacks (written by adapter
loads into slots no running batch reads). Its first statement is then `pdl_start(True)`, which waits for nothing,
and it calls `pdl_deferred_start(True)` after those loads and before any other memory access (tests/test_pdl.py
checks the PTX: loads only before the wait). With PDL the loads run while the kernel before is finishing. The
decode GEMMs (ops/gemm/kernels.py, fp8_kernels.py with PREFETCH) do the same with L2 prefetches of their weights'
first bytes, which no kernel of a forward writes; a prefetch returns nothing to the program, and its own loads of
the weight come after its wait.

Late wait (ops/lora/shrink_kernels.py's shrink with AFTER_GEMM: ops/lora/overlap.py's "after" order): a fused
projection's shrink is launched right after its GEMM, which reads the same x, and releases the next kernel first
(`pdl_release`) and waits for the grids before it last (`pdl_wait_last`), so that its programs run beside the GEMM's
and the consumer's programs are placed while both run. Before its wait it reads x and the pool's A and stores its
partials. That is safe because x was written by a kernel before the GEMM, and the GEMM (ops/gemm/skinny.py's Triton
kernel, or fp8_kernels.py's for FP8 weights: overlap.py's `shrink_order` takes "after" only where one of them is the
GEMM and PDL is on) released the shrink
only after its own wait, for which that kernel had completed; the only grid that may still run is the GEMM, which
reads x and its weight and writes its output, none of which the shrink writes (its partials are a live tensor of
their own). The consumer waits for the shrink's grid to complete, and the shrink completes only after its wait, for
the GEMM: so the consumer finds the GEMM's output complete too. One program waits, (0, 0), which every grid has: the
grid completes no sooner, and the others leave as soon as their work is stored, so that a grid larger than the room the
GEMM leaves still runs beside it (tests/test_pdl.py checks the PTX: the release before any memory access, the wait
after the last).

Every Triton kernel of the package calls `pdl_start()` first, and ops/launch.py's Launcher launches them with
`launch_pdl` when PDL is on; kernels of PyTorch's own (cuBLAS, copies, sampling) keep the plain order, which
the wait also honours (their grids complete before a dependent one is released). Off, in Triton's
interpreter, and on GPUs before compute capability 9.0, `pdl_start` compiles to nothing.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import envs

try:   # Triton 3.4 on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None



def _interpreting() -> bool:
    """Triton's interpreter (TRITON_INTERPRET, read when kernels are decorated, as Triton reads it)."""
    return envs.triton_interpret()


def _supported() -> bool:
    """PDL's instructions exist on sm_90 and later, in Triton 3.4 on; not in Triton's interpreter. Every visible
    GPU must have them (the kernels compile with one setting for all)."""
    if gdc_wait is None or _interpreting():
        return False
    import torch   # (reads the GPU's compute capability at import, where LORAPLEX_PDL=on: the default)
    return (torch.cuda.is_available() and torch.version.hip is None
            and min(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())) >= (9, 0))


# A compile-time constant of every kernel (Triton keys its cache on the globals a kernel reads).
PDL = tl.constexpr(envs.pdl() and _supported())

if _interpreting():
    def pdl_start(defer=False):
        """Nothing, as plain Python: the interpreter runs a kernel's programs one by one in Python, where a
        call to a jitted helper cost ~150 µs a program (+40% on a small kernel, minutes of the CPU suite)."""
        return None

    def pdl_deferred_start(deferred=False):
        """Nothing (see pdl_start)."""
        return None

    def pdl_release(on=False):
        """Nothing (see pdl_start)."""
        return None

    def pdl_wait_last(on=False):
        """Nothing (see pdl_start)."""
        return None
else:
    @triton.jit
    def pdl_start(DEFER: tl.constexpr = False):
        """A kernel's first statement: with PDL, wait for the grids before this one, then release the next.
        DEFER: not here but at the kernel's `pdl_deferred_start(DEFER)`, after its early reads (see below)."""
        if PDL and not DEFER:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def pdl_deferred_start(DEFERRED: tl.constexpr):
        """pdl_start's wait and release where the kernel deferred them (DEFERRED), after its early reads."""
        if PDL and DEFERRED:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def pdl_release(ON: tl.constexpr):
        """With PDL and ON: let the next kernel launch now, before this one waits (`pdl_wait_last`). The next
        kernel's own wait still waits for this grid to complete, so it sees this grid's writes and, as this grid
        completes only after its wait, every earlier grid's."""
        if PDL and ON:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait_last(ON: tl.constexpr):
        """With PDL and ON: wait for the grids before this one, as a kernel's last statement (see `pdl_release`)."""
        if PDL and ON:
            gdc_wait()
