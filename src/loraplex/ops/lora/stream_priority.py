"""Stream priorities of the CUDA graphs with LoRA kernels beside the GEMMs (ops/overlap.py): which stream's
kernels the SMs take first at replay, LORAPLEX_GRAPH_PRIORITY."""
from __future__ import annotations

from ...env_switch import env_switch

PRIORITY_SCHEMES = ("high", "gemm", "default")


def priority_scheme() -> str:
    """LORAPLEX_GRAPH_PRIORITY, one of PRIORITY_SCHEMES: how the CUDA graphs of forwards with LoRA kernels
    (engine/cuda_graphs.py) order those kernels against the main stream's on the SMs.

    - "high" (the default; also "1" or empty): captured on a high-priority stream, so the GEMMs and the other
      main-stream kernels go ahead of the side stream's LoRA kernels wherever both have CTAs waiting.
    - "gemm": captured at PyTorch's default priority, but each GEMM beside LoRA kernels runs on a high-priority
      stream of its own (ops/overlap.py's `_beside_gemm`), so only the GEMMs go first. Measured no faster than
      "high" (below).
    - "default" (or "0"): PyTorch's default priority for every stream.

    Only graphs whose forwards run LoRA kernels on the side stream take a priority (engine/cuda_graphs.py):
    elsewhere there is nothing to order.

    Captured kernels keep their stream's priority at replay (PyTorch instantiates graphs with
    cudaGraphInstantiateFlagUseNodePriority). Measured on an H200 (2026-12-02, Llama-2-7B decode forwards at batch
    32 with distinct adapters, graphs timed in alternating rounds, results/decode_graph_trace_prio{,2}.json):
    "high" took 0.987× and 0.992× the time of "default" (21 and 9 rounds): the shrinks run beside the GEMMs
    (alone 197 µs a forward against 579) and the expands after them (alone 788 against 283). But every edge
    between two highest-priority kernels waited longer: ~0.45 µs against ~0.1 (185 µs a forward idle against
    25), which "gemm" was meant to avoid; it took 1.001× the time of "high" and "default" 1.009× (9 rounds, the
    fourteenth session, results/decode_graph_trace_prio3.json). The side stream at the highest priority instead:
    0.999× (no change).
    The paper's workload at batch 32: 3,376 tok/s with "high" against 3,359 (two leases; decode steps' GPU time
    9.05 against 9.08 ms, mixed steps' 10.30 against 11.11)."""
    return env_switch("LORAPLEX_GRAPH_PRIORITY", "high", on="high", off="default", others=("gemm",))


def capture_priority() -> int:
    """The priority of the stream graphs with side-stream LoRA kernels are captured on (PyTorch's numbering,
    lower is higher, 0 the default; PyTorch clamps -5 to its highest pool, which is all that matters here:
    above the side stream's)."""
    return -5 if priority_scheme() == "high" else 0


def gemm_stream_priority() -> int | None:
    """The priority of the stream of the GEMMs beside LoRA kernels while capturing, None: the main stream."""
    return -5 if priority_scheme() == "gemm" else None
