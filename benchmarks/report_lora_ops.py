"""Turn a bench_lora_ops JSON into a markdown table, the issue's target checks, and plots.

    python benchmarks/report_lora_ops.py benchmarks/results/lora_ops.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SYSTEMS = ["loraplex", "loop", "gather_bmm", "plain"]
HEAD_K, HEAD_N, HEAD_R = 4096, 4096, 16


def _fmt(v) -> str:
    return "–" if v is None else (f"{v:.1f}" if v < 1000 else f"{v:.0f}")


def _headline(rows):
    return [r for r in rows if (r["K"], r["N"], r["r"]) == (HEAD_K, HEAD_N, HEAD_R)]


def targets(env, rows) -> list[tuple[str, bool, str]]:
    """The issue's targets (H200, bf16, K=N=4096, r=16), each with pass/fail and the evidence."""
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
    from loraplex.workloads import POPULARITIES
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


if __name__ == "__main__":
    path = Path(sys.argv[1])
    write_report(path, path.parent)
