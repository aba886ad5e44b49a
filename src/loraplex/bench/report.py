"""The text-generation benchmark's markdown table, ratios and bar charts; and merging the results of
several runs (each GPU call has a time limit) into one report:

    python -m loraplex.bench.report run1.json run2.json … --out-dir benchmarks/results --name textgen_7b
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path


def _key(row: dict) -> tuple:
    return row["popularity"], str(row["max_batch"]), row["requests"]


def _where(row: dict) -> dict:
    where = dict(popularity=row["popularity"], max_batch=row["max_batch"], requests=row["requests"])
    if "lengths" in row:
        where = dict(lengths=row["lengths"], **where)
    return where


def ratios(rows: list[dict]) -> list[dict]:
    """loraplex's tokens/s over each other system's, on the same requests and max batch."""
    out = []
    for row in rows:
        if row["system"] != "loraplex":
            continue
        for other in rows:
            same = (other["max_batch"] == row["max_batch"] and other["requests"] == row["requests"] and
                    other.get("lengths") == row.get("lengths") and
                    (other["popularity"] == row["popularity"] or other["system"] in ("loraplex-backbone",
                                                                                     "hf-backbone")))
            if other is not row and same:
                out.append(dict(_where(row), versus=other["system"], ratio=row["tokens_per_s"] / other["tokens_per_s"]))
        if row.get("ceiling_tokens_per_s"):
            out.append(dict(_where(row), versus="ceiling", ratio=row["tokens_per_s"] / row["ceiling_tokens_per_s"]))
        if row.get("ceiling_tokens_per_s_high"):
            out.append(dict(_where(row), versus="ceiling at the higher copy-bandwidth reading",
                            ratio=row["tokens_per_s"] / row["ceiling_tokens_per_s_high"]))
        if row.get("run_ceiling_tokens_per_s"):
            out.append(dict(_where(row), versus="ceiling over its own steps",
                            ratio=row["tokens_per_s"] / row["run_ceiling_tokens_per_s"]))
    return out


def markdown(result: dict) -> str:
    w = result["workload"]
    if "runs" in w:   # merged
        what = (f"Workloads: {'; '.join(w['runs'])}. Each run's own copy bandwidth is in the JSON "
                f"(median {result['bandwidth_gbs']:.0f} GB/s)." if result.get("bandwidth_gbs") else "")
    else:
        what = (f"Workload: {w['requests']} requests, lengths {w['lengths']} (max {w['max_len']}), seed {w['seed']}. "
                f"Copy bandwidth " + (f"{result['bandwidth_gbs']:.0f} GB/s." if result.get("bandwidth_gbs")
                                      else "not measured."))
    lines = [f"# Text generation — {result['gpu']}, {result['date']}", "",
             f"Model {result['model']} ({result['dtype']}), rank-{result['rank']} adapters on all seven projections. "
             f"Every request queued at once; greedy, EOS ignored. {what}", "",
             "| popularity | max batch | system | requests | output tok/s | req/s | TTFT p50 / p99 (ms) | "
             "TPOT p50 / p99 (ms) | ceiling tok/s | of ceiling |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    merged = any("lengths" in r for r in result["rows"])
    if merged:
        lines[-2:] = ["| lengths " + lines[-2], "|---" + lines[-1]]
    for r in result["rows"]:
        ceil = r.get("ceiling_tokens_per_s")
        lines.append((f"| {r.get('lengths', '')} " if merged else "") +
                     f"| {r['popularity']} | {r['max_batch']} | {r['system']} | {r['requests']} | "
                     f"{r['tokens_per_s']:.1f} | {r['requests_per_s']:.3f} | {r['ttft_ms_p50']:.0f} / "
                     f"{r['ttft_ms_p99']:.0f} | {r['tpot_ms_p50']:.2f} / {r['tpot_ms_p99']:.2f} | "
                     + (f"{ceil:.0f} | {r['tokens_per_s'] / ceil:.2f} |" if ceil else "– | – |"))
    if result["ratios"]:
        lines += ["", "loraplex over each system, on the same requests:", "",
                  ("| lengths " if merged else "") + "| popularity | max batch | requests | versus | ratio |",
                  ("|---" if merged else "") + "|---|---|---|---|---|"]
        for q in result["ratios"]:
            lines.append((f"| {q.get('lengths', '')} " if merged else "") +
                         f"| {q['popularity']} | {q['max_batch']} | {q['requests']} | {q['versus']} | "
                         f"{q['ratio']:.3f}× |")
    steps = [r for r in result["rows"] if r.get("decode_step_ms") is not None]
    if steps:   # where each loraplex run's time went
        lines += ["", "Where loraplex's time went: decode steps (every sequence fed one token; overlapped, so "
                  "each costs its GPU time), mixed steps (prompts in them; replayed from CUDA graphs up to "
                  "cuda_graph_max_prompt_tokens prompt tokens, eager beyond), and the rest (between steps, and "
                  "waits when nothing could run, e.g. for adapter loads):", "",
                  ("| lengths " if merged else "") + "| popularity | max batch | system | decode steps × ms | "
                  "mixed steps × ms | other (s) | mean batch | scheduler alone |",
                  ("|---" if merged else "") + "|---|---|---|---|---|---|---|---|"]
        for r in steps:
            mixed = r["steps"] - r["decode_steps"]
            alone = f"{r['schedule_mean_batch']:.1f}" if r.get("schedule_mean_batch") is not None else "–"
            lines.append((f"| {r.get('lengths', '')} " if merged else "") +
                         f"| {r['popularity']} | {r['max_batch']} | {r['system']} | {r['decode_steps']} × "
                         f"{r['decode_step_ms']:.2f} | {mixed} × {r['mixed_step_ms']:.1f} | "
                         f"{r['other_seconds']:.1f} | {r['mean_batch']:.1f} | {alone} |")
        lines += ["", "Scheduler alone: the mean batch the engine's scheduler allows the same requests with every "
                  "adapter resident from the start and the run's KV memory (src/loraplex/bench/schedule.py); "
                  "below it, adapter loads or host time held the batch back."]
    lines += ["", "Ceiling: per step, weights + KV of the batch's contexts + each adapter in the batch once, over "
              "the copy bandwidth, summed over a first-come-first-served schedule of the same requests "
              "(src/loraplex/bench/ceiling.py). Backbone rows (no adapters) are the same for every popularity. "
              "That schedule never preempts, so it admits a request only once its whole length fits. The same "
              "sum over the run's own steps (\"ceiling over its own steps\", where recorded) is higher where the "
              "engine ran fuller batches (it read the weights fewer times) and lower where its batches were "
              "emptier (held back by adapter loads, say): it bounds the run's schedule, not the workload."]
    if result.get("notes"):
        lines += [""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, folder: Path, name: str) -> list[Path]:
    """One bar chart of output tokens/s per system for each popularity (log scale where baselines are far apart)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    pops = list(dict.fromkeys(r["popularity"] for r in result["rows"]))
    backbones = ("loraplex-backbone", "hf-backbone")   # the same for every popularity: beside each chart's rows
    for pop in pops:
        rows = [r for r in result["rows"] if r["popularity"] == pop]
        run = lambda r: (r.get("lengths"), str(r["max_batch"]), r["requests"])  # noqa: E731
        runs, drawn = {run(r) for r in rows}, {(r["system"], run(r)) for r in rows}
        for r in result["rows"]:
            if r["system"] in backbones and run(r) in runs and (r["system"], run(r)) not in drawn:
                rows.append(r)
                drawn.add((r["system"], run(r)))
        labels = [f"{r['system']}\nB={r['max_batch']}, n={r['requests']}"
                  + (f"\n{r['lengths']}" if "lengths" in r else "") for r in rows]
        values = [r["tokens_per_s"] for r in rows]
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 4.5))
        bars = ax.bar(range(len(rows)), values, color=["tab:blue" if r["system"].startswith("loraplex") else
                                                       "tab:gray" for r in rows])
        for i, r in enumerate(rows):
            if r.get("ceiling_tokens_per_s"):
                ax.hlines(r["ceiling_tokens_per_s"], i - 0.4, i + 0.4, colors="tab:red", linestyles="dashed")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        if max(values) > 20 * min(values):   # baselines far apart: log scale; else a linear one from 0
            ax.set_yscale("log")
            ax.set_ylabel("output tokens/s (log)")
        else:
            ax.set_ylim(0, 1.1 * max(values + [r.get("ceiling_tokens_per_s") or 0 for r in rows]))
            ax.set_ylabel("output tokens/s")
        ax.set_title(f"{result['model']}, {pop} adapters — {result['gpu']}, {result['date']}\n"
                     f"dashed: bandwidth ceiling", fontsize=9)
        fig.tight_layout()
        path = folder / f"{name}_{pop}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def lengths_label(w: dict) -> str:
    """What tells runs' workloads apart in a merged report (rows are compared only within one)."""
    label = (f"fixed {w.get('prompt_len', '?')}+{w.get('output_len', '?')}" if w["lengths"] == "fixed"
             else f"{w['lengths']} ≤{w['max_len']}")
    return label if w.get("seed", 0) == 0 else f"{label} seed {w['seed']}"


def describe_workload(w: dict) -> str:
    return f"{lengths_label(w)}: {w['requests']} requests, seed {w['seed']}"


# keys of a run's result that merge() combines itself; every other top-level key is a setting of the run
_PER_RUN = ("rows", "ratios", "notes", "workload", "date", "bandwidth_gbs")


def merge(results: list[dict], extra_notes: Iterable[str] = ()) -> dict:
    """One report from several runs of the same model: each row keeps its run's lengths, copy bandwidth
    and the settings that differ between runs, and ratios only compare rows of the same workload,
    popularity, batch and requests. `extra_notes` go below the runs' own notes."""
    if not results:
        raise ValueError("nothing to merge")
    for key in ("gpu", "model", "dtype", "rank"):
        differ = {str(r.get(key)) for r in results}
        if len(differ) > 1:
            raise ValueError(f"cannot merge runs with different {key}: {sorted(differ)}")
    # a run's settings (loader threads, engine options, library versions…) stay on top only where every
    # run agrees; the others go into each row as `run_settings`, so no row claims settings it ran without
    settings = [{k: v for k, v in r.items() if k not in _PER_RUN} for r in results]
    common = {k: v for k, v in settings[0].items() if all(k in s and s[k] == v for s in settings[1:])}
    rows, notes, runs = [], [], []
    for r, own in zip(results, settings):
        label = lengths_label(r["workload"])
        runs.append(describe_workload(r["workload"]))
        differing = {k: v for k, v in own.items() if k not in common}
        for row in r["rows"]:
            rows.append(dict(row, lengths=label, run_date=r["date"], **({"run_settings": differing} if differing
                                                                         else {})))
        notes += [f"{label}: {n}" for n in r.get("notes", []) if f"{label}: {n}" not in notes]
    dates = sorted({r["date"] for r in results})
    if len(dates) > 1:   # say which rows are older: code and machine may differ between runs
        for date in dates:
            which = [f"{row['lengths']} {row['system']} (max batch {row['max_batch'] or 'unlimited'})"
                     for row in rows if row["run_date"] == date]
            notes.append(f"run on {date}: {', '.join(which)}")
    bandwidths = sorted(r["bandwidth_gbs"] for r in results if r.get("bandwidth_gbs"))
    return dict(common, date=max(dates), rows=rows, ratios=ratios(rows), notes=notes + list(extra_notes),
                workload=dict(runs=list(dict.fromkeys(runs))),
                bandwidth_gbs=bandwidths[len(bandwidths) // 2] if bandwidths else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loraplex.bench.report", description=merge.__doc__)
    ap.add_argument("results", nargs="+", type=Path, help="JSON files written by loraplex bench")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    args = ap.parse_args(argv)
    results = []
    for path in args.results:
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"error: {path}: {e}")
    try:
        result = merge(results, args.note)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown(result)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (args.out_dir / f"{args.name}.md").write_text(table)
    if not args.no_plots:
        plot(result, args.out_dir, args.name)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
