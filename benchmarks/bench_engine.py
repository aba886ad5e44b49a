"""End-to-end engine benchmark on the GPU: Llama-2-7B shapes, dummy weights, bf16, rank-16
adapters on all seven projections.

Workload: `--waves` × max_num_seqs prompts of 128–512 random tokens, 128 output tokens each (ignore_eos),
all submitted at once; `max_num_seqs` of 32 and 256 (`--batches`). Variants on the same prompts:
- backbone: no adapters;
- distinct: request i uses adapter i mod max_num_seqs, so every full batch has all-distinct adapters;
- shared: every request uses one adapter;
- composed (on request): request i combines two rank-16 adapters of its own, {a(2i): 0.7, a(2i+1): 0.3};
- merged (on request): request i uses a rank-32 adapter of its own (what merging its pair offline builds).
Each of composed and merged runs in an engine whose pool is as wide as its adapters (R = 16 and 32: what each
deployment would configure); `--compose-pool shared` runs the pair in one engine whose pool holds both (R = 32,
so each rank-16 member's B rows are padded to 32 ranks).
`--quantizations none,fp8` runs every variant with bf16 weights and again with FP8 ones (`--quantization fp8`:
e4m3, a scale per output channel, quantized at load), each in an engine of its own, in one process; `fp8kv`: FP8
weights and an FP8 KV cache (`--kv-cache-dtype fp8`, scales 1.0); `--profile` tells their kernels apart.
Adapters are synthetic (no files) and made resident before timing, so the runs measure serving,
not loading. Each variant runs with CUDA graphs, and at `--eager-batches` also with `enforce_eager`.

Reported per run: output tokens/s over the whole run, the median wall time of full-batch decode
steps (schedule + forward + sample + postprocess), and beside them the memory floor of such a
step: weights + KV of the batch's contexts + each used adapter once, over the copy bandwidth
measured in the same run.

`--block-size` and `--decode-tiles even_split_tokens=128,programs_per_sm=4` set the KV cache's blocks and the
decode attention's tiles (any DecodeConfig field, for the 16-bit and e4m3 caches alike) for every engine of the run:
what a change to their defaults would be timed with.

`--repeats N` runs each variant N times, interleaved across the variants (so drift over the call hits each
alike), and reports each variant's median-throughput run beside every run's tokens/s, full-batch decode step and
prompt steps' seconds (the prompt steps can move a short run's tokens/s while the decode step holds). The full-batch
decode steps' GPU span (inputs, forward, sampling on the GPU) is reported beside their wall time.

    python benchmarks/bench_engine.py --batches 32,256 --repeats 3 \
        --out benchmarks/results/engine.json --md benchmarks/results/engine.md
    python benchmarks/bench_engine.py --batches 32 --modes graphs --variants backbone,distinct --repeats 3
    python benchmarks/bench_engine.py --batches 32 --modes graphs --variants backbone,distinct \
        --quantizations none,fp8 --repeats 3
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import copy_bandwidth_gbs  # noqa: E402
from bench_model import adapter_bytes, kv_bytes, weight_bytes  # noqa: E402
import step_profile  # noqa: E402

from loraplex import SamplingParams, envs  # noqa: E402
from loraplex.config import EngineConfig  # noqa: E402
from loraplex.engine import Engine  # noqa: E402
from loraplex.ops.attention import launchers  # noqa: E402

RANK = 16
OUTPUT_TOKENS = 128


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(128, 513, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (L,), generator=gen).tolist() for L in lens]


def run(engine: Engine, work: list[list[int]], adapters: list[str | None]) -> dict:
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    engine.stats["overlapped_steps"] = 0
    torch.cuda.synchronize()
    started = time.time()   # (wall-clock: beside gpu_engine.sh's clock log)
    start = time.perf_counter()
    for i, (p, a) in enumerate(zip(work, adapters)):
        engine.add_request(f"r{i}", p, params, a)
    steps, out_tokens, contexts = [], 0, []
    while engine.has_unfinished():
        outs = engine.step()
        info = engine.last_step
        out_tokens += sum(len(o.new_token_ids) for o in outs)
        if info is not None:
            steps.append(info)
            if info.decode and info.num_seqs == engine.config.max_num_seqs:
                contexts.append(info.context_tokens)
    seconds = time.perf_counter() - start
    kinds = {"decode": [s for s in steps if s.decode], "mixed": [s for s in steps if not s.decode and s.num_seqs > 1],
             "prefill": [s for s in steps if not s.decode and s.num_seqs == 1]}
    breakdown = {k: dict(steps=len(v), seconds=round(sum(s.seconds for s in v), 3),
                         tokens=sum(s.num_tokens for s in v)) for k, v in kinds.items()}
    full_steps = [s for s in steps if s.decode and s.num_seqs == engine.config.max_num_seqs]
    full = [s.seconds for s in full_steps]
    full_gpu = [g for g in (s.gpu_seconds for s in full_steps) if g is not None]
    # the steps with prompts (eager): their GPU span beside their wall time tells host time from GPU time
    prompt_gpu = [g for g in (s.gpu_seconds for s in steps if not s.decode) if g is not None]
    return dict(started=started, seconds=seconds, breakdown=breakdown,
                step_seconds=round(sum(s.seconds for s in steps), 3),
                output_tokens=out_tokens, tokens_per_s=out_tokens / seconds, steps=len(steps),
                decode_steps=sum(s.decode for s in steps), graph_steps=sum(s.graphed for s in steps),
                overlapped_steps=engine.stats["overlapped_steps"],
                full_decode_steps=len(full), full_decode_step_ms=1e3 * statistics.median(full) if full else None,
                full_decode_gpu_ms=1e3 * statistics.median(full_gpu) if full_gpu else None,
                mean_full_context=statistics.mean(contexts) / engine.config.max_num_seqs if contexts else None,
                prefill_step_ms=1e3 * statistics.median([s.seconds for s in steps if not s.decode] or [0]),
                prefill_gpu_ms=1e3 * statistics.median(prompt_gpu) if prompt_gpu else None,
                prompt_steps_seconds=round(sum(s.seconds for s in steps if not s.decode), 4),
                prompt_steps_gpu_seconds=round(sum(prompt_gpu), 4) if prompt_gpu else None)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--waves", type=int, default=2, help="requests = waves × max_num_seqs")
    ap.add_argument("--modes", default="graphs,eager")
    ap.add_argument("--eager-batches", default="32", help="batch sizes also run with enforce_eager")
    ap.add_argument("--variants", default="backbone,distinct,shared")
    ap.add_argument("--repeats", type=int, default=1,
                    help="measured runs per variant, interleaved across variants; each row is the median-tokens/s run")
    ap.add_argument("--quantizations", default="none",
                    help="comma-separated: none (bf16), fp8 (FP8 weights), fp8kv (FP8 weights and an FP8 KV cache)")
    ap.add_argument("--compose-pool", choices=("own", "shared"), default="own",
                    help="composed and merged in pools as wide as their adapters (own) or in one R = 32 pool")
    ap.add_argument("--graph-prompt-tokens", type=int, default=None,
                    help="EngineConfig.cuda_graph_max_prompt_tokens (default: the engine's): prompt steps of up to "
                         "this many prompt tokens replay CUDA graphs, larger ones run eagerly")
    ap.add_argument("--block-size", type=int, default=None,
                    help="EngineConfig.block_size, tokens a KV-cache block (default: the engine's)")
    ap.add_argument("--decode-tiles", type=_tile_fields, default={}, metavar="FIELD=VALUE,...",
                    help="decode attention's tiles (ops/attention/launchers.py's DecodeConfig fields) for the 16-bit "
                         "and e4m3 caches, to time them")
    ap.add_argument("--profile", type=Path,
                    help="also write each engine's kernel times of full-batch decode steps and of prompt steps, a "
                         "column per variant (step_profile.py), to this markdown file")
    ap.add_argument("--out")
    ap.add_argument("--md")
    args = ap.parse_args(argv)
    for q in args.quantizations.split(","):
        if q not in QUANTIZATIONS:
            ap.error(f"--quantizations: {q!r} is not one of {', '.join(QUANTIZATIONS)}")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.graph_prompt_tokens is not None and args.graph_prompt_tokens < 0:
        ap.error(f"--graph-prompt-tokens must be at least 0, got {args.graph_prompt_tokens}")
    if args.block_size is not None and args.block_size < 1:
        ap.error(f"--block-size must be at least 1, got {args.block_size}")
    _set_decode_tiles(args)
    copy_gbs = copy_bandwidth_gbs()
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), torch=torch.__version__,
                  preset=args.preset, layers=args.layers, rank=RANK, output_tokens=OUTPUT_TOKENS, repeats=args.repeats,
                  settings=envs.snapshot(),   # the LORAPLEX_* settings the run had
                  compose_pool=args.compose_pool, graph_prompt_tokens=_graph_prompt_tokens(args), copy_gbs=copy_gbs,
                  block_size=_block_size(args),
                  decode_tiles=args.decode_tiles, rows=[], profiles={})
    for B in map(int, args.batches.split(",")):
        for mode in args.modes.split(","):
            if mode == "eager" and str(B) not in args.eager_batches.split(","):
                continue
            for quant in args.quantizations.split(","):
                for variants in _groups(args.variants.split(","), args.compose_pool == "shared"):
                    rows, profiles = run_group(args, B, mode, variants, copy_gbs, quant)
                    result["rows"] += rows
                    for steps, by_variant in profiles.items():
                        result["profiles"].setdefault(f"max seqs {B}, {mode}, {quant} weights, {steps}",
                                                      {}).update(by_variant)
                    _write(result, args)   # after each engine: a run cut short keeps what it measured
    print(markdown(result))


def _write(result: dict, args) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.md:
        Path(args.md).write_text(markdown(result))
    if args.profile and result["profiles"]:
        args.profile.write_text(f"# Kernel time of full-batch decode steps and of prompt steps — {result['gpu']}, "
                                f"{result['date']}\n\n"
                                + "\n".join(f"## {name}\n\n{step_profile.markdown(p)}"
                                            for name, p in result["profiles"].items()))


def _set_decode_tiles(args) -> None:
    """The decode tiles of `--decode-tiles`, for every engine of the run (module defaults the engine reads: tiles
    to time before they become the default)."""
    if args.decode_tiles:
        for name in ("DECODE_CONFIGS", "FP8_DECODE_CONFIGS"):
            tables = getattr(launchers, name)
            setattr(launchers, name, {d: replace(c, **args.decode_tiles) for d, c in tables.items()})


def _tile_fields(text: str) -> dict:
    """`FIELD=VALUE,...` of DecodeConfig, each value of the field's type (argparse's type for --decode-tiles)."""
    defaults = launchers.DECODE_CONFIGS[128]
    fields = {}
    for item in filter(None, text.split(",")):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or not hasattr(defaults, name):
            raise argparse.ArgumentTypeError(f"{item!r} is not FIELD=VALUE of a DecodeConfig field "
                                             f"({', '.join(vars(defaults))})")
        kind = type(getattr(defaults, name))
        try:
            fields[name] = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: {value!r} is not of type {kind.__name__}") from None
    try:
        replace(defaults, **fields)   # the dataclass's own checks (e.g. a negative even_split_tokens)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return fields


COMPOSE_VARIANTS = ("composed", "merged")
QUANTIZATIONS = ("none", "fp8", "fp8kv")


def _groups(variants: list[str], shared_compose_pool: bool) -> list[list[str]]:
    """The variants that share an engine: the plain ones (a rank-16 pool), then composed (a rank-16 pool) and
    merged (rank 32) each in its own, or the two in one pool of both ranks (R = 32) where `shared_compose_pool`."""
    plain = [v for v in variants if v not in COMPOSE_VARIANTS]
    compose = [v for v in variants if v in COMPOSE_VARIANTS]
    return [g for g in [plain] + ([compose] if shared_compose_pool else [[v] for v in compose]) if g]


def _adapter(variant: str, i: int, B: int):
    """Request i's adapter: none, one shared, its own (distinct), two of its own combined (composed: rank-16 members
    at 0.7 / 0.3), or its own rank-32 adapter (merged: what combining those two offline would build)."""
    if variant == "composed":
        return {f"a{2 * (i % B)}": 0.7, f"a{2 * (i % B) + 1}": 0.3}
    return {"backbone": None, "shared": "a0", "distinct": f"a{i % B}", "merged": f"m{i % B}"}[variant]


def _engine(args, B: int, mode: str, variants: list[str], quant: str) -> tuple[Engine, float]:
    """An engine with the adapters of `variants` resident: B rank-16 ones (the plain variants), 2B rank-16 members
    (composed) and B rank-32 merged ones (merged), in a pool as wide as the largest; base weights in bf16 or FP8,
    and an FP8 KV cache for fp8kv (`quant`)."""
    plain = [v for v in variants if v not in COMPOSE_VARIANTS]
    rank16 = 2 * B if "composed" in variants else B if plain else 0
    names = [(f"a{i}", RANK) for i in range(rank16)] + \
        ([(f"m{i}", 2 * RANK) for i in range(B)] if "merged" in variants else [])
    config = EngineConfig(model=f"dummy:{args.preset}", dummy_layers=args.layers, dtype="bfloat16",
                          quantization=None if quant == "none" else "fp8",
                          kv_cache_dtype="fp8" if quant == "fp8kv" else "auto",
                          max_num_seqs=B, max_num_batched_tokens=max(2048, B), max_gpu_adapters=len(names),
                          max_lora_rank=max(rank for _, rank in names), max_cpu_adapters=0,
                          enforce_eager=(mode == "eager"), cuda_graph_max_batch=B, max_model_len=1024,
                          cuda_graph_max_prompt_tokens=_graph_prompt_tokens(args),
                          block_size=_block_size(args))
    t0 = time.perf_counter()
    engine = Engine(config)
    setup_s = time.perf_counter() - t0
    for i, (name, rank) in enumerate(names):
        engine.adapters.register_synthetic(name, rank, seed=i + 1)
    for name, _ in names:
        engine.adapters.prefetch(name)
    for name, _ in names:
        engine.adapters.wait_resident(name, timeout=600)
    return engine, setup_s


def _block_size(args) -> int:
    """--block-size, or EngineConfig's default where it is not given."""
    return getattr(args, "block_size", None) or EngineConfig.block_size


def _graph_prompt_tokens(args) -> int:
    """--graph-prompt-tokens, or EngineConfig's default where it is not given."""
    given = getattr(args, "graph_prompt_tokens", None)
    return EngineConfig.cuda_graph_max_prompt_tokens if given is None else given


def run_group(args, B: int, mode: str, variants: list[str], copy_gbs: float,
              quant: str = "none") -> tuple[list[dict], dict]:
    """Each variant `--repeats` times in one engine, interleaved: a row per variant (its median run), and with
    `--profile` each variant's kernel times (step_profile.py)."""
    engine, setup_s = _engine(args, B, mode, variants, quant)
    print(f"B={B} {mode} {quant} engine for {','.join(variants)}: set up in {setup_s:.0f} s", flush=True)
    model = engine.runner.model
    work = prompts(args.waves * B, model.config.vocab_size)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    # interleaved, and each round in a rotated order, so that drift over the call hits every variant alike
    for repeat in range(args.repeats):
        for variant in variants[repeat % len(variants):] + variants[:repeat % len(variants)]:
            adapters = [_adapter(variant, i, B) for i in range(len(work))]
            if repeat == 0:
                # warm-up: a whole run of each variant, so that it sees every step shape with its own kernels (the
                # LoRA kernels' variants by the batches' shapes: the backbone's run launches none of them), and the
                # allocator settles
                t0 = time.perf_counter()
                run(engine, work, adapters)
                print(f"B={B} {mode} {quant} {variant}: warmed up in {time.perf_counter() - t0:.0f} s", flush=True)
            runs[variant].append(run(engine, work, adapters))
    rows = []
    for variant in variants:
        ordered = sorted(runs[variant], key=lambda r: r["tokens_per_s"])
        res = ordered[(len(ordered) - 1) // 2]   # the median run (the lower middle of an even count)
        used = {"backbone": 0, "shared": 1, "distinct": B, "composed": 2 * B, "merged": 2 * B}[variant]
        ctx = res["mean_full_context"] or 0
        kv = kv_bytes(model, int(ctx * B)) // (2 if quant == "fp8kv" else 1)   # (kv_bytes: 16-bit values)
        floor_ms = (weight_bytes(model, B) + kv +
                    used * adapter_bytes(model)) / (copy_gbs * 1e9) * 1e3   # (merged: rank 32 = 2 × rank 16)
        row = dict(batch=B, mode=mode, variant=variant, quantization=quant, setup_s=setup_s, floor_ms=floor_ms,
                   repeats_tokens_per_s=[round(r["tokens_per_s"], 1) for r in runs[variant]],
                   # each run's decode step and prompt steps: which of the two moved a run's tokens/s
                   repeats_decode_step_ms=[None if r["full_decode_step_ms"] is None else
                                           round(r["full_decode_step_ms"], 3) for r in runs[variant]],
                   repeats_prompt_seconds=[r["prompt_steps_seconds"] for r in runs[variant]],
                   repeats_prompt_gpu_seconds=[r["prompt_steps_gpu_seconds"] for r in runs[variant]],
                   repeats_started=[round(r["started"], 1) for r in runs[variant]], **res)
        rows.append(row)
        step = f"{row['full_decode_step_ms']:.2f} ms" if row["full_decode_step_ms"] else "–"
        print(f"B={B} {mode} {quant} {variant}: {row['tokens_per_s']:.0f} tokens/s, full-batch decode step {step}, "
              f"floor {floor_ms:.2f} ms (runs {row['repeats_tokens_per_s']})", flush=True)
    profiles: dict[str, dict] = {"decode steps": {}, "prompt steps": {}} if args.profile else {}
    for v in variants if args.profile else []:
        adapters = [_adapter(v, i, B) for i in range(len(work))]
        profiles["decode steps"][v] = step_profile.profile_decode(engine, work, adapters)
        profiles["prompt steps"][v] = step_profile.profile_prompts(engine, work, adapters)
    engine.close()
    del engine, model
    torch.cuda.empty_cache()
    return rows, profiles


def _cache_note(res: dict) -> str:
    """The KV-cache block size and decode tiles where a run set them (earlier results lack the keys)."""
    block, tiles = res.get("block_size"), res.get("decode_tiles")
    return ((f" KV-cache blocks of {block} tokens." if block and block != EngineConfig.block_size else "")
            + (" Decode attention's tiles: " + ", ".join(f"{k}={v}" for k, v in tiles.items()) + "." if tiles else ""))


def markdown(res: dict) -> str:
    repeats = res.get("repeats", 1)
    lines = [f"# Engine throughput — {res['gpu']}, {res['date']}", "",
             f"{res['preset']} dummy weights, bf16, rank-{res['rank']} adapters on all 7 projections; prompts "
             f"128–512 tokens, {res['output_tokens']} output tokens each, all submitted at once. Copy bandwidth "
             f"{res['copy_gbs']:.0f} GB/s."
             + (f" In graph mode, steps with up to {res['graph_prompt_tokens']} prompt tokens replay CUDA graphs too."
                if "graph_prompt_tokens" in res else "")
             + (f" Each row is the median-throughput run of {repeats}, the variants' runs interleaved." if repeats > 1
                else "") + _cache_note(res), "",
             "| max seqs | mode | weights | adapters | tokens/s | vs backbone | full-batch decode step (ms) "
             "| its GPU span (ms) | floor (ms) | of floor | prefill step (ms) | its GPU span (ms) | graph steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    key = lambda r: (r["batch"], r["mode"], r.get("quantization", "none"))   # noqa: E731
    base = {key(r): r["tokens_per_s"] for r in res["rows"] if r["variant"] == "backbone"}
    for r in res["rows"]:
        step, gpu = r["full_decode_step_ms"], r.get("full_decode_gpu_ms")
        rel = f"{r['tokens_per_s'] / base[key(r)]:.3f}" if key(r) in base else "–"
        weights = {"none": "bf16", "fp8kv": "fp8, fp8 KV"}.get(r.get("quantization", "none"), r.get("quantization"))
        steps = (f"{step:.2f} | {gpu:.2f} | " if gpu else f"{step:.2f} | – | ") if step else "– | – | "
        floor = f"{r['floor_ms']:.2f} | {step / r['floor_ms']:.2f}× | " if step else "– | – | "
        name = r["variant"]
        prompt_gpu = f"{r['prefill_gpu_ms']:.1f}" if r.get("prefill_gpu_ms") else "–"
        lines.append(f"| {r['batch']} | {r['mode']} | {weights} | {name} | {r['tokens_per_s']:.0f} | {rel} | "
                     f"{steps}{floor}{r['prefill_step_ms']:.1f} | {prompt_gpu} | {r['graph_steps']}/{r['steps']} |")
    lines += ["", "Floor: (weights + KV bytes of the batch's mean context + each used adapter once) / copy "
              "bandwidth. Step times are wall times of the engine's whole step (host work included); the GPU span "
              "is the step's inputs, forward and sampling on the GPU."]
    starts = {f"{r['batch']} {r['mode']} {r.get('quantization', 'none')}": r["setup_s"] for r in res["rows"]
              if r.get("setup_s") is not None}
    if starts:   # the captures grow with the graphs' shapes (cuda_graph_max_prompt_tokens)
        lines += ["", "Engine start-up (weights, KV sizing, kernels, CUDA graphs), s: "
                  + "; ".join(f"{name} {s:.0f}" for name, s in starts.items()) + "."]
    if repeats > 1:
        lines += ["", "Each run in order, tokens/s / full-batch decode step (ms) / all prompt steps (s, and their GPU "
                  "spans' sum where recorded):"]
        lines += [f"- {r['batch']} {r['mode']} {r.get('quantization', 'none')} {r['variant']}: "
                  + "; ".join(_run_cells(r)) for r in res["rows"]]
    if any(r["variant"] in COMPOSE_VARIANTS for r in res["rows"]):
        lines += ["", "composed: two rank-16 adapters a request (0.7 / 0.3); merged: one rank-32 adapter a request; "
                  + ("both in one pool of rank 32." if res.get("compose_pool") == "shared" else
                     "each in a pool as wide as its adapters (16 and 32).")]
    return "\n".join(lines) + "\n"


def _run_cells(row: dict) -> list[str]:
    """'tokens/s / decode step / prompt steps' of each of a row's runs (rows of older results: tokens/s only)."""
    n = len(row["repeats_tokens_per_s"])
    steps = row.get("repeats_decode_step_ms") or [None] * n
    prompts = row.get("repeats_prompt_seconds") or [None] * n
    prompt_gpu = row.get("repeats_prompt_gpu_seconds") or [None] * n
    fmt = lambda v, spec: "–" if v is None else format(v, spec)   # noqa: E731
    return [f"{t:.0f} / {fmt(d, '.2f')} / {fmt(p, '.3f')}" + ("" if g is None else f" (GPU {g:.3f})")
            for t, d, p, g in zip(row["repeats_tokens_per_s"], steps, prompts, prompt_gpu)]


if __name__ == "__main__":
    main()
