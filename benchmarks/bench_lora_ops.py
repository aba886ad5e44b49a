"""GPU benchmark of the batched LoRA op against the ways people write it without one.

Side by side in one run, on the same inputs (bf16, LoRA on every row, rank r for every slot):
- loraplex:   `ops.add_lora` (SGMV shrink + expand, two Triton launches)
- loop:       a Python loop of per-segment torch matmuls (`y[seg].addmm_(x[seg] @ Aᵀ, Bᵀ)`)
- gather_bmm: gather each row's A and B, then two `torch.bmm`
- plain:      for identical popularity only, `y.addmm_(x @ Aᵀ, Bᵀ)` (the single-adapter floor)
Each eager and replayed from a CUDA graph. Times are medians of CUDA-event timings after
warm-up, rotating over several input sets and adapter sets so that L2 holds none of them.
The memory floor counts the fewest bytes: x read once, each used adapter's A and B once, y
read and written; it is reported as GB/s and as a fraction of the copy bandwidth measured
in the same run.

Writes lora_ops.json, a markdown table with the targets checked (lora_ops.md) and a plot (lora_ops.png).

    python benchmarks/bench_lora_ops.py --out benchmarks/results          # full run
    python benchmarks/bench_lora_ops.py --quick                           # a few cases
    python benchmarks/bench_lora_ops.py --report benchmarks/results/lora_ops.json   # table and plot again
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import triton

from loraplex import envs, ops
from loraplex.workloads import POPULARITIES, popularity_slots

ROTATIONS = 4
DECODE_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL_LEN = 128
GATHER_LIMIT_BYTES = 6 << 30


@triton.jit
def _empty_kernel():
    pass


def time_us(fns: list, target_ms: float = 1.5, reps: int = 11) -> float:
    """Median µs per call of fns (called round robin), from CUDA events around blocks of calls."""
    for f in fns * 2:
        f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for f in fns:
        f()
    end.record()
    torch.cuda.synchronize()
    est_ms = max(start.elapsed_time(end) / len(fns), 1e-4)
    inner = len(fns) * max(1, math.ceil(target_ms / est_ms / len(fns)))
    reps = reps if est_ms * inner * reps < 150 else 5  # slow baselines: fewer blocks
    times = []
    for _ in range(reps):
        start.record()
        for i in range(inner):
            fns[i % len(fns)]()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / inner)
    return statistics.median(times)


def graphed(fn):
    """Capture fn in a CUDA graph (after a warm-up call) and return its replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def copy_bandwidth_gbs() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_()
    us = time_us([lambda: b.copy_(a)], target_ms=20, reps=7)
    return 2 * a.numel() / us / 1e3


class Pool:
    """Adapter stacks with ROTATIONS disjoint blocks of `per_rot` slots, bf16, every rank = r."""

    def __init__(self, K: int, N: int, r: int, per_rot: int, gen: torch.Generator):
        slots = per_rot * ROTATIONS
        self.a = (torch.randn(slots, r, K, generator=gen, device="cuda") * K ** -0.5).to(torch.bfloat16)
        self.b = (torch.randn(slots, N, r, generator=gen, device="cuda") * r ** -0.5).to(torch.bfloat16)
        self.ranks = torch.full((slots,), r, dtype=torch.int32, device="cuda")
        self.scalings = (torch.rand(slots, generator=gen, device="cuda") + 0.5)
        self.scal_host = self.scalings.tolist()
        self.per_rot = per_rot


def make_systems(pool: Pool, xs, ys, seg_lens, slots_per_rot, popularity):
    """Callables per system, one per rotation (rotation k uses its own x, y and adapter block)."""
    systems = {"loraplex": [], "loop": [], "gather_bmm": [], "plain": []}
    T, K = xs[0].shape
    N, r = pool.b.shape[1], pool.b.shape[2]
    gather_bytes = T * (r * K + N * r) * 2
    for k in range(ROTATIONS):
        x, y = xs[k], ys[k]
        slots = [s + k * pool.per_rot for s in slots_per_rot]
        batch = ops.LoraBatch.from_lengths(seg_lens, slots, "cuda")
        systems["loraplex"].append(
            lambda x=x, y=y, b=batch: ops.add_lora(y, x, pool.a, pool.b, b, pool.ranks, pool.scalings))
        segs = [(int(s0), int(n), sl) for s0, n, sl in zip(np.cumsum([0] + seg_lens[:-1]), seg_lens, slots)]

        def loop(x=x, y=y, segs=segs):
            for s0, n, sl in segs:
                y[s0:s0 + n].addmm_(x[s0:s0 + n] @ pool.a[sl].T, pool.b[sl].T, alpha=pool.scal_host[sl])
        systems["loop"].append(loop)
        if gather_bytes <= GATHER_LIMIT_BYTES:
            row_slot = torch.tensor(np.repeat(slots, seg_lens), device="cuda", dtype=torch.long)

            def gather(x=x, y=y, rs=row_slot):
                v = torch.bmm(x.unsqueeze(1), pool.a[rs].transpose(1, 2))
                d = torch.bmm(v, pool.b[rs].transpose(1, 2)).squeeze(1)
                y.add_(d * pool.scalings[rs].unsqueeze(1).to(d.dtype))
            systems["gather_bmm"].append(gather)
        if popularity == "identical":
            sl = slots[0]
            systems["plain"].append(
                lambda x=x, y=y, sl=sl: y.addmm_(x @ pool.a[sl].T, pool.b[sl].T, alpha=pool.scal_host[sl]))
    return {name: fns for name, fns in systems.items() if fns}


def check_against_loop(systems, xs, ys) -> float:
    """Relative difference between loraplex and the loop on rotation 0 (a sanity check, not a test)."""
    y0 = ys[0].clone()
    systems["loraplex"][0]()
    ours = ys[0].double() - y0.double()
    ys[0].copy_(y0)
    systems["loop"][0]()
    theirs = ys[0].double() - y0.double()
    ys[0].copy_(y0)
    return ((ours - theirs).norm() / theirs.norm().clamp_min(1e-30)).item()


def run_case(pool, K, N, r, regime, batch_size, popularity, rng, gen, copy_gbs, graphs=True):
    seg_len = 1 if regime == "decode" else PREFILL_LEN
    seg_lens = [seg_len] * batch_size
    slots = popularity_slots(popularity, batch_size, rng)
    T = sum(seg_lens)
    xs = [torch.randn(T, K, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(ROTATIONS)]
    ys = [torch.randn(T, N, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(ROTATIONS)]
    systems = make_systems(pool, xs, ys, seg_lens, slots, popularity)
    used = len(set(slots))
    floor_bytes = T * K * 2 + used * (r * K + N * r) * 2 + 2 * T * N * 2
    row = dict(K=K, N=N, r=r, regime=regime, batch=batch_size, popularity=popularity, tokens=T,
               adapters=used, floor_bytes=floor_bytes, floor_us=floor_bytes / copy_gbs / 1e3,
               max_rel_diff_vs_loop=check_against_loop(systems, xs, ys))
    for name, fns in systems.items():
        row[f"{name}_us"] = time_us(fns)
        if graphs:
            row[f"{name}_graph_us"] = time_us([graphed(f) for f in fns])
    best = row.get("loraplex_graph_us", row["loraplex_us"])
    row["loraplex_gbs"] = floor_bytes / best / 1e3
    row["loraplex_frac_copy_bw"] = row["loraplex_gbs"] / copy_gbs
    return row


def empty_launches_us() -> dict:
    def two():
        _empty_kernel[(1,)]()
        _empty_kernel[(1,)]()
    return {"two_empty_launches_graph_us": time_us([graphed(two)]),
            "two_empty_launches_eager_us": time_us([two])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--quick", action="store_true", help="K=N=4096, r=16, a few batch sizes")
    p.add_argument("--shapes", default="4096x4096,4096x11008")
    p.add_argument("--ranks", default="8,16,64")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--tag", default="lora_ops")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new (shape, rank) groups after this many seconds; the rest is listed as skipped")
    p.add_argument("--report", type=Path, metavar="JSON",
                   help="only write the markdown table and plot of a results JSON (beside it); no GPU needed")
    args = p.parse_args(argv)
    if args.report:
        write_report(args.report, args.report.parent)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_lora_ops needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    rng = np.random.default_rng(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    decode, prefill = DECODE_BATCHES, PREFILL_BATCHES
    if args.quick:
        shapes, ranks, decode, prefill = [(4096, 4096)], [16], [1, 16, 64, 256], [1, 8]
    t0 = time.time()
    copy_gbs = copy_bandwidth_gbs()
    env = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               torch=torch.__version__, triton=triton.__version__, settings=envs.snapshot(), dtype="bfloat16",
               copy_gbs=copy_gbs,
               rotations=ROTATIONS, prefill_len=PREFILL_LEN, **empty_launches_us())
    print(f"# {env['gpu']}  copy {copy_gbs:.0f} GB/s  two empty launches (graph) "
          f"{env['two_empty_launches_graph_us']:.2f} us", flush=True)
    rows = []
    # The headline shape and rank first, so that a time budget cuts the least important groups.
    groups = sorted(((K, N, r) for K, N in shapes for r in ranks), key=lambda g: (g[2] != 16, g[1] != 4096, g))
    env["skipped"] = []  # cases not run because --budget-s ran out
    for K, N, r in groups:
        pool = None
        for regime, batches in (("decode", decode), ("prefill", prefill)):
            for bs in batches:
                for pop in POPULARITIES:
                    if bs == 1 and pop != "identical":
                        continue  # one request: every popularity is the same
                    if args.budget_s is not None and time.time() - t0 > args.budget_s:
                        env["skipped"].append(f"K={K} N={N} r={r} {regime} bs={bs} {pop}")
                        continue
                    pool = pool or Pool(K, N, r, max(decode + prefill), gen)
                    row = run_case(pool, K, N, r, regime, bs, pop, rng, gen, copy_gbs, not args.no_graphs)
                    rows.append(row)
                    print(_line(row), flush=True)
        del pool
        torch.cuda.empty_cache()
    if env["skipped"]:
        print(f"# budget spent: {len(env['skipped'])} cases skipped, first {env['skipped'][0]}", flush=True)
    env["seconds"] = time.time() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    write_report(args.out / f"{args.tag}.json", args.out)


# ---- the report ---------------------------------------------------------------------------------
SYSTEMS = ["loraplex", "loop", "gather_bmm", "plain"]
HEAD_K, HEAD_N, HEAD_R = 4096, 4096, 16


def _fmt(v) -> str:
    return "–" if v is None else (f"{v:.1f}" if v < 1000 else f"{v:.0f}")


def _headline(rows):
    return [r for r in rows if (r["K"], r["N"], r["r"]) == (HEAD_K, HEAD_N, HEAD_R)]


def targets(env, rows) -> list[tuple[str, bool, str]]:
    """The op's targets at the headline shape (bf16, K=N=4096, r=16), each with pass/fail and the evidence."""
    head = _headline(rows)
    out = []
    for mode, label in (("_graph", "graph replay"), ("", "eager")):
        worst = None
        for r in head:
            for base in ("loop", "gather_bmm"):
                theirs = r.get(f"{base}{mode}_us")
                if theirs is not None and f"loraplex{mode}_us" in r:
                    ratio = r[f"loraplex{mode}_us"] / theirs
                    if worst is None or ratio > worst[0]:
                        worst = (ratio, f"{r['regime']} bs={r['batch']} {r['popularity']} vs {base}")
        if worst:
            out.append((f"never slower than loop or gather-BMM ({label})", worst[0] <= 1.0,
                        f"worst ours/theirs = {worst[0]:.2f} ({worst[1]})"))
    for mode, label in (("_graph", "graph replay"), ("", "eager")):
        ident = [(r[f"loraplex{mode}_us"] / r[f"plain{mode}_us"], f"{r['regime']} bs={r['batch']}")
                 for r in head if r["popularity"] == "identical" and f"plain{mode}_us" in r]
        if ident:
            w = max(ident)
            out.append((f"identical within 1.2x of the plain matmul pair ({label})", w[0] <= 1.2,
                        f"worst {w[0]:.2f}x ({w[1]})"))
    d256 = [r for r in head if r["regime"] == "decode" and r["batch"] == 256 and r["popularity"] == "distinct"]
    if d256:
        f = d256[0]["loraplex_frac_copy_bw"]
        out.append(("batch 256 distinct decode >= 70% of copy bandwidth", f >= 0.7,
                    f"{f:.0%} ({d256[0]['loraplex_gbs']:.0f} GB/s of {env['copy_gbs']:.0f})"))
    small = [r for r in head if r["regime"] == "decode" and r["batch"] <= 64 and r["popularity"] == "distinct"
             and "loraplex_graph_us" in r]
    if small and "two_empty_launches_graph_us" in env:
        w = max(small, key=lambda r: r["loraplex_graph_us"])
        ratio = w["loraplex_graph_us"] / env["two_empty_launches_graph_us"]
        out.append(("batch <= 64 distinct decode within 2x of two empty launches (graph)", ratio <= 2.0,
                    f"worst {w['loraplex_graph_us']:.1f} us at bs={w['batch']} = {ratio:.2f}x of "
                    f"{env['two_empty_launches_graph_us']:.2f} us"))
    return out


def markdown(env, rows) -> str:
    lines = [f"# LoRA op benchmark: {env['gpu']}, {env['date'][:10]}", "",
             f"bf16, torch {env['torch']}, triton {env['triton']}. Copy bandwidth measured in the same run: "
             f"{env['copy_gbs']:.0f} GB/s. Two empty kernel launches under graph replay: "
             f"{env.get('two_empty_launches_graph_us', float('nan')):.2f} µs (eager "
             f"{env.get('two_empty_launches_eager_us', float('nan')):.2f} µs). Median µs per call from CUDA events, "
             f"{env['rotations']} rotating input and adapter sets; prefill segments are {env['prefill_len']} tokens.",
             ""]
    if env.get("skipped"):
        lines += [f"Not run for lack of device time: {len(env['skipped'])} cases, e.g. {env['skipped'][0]}.", ""]
    lines += ["## Targets (K=N=4096, r=16)", "", "| target | met | measured |", "|---|---|---|"]
    for name, ok, ev in targets(env, rows):
        lines.append(f"| {name} | {'yes' if ok else '**no**'} | {ev} |")
    for (K, N, r) in sorted({(x["K"], x["N"], x["r"]) for x in rows}):
        sub = [x for x in rows if (x["K"], x["N"], x["r"]) == (K, N, r)]
        lines += ["", f"## K={K}, N={N}, r={r}", "",
                  "| regime | batch | popularity | loraplex | graph | loop | graph | gather-BMM | graph | plain "
                  "| graph | floor | GB/s | % copy bw |", "|" + "---|" * 14]
        for x in sub:
            cells = [x["regime"], str(x["batch"]), x["popularity"]]
            for s in SYSTEMS:
                cells += [_fmt(x.get(f"{s}_us")), _fmt(x.get(f"{s}_graph_us"))]
            cells += [_fmt(x["floor_us"]), f"{x['loraplex_gbs']:.0f}", f"{x['loraplex_frac_copy_bw']:.0%}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(env, rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    head = _headline(rows)
    fig, axes = plt.subplots(2, len(POPULARITIES), figsize=(4 * len(POPULARITIES), 7), sharex=True)
    for i, regime in enumerate(("decode", "prefill")):
        for j, pop in enumerate(POPULARITIES):
            ax = axes[i][j]
            sub = sorted((r for r in head if r["regime"] == regime and r["popularity"] == pop
                          or (r["regime"] == regime and r["batch"] == 1)), key=lambda r: r["batch"])
            for key, style in (("loraplex_graph_us", "-o"), ("loop_graph_us", "--s"), ("gather_bmm_graph_us", ":^"),
                               ("plain_graph_us", "-.x"), ("floor_us", "k-")):
                pts = [(r["batch"], r[key]) for r in sub if key in r]
                if pts:
                    ax.plot(*zip(*pts), style, label=key.replace("_graph_us", "").replace("_us", ""), ms=4)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{regime}, {pop}")
            ax.grid(True, which="both", alpha=0.3)
            if j == 0:
                ax.set_ylabel("µs per call (graph replay)")
            if i == 1:
                ax.set_xlabel("batch size (requests)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"add_lora, K=N={HEAD_K}, r={HEAD_R}, bf16 — {env['gpu']}, {env['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(json_path: Path, out_dir: Path) -> None:
    data = json.loads(Path(json_path).read_text())
    stem = Path(json_path).stem
    (out_dir / f"{stem}.md").write_text(markdown(data["env"], data["rows"]))
    plot(data["env"], data["rows"], out_dir / f"{stem}.png")
    for name, ok, ev in targets(data["env"], data["rows"]):
        print(f"{'PASS' if ok else 'MISS'}  {name}: {ev}")


def _line(row) -> str:
    keys = [k for k in row if k.endswith("_us") and k != "floor_us"]
    times = " ".join(f"{k[:-3]}={row[k]:.1f}" for k in keys)
    return (f"K={row['K']} N={row['N']} r={row['r']} {row['regime']:7s} bs={row['batch']:3d} "
            f"{row['popularity']:9s} {times}  {row['loraplex_frac_copy_bw']:.0%} of copy bw")


if __name__ == "__main__":
    main()
