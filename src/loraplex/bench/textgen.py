"""`loraplex bench`: offline text generation, loraplex against transformers + PEFT and its own backbone.

Every system runs the same requests (see workload.py) in this one process, one after another; the
GPU memory of each is freed before the next. Results: JSON, a markdown table with ratios, and one bar
chart per popularity, under --out-dir.

    loraplex bench --model dummy:llama-2-7b --requests 1000 --popularity distinct --max-batch 32 \
        --systems loraplex --out-dir out --name b32
    loraplex bench --requests 32 --lengths fixed --prompt-len 128 --output-len 64 --max-batch 32 \
        --systems loraplex,loraplex-backbone,hf-peft,hf-backbone,hf-peft-grouped --preload-adapters

A Punica run of 1,000 requests takes ~5 minutes a system on an H200; runs of separate processes merge into
one report with `python -m loraplex.bench.report` (report.py).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time

import torch

from .. import envs
from ..config import EngineConfig
from .ceiling import StepBytes, copy_bandwidth_gbs, run_ceiling_tokens_per_s, simulate_ceiling
from .flags import HF_SYSTEMS, SYSTEMS, add_arguments  # noqa: F401  (add_arguments: the CLI's import)
from .report import markdown, plot, ratios
from .run_hf import add_adapters, load_hf_model, run_hf
from .run_loraplex import LoraplexSystem, engine_config
from .schedule import simulate_schedule
from .workload import POPULARITIES, make_workload


def _parse(args) -> tuple[list[str], list[str], list[int | None]]:
    pops = [p.strip() for p in args.popularity.split(",") if p.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for p in pops:
        if p not in POPULARITIES:
            raise SystemExit(f"error: --popularity {p}: must be one of {', '.join(POPULARITIES)}")
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"error: --systems {s}: must be one of {', '.join(SYSTEMS)}")
    sizes: list[int | None] = []
    for b in args.max_batch.split(","):
        if b.strip() == "unlimited":
            sizes.append(None)
        elif b.strip().isdigit() and int(b) > 0:
            sizes.append(int(b))
        else:
            raise SystemExit(f"error: --max-batch {b}: must be a positive integer or 'unlimited'")
    if args.gpu_adapters is not None and args.gpu_adapters < 1:
        raise SystemExit(f"error: --gpu-adapters must be at least 1, got {args.gpu_adapters}")
    if args.loader_threads is not None and args.loader_threads < 1:
        raise SystemExit(f"error: --loader-threads must be at least 1, got {args.loader_threads}")
    if args.cpu_adapters is not None and args.cpu_adapters < 0:
        raise SystemExit(f"error: --cpu-adapters must be at least 0, got {args.cpu_adapters}")
    if args.admission_lookahead is not None and args.admission_lookahead < 0:
        raise SystemExit(f"error: --admission-lookahead must be at least 0, got {args.admission_lookahead}")
    if args.requests < 1:
        raise SystemExit(f"error: --requests must be at least 1, got {args.requests}")
    if args.baseline_requests is not None and not 1 <= args.baseline_requests <= args.requests:
        raise SystemExit(f"error: --baseline-requests must be in [1, --requests], got {args.baseline_requests}")
    return pops, systems, sizes


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cpu_copy_bandwidth_gbs(size: int = 1 << 26, reps: int = 5) -> float:
    a = torch.empty(size, dtype=torch.uint8).random_()
    b = torch.empty_like(a)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return 2 * size / sorted(times)[reps // 2] / 1e9


def run(args: argparse.Namespace) -> int:
    pops, systems, sizes = _parse(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    progress = not args.quiet
    workloads = {p: make_workload(args.requests, p, lengths=args.lengths, max_len=args.max_len, seed=args.seed,
                                  prompt_len=args.prompt_len, output_len=args.output_len) for p in pops}
    n_base = args.baseline_requests or args.requests

    def measure_bandwidth() -> float:
        return copy_bandwidth_gbs(device) if device == "cuda" else cpu_copy_bandwidth_gbs()

    bandwidth = measure_bandwidth()
    rows, notes = [], []
    readings = [bandwidth]

    def read_bandwidth_again(since: int) -> None:
        """A second copy-bandwidth reading once an engine has freed its memory, kept with the rows it ran
        (rows[since:]), and each row's ceiling at the higher of the two readings: one low reading (readings
        vary by a few percent between machines of one kind) cannot flatter a ratio to the ceiling."""
        reading = measure_bandwidth()
        readings.append(reading)
        for row in rows[since:]:
            row["bandwidth_after_gbs"] = reading
            if row.get("ceiling_tokens_per_s"):
                row["ceiling_tokens_per_s_high"] = row["ceiling_tokens_per_s"] * max(reading, bandwidth) / bandwidth

    if args.preload_adapters:
        notes.append("loraplex rows: each workload's adapters were put on the GPU before timing, up to the "
                     "number of slots (`preloaded` in the JSON); otherwise they start on disk")

    def add(result, workload, kv_tokens, step_bytes, backbone: bool, max_batch, startup: dict | None = None,
            schedule: dict | None = None):
        row = result.summary()
        row.update(startup or {})
        row.update(schedule or {})   # the batch the scheduler alone allows (bench/schedule.py)
        row["max_batch"] = max_batch if max_batch is not None else "unlimited"
        row["kv_tokens"] = kv_tokens if kv_tokens < 1 << 40 else None   # KV memory (None: transformers' grows)
        row.update(simulate_ceiling(workload, step_bytes, bandwidth, max_batch=result.max_batch,
                                    kv_tokens=kv_tokens, with_adapters=not backbone))
        if row.get("step_context_tokens"):   # loraplex rows: the same bound over the run's own steps
            row["run_ceiling_tokens_per_s"] = run_ceiling_tokens_per_s(
                step_bytes, bandwidth, row["output_tokens"], steps=row["steps"],
                context_tokens=row["step_context_tokens"], adapter_reads=row["step_adapter_reads"])
        rows.append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        if args.out_dir is not None:   # what is done survives a run cut short
            args.out_dir.mkdir(parents=True, exist_ok=True)
            (args.out_dir / f"{args.name}.partial.json").write_text(json.dumps(rows, indent=1))

    if any(s.startswith("loraplex") for s in systems):
        for max_batch in sizes:
            first_row = len(rows)
            slots = {} if args.gpu_adapters is None else dict(max_gpu_adapters=args.gpu_adapters)
            if args.loader_threads is not None:
                slots["adapter_loader_threads"] = args.loader_threads
            if args.cpu_adapters is not None:
                slots["max_cpu_adapters"] = args.cpu_adapters
            if args.admission_lookahead is not None:
                slots["admission_lookahead"] = args.admission_lookahead
            if args.adapter_host_reserve_gib is not None:
                slots["adapter_host_reserve_gib"] = args.adapter_host_reserve_gib
            if args.overlap_admissions is not None:
                slots["overlap_admissions"] = args.overlap_admissions
            if args.quantization is not None:
                slots["quantization"] = args.quantization
            if args.kv_cache_dtype is not None:
                slots["kv_cache_dtype"] = args.kv_cache_dtype
            config = engine_config(args.model, max_batch=max_batch, rank=args.rank,
                                   max_len=max(w.max_len for w in workloads.values()), device=device, dtype=dtype,
                                   layers=args.layers, **slots)
            system = LoraplexSystem(config, max(w.num_adapters for w in workloads.values()))
            step_bytes = _step_bytes(system, args.rank, dtype)
            first = next(iter(workloads.values()))
            prompts = first.prompt_ids(system.vocab_size)
            warm_start = time.perf_counter()
            system.warm_up(first, prompts)
            # Not in any rate: how long a run needs before its clock starts (engine start-up with kernel
            # compiles and graph captures, adapter registration; then the warm-up run).
            startup = dict(setup_seconds=round(system.setup_s, 2),
                           warmup_seconds=round(time.perf_counter() - warm_start, 2))
            print(json.dumps(dict(max_batch=max_batch if max_batch is not None else "unlimited", **startup)),
                  flush=True)
            heads = sorted({args.requests, n_base})
            for pop in pops:
                for n in heads:
                    w = workloads[pop].head(n)
                    schedule = simulate_schedule(w, config, system.engine.runner.kv.num_blocks)
                    if "loraplex" in systems:
                        add(system.run(w, prompts, backbone=False, name="loraplex", progress=progress,
                                       preload=args.preload_adapters), w,
                            system.kv_tokens, step_bytes, False, max_batch, startup, schedule)
                    if "loraplex-backbone" in systems and pop == pops[0]:
                        add(system.run(w, prompts, backbone=True, name="loraplex-backbone", progress=progress),
                            w, system.kv_tokens, step_bytes, True, max_batch, startup, schedule)
            system.close()
            del system
            _free()
            read_bandwidth_again(first_row)

    hf_systems = [s for s in systems if s in HF_SYSTEMS]
    hf_sizes = [b for b in sizes if b is not None]
    if hf_systems and not hf_sizes:
        notes.append("hf-* systems need a numeric --max-batch; none was given, so they did not run")
    if hf_systems and hf_sizes:
        if n_base < args.requests:
            notes.append(f"hf-* systems ran the first {n_base} of the {args.requests} requests (too slow for all); "
                         f"loraplex also ran those {n_base}, and each ratio compares the same requests")
        first_row = len(rows)
        hf = load_hf_model(args.model, layers=args.layers, dtype=getattr(torch, dtype), device=device)
        step_bytes = StepBytes.of(_model_config(args.model, args.layers), args.rank,
                                  torch.finfo(getattr(torch, dtype)).bits // 8)
        vocab = hf.config.vocab_size
        heads = {p: workloads[p].head(n_base) for p in pops}
        kv_tokens = 1 << 40    # HF's cache grows as needed: the ceiling is not KV-limited
        for max_batch in hf_sizes:
            if "hf-backbone" in hf_systems:
                w = heads[pops[0]]
                add(run_hf(hf, "hf-backbone", w, w.prompt_ids(vocab), max_batch=max_batch, progress=progress), w,
                    kv_tokens, step_bytes, True, max_batch)
        peft_systems = [s for s in hf_systems if s != "hf-backbone"]
        if peft_systems:
            model = add_adapters(hf, max(w.num_adapters for w in heads.values()), args.rank)
            for max_batch in hf_sizes:
                for pop in pops:
                    w = heads[pop]
                    for s in peft_systems:
                        add(run_hf(model, s, w, w.prompt_ids(vocab), max_batch=max_batch, progress=progress), w,
                            kv_tokens, step_bytes, False, max_batch)
            del model
        del hf
        _free()
        read_bandwidth_again(first_row)

    result = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  date=datetime.date.today().isoformat(), torch=torch.__version__, model=args.model,
                  layers=args.layers, dtype=dtype, rank=args.rank, bandwidth_gbs=bandwidth,
                  bandwidth_readings_gbs=readings,   # the first, then one after each engine
                  gpu_adapters=args.gpu_adapters, loader_threads=args.loader_threads, cpu_adapters=args.cpu_adapters,
                  admission_lookahead=EngineConfig.admission_lookahead if args.admission_lookahead is None
                  else args.admission_lookahead,
                  preload_adapters=args.preload_adapters, adapter_host_reserve_gib=args.adapter_host_reserve_gib,
                  overlap_admissions=EngineConfig.overlap_admissions
                  if args.overlap_admissions is None else args.overlap_admissions,
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype or "auto",
                  settings=envs.snapshot(),   # the LORAPLEX_* settings the run had
                  workload=dict(requests=args.requests, lengths=args.lengths, max_len=args.max_len, seed=args.seed,
                                prompt_len=args.prompt_len, output_len=args.output_len,
                                popularity=pops, baseline_requests=n_base),
                  rows=rows, ratios=ratios(rows), notes=notes)
    table = markdown(result)
    print(table)
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1))
        (args.out_dir / f"{args.name}.md").write_text(table)
        (args.out_dir / f"{args.name}.partial.json").unlink(missing_ok=True)
        if not args.no_plots:
            plot(result, args.out_dir, args.name)
    return 0


def _model_config(model: str, layers: int | None):
    from ..models.config import ModelConfig
    from ..models.presets import preset_config
    if model.startswith("dummy:"):
        return preset_config(model.removeprefix("dummy:"), layers)
    return ModelConfig.from_pretrained(model)


def _step_bytes(system, rank: int, dtype: str) -> StepBytes:
    """The ceiling's bytes of the engine as built: its projections FP8 where any weight is (quantized at load or
    stored so), its KV cache's element size."""
    from ..models.fp8 import Fp8Weight
    runner = system.engine.runner
    fp8 = any(isinstance(m, Fp8Weight) for m in runner.model.modules())
    return StepBytes.of(system.engine.model_config, rank, torch.finfo(getattr(torch, dtype)).bits // 8,
                        projection_bytes=1 if fp8 else None, kv_bytes=runner.kv.dtype.itemsize)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
