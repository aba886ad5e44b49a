"""The text-generation benchmark's markdown table, ratios and bar charts."""
from __future__ import annotations

from pathlib import Path


def _key(row: dict) -> tuple:
    return row["popularity"], str(row["max_batch"]), row["requests"]


def ratios(rows: list[dict]) -> list[dict]:
    """loraplex's tokens/s over each other system's, on the same requests and max batch."""
    out = []
    for row in rows:
        if row["system"] != "loraplex":
            continue
        for other in rows:
            same = (other["max_batch"] == row["max_batch"] and other["requests"] == row["requests"] and
                    (other["popularity"] == row["popularity"] or other["system"] in ("loraplex-backbone",
                                                                                     "hf-backbone")))
            if other is not row and same:
                out.append(dict(popularity=row["popularity"], max_batch=row["max_batch"], requests=row["requests"],
                                versus=other["system"], ratio=row["tokens_per_s"] / other["tokens_per_s"]))
        if row.get("ceiling_tokens_per_s"):
            out.append(dict(popularity=row["popularity"], max_batch=row["max_batch"], requests=row["requests"],
                            versus="ceiling", ratio=row["tokens_per_s"] / row["ceiling_tokens_per_s"]))
    return out


def markdown(result: dict) -> str:
    w = result["workload"]
    lines = [f"# Text generation — {result['gpu']}, {result['date']}", "",
             f"Model {result['model']} ({result['dtype']}), rank-{result['rank']} adapters on all seven projections. "
             f"Workload: {w['requests']} requests, lengths {w['lengths']} (max {w['max_len']}), seed {w['seed']}; "
             f"every request queued at once; greedy, EOS ignored. Copy bandwidth "
             + (f"{result['bandwidth_gbs']:.0f} GB/s." if result.get("bandwidth_gbs") else "not measured."), "",
             "| popularity | max batch | system | requests | output tok/s | req/s | TTFT p50 / p99 (ms) | "
             "TPOT p50 / p99 (ms) | ceiling tok/s | of ceiling |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ceil = r.get("ceiling_tokens_per_s")
        lines.append(f"| {r['popularity']} | {r['max_batch']} | {r['system']} | {r['requests']} | "
                     f"{r['tokens_per_s']:.1f} | {r['requests_per_s']:.3f} | {r['ttft_ms_p50']:.0f} / "
                     f"{r['ttft_ms_p99']:.0f} | {r['tpot_ms_p50']:.2f} / {r['tpot_ms_p99']:.2f} | "
                     + (f"{ceil:.0f} | {r['tokens_per_s'] / ceil:.2f} |" if ceil else "– | – |"))
    if result["ratios"]:
        lines += ["", "loraplex over each system, on the same requests:", "",
                  "| popularity | max batch | requests | versus | ratio |", "|---|---|---|---|---|"]
        for q in result["ratios"]:
            lines.append(f"| {q['popularity']} | {q['max_batch']} | {q['requests']} | {q['versus']} | "
                         f"{q['ratio']:.2f}× |")
    lines += ["", "Ceiling: per step, weights + KV of the batch's contexts + each adapter in the batch once, over "
              "the copy bandwidth, summed over a first-come-first-served schedule of the same requests "
              "(src/loraplex/bench/ceiling.py). Backbone rows (no adapters) are the same for every popularity."]
    if result.get("notes"):
        lines += [""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, folder: Path, name: str) -> list[Path]:
    """One bar chart of output tokens/s per system for each popularity (log scale: baselines are far apart)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    pops = list(dict.fromkeys(r["popularity"] for r in result["rows"]))
    for pop in pops:
        rows = [r for r in result["rows"] if r["popularity"] == pop]
        labels = [f"{r['system']}\nB={r['max_batch']}, n={r['requests']}" for r in rows]
        values = [r["tokens_per_s"] for r in rows]
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 4.5))
        bars = ax.bar(range(len(rows)), values, color=["tab:blue" if r["system"].startswith("loraplex") else
                                                       "tab:gray" for r in rows])
        for i, r in enumerate(rows):
            if r.get("ceiling_tokens_per_s"):
                ax.hlines(r["ceiling_tokens_per_s"], i - 0.4, i + 0.4, colors="tab:red", linestyles="dashed")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("output tokens/s (log)")
        ax.set_title(f"{result['model']}, {pop} adapters — {result['gpu']}, {result['date']}\n"
                     f"dashed: bandwidth ceiling", fontsize=9)
        fig.tight_layout()
        path = folder / f"{name}_{pop}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
