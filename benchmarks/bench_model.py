"""GPU benchmark of one model forward (Llama-2-7B shapes, dummy weights, bf16) beside its floors.

Decode: batches of 1, 8, 32, 128 sequences, each at context 512 (511 cached tokens plus the
new one), in three variants: the backbone alone (no adapter pool), every sequence with its
own rank-16 adapter on all seven projections, and every sequence sharing one adapter. Each
forward is captured in a CUDA graph and replayed (the way a serving engine runs decode);
eager times are reported beside it to show host overhead. The memory floor is the bytes one
forward must read — weights (the embedding only for the batch's rows), the keys and values
of the context, each used adapter once — divided by the copy bandwidth measured in the same
run.

Prefill: 8 sequences of 512 tokens from empty caches, backbone and distinct adapters, beside
the FLOP floor: the forward's matrix FLOPs (dense layers over all tokens, causal attention,
LoRA) divided by the bf16 GEMM throughput measured in the same run.

    python benchmarks/bench_model.py --out benchmarks/results/model_forward.json \\
        --md benchmarks/results/model_forward.md
    python benchmarks/bench_model.py --layers 2 --batches 1,8      # a quick check of the set-up
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import copy_bandwidth_gbs, time_us  # noqa: E402

from loraplex import envs  # noqa: E402
from loraplex.adapters import AdapterPool  # noqa: E402
from loraplex.models import PROJECTIONS, ForwardBatch, KVCache, SequenceChunk, dummy_model  # noqa: E402

RANK = 16
BLOCK = 16


def gemm_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = time_us([lambda: a @ b], target_ms=30, reps=7)
    return 2 * n ** 3 / us / 1e6


def capture(fn):
    """Capture fn in a CUDA graph after a warm-up call: (replay, the output tensor it rewrites)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def kernel_profile(fn, title: str, reps: int = 3) -> str:
    """GPU time per kernel over `reps` eager forwards (kernel durations exclude launch gaps)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    return f"# {title}, {reps} forwards\n{table}"


def fill_pool(pool: AdapterPool, gen: torch.Generator) -> None:
    """Every slot a rank-16 adapter on all seven projections, random weights of realistic scale."""
    for layer in range(pool.model.num_hidden_layers):
        for proj in PROJECTIONS:
            a, b = pool.lora_a[layer][proj], pool.lora_b[layer][proj]
            a.copy_(torch.randn(a.shape, generator=gen, device=a.device) * a.shape[2] ** -0.5)
            b.copy_(torch.randn(b.shape, generator=gen, device=b.device) * 0.01)
    pool.ranks.fill_(RANK)
    pool.scalings.fill_(2.0)


def adapter_bytes(model) -> int:
    c = model.config
    return RANK * sum(sum(c.projection_shape(p)) for p in PROJECTIONS) * c.num_hidden_layers * 2


def weight_bytes(model, rows: int) -> int:
    """Weights one forward reads: all but the embedding, of which only `rows` rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens
    return total - embed.numel() * embed.element_size() + rows * embed.shape[1] * embed.element_size()


def kv_bytes(model, tokens: int) -> int:
    c = model.config
    return tokens * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2


def tables(num_seqs: int, blocks_each: int, offset: int, gen: torch.Generator) -> list[list[int]]:
    """Block tables out of a shuffled range, so sequences' pages are scattered as after real churn."""
    order = (torch.randperm(num_seqs * blocks_each, generator=gen) + offset).tolist()
    return [order[i * blocks_each:(i + 1) * blocks_each] for i in range(num_seqs)]


def matmul_flops(model, tokens: int, logits_rows: int, seq_len: int, num_seqs: int, lora: bool) -> float:
    c = model.config
    dense = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n
                and "lm_head" not in n)
    flops = 2.0 * tokens * dense + 2.0 * logits_rows * model.lm_head.numel()
    # causal attention: QKᵀ and PV over n(n+1)/2 query-key pairs per sequence, head and layer
    flops += 4.0 * num_seqs * c.num_attention_heads * c.head_dim * seq_len * (seq_len + 1) / 2 * c.num_hidden_layers
    if lora:
        flops += 2.0 * tokens * RANK * sum(sum(c.projection_shape(p)) for p in PROJECTIONS) * c.num_hidden_layers
    return flops


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prefill", default="8x512")
    ap.add_argument("--profile", type=Path, help="write per-kernel GPU time of decode forwards (torch.profiler) here")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    n_pre, len_pre = (int(v) for v in args.prefill.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)

    model = dummy_model(args.preset, dtype="bfloat16", device="cuda", num_layers=args.layers)
    c = model.config
    ctx_blocks = -(-args.context // BLOCK)
    decode_blocks = max(batches) * ctx_blocks
    pre_blocks = n_pre * -(-len_pre // BLOCK)
    kv = KVCache(c, decode_blocks + pre_blocks, BLOCK, dtype=torch.bfloat16, device="cuda")
    kv.data.normal_(0, 1, generator=gen)
    pool = AdapterPool(c, num_slots=max(max(batches), n_pre), max_rank=RANK, dtype=torch.bfloat16, device="cuda")
    fill_pool(pool, gen)
    copy_gbs, tflops = copy_bandwidth_gbs(), gemm_tflops()
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s, bf16 GEMM {tflops:.0f} TFLOP/s; "
          f"{c.name_or_path} × {c.num_hidden_layers} layers; {kv.describe()}; {pool.describe()}", flush=True)

    def build(chunks):
        return ForwardBatch.build(chunks, block_size=BLOCK, num_blocks=kv.num_blocks, vocab_size=c.vocab_size,
                                  device="cuda", num_adapter_slots=pool.num_slots)

    rows, profiles = [], []
    for B in batches:
        tabs = tables(B, ctx_blocks, 0, cpu_gen)
        tokens = torch.randint(0, c.vocab_size, (B,), generator=cpu_gen).tolist()
        for variant in ("backbone", "distinct", "shared"):
            slots = {"backbone": [-1] * B, "distinct": list(range(B)), "shared": [0] * B}[variant]
            batch = build([SequenceChunk([t], args.context - 1, tab, s) for t, tab, s in zip(tokens, tabs, slots)])
            use_pool = None if variant == "backbone" else pool
            fn = lambda: model(batch, kv, use_pool)  # noqa: E731
            eager_logits = fn().clone()
            replay, graph_logits = capture(fn)
            with torch.inference_mode():  # the forward's outputs are inference tensors
                graph_logits.fill_(float("nan"))
            replay()
            # the replay must compute what eager did (same KV slots are rewritten with the same values)
            graph_error = (graph_logits - eager_logits).abs().max().item()
            us_graph = time_us([replay])
            us_eager = time_us([fn], reps=5)
            adapters = {"backbone": 0, "distinct": B, "shared": 1}[variant]
            nbytes = weight_bytes(model, B) + kv_bytes(model, B * args.context) + adapters * adapter_bytes(model)
            floor_us = nbytes / copy_gbs / 1e3
            row = dict(kind="decode", batch=B, context=args.context, variant=variant, graph_us=us_graph,
                       eager_us=us_eager, floor_us=floor_us, bytes=nbytes, adapters_read=adapters,
                       of_floor=floor_us / us_graph, tokens_per_s=B / us_graph * 1e6,
                       graph_vs_eager_max_abs=graph_error, logits_finite=bool(torch.isfinite(eager_logits).all()))
            rows.append(row)
            print(f"decode B={B:4d} {variant:9s} graph {us_graph:8.0f} µs  eager {us_eager:8.0f} µs  "
                  f"floor {floor_us:7.0f} µs  ({100 * row['of_floor']:.0f}% of floor)", flush=True)
            del replay, graph_logits
            if args.profile and variant == "distinct" and B in (1, max(batches)):
                profiles.append(kernel_profile(fn, f"decode B={B} {variant} adapters, context {args.context}"))
        torch.cuda.empty_cache()

    tabs = tables(n_pre, -(-len_pre // BLOCK), decode_blocks, cpu_gen)
    for variant in ("backbone", "distinct"):
        slots = list(range(n_pre)) if variant == "distinct" else [-1] * n_pre
        chunks = [SequenceChunk(torch.randint(0, c.vocab_size, (len_pre,), generator=cpu_gen).tolist(), 0, tab, s)
                  for tab, s in zip(tabs, slots)]
        batch = build(chunks)
        use_pool = None if variant == "backbone" else pool
        us = time_us([lambda: model(batch, kv, use_pool)], target_ms=50, reps=7)
        flops = matmul_flops(model, n_pre * len_pre, n_pre, len_pre, n_pre, variant == "distinct")
        floor_us = flops / tflops / 1e6
        rows.append(dict(kind="prefill", batch=n_pre, context=len_pre, variant=variant, eager_us=us,
                         floor_us=floor_us, flops=flops, of_floor=floor_us / us, tflops=flops / us / 1e6,
                         tokens_per_s=n_pre * len_pre / us * 1e6))
        print(f"prefill {n_pre}x{len_pre} {variant:9s} {us:8.0f} µs  floor {floor_us:7.0f} µs  "
              f"({100 * floor_us / us:.0f}% of floor, {flops / us / 1e6:.0f} TFLOP/s)", flush=True)

    if args.profile:
        args.profile.write_text("\n\n".join(profiles))
    import triton
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, triton=triton.__version__, settings=envs.snapshot(), preset=args.preset,
                  layers=c.num_hidden_layers, rank=RANK, block_size=BLOCK, copy_gbs=copy_gbs, gemm_tflops=tflops,
                  weight_bytes=weight_bytes(model, 0), adapter_bytes=adapter_bytes(model), rows=rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if args.md:
        args.md.write_text(markdown(result))
    return result


def markdown(res: dict) -> str:
    lines = [f"# One forward, {res['preset']} shapes ({res['layers']} layers), dummy weights, bf16",
             "", f"{res['gpu']}, {res['date'][:10]}, torch {res['torch']}, triton {res['triton']}. "
             f"Copy bandwidth {res['copy_gbs']:.0f} GB/s and bf16 GEMM {res['gemm_tflops']:.0f} TFLOP/s, "
             f"measured in the same run. Adapters: rank {res['rank']} on all seven projections "
             f"({res['adapter_bytes'] / 2**20:.0f} MiB each). KV blocks of {res['block_size']} tokens.", "",
             "## Decode (one new token per sequence), CUDA graph replay", "",
             "| batch | context | adapters | time (µs) | eager (µs) | floor (µs) | of floor | tokens/s |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if r["kind"] == "decode":
            lines.append(f"| {r['batch']} | {r['context']} | {r['variant']} | {r['graph_us']:.0f} | "
                         f"{r['eager_us']:.0f} | {r['floor_us']:.0f} | {100 * r['of_floor']:.0f}% | "
                         f"{r['tokens_per_s']:.0f} |")
    lines += ["", "Floor: (weight bytes + KV bytes of the context + bytes of each used adapter) / copy bandwidth.",
              "", "## Prefill, eager", "",
              "| sequences × tokens | adapters | time (µs) | FLOP floor (µs) | of floor | TFLOP/s |",
              "|---|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if r["kind"] == "prefill":
            lines.append(f"| {r['batch']}×{r['context']} | {r['variant']} | {r['eager_us']:.0f} | "
                         f"{r['floor_us']:.0f} | {100 * r['of_floor']:.0f}% | {r['tflops']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
