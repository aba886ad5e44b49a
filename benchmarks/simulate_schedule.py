"""The batch the engine's scheduler alone allows (src/loraplex/bench/schedule.py) for the paper's workload at a
given KV memory, every adapter resident from the start; host only.

`loraplex bench` rows carry it since 2026-12-01's fifth session (`schedule_mean_batch`). For older runs, which
did not record their KV memory, `--from-ceiling STEPS` recovers it from the run's ceiling: the KV size at which
the ceiling's own schedule (src/loraplex/bench/ceiling.py) takes that many steps.

    python benchmarks/simulate_schedule.py --from-ceiling 8851     # the H200 unlimited runs of 2026-12-01
"""
from __future__ import annotations

import argparse

from loraplex.bench.ceiling import StepBytes, simulate_ceiling
from loraplex.bench.run_loraplex import UNLIMITED_SEQS, engine_config
from loraplex.bench.schedule import simulate_schedule
from loraplex.bench.workload import make_workload
from loraplex.models.config import ModelConfig
from loraplex.models.presets import PRESETS


def kv_from_ceiling(workload, steps: int, lo: int = 1 << 12, hi: int = 1 << 22) -> int:
    """The smallest KV size (tokens) at which the ceiling's schedule takes at most `steps` steps."""
    step_bytes = StepBytes.of(ModelConfig.from_dict(PRESETS["llama-2-7b"]), 16)   # bytes do not move steps
    lo = max(lo, max(r.total_len for r in workload.requests))   # the ceiling needs room for the longest
    while lo < hi:
        mid = (lo + hi) // 2
        if simulate_ceiling(workload, step_bytes, 1.0, max_batch=None, kv_tokens=mid)["ceiling_steps"] <= steps:
            hi = mid
        else:
            lo = mid + 1
    return lo


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--popularity", default="distinct")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--max-batch", type=int, default=None, help="default: unlimited, as `loraplex bench` runs it")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--kv-tokens", type=int)
    group.add_argument("--from-ceiling", type=int, metavar="STEPS", help="a run's ceiling_steps (unlimited batch)")
    ap.add_argument("--admission-lookahead", type=int, default=None,
                    help="EngineConfig.admission_lookahead (default: the engine's)")
    args = ap.parse_args(argv)
    workload = make_workload(args.requests, args.popularity, max_len=args.max_len)
    kv = args.kv_tokens or kv_from_ceiling(workload, args.from_ceiling)
    lookahead = {} if args.admission_lookahead is None else dict(admission_lookahead=args.admission_lookahead)
    config = engine_config("dummy:llama-2-7b", max_batch=args.max_batch, rank=16, max_len=args.max_len, device="cpu",
                           dtype="bfloat16", **lookahead)
    result = dict(kv_tokens=kv, max_batch=args.max_batch or UNLIMITED_SEQS,
                  admission_lookahead=config.admission_lookahead,
                  **simulate_schedule(workload, config, kv // config.block_size))
    print(", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main()
