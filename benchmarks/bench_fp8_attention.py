"""Decode attention over an FP8 (e4m3) KV cache on the GPU, bf16 queries: the decode kernel's tiles swept.

The kernel's decode tiles for 16-bit caches (ops/attention/launchers.py's DECODE_CONFIGS) keep two resident
programs an SM with two K/V tiles in flight each, which covers HBM's latency. e4m3 caches take the same keys a step
at 2 warps (FP8_DECODE_CONFIGS): an e4m3 tile of them moves half the bytes, and twice the keys at 4 warps (the 16-bit
tile's bytes) ran slower in 7 of 8 cases once V's tile converted in its load's layout. Per case, side by side in one
run: the same batch over a bf16 cache (its tiles, and with even shares of each context where the splits are planned
for longer contexts than the case's), then the e4m3 cache with today's tiles, the 16-bit ones and each
of `candidates` (more or fewer stages and warps, shorter splits, shorter even shares or splits of the longest
context, wider or narrower key steps), beside the floor of the e4m3 bytes over the copy bandwidth measured in the
same run. Every output is checked against the reference path on the same cache first.
`--planned-len N` plans the splits for contexts of up to N tokens, as a CUDA graph plans them for the model's length
(the engine benchmark's 1,024, a server's 4,096 or more); by default for the case's own context.

Llama-2-7B and Llama-3-8B heads, batches 32 and 128 × contexts 512 and 4096, one query row a sequence, in CUDA
graphs over rotating input sets (bench_attention.py's `Paged`: disjoint shuffled pages, L2 cleared between uses);
medians of CUDA-event timings after warm-up.

    python benchmarks/bench_fp8_attention.py --out benchmarks/results/fp8_attention.json \
        --md benchmarks/results/fp8_attention.md
    python benchmarks/bench_fp8_attention.py --planned-len 4096 --only "even;longest" --out ... --md ...
    TRITON_INTERPRET=1 python benchmarks/bench_fp8_attention.py --smoke   # tiny shapes on the CPU, no timing
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import HEAD_SHAPES, Paged, _rotations  # noqa: E402

from loraplex import envs, ops  # noqa: E402
from loraplex.ops.attention import launchers as ak  # noqa: E402

BATCHES, CONTEXTS = [32, 128], [512, 4096]
E4M3 = torch.float8_e4m3fn


def candidates(head_dim: int, only: list[str] | None = None) -> dict[str, ak.DecodeConfig]:
    """The launcher's tiles for e4m3 caches ("today"), the 16-bit caches' tiles, then variants to time over an e4m3
    cache; with `only`, today's and those whose labels contain one of its words."""
    every = _all_candidates(head_dim)
    if not only:
        return every
    unmatched = [w for w in only if not any(w in label for label in every)]
    if unmatched:
        raise SystemExit(f"--only: no candidate's label contains {unmatched}; the labels: {[*every]}")
    return {k: c for k, c in every.items() if k == "today" or any(w in k for w in only)}


def _all_candidates(head_dim: int) -> dict[str, ak.DecodeConfig]:
    today, bf16 = ak.decode_config(head_dim, torch.bfloat16, fp8_kv=True), ak.DECODE_CONFIGS[head_dim]
    half, double = today.block_n // 2, 2 * today.block_n
    return {"today": today, "16-bit tiles": bf16,
            "2x keys, 4 warps": replace(today, block_n=double, num_warps=4),
            "2x keys": replace(today, block_n=double),
            "2 stages": replace(today, num_stages=2), "4 stages": replace(today, num_stages=4),
            "1 warp": replace(today, num_warps=1),
            "half keys": replace(today, block_n=half), "half keys, 1 warp": replace(today, block_n=half, num_warps=1),
            "half keys, 4 stages": replace(today, block_n=half, num_stages=4),
            "splits of 256": replace(today, min_split_tokens=256),
            "even splits of 128+": replace(today, even_split_tokens=128),
            "splits of the longest": replace(today, even_split_tokens=0)}   # (a split: a share of the longest context)


def to_e4m3(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 cache, fp32 scale [1]): one scale for the tensor, its largest value at 448."""
    scale = (cache.float().abs().amax() / 448).reshape(1)
    return (cache.float() / scale).clamp(-448, 448).to(E4M3), scale


def decode_fn(p: Paged, i: int, k, v, cfg: ak.DecodeConfig, k_scale=None, v_scale=None, planned_len: int = 0):
    """Set i's decode launch through the launcher with tiles `cfg`, its splits planned for contexts of up to
    `planned_len` tokens or, 0, the longest one's (paged.py's checks run once, in `check`)."""
    st = p.sets[i]
    return lambda: ak.decode(st["q"], k, v, st["block_tables"], p.seq_lens, p.query_start, st["out"],
                             max_seq_len=max(planned_len, p.max_seq_len), scale=p.scale, window=0, cfg=cfg,
                             k_scale=k_scale, v_scale=v_scale)


def bench_case(name: str, heads, batch: int, ctx: int, copy_gbs: float | None, gen, device, smoke: bool,
               only: list[str] | None = None, planned_len: int = 0) -> dict:
    Hq, Hkv, D = heads
    rot = 1 if smoke else _rotations(batch * ctx * Hkv * D * 2)   # (the e4m3 sets' bytes)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16   # (the interpreter has no bf16 dots)
    backend = "triton" if smoke and ops.triton_interpreted() else None
    p = Paged([ctx - 1] * batch, [1] * batch, Hq, Hkv, D, dtype, device, rot, gen, backend)
    e4m3_bytes = batch * ctx * Hkv * D * 2
    tiles = candidates(D, only)
    if max(planned_len, ctx) <= ctx:   # every context is the longest: even shares are today's ranges
        tiles = {k: c for k, c in tiles.items() if k == "today" or not _even_shares_alone_differ(c, tiles["today"])}
    row = dict(model=name, Hq=Hq, Hkv=Hkv, D=D, batch=batch, context=ctx, planned_len=max(planned_len, ctx),
               rotations=rot, e4m3_bytes=e4m3_bytes, configs={k: asdict(c) for k, c in tiles.items()}, us={},
               max_abs_err={})
    (k8, ks), (v8, vs) = to_e4m3(p.k_cache), to_e4m3(p.v_cache)
    if not smoke:   # a throwaway timing: the first one of a large case ran ~17% slow, its tiles timed again later not
        _graph_time([decode_fn(p, i, k8, v8, tiles["today"], ks, vs, planned_len) for i in range(rot)])
    reference = _reference(p, k8, v8, ks, vs)
    for label, cfg in tiles.items():
        row["max_abs_err"][label], us = _run_tiles(p, k8, v8, ks, vs, cfg, planned_len, smoke, reference)
        if us is not None:
            row["us"][label] = us
    bf16_tiles = ak.decode_config(D, dtype)
    if not smoke:
        row["bf16_cache_us"] = _graph_time([decode_fn(p, i, p.k_cache, p.v_cache, bf16_tiles, planned_len=planned_len)
                                            for i in range(rot)])
    if max(planned_len, ctx) > ctx:   # the 16-bit cache's tiles with even shares of each context too
        row["bf16_even_err"], us = _run_tiles(p, p.k_cache, p.v_cache, None, None,
                                              replace(bf16_tiles, even_split_tokens=256), planned_len, smoke,
                                              _reference(p, p.k_cache, p.v_cache, None, None))
        if us is not None:
            row["bf16_even_cache_us"] = us
    if not smoke:
        row["floor_us"] = e4m3_bytes / copy_gbs / 1e3
        row["best"] = min(row["us"], key=row["us"].get)
    return row


def _even_shares_alone_differ(cfg: ak.DecodeConfig, today: ak.DecodeConfig) -> bool:
    return replace(cfg, even_split_tokens=today.even_split_tokens) == today


def _reference(p: Paged, k, v, ks, vs) -> torch.Tensor:
    """Set 0's attention over the cache (k, v), with scales (ks, vs) for an e4m3 one, by the reference path, in
    fp32."""
    st = p.sets[0]
    return ops.paged_attention(st["q"], k, v, st["block_tables"], p.seq_lens, p.query_start, max_query_len=1,
                               max_seq_len=p.max_seq_len, scale=p.scale, k_scale=ks, v_scale=vs,
                               backend="reference").float()


def _run_tiles(p: Paged, k, v, ks, vs, cfg: ak.DecodeConfig, planned_len: int, smoke: bool,
               reference: torch.Tensor) -> tuple[float, float | None]:
    """(the largest error against `reference`, `_reference`'s on this cache; µs a launch, None when `smoke`) of
    tiles `cfg` over the cache (k, v)."""
    st = p.sets[0]
    decode_fn(p, 0, k, v, cfg, ks, vs, planned_len)()
    err = (st["out"].float() - reference).abs().max().item()
    if smoke:
        return err, None
    return err, _graph_time([decode_fn(p, i, k, v, cfg, ks, vs, planned_len) for i in range(len(p.sets))])


def _graph_time(fns) -> float:
    from bench_lora_ops import graphed, time_us
    return time_us([graphed(f) for f in fns])


def markdown(env: dict, rows: list[dict]) -> str:
    labels = list(dict.fromkeys(k for r in rows for k in r["us"]))   # (a case without a candidate shows —)
    planned = f"contexts of up to {env['planned_len']:,} tokens" if env.get("planned_len") else "each case's context"
    lines = [f"# Decode attention over an e4m3 KV cache — {env['device']}, {env['date']}", "",
             f"torch {env['torch']}, Triton {env['triton']}; bf16 queries, blocks of 16 tokens; splits planned for {planned}; copy bandwidth "
             f"{env.get('copy_gbs', 0):.0f} GB/s; µs per launch in CUDA graphs. The floor: the e4m3 K and V bytes "
             "over the copy bandwidth. Tiles: "
             + "; ".join(f"{k} = {v['block_n']} keys, {v['num_warps']} warps, {v['num_stages']} stages, splits of "
                         f"{v['min_split_tokens']}+" + (f", each context shared evenly in {v['even_split_tokens']}+"
                                                        if v.get("even_split_tokens") else "")
                         for k, v in {k: v for r in rows for k, v in r["configs"].items()}.items()), "",
             "| model | batch | context | bf16 cache | bf16 cache, even 256+ | e4m3 floor | " + " | ".join(labels)
             + " |",
             "|---|---:|---:|---:|---:|---:|" + "---:|" * len(labels)]
    for r in rows:
        cells = [("—" if k not in r["us"] else f"**{r['us'][k]:.1f}**" if k == r.get("best") else f"{r['us'][k]:.1f}")
                 for k in labels]
        even = f"{r['bf16_even_cache_us']:.1f}" if "bf16_even_cache_us" in r else "—"
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r.get('bf16_cache_us', 0):.1f} | {even} | "
                     f"{r.get('floor_us', 0):.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--models", default=",".join(HEAD_SHAPES))
    ap.add_argument("--only", help="words separated by ';': time only the candidates whose labels contain one (and "
                    "today's tiles)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing: the set-up and each tile's output")
    ap.add_argument("--planned-len", type=int, default=0, help="plan the splits for contexts of up to this many "
                    "tokens, as CUDA graphs do for the model's length (default: each case's own context)")
    args = ap.parse_args(argv)
    only = args.only.split(";") if args.only else None
    candidates(128, only)   # a word of --only that names no candidate stops the run here, before any timing
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("bench_fp8_attention needs a CUDA GPU (or --smoke)")
    gen = torch.Generator(device=device).manual_seed(0)
    env = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               date=datetime.date.today().isoformat(), torch=torch.__version__,
               triton=getattr(sys.modules.get("triton"), "__version__", "?"), settings=envs.snapshot(),
               planned_len=args.planned_len)
    copy_gbs = None
    if not args.smoke:
        from bench_lora_ops import copy_bandwidth_gbs
        copy_gbs = env["copy_gbs"] = copy_bandwidth_gbs()
    rows = []
    for name in args.models.split(","):
        heads = HEAD_SHAPES[name] if not args.smoke else (HEAD_SHAPES[name][0] // 8, HEAD_SHAPES[name][1] // 8, 32)
        for ctx in CONTEXTS if not args.smoke else [40]:
            for batch in BATCHES if not args.smoke else [3]:
                rows.append(bench_case(name, heads, batch, ctx, copy_gbs, gen, device, args.smoke, only,
                                       args.planned_len))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "configs"}), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    if args.md:
        args.md.write_text(markdown(env, rows))
    bad = [(r["model"], r["batch"], r["context"], k) for r in rows
           for k, e in {**r["max_abs_err"], "bf16 cache, even 256+": r.get("bf16_even_err", 0.0)}.items()
           if not e <= 0.05]
    if bad:   # (NaN compares false, so it lands here too)
        raise SystemExit(f"outputs off the reference path by more than 0.05: {bad}")


if __name__ == "__main__":
    main()
