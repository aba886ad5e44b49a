"""Where a graph-replayed decode forward's LoRA time goes: Llama-2-7B, batch 32 distinct rank-16 adapters,
context 512, captured in a CUDA graph as the engine runs decode.

Two views, one run:
- **Variants**, each captured and timed alone (median µs of replays, CUDA events): the backbone, today's
  path, and ablations that take one piece away (some give wrong logits; they are for timing only: with 32
  distinct rank-16 adapters on every projection no row lacks an adapter).
- **Timeline** of today's path and the backbone (PyTorch profiler over graph replays): each kernel's time,
  and the time in which it ran alone (exclusive: on the critical path, nothing beside it), beside others, or
  nothing ran (dependency and launch gaps), by kind of kernel.
- **Paired** (`--paired ROUNDS`): every variant's graph timed again, round robin in rotating order, and each
  variant's time over today's path's in the same round (`paired_summary`): later variants time slower as the
  GPU warms, so times taken minutes apart mislead by more than the differences sought.

    python benchmarks/trace_decode_graph.py --out benchmarks/results/decode_graph_trace.json
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import time_us  # noqa: E402
from bench_model import RANK, capture, decode_setup  # noqa: E402

from loraplex.ops import pdl
from loraplex.ops.lora import overlap
from loraplex.ops.lora import sgmv
from loraplex.ops.lora import stream_priority  # noqa: E402


def kind_of(name: str) -> str:
    if "nvjet" in name or "gemm" in name.lower() or "splitKreduce" in name or "cutlass" in name:
        return "gemm"
    for key, kind in (("_decode_kernel", "attention"), ("_sgmv_shrink", "shrink"), ("_sgmv_expand", "expand"),
                      ("Fill", "fill"), ("_rope", "rope"), ("_rms_norm", "rms_norm"), ("_silu", "silu"),
                      ("_store_kv", "store_kv")):
        if key in name:
            return kind
    return "other"


def idle_by_edge(events: list[dict]) -> dict[str, float]:
    """Each idle gap (no kernel running) by the kind of the kernel that ended last before it and of the one that
    starts after it ("rms_norm→gemm"), summed: where the waits between dependent kernels go (the thirteenth
    session found them ~0.35 µs longer between high-priority kernels)."""
    gaps: dict[str, float] = defaultdict(float)
    by_start = sorted(events, key=lambda e: e["ts"])
    if not by_start:
        return gaps
    last = by_start[0]   # the kernel that ends last among those started so far
    for e in by_start[1:]:
        end = last["ts"] + last["dur"]
        if e["ts"] > end:
            gaps[f"{kind_of(last['name'])}→{kind_of(e['name'])}"] += e["ts"] - end
        if e["ts"] + e["dur"] > end:
            last = e
    return gaps


def timeline(events: list[dict], reps: int) -> dict:
    """Per kind: busy µs, µs alone (nothing else running), and µs beside each other kind; idle µs, and by the
    kinds on either side of each gap (`idle_by_edge`)."""
    points = sorted({t for e in events for t in (e["ts"], e["ts"] + e["dur"])})
    span = points[-1] - points[0] if points else 0.0
    alone, beside, busy = defaultdict(float), defaultdict(float), defaultdict(float)
    idle = 0.0
    by_start = sorted(events, key=lambda e: e["ts"])
    active: list[dict] = []
    i = 0
    for left, right in zip(points, points[1:]):
        while i < len(by_start) and by_start[i]["ts"] <= left:
            active.append(by_start[i])
            i += 1
        active = [e for e in active if e["ts"] + e["dur"] > left]
        width = right - left
        kinds = sorted({kind_of(e["name"]) for e in active})
        if not active:
            idle += width
        elif len(active) == 1:
            alone[kinds[0]] += width
        else:
            beside["+".join(kinds)] += width
    for e in events:
        busy[kind_of(e["name"])] += e["dur"]
    per = lambda d: {k: round(v / reps, 1) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa: E731
    return dict(span_us=round(span / reps, 1), idle_us=round(idle / reps, 1), busy_us=per(busy),
                alone_us=per(alone), beside_us=per(beside), idle_by_edge_us=per(idle_by_edge(events)),
                kernels_per_forward=len(events) / reps)


def trace(replay, reps: int, path: Path | None) -> dict:
    from torch.profiler import ProfilerActivity, profile
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    if path is not None:
        prof.export_chrome_trace(str(path))
    events = [dict(name=e.name, ts=e.time_range.start, dur=e.time_range.end - e.time_range.start)
              for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0]
    events = [e for e in events if "Memcpy" not in e["name"] and "Memset" not in e["name"]]
    if not events:
        return dict(error="the profiler recorded no kernels inside the graph replays")
    return timeline(events, reps)


@contextlib.contextmanager
def variant(name: str):
    """The patches of one variant (see VARIANTS), or of several joined by "+" (e.g. "graph_default+od_split1024"),
    applied in order."""
    if "+" in name:
        with contextlib.ExitStack() as stack:
            for part in name.split("+"):
                stack.enter_context(variant(part))
            yield
        return
    patches = []
    # "nofill*": measured before the eleventh session, when it patched out the deltas' zero fills; today's path
    # has none, so "nofill" is "fused" and its suffixed variants change only what their suffix says
    if name in ("noshrink", "nolora"):
        patches.append(mock.patch.object(sgmv, "shrink_into", lambda *a, **k: None))
    if name in ("noexpand", "nolora"):
        patches.append(mock.patch.object(sgmv, "expand_from", lambda *a, **k: None))
    if name in ("nofill_gemm_first", "nofill_qkv_gemm_first"):
        patches.append(mock.patch.object(overlap, "_beside_gemm", gemm_first(name == "nofill_qkv_gemm_first")))
    if name == "nofill_od_shrink":
        delta = overlap.linear_with_lora_delta

        def od_shrink(x, weight, bias, lora_a, lora_b, batch, ranks, scalings, *, side):
            if len(lora_b) == 1:   # o_proj and down_proj: expand after the GEMM, into y
                return overlap.linear_with_lora(x, weight, bias, lora_a, lora_b, batch, ranks, scalings), None
            return delta(x, weight, bias, lora_a, lora_b, batch, ranks, scalings, side=side)
        patches.append(mock.patch.object(overlap, "linear_with_lora_delta", od_shrink))
    if name in ("down_in_silu", "expand_work_first") or name in SILU_TOO:
        from loraplex.models import llama
        patches.append(mock.patch.object(llama, "DOWN_SHRINK_IN_SILU", True))
        # as measured (eleventh session): gate/up's product not left to SiLU, which computes down's shrink instead
        patches.append(mock.patch.object(overlap, "DECODE_EXTRA_FUSED", frozenset()))
    if name == "expand_work_first":
        patches.append(mock.patch.object(overlap, "EXPAND_GEMM_FIRST", False))
    if name == "down_sgmv":
        from loraplex.models import llama
        patches.append(mock.patch.object(llama, "DOWN_SHRINK_IN_SILU", False))
    if name in PRODUCT_VARIANTS:   # more projections' products expanded by their consumers (ops/lora_product.py)
        from loraplex.ops.fused import lora_kernels as fused_lora_kernels
        from loraplex.models import llama
        projs, rms_split, boundaries = PRODUCT_VARIANTS[name]
        patches.append(mock.patch.object(overlap, "FUSED_PROJECTIONS", frozenset(projs)))
        patches.append(mock.patch.object(overlap, "FUSED_MIN_ROWS", 1))   # at any batch, as the variant says
        patches.append(mock.patch.object(overlap, "DECODE_EXTRA_FUSED", frozenset()))   # only `projs`
        patches.append(mock.patch.object(fused_lora_kernels, "RMS_SPLIT", rms_split))
        patches.append(mock.patch.object(llama, "FUSED_BOUNDARIES", boundaries))
    if name in ("o_in_attention", "o_in_attention_late", "o_in_attention_silu"):
        from loraplex.models import llama
        from loraplex.ops.attention import kernels as attention_kernels
        patches.append(mock.patch.object(llama, "O_SHRINK_IN_ATTENTION", True))
        # as measured (thirteenth session): o's product not left to the RMSNorm, where the attention's shrink is off
        patches.append(mock.patch.object(overlap, "FUSED_PROJECTIONS", frozenset({"q_proj"})))
        patches.append(mock.patch.object(overlap, "DECODE_EXTRA_FUSED", frozenset()))
        patches.append(mock.patch.object(attention_kernels, "LORA_PREFETCH_A", name != "o_in_attention_late"))
        if name == "o_in_attention_silu":
            patches.append(mock.patch.object(llama, "DOWN_SHRINK_IN_SILU", True))
    if name in ROPE_HEADS_VARIANTS:   # heads per RoPE program (fused_lora_kernels.ROPE_HEADS, 4): more programs
        from loraplex.ops.fused import lora_kernels as fused_lora_kernels
        patches.append(mock.patch.object(fused_lora_kernels, "ROPE_HEADS", ROPE_HEADS_VARIANTS[name]))
    if name == "no_gate":   # the default before the seventeenth session: gate/up's product expanded apart
        patches.append(mock.patch.object(overlap, "DECODE_EXTRA_FUSED", frozenset()))
    if name in ("silu_loads_first", "no_early"):   # without the early reads (on by default since 2026-12-03),
        from loraplex.ops.fused import lora_kernels as fused_lora_kernels   # which take over LOADS_FIRST's order
        patches.append(mock.patch.object(fused_lora_kernels, "EARLY_READS", False))
        if name == "silu_loads_first":
            patches.append(mock.patch.object(fused_lora_kernels, "SILU_LOADS_FIRST", True))
    if name in RMS_SPLIT_VARIANTS:   # columns per program of the split RMSNorm (fused_lora_kernels.RMS_SPLIT, 512)
        from loraplex.ops.fused import lora_kernels as fused_lora_kernels
        patches.append(mock.patch.object(fused_lora_kernels, "RMS_SPLIT", RMS_SPLIT_VARIANTS[name]))
    if name == "rms_one":   # the split RMSNorm's two launches in one (fused_lora_rms_split.ONE_LAUNCH)
        from loraplex.ops.fused import rms_split as fused_lora_rms_split
        patches.append(mock.patch.object(fused_lora_rms_split, "ONE_LAUNCH", True))
    if name in EARLY_VARIANTS:   # ops/pdl.py's early reads in the LoRA consumers (all, or one of them)
        from loraplex.ops.fused import lora_kernels as fused_lora_kernels
        patches.append(mock.patch.object(fused_lora_kernels, "EARLY_READS", True))
        patches.append(mock.patch.object(fused_lora_kernels, "EARLY_KERNELS", EARLY_VARIANTS[name]))
    if name in ("silu_w4", "silu_w8"):
        from loraplex.ops.fused import lora_kernels as fused_lora_kernels
        patches.append(mock.patch.object(fused_lora_kernels, "SILU_WARPS", int(name[-1])))
    if name in ("skinny", "cublas"):   # the projections' GEMMs by ops/skinny_gemm.py (the default since the
        from loraplex.ops.gemm import skinny as skinny_gemm   # eighteenth session) or by cuBLAS (F.linear)
        patches.append(mock.patch.object(skinny_gemm, "SETTING", "on" if name == "skinny" else "off"))
    if name == "skinny_lora":   # each projection's shrink and expand inside its GEMM's launch (ops/skinny_lora.py)
        from loraplex.ops.gemm import skinny_lora
        patches.append(mock.patch.object(skinny_lora, "SETTING", "on"))
    if name in KERNEL_VARIANTS:   # the decode config's kernel settings (sgmv.CONFIGS[16])
        patches.append(kernel_settings(KERNEL_VARIANTS[name]))
    if name in SILU_BLOCK_VARIANTS:   # columns per SiLU-and-mul program where it expands gate/up's product
        from loraplex.ops.fused import lora_kernels as fused_lora_kernels
        patches.append(mock.patch.object(fused_lora_kernels, "SILU_BLOCK", SILU_BLOCK_VARIANTS[name]))
    if name in PRIORITY_VARIANTS:
        patches.append(mock.patch.object(overlap, "SIDE_STREAM_PRIORITY", PRIORITY_VARIANTS[name][0]))
        patches.append(mock.patch.dict(os.environ, {"LORAPLEX_GRAPH_PRIORITY": PRIORITY_VARIANTS[name][1]}))
    if name == "nofill_carve16":
        patches.append(carveout(16))
    if name == "one_stream":
        patches.append(mock.patch.object(overlap, "_usable_side", lambda device: None))
    if name in ("shrink_after", "shrink_before", "shrink_side"):   # where the "fused" projections' shrink runs
        patches.append(mock.patch.object(overlap, "SHRINK_ORDER", name.split("_")[1]))
    env = {"full": "full", "shrink": "shrink", "off": "off"}.get(name)
    old = os.environ.get("LORAPLEX_LORA_OVERLAP")
    if env:
        os.environ["LORAPLEX_LORA_OVERLAP"] = env
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("LORAPLEX_LORA_OVERLAP", None)
            else:
                os.environ["LORAPLEX_LORA_OVERLAP"] = old


# Kernel settings tried on the "nofill" variant (`--sweep`): changes to sgmv.CONFIGS[16], the decode config
# (its shrink beside the GEMM mostly runs first and alone, its expand on the SMs the GEMM leaves).
SWEEP = {
    "base": {},
    "k512": dict(shrink_block_k=512),
    "k256_split16": dict(split_k=16),
    "k512_s4": dict(shrink_block_k=512, shrink_programs_per_sm=4.0),
    "k256_w2": dict(shrink_warps=2),
    "k512_w8": dict(shrink_block_k=512, shrink_warps=8),
    "e32": dict(expand_programs_per_sm=32.0),
    "e8": dict(expand_programs_per_sm=8.0),
    "n256": dict(rows_block_n=256),
    "n1024": dict(rows_block_n=1024),
    "ew2": dict(expand_warps=2),
    "prefetch": dict(rows_prefetch=True),
}


@contextlib.contextmanager
def kernel_settings(changes: dict):
    """sgmv.CONFIGS[16] with `changes` (split_k past sgmv.MAX_SPLIT_K raises that bound too)."""
    cfg = dataclasses.replace(sgmv.CONFIGS[16], **changes)
    with mock.patch.dict(sgmv.CONFIGS, {16: cfg}), \
            mock.patch.object(sgmv, "MAX_SPLIT_K", max(sgmv.MAX_SPLIT_K, changes.get("split_k") or 0)):
        yield


def gemm_first(only_product: bool):
    """overlap._beside_gemm with the GEMM captured before the side stream's work (both after x): at replay
    the GEMM's CTAs may take their SMs first and the LoRA kernels the rest. `only_product`: only where the
    work is a shrink alone (the "product" path of q/k/v)."""
    real = overlap._beside_gemm

    def beside(x, weight, bias, side, work, gemm_first=False):
        stream = overlap._usable_side(x.device) if side else None
        if stream is None or (only_product and weight.shape[0] != 3 * weight.shape[1]):
            return real(x, weight, bias, side, work, gemm_first)
        main = torch.cuda.current_stream(x.device)
        ready = torch.cuda.Event()
        ready.record(main)
        y = torch.nn.functional.linear(x, weight, bias)
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            work()
        main.wait_stream(stream)
        return y
    return beside


@contextlib.contextmanager
def carveout(sms: int):
    """cuBLAS GEMMs leave `sms` SMs free while graphs are captured (PyTorch's experimental setting)."""
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
        raise RuntimeError("this torch has no _set_sm_carveout_experimental")
    setter(sms)
    try:
        yield
    finally:
        try:
            setter(None)
        except TypeError:
            setter(0)


# (projections whose product the next op expands, fused_lora_kernels.RMS_SPLIT, models/llama.FUSED_BOUNDARIES):
# o's and down's products expanded by the RMSNorm after them, each row over programs of RMS_SPLIT columns (two
# launches, fused_lora_rms_split.py; 0: one program per row); with boundaries, that RMSNorm's second launch also
# computes the next projection's shrink (ops/rms_shrink.py; benchmarks/NOTES.md, eleventh session).
QKV_O_DOWN = ("q_proj", "o_proj", "down_proj")
ALL_FOUR = QKV_O_DOWN + ("gate_proj",)
PRODUCT_VARIANTS = {"od_rows": (QKV_O_DOWN, 0, False), "od_split512": (QKV_O_DOWN, 512, False),
                    "od_split1024": (QKV_O_DOWN, 1024, False), "od_split2048": (QKV_O_DOWN, 2048, False),
                    "all_split512": (ALL_FOUR, 512, False), "boundary_od512": (QKV_O_DOWN, 512, True),
                    "boundary_od1024": (QKV_O_DOWN, 1024, True), "boundary_od2048": (QKV_O_DOWN, 2048, True),
                    "boundary_all1024": (ALL_FOUR, 1024, True),
                    # the default before the fourteenth session: only q/k/v's product left to its consumer (RoPE)
                    "q_only": (("q_proj",), 0, False)}
# with down's shrink in SiLU-and-mul too (models/llama.DOWN_SHRINK_IN_SILU): then o's shrink and gate/up's expand
# are a layer's only LoRA launches
SILU_TOO = {"boundary_od1024_silu"}
PRODUCT_VARIANTS["boundary_od1024_silu"] = (QKV_O_DOWN, 1024, True)

ROPE_HEADS_VARIANTS = {"rope_heads2": 2, "rope_heads1": 1, "rope_heads8": 8}
RMS_SPLIT_VARIANTS = {"rms_split256": 256, "rms_split128": 128}
# columns per SiLU-and-mul program (fused_lora_kernels.SILU_BLOCK, 512): matters where gate/up's product is left
# to it ("all_split512+silu256")
EARLY_VARIANTS = {"early_reads": frozenset({"rms", "silu", "rope"}), "early_silu": frozenset({"silu"}),
                  "early_rope": frozenset({"rope"}), "early_rms": frozenset({"rms"})}
SILU_BLOCK_VARIANTS = {"silu256": 256, "silu1024": 1024}
# the decode config's kernel settings: the row-wise expand's 512-column steps in 8 warps (64 registers a thread
# against 120 in 4, sm_90 ptxas)
KERNEL_VARIANTS = {"rows_ew8": dict(expand_warps=8)}
# (side stream's priority, LORAPLEX_GRAPH_PRIORITY): PyTorch's numbering (lower is higher, 0 the lowest; -5 is
# clamped to PyTorch's highest pool); a graph's kernels keep their stream's priority. Every other variant
# captures as the engine does (stream_priority.priority_scheme(), "high" since the thirteenth session, whose probe named
# it "main_high"; graphs without LoRA kernels at the default priority).
PRIORITY_VARIANTS = {"graph_default": (0, "default"), "side_high": (-5, "default"), "both_high": (-5, "high"),
                     "graph_high": (0, "high"), "gemm_high": (0, "gemm")}


VARIANTS = {
    "backbone": "no adapters",
    "fused": "today's path (LORAPLEX_LORA_OVERLAP=fused)",
    "nofill": "fused without zero fills of the fp32 deltas (no patch since the eleventh session: fused)",
    "skinny_lora": "each projection's GEMM, shrink and expand in one launch (LORAPLEX_SKINNY_LORA=on)",
    "down_in_silu": "fused with down's shrink inside SiLU-and-mul (models/llama.DOWN_SHRINK_IN_SILU on)",
    "expand_work_first": "down_in_silu with down's expand captured before its GEMM (overlap.EXPAND_GEMM_FIRST off)",
    "down_sgmv": "fused with models/llama.DOWN_SHRINK_IN_SILU off (today's default: fused)",
    "nofill_gemm_first": "nofill, each GEMM captured before its side-stream LoRA kernels",
    "nofill_qkv_gemm_first": "nofill, q/k/v's GEMM captured before its shrink",
    "nofill_od_shrink": "nofill, o and down: the shrink beside the GEMM, the expand after it into y",
    "nofill_carve16": "nofill, cuBLAS leaving 16 SMs free (torch._C._set_sm_carveout_experimental)",
    **{name: f"fused, products of {'/'.join(p.split('_')[0] for p in projs)} expanded by their consumers, RMSNorm "
                f"{'one program per row' if split == 0 else f'over {split}-column programs'}"
                f"{', computing the next shrink (fused boundaries)' if boundaries else ''}"
                f"{', the shrink of down in SiLU-and-mul' if name in SILU_TOO else ''}"
       for name, (projs, split, boundaries) in PRODUCT_VARIANTS.items()},
    "o_in_attention": "fused with o's shrink in the attention kernel (models/llama.O_SHRINK_IN_ATTENTION on; "
                      "MHA: A's tile loaded before the key walk; q/k/v's product alone left to its consumer)",
    "o_in_attention_late": "o_in_attention with A's tile loaded after the key walk (LORA_PREFETCH_A off)",
    "o_in_attention_silu": "o_in_attention with down's shrink inside SiLU-and-mul too",
    **{name: f"fused with {h} head(s) per RoPE program (4 today)" for name, h in ROPE_HEADS_VARIANTS.items()},
    **{name: f"fused with the split RMSNorm over {c}-column programs (512 today)"
       for name, c in RMS_SPLIT_VARIANTS.items()},
    "no_gate": "fused without gate/up's product left to SiLU-and-mul at decode (overlap.DECODE_EXTRA_FUSED empty: "
               "the default before the seventeenth session)",
    "silu_w8": "SiLU-and-mul's programs in 8 warps where it expands gate/up's product (fused_lora_kernels.SILU_WARPS)",
    "silu_loads_first": "SiLU-and-mul loading both B blocks before either product (fused_lora_kernels."
                        "SILU_LOADS_FIRST; 165 registers a thread against 148)",
    "early_reads": "the LoRA consumers (RoPE, SiLU-and-mul, the split RMSNorm's first launch) reading their rows' "
                   "slots, ranks, scalings and B blocks before the PDL wait (LORAPLEX_LORA_EARLY_READS=on)",
    **{f"early_{k}": f"early_reads in the {k} consumer alone" for k in ("silu", "rope", "rms")},
    "no_early": "fused without the early reads (LORAPLEX_LORA_EARLY_READS=off; on by default since 2026-12-03, so "
                "'fused' has them)",
    "rms_one": "the split RMSNorm with a product in one launch, each row's last program normalizing it "
               "(LORAPLEX_LORA_RMS_ONE_LAUNCH=on)",
    "silu_w4": "SiLU-and-mul's programs in 4 warps whatever their columns (silu256+silu_w4: 71 registers a thread, "
               "where 256 columns in 2 warps take 148)",
    "skinny": "the projections' GEMMs by ops/skinny_gemm.py's Triton kernel (LORAPLEX_SKINNY_GEMM=on; the default "
              "on GPUs since the eighteenth session), e.g. backbone+skinny",
    "cublas": "the projections' GEMMs by cuBLAS (LORAPLEX_SKINNY_GEMM=off: the default before the eighteenth "
              "session), e.g. backbone+cublas",
    "rows_ew8": "the decode config's expand in 8 warps (sgmv.CONFIGS[16].expand_warps, 4 today)",
    **{name: f"{n} columns per SiLU-and-mul program (512 today; where it expands gate/up's product)"
       for name, n in SILU_BLOCK_VARIANTS.items()},
    "graph_default": "fused captured on a stream of PyTorch's default priority, the side stream's (before the "
                     "thirteenth session: LORAPLEX_GRAPH_PRIORITY=default)",
    "side_high": "graph_default with the side stream (LoRA kernels) at the highest priority "
                 "(overlap.SIDE_STREAM_PRIORITY)",
    "both_high": "fused with both streams at the highest priority (equal, as graph_default's)",
    "graph_high": "captured at the highest priority even without LoRA kernels (backbone+graph_high: what the "
                  "priority alone costs)",
    "gemm_high": "graph_default with each GEMM beside LoRA kernels on a highest-priority stream of its own "
                 "(LORAPLEX_GRAPH_PRIORITY=gemm)",
    "noshrink": "fused without shrink kernels (timing only)",
    "noexpand": "fused without expand kernels (timing only; RoPE still expands q/k/v)",
    "nolora": "fused without shrink and expand kernels: the consumers' cost and the fills (timing only)",
    "one_stream": "fused with the LoRA kernels on the main stream (no side stream)",
    "shrink_after": "fused with the fused projections' shrink on the main stream right after the GEMM, releasing the "
                    "consumer first and waiting for the GEMM last (LORAPLEX_LORA_SHRINK_ORDER=after, the default "
                    "since 2026-12-03: 'fused' is this)",
    "shrink_side": "fused with the fused projections' shrink on the side stream beside the GEMM "
                   "(LORAPLEX_LORA_SHRINK_ORDER=side, the default before 2026-12-03)",
    "shrink_before": "fused with the fused projections' shrink on the main stream before the GEMM "
                     "(LORAPLEX_LORA_SHRINK_ORDER=before)",
    "full": "LORAPLEX_LORA_OVERLAP=full",
    "shrink": "LORAPLEX_LORA_OVERLAP=shrink",
    "off": "LORAPLEX_LORA_OVERLAP=off (plain order)",
}


def is_backbone(name: str) -> bool:
    """Does variant `name` run without adapters?"""
    return "backbone" in name.split("+")


def capture_priority(name: str) -> int:
    """The priority variant `name`'s graph is captured at, inside its variant(): the engine's
    (engine/cuda_graphs.py: the default one without LoRA kernels), or the highest with "graph_high"."""
    if is_backbone(name) and "graph_high" not in name.split("+"):
        return 0
    return stream_priority.capture_priority()


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(name: str) -> torch.cuda.Stream | None:
    """The stream variant `name` is captured on (inside its variant()), one per priority for the whole run, as
    the engine keeps them: a new pooled stream per variant would pin a cuBLAS workspace each and, after 32
    draws, could be the side stream itself (then no overlap). None: PyTorch's capture stream."""
    priority = capture_priority(name)
    if priority == 0:
        return None
    if priority not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[priority] = torch.cuda.Stream(priority=priority)
    return _CAPTURE_STREAMS[priority]


def describe(name: str) -> str:
    """VARIANTS' description of `name`, or of each of its parts joined by "+"."""
    parts = name.split("+")
    unknown = [p for p in parts if p not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown} in {name!r}; known: {', '.join(VARIANTS)}")
    return " + ".join(VARIANTS[p] for p in parts)


def round_order(names: list[str], r: int) -> list[str]:
    """The variants' order in round r of the paired timing: rotated by one each round, so that no variant is
    always timed first or last (later ones time slower as the GPU warms up)."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def paired_summary(times: dict[str, list[float]], base: str = "fused") -> dict:
    """Per variant, the median µs over the rounds and the median over rounds of its time / `base`'s time in the
    same round (a variant and the base timed minutes apart drift; within a round they are seconds apart)."""
    out = {}
    for name, ts in times.items():
        row = dict(median_us=round(statistics.median(ts), 1), rounds=len(ts))
        if base in times and name != base:
            row[f"vs_{base}"] = round(statistics.median(t / b for t, b in zip(ts, times[base])), 4)
        out[name] = row
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--trace-variants", default="backbone,fused,nofill")
    ap.add_argument("--sweep", default="", help=f"comma-separated settings to time on nofill: {', '.join(SWEEP)}")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--trace-dir", type=Path, help="where to write the chrome traces")
    ap.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                    help="then time every variant's graph again, round robin over ROUNDS rounds (paired_summary)")
    args = ap.parse_args(argv)
    for name in args.variants.split(","):
        describe(name)   # a misspelt variant fails before the model is built
    B = args.batch
    model, kv, pool, batch = decode_setup(B, args.context)
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), torch=torch.__version__,
                  batch=B, context=args.context, rank=RANK, pdl=bool(pdl.PDL), variants={}, timelines={}, sweep={})
    reference = None
    kept: dict[str, object] = {}   # --paired: each variant's replay, kept for the rounds

    def one_variant(name: str, adapters) -> None:
        nonlocal reference
        with variant(name):
            replay, logits = capture(lambda: model(batch, kv, adapters), stream=capture_stream(name))
            with torch.inference_mode():
                logits.fill_(float("nan"))   # poisoned: the replay must write every logit
            replay()
            torch.cuda.synchronize()
            out = logits.clone()
            if name == "fused":
                reference = out
            us = time_us([replay], target_ms=30, reps=9)
            row = dict(what=describe(name), graph_us=round(us, 1), finite=bool(torch.isfinite(out).all()))
            if reference is not None and not is_backbone(name):
                row["max_abs_vs_fused"] = (out - reference).abs().max().item()
            result["variants"][name] = row
            print(f"{name:11s} {us:8.0f} µs  {row}", flush=True)
            if name in args.trace_variants.split(","):
                path = args.trace_dir / f"decode_graph_{name}.json" if args.trace_dir else None
                result["timelines"][name] = trace(replay, 3, path)
                print(json.dumps(result["timelines"][name], indent=1), flush=True)
            if args.paired and name not in kept:
                kept[name] = replay
            del replay, logits
            torch.cuda.empty_cache()

    for name in args.variants.split(","):
        adapters = None if is_backbone(name) else pool
        try:
            one_variant(name, adapters)
        except Exception as e:  # noqa: BLE001 - one variant's failure (e.g. a missing torch hook) is reported
            result["variants"][name] = dict(what=describe(name), error=repr(e))
            print(f"{name:11s} failed: {e!r}", flush=True)
        if args.out:   # after every variant: a run cut short keeps what it measured
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    if kept:
        names, times = list(kept), defaultdict(list)
        for r in range(args.paired):
            for name in round_order(names, r):
                times[name].append(time_us([kept[name]], target_ms=20, reps=3))
        result["paired"] = paired_summary(dict(times))
        for name, row in result["paired"].items():
            print(f"paired {name:20s} {row}", flush=True)
        kept.clear()
        torch.cuda.empty_cache()
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name in filter(None, args.sweep.split(",")):
        with variant("nofill"), kernel_settings(SWEEP[name]):
            replay, logits = capture(lambda: model(batch, kv, pool), stream=capture_stream("nofill"))
            replay()
            torch.cuda.synchronize()
            err = (logits - reference).abs().max().item() if reference is not None else None
            us = time_us([replay], target_ms=30, reps=9)
            result["sweep"][name] = dict(changes=SWEEP[name], graph_us=round(us, 1), max_abs_vs_fused=err)
            print(f"sweep {name:14s} {us:8.0f} µs  max|Δ| vs fused {err}", flush=True)
            del replay, logits
            torch.cuda.empty_cache()
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
