"""loraplex on a benchmark workload: one engine, random adapters, every request queued at once."""
from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from ..config import EngineConfig
from ..engine.engine import Engine
from ..sampling import SamplingParams
from .results import RunResult, check_complete
from .workload import Workload

START_LOADS = 64          # _load_stats: the loads of a run's start-up, whose times it reports apart
UNLIMITED_SEQS = 256      # "unlimited": more than the KV memory of a 7B model on one GPU holds at these lengths


def engine_config(model: str, *, max_batch: int | None, rank: int, max_len: int, device: str | None,
                  dtype: str, layers: int | None = None, **overrides) -> EngineConfig:
    seqs = max_batch if max_batch is not None else UNLIMITED_SEQS
    settings = dict(model=model, dummy_layers=layers if model.startswith("dummy:") else None, dtype=dtype,
                    device=device, max_num_seqs=seqs, max_num_batched_tokens=max(2048, seqs),
                    max_model_len=max_len, max_lora_rank=rank, max_gpu_adapters=max(2 * seqs, 8) if max_batch
                    else seqs, max_cpu_adapters=max(2 * seqs, 8), cuda_graph_max_batch=min(seqs, 256))
    settings.update(overrides)
    return EngineConfig(**settings)


class LoraplexSystem:
    """One engine (one max batch size) with `num_adapters` random rank-`rank` adapters a0, a1, …"""

    def __init__(self, config: EngineConfig, num_adapters: int) -> None:
        self.config = config
        started = time.perf_counter()
        self.engine = Engine(config)
        for i in range(num_adapters):
            self.engine.adapters.register_synthetic(f"a{i}", config.max_lora_rank, seed=i + 1)
        self.engine.freeze_heap()   # the adapters' specs too: out of the garbage collector's full passes
        self.setup_s = time.perf_counter() - started
        self.num_adapters = num_adapters

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def kv_tokens(self) -> int:
        return self.engine.runner.kv.num_blocks * self.engine.runner.kv.block_size

    def close(self) -> None:
        self.engine.close()
        del self.engine
        torch.cuda.empty_cache() if torch.cuda.is_available() else None

    def preload(self, indices: list[int], prefix: str = "a") -> int:
        """Make the adapters prefix{i} resident, the first ones first, as many as the GPU slots hold;
        how many were."""
        names = [f"{prefix}{i}" for i in indices][:self.config.max_gpu_adapters]
        cache = self.engine.adapters
        for name in names:
            cache.prefetch(name)
        for name in names:
            if not cache.wait_resident(name, timeout=600):
                raise RuntimeError(f"adapter {name} did not load within 600 s")
        return len(names)

    def warm_up(self, workload: Workload, prompts: list[list[int]]) -> None:
        """Compile, capture and touch every path once, with adapters of its own (w0, w1, …), so that
        the measured runs start with none of theirs resident."""
        count = min(len(workload.requests), 2 * self.config.max_num_seqs)
        adapters = min(count, 32)   # loads are not what is warmed up, and each takes ~0.1 s at 7B
        for i in range(adapters):
            if f"w{i}" not in self.engine.adapters:
                self.engine.adapters.register_synthetic(f"w{i}", self.config.max_lora_rank, seed=10_000 + i)
        self.run(workload.head(count), prompts, backbone=False, name="warm-up", progress=False, cap_output=16,
                 adapter_prefix="w", num_adapters=adapters)

    def run(self, workload: Workload, prompts: list[list[int]], *, backbone: bool, name: str,
            progress: bool = True, cap_output: int | None = None, adapter_prefix: str = "a",
            num_adapters: int | None = None, preload: bool = False) -> RunResult:
        """Every request queued at t=0, stepped to the end. `cap_output` shortens outputs (warm-up).
        `preload`: before the clock starts, put the workload's first adapters on the GPU (as many as
        there are slots), as the transformers baselines have all theirs there."""
        engine = self.engine
        num_adapters = self.num_adapters if num_adapters is None else num_adapters
        preloaded = 0
        if preload and not backbone:
            preloaded = self.preload(list(dict.fromkeys(r.adapter % num_adapters for r in workload.requests)),
                                     adapter_prefix)   # the first ones in queue order
        lens = [min(r.output_len, cap_output or r.output_len) for r in workload.requests]
        ids = [f"{name}-{r.index}" for r in workload.requests]
        index = {rid: i for i, rid in enumerate(ids)}
        first = [0.0] * len(ids)
        last = [0.0] * len(ids)
        got = [0] * len(ids)
        steps = decode_steps = seq_sum = context_sum = adapter_reads = 0
        first_step_s = 0.0
        short_at: list[tuple[float, int]] = []   # steps loads held back: (seconds into the run, rows missing)
        decode_s = mixed_s = 0.0   # wall time of the steps that ran, by kind (where a gap to the backbone lies)
        spans: dict[bool, list] = {True: [], False: []}   # decode?: the steps' GPU spans (CUDA), read after the run
        walls: dict[bool, list[float]] = {True: [], False: []}   # decode?: each step's wall time (its spread)
        span_at: dict[bool, list[float]] = {True: [], False: []}   # decode?: when in the run each span's step ended
        engine.adapters.take_load_times()   # only this run's loads below
        pinned_before = _pinned_allocs()
        stats_before = dict(engine.stats)
        preemptions_before = engine.scheduler.num_preemptions
        recomputed_before = engine.scheduler.num_recomputed_tokens
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for rid, r, p, n in zip(ids, workload.requests, prompts, lens):
            adapter = None if backbone else f"{adapter_prefix}{r.adapter % num_adapters}"
            engine.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), adapter)
        with tqdm(total=sum(lens), desc=name, unit="tok", disable=not progress, mininterval=2) as bar:
            while engine.has_unfinished():
                outs = engine.step()
                now = time.perf_counter() - start
                info = engine.last_step
                if info is None and not outs:
                    time.sleep(0.0005)   # nothing could run (adapter loads): leave the GIL to the loaders
                if info is not None:
                    if not steps:
                        first_step_s = now   # when the first step ended: before it, requests waited for adapters
                    steps += 1
                    decode_steps += info.decode
                    seq_sum += info.num_seqs
                    context_sum += info.context_tokens   # for the ceiling over this run's own steps
                    adapter_reads += info.num_adapters
                    # a batch below its limit while a request it had KV memory for waited for its adapter:
                    # loads held it back
                    if info.num_seqs < self.config.max_num_seqs and engine.scheduler.waiting_on_adapters:
                        short_at.append((now, self.config.max_num_seqs - info.num_seqs))
                    if info.decode:
                        decode_s += info.seconds
                    else:
                        mixed_s += info.seconds
                    walls[info.decode].append(info.seconds)
                    if info.span is not None:
                        spans[info.decode].append(info.span)
                        span_at[info.decode].append(now)
                for out in outs:
                    i = index[out.request_id]
                    if out.finish_reason in ("abort", "error"):
                        raise RuntimeError(f"{name}: request {out.request_id} ended with {out.finish_reason}: "
                                           f"{out.error}")
                    if out.new_token_ids:
                        if got[i] == 0:
                            first[i] = now
                        last[i] = now
                        got[i] += len(out.new_token_ids)
                        bar.update(len(out.new_token_ids))
        seconds = time.perf_counter() - start
        result = RunResult(name, workload.popularity, self.config.max_num_seqs, len(ids), workload.prompt_tokens,
                           sum(got), seconds, first, last, got,
                           extra=dict(steps=steps, decode_steps=decode_steps,
                                      mean_batch=seq_sum / steps if steps else 0.0, preloaded=preloaded,
                                      decode_step_ms=1e3 * decode_s / decode_steps if decode_steps else 0.0,
                                      mixed_step_ms=1e3 * mixed_s / (steps - decode_steps) if steps > decode_steps
                                      else 0.0, other_seconds=seconds - decode_s - mixed_s,
                                      **_gpu_ms(engine.runner.device, spans, span_at), **_spread_ms(walls),
                                      graph_steps=engine.stats["graph_steps"] - stats_before["graph_steps"],
                                      mixed_graph_steps=engine.stats["mixed_graph_steps"]
                                      - stats_before["mixed_graph_steps"],
                                      overlapped_admissions=engine.stats["overlapped_admissions"]
                                      - stats_before["overlapped_admissions"],
                                      first_step_s=round(first_step_s, 4), **_short_on_adapters(short_at, seconds),
                                      step_context_tokens=context_sum, step_adapter_reads=adapter_reads,
                                      preemptions=engine.scheduler.num_preemptions - preemptions_before,
                                      recomputed_tokens=engine.scheduler.num_recomputed_tokens - recomputed_before,
                                      **_load_stats(engine.adapters.take_load_times()),
                                      **_pinned_growth(pinned_before, _pinned_allocs())))
        check_complete(result, lens)
        return result


def _short_on_adapters(short_at: list[tuple[float, int]], seconds: float) -> dict:
    """The steps adapter loads held back: how many, the batch rows they lacked in all, and how many fell in each
    tenth of the run (the start-up's first loads, or all along)."""
    deciles = [0] * 10
    for at, _ in short_at:
        deciles[min(int(10 * at / seconds), 9) if seconds > 0 else 0] += 1
    return dict(steps_short_on_adapters=len(short_at), rows_short_on_adapters=sum(n for _, n in short_at),
                steps_short_on_adapters_by_tenth=deciles,
                last_short_on_adapters_s=round(max(at for at, _ in short_at), 3) if short_at else 0.0)


def _gpu_ms(device: torch.device, spans: dict[bool, list], span_at: dict[bool, list[float]] | None = None) -> dict:
    """On CUDA, the mean GPU span (engine StepInfo.span) of decode and of mixed steps, in ms: beside their
    wall times, how much of a step the GPU worked and how much it waited for the host. `span_at`: when in the
    run each span's step ended, for when the longest fell (`<kind>_gpu_ms_max_at_s`)."""
    if device.type != "cuda":
        return {}
    seconds = {decode: [span.seconds() for span in s] for decode, s in spans.items()}
    return _span_stats(seconds, span_at)


def _span_stats(seconds: dict[bool, list[float]], span_at: dict[bool, list[float]] | None) -> dict:
    mean = lambda s: 1e3 * sum(s) / len(s) if s else 0.0  # noqa: E731
    out = dict(decode_gpu_ms=mean(seconds[True]), mixed_gpu_ms=mean(seconds[False]))
    # the spans' own spread: a long step's GPU span says whether the GPU took long or the host held it
    out.update({k.replace("_step_ms_", "_gpu_ms_"): v for k, v in _spread_ms(seconds).items()})
    for decode, kind in ((True, "decode"), (False, "mixed")):
        if span_at is not None and seconds[decode] and len(span_at[decode]) == len(seconds[decode]):
            longest = max(range(len(seconds[decode])), key=seconds[decode].__getitem__)
            out[f"{kind}_gpu_ms_max_at_s"] = round(span_at[decode][longest], 3)
    return out


def _spread_ms(walls: dict[bool, list[float]]) -> dict:
    """The median, 99th percentile and longest wall time of decode and of mixed steps, in ms: a mean hides
    whether every step is slow or a few are very slow (a mid-run compile, a stall on the host)."""
    out = {}
    for decode, kind in ((True, "decode"), (False, "mixed")):
        times = sorted(walls[decode])
        if times:
            for name, q in (("p50", 0.5), ("p99", 0.99)):
                out[f"{kind}_step_ms_{name}"] = 1e3 * times[min(len(times) - 1, int(q * len(times)))]
            out[f"{kind}_step_ms_max"] = 1e3 * times[-1]
    return out


def _pinned_allocs() -> dict[str, float] | None:
    """PyTorch's pinned host allocator's counts of CUDA allocations and their total time in µs (None off CUDA, or
    where this torch does not count them)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    got = stats()
    if "num_host_alloc" not in got or "host_alloc_time.total" not in got:
        return None
    return {"count": got["num_host_alloc"], "us": got["host_alloc_time.total"]}


def _pinned_growth(before: dict | None, after: dict | None) -> dict:
    """How often a run page-locked fresh host memory (cudaHostAlloc: adapter reads that found no freed chunk) and
    the seconds those calls took (adapters/pinned_reserve.py)."""
    if before is None or after is None:
        return {}
    return dict(pinned_host_allocs=after["count"] - before["count"],
                pinned_host_alloc_s=round((after["us"] - before["us"]) / 1e6, 4))


def _load_stats(times: list[tuple[str, float]]) -> dict:
    """Adapter loads of a run: how many reached each stage (AdapterCache.take_load_times: "disk" read to a
    host copy, "slot_wait" host copy to slot assigned, "copy_issue" queueing the copies, "gpu" slot
    assigned to copy done) and their median and 90th-percentile seconds."""
    out = {}
    for stage in ("disk", "slot_wait", "copy_issue", "gpu"):
        in_order = [t for s, t in times if s == stage]
        seconds = sorted(in_order)
        out[f"adapter_loads_{stage}"] = len(seconds)
        if seconds:
            out[f"adapter_load_{stage}_s_p50"] = round(seconds[len(seconds) // 2], 4)
            out[f"adapter_load_{stage}_s_p90"] = round(seconds[min(len(seconds) - 1, int(0.9 * len(seconds)))], 4)
            # the start-up's loads (the first batch and its first replacements), which the percentiles hide
            first = in_order[:START_LOADS]
            out[f"adapter_load_{stage}_s_first_mean"] = round(sum(first) / len(first), 4)
            out[f"adapter_load_{stage}_s_first_max"] = round(max(first), 4)
    return out
