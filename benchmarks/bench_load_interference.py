"""How much adapter loads on background threads slow the engine's eager (mixed) steps, and which part.

The engine thread issues an eager Llama-2-7B forward (32 sequences, one token each, distinct
rank-16 adapters: what a mixed step's launches look like) and times it on the wall clock, to the
sync, while threads of the same process do one part of an adapter load in a loop:

- `reads`: two threads building host copies (synthetic reads: the cast into pinned chunks that a
  folder read also ends with), pinned memory reused from PyTorch's caching host allocator;
- `fresh-pinned`: the same, every host copy kept (for the scenario's second or so), so every chunk
  is a new page-locked allocation (what the first loads of a run pay, before copies are recycled);
- `copies`: one thread copying a host copy into a GPU slot (~450 asynchronous copies per adapter);
- `all`: reads and copies together, as during a run.

Each with the loaders checking in at adapters/priority.py's checkpoints while the forward is marked
busy (the engine's behaviour), and without (`HOST_PRIORITY` never busy). Median of 15 forwards.

    python benchmarks/bench_load_interference.py --out benchmarks/results/load_interference.json
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import BLOCK, RANK, fill_pool, tables  # noqa: E402

from loraplex.adapters import AdapterPool  # noqa: E402
from loraplex.adapters.priority import HOST_PRIORITY  # noqa: E402
from loraplex.adapters.synthetic import read_synthetic, synthetic_spec  # noqa: E402
from loraplex.models import ForwardBatch, KVCache, SequenceChunk, dummy_model  # noqa: E402

SCENARIOS = ("idle", "reads", "fresh-pinned", "copies", "all")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--forwards", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    B = args.batch
    model = dummy_model("llama-2-7b", dtype="bfloat16", device="cuda")
    c = model.config
    kv = KVCache(c, B * 32, BLOCK, dtype=torch.bfloat16, device="cuda")
    pool = AdapterPool(c, num_slots=B + 1, max_rank=RANK, dtype=torch.bfloat16, device="cuda")
    fill_pool(pool, torch.Generator(device="cuda").manual_seed(0))
    tabs = tables(B, 32, 0, torch.Generator().manual_seed(0))
    batch = ForwardBatch.build([SequenceChunk([7], 500, tab, i) for i, tab in enumerate(tabs)], block_size=BLOCK,
                               num_blocks=kv.num_blocks, vocab_size=c.vocab_size, device="cuda",
                               num_adapter_slots=pool.num_slots)
    spec = synthetic_spec("bg", c, RANK, seed=1)
    host = read_synthetic(spec, torch.bfloat16, True)
    copy_stream = torch.cuda.Stream()

    def forward_ms(priority: bool) -> float:
        times = []
        for _ in range(args.forwards):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with HOST_PRIORITY.busy() if priority else contextlib.nullcontext():
                model(batch, kv, pool)
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)

    def reader(stop: threading.Event, fresh: bool) -> None:
        kept = []
        while not stop.is_set():
            adapter = read_synthetic(spec, torch.bfloat16, True)
            if fresh:
                kept.append(adapter)

    def copier(stop: threading.Event) -> None:
        with torch.cuda.stream(copy_stream):
            while not stop.is_set():
                pool.write(B, host, non_blocking=True)
                copy_stream.synchronize()

    forward_ms(False)   # compile and warm up
    rows = []
    for scenario in SCENARIOS:
        for priority in (False, True):
            stop = threading.Event()
            threads = []
            if scenario in ("reads", "fresh-pinned", "all"):
                threads += [threading.Thread(target=reader, args=(stop, scenario == "fresh-pinned")) for _ in range(2)]
            if scenario in ("copies", "all"):
                threads.append(threading.Thread(target=copier, args=(stop,)))
            for t in threads:
                t.start()
            time.sleep(0.3)
            ms = forward_ms(priority)
            stop.set()
            for t in threads:
                t.join()
            rows.append(dict(scenario=scenario, priority=priority, forward_ms=ms))
            print(f"{scenario:13s} priority={'on ' if priority else 'off'} eager forward {ms:7.1f} ms", flush=True)
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, batch=B, rank=RANK, rows=rows)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
