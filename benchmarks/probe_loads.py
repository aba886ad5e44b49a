"""Where a 7B adapter load's time goes, stage by stage, with no engine running (GPU; CPU for a smoke run).

The unlimited-batch Punica run admits ~4.7 requests/s, each bringing a new Llama-2-7B-shaped rank-16
adapter (80 MB in bf16), while its scheduler alone would keep ~197 sequences running (NOTES.md). This
times the pipeline's parts in isolation, so the run's own stage timings can be read against them:

1. `read_synthetic(..., pin=True)` one at a time: fresh pinned memory (copies kept alive) and then
   reused pinned memory (copies dropped, so the caching host allocator hands the blocks back);
2. the same reads from 1, 2, 4 and 8 threads at once (reads/s), with PyTorch's default CPU threading and
   with each reader on one core (adapters/threads.py, what the cache's loader threads do);
3. `AdapterPool.write` on a side stream: host time to issue the copies, and time to completion;
4. the whole cache: `--count` adapters prefetched into as many slots, loader threads 2 and 4,
   fresh pinned memory and then reused (a second round after dropping the first's host copies).

An engine's thread is not simulated: the unlimited run's own stage timings (bench rows) say what
loads cost beside it.

    python benchmarks/probe_loads.py --out results/probe_loads.json
    python benchmarks/probe_loads.py --layers 2 --count 8          # CPU smoke run
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from loraplex.adapters import AdapterCache, AdapterPool
from loraplex.adapters.synthetic import read_synthetic, synthetic_spec
from loraplex.adapters.threads import one_core_per_thread
from loraplex.models.presets import preset_config


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reads(model, rank: int, count: int, keep: bool, seed0: int) -> list[float]:
    """Seconds per read, one at a time; `keep` holds every host copy (so each read pins fresh memory)."""
    kept, times = [], []
    for i in range(count):
        spec = synthetic_spec(f"r{seed0 + i}", model, rank, seed=seed0 + i)
        start = time.perf_counter()
        host = read_synthetic(spec, torch.bfloat16, torch.cuda.is_available())
        times.append(time.perf_counter() - start)
        if keep:
            kept.append(host)
    return times


def parallel_reads(model, rank: int, count: int, threads: int, seed0: int, one_core: bool) -> float:
    """Reads per second with `threads` readers (host copies dropped as they come); `one_core`: each
    reader's torch ops on one core (adapters/threads.py, as the cache's loaders), else PyTorch's default."""
    specs = [synthetic_spec(f"p{seed0 + i}", model, rank, seed=seed0 + i) for i in range(count)]
    pin = torch.cuda.is_available()
    start = time.perf_counter()
    with ThreadPoolExecutor(threads, initializer=one_core_per_thread if one_core else None) as pool:
        for _ in pool.map(lambda s: read_synthetic(s, torch.bfloat16, pin) and None, specs):
            pass
    return count / (time.perf_counter() - start)


def writes(model, rank: int, count: int) -> dict:
    """Host time to issue one slot write on a side stream, and issue-to-completion time."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pool = AdapterPool(model, 2, rank, torch.bfloat16, device)
    host = read_synthetic(synthetic_spec("w", model, rank, seed=7), torch.bfloat16, device == "cuda")
    stream = torch.cuda.Stream() if device == "cuda" else None
    issue, done = [], []
    for i in range(count):
        _sync()
        start = time.perf_counter()
        if stream is not None:
            with torch.cuda.stream(stream):
                pool.write(i % 2, host, non_blocking=True)
        else:
            pool.write(i % 2, host)
        issue.append(time.perf_counter() - start)
        _sync()
        done.append(time.perf_counter() - start)
    return dict(issue_ms=_ms(issue), done_ms=_ms(done))


def cache_round(model, rank: int, count: int, threads: int, seed0: int, cache: AdapterCache | None = None):
    """Prefetch `count` new adapters into `count` slots; loads/s until all are resident."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if cache is None:
        cache = AdapterCache(model, max_gpu_adapters=count, max_lora_rank=rank, max_cpu_adapters=0,
                             device=device, loader_threads=threads)
    names = [f"c{seed0 + i}" for i in range(count)]
    for i, name in enumerate(names):
        cache.register_synthetic(name, rank, seed=seed0 + i)
    cache.take_load_times()
    start = time.perf_counter()
    for name in names:
        cache.prefetch(name)
    for name in names:
        if not cache.wait_resident(name, timeout=600):
            raise RuntimeError(f"{name} did not load")
    seconds = time.perf_counter() - start
    stages: dict[str, list[float]] = {}
    for stage, t in cache.take_load_times():
        stages.setdefault(stage, []).append(t)
    for name in names:   # free the slots for the next round
        cache.unregister(name)
    return cache, dict(loads_per_s=count / seconds, seconds=seconds,
                       stages={s: _ms(v) for s, v in stages.items()})


def _ms(values: list[float]) -> dict:
    values = sorted(values)
    return dict(n=len(values), p50=round(1e3 * statistics.median(values), 2),
                p90=round(1e3 * values[min(len(values) - 1, int(0.9 * len(values)))], 2),
                mean=round(1e3 * statistics.fmean(values), 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--layers", type=int, help="cut the model to this many layers (smoke runs)")
    parser.add_argument("--count", type=int, default=48)
    parser.add_argument("--out")
    args = parser.parse_args()
    model = preset_config(args.model, args.layers)
    result = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  date=datetime.date.today().isoformat(), torch=torch.__version__, model=args.model,
                  rank=args.rank, count=args.count)
    n = args.count
    result["read_fresh_pinned_ms"] = _ms(reads(model, args.rank, n // 2, keep=True, seed0=1000))
    result["read_reused_pinned_ms"] = _ms(reads(model, args.rank, n // 2, keep=False, seed0=2000))
    for one_core in (False, True):
        result[f"parallel_reads_per_s{'_one_core' if one_core else ''}"] = {
            t: round(parallel_reads(model, args.rank, n, t, 3000 + 100 * t, one_core), 2) for t in (1, 2, 4, 8)}
    result["write"] = writes(model, args.rank, 16)
    for threads in (2, 4):
        cache, first = cache_round(model, args.rank, n, threads, 10_000 * threads)
        _, second = cache_round(model, args.rank, n, threads, 10_000 * threads + 5000, cache)
        cache.close()
        result[f"cache_{threads}_threads"] = dict(first=first, second=second)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
