"""Cluster simulation sweep: routing policies × request rates × adapter popularities on N simulated H200s.

Fits the step cost model to the engine benchmarks' results (loraplex.cluster.cost_model), replays the Punica
workload through loraplex.cluster.simulator under each policy, and writes `NAME.json` (settings, the cost
model with its points and residuals, one row per run, the consolidation criterion), `NAME.md` and one plot per
popularity, `NAME_<popularity>.png` (throughput, p99 latency and GPU-busy-seconds per 1,000 requests against
the rate, one line per policy). Pure CPU, deterministic for a seed.

    python benchmarks/simulate_cluster.py --out-dir benchmarks/results

Policies: round_robin, least_loaded, consolidate (Punica: the fullest replica with room), and consolidate with
a batch target per `--targets` (routing rule 3), labelled consolidate_t<N>.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from loraplex.cluster.cost_model import fit_cost_model
from loraplex.cluster.simulator import POPULARITIES, ClusterConfig, make_trace, simulate

METRICS = [("window_tokens_per_s", "output tokens/s (arrival window)"), ("latency_p99_s", "p99 latency (s)"),
           ("busy_s_per_1k", "GPU-busy-s per 1,000 requests")]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rates", default="0.5,1,2,4,8,16,32,64", help="requests per second, comma-separated")
    ap.add_argument("--popularity", default=",".join(POPULARITIES), help=f"comma-separated, of {POPULARITIES}")
    ap.add_argument("--targets", default="16,32", help="consolidation batch targets to add ('' for none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default="benchmarks/results", help="where the step times are")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--name", default="cluster_sim")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    args.rates = _floats(args.rates)
    args.popularity = [p for p in args.popularity.split(",") if p]
    args.targets = [int(t) for t in _floats(args.targets)]
    bad = [p for p in args.popularity if p not in POPULARITIES]
    if bad or not args.rates or min(args.rates) <= 0:
        ap.error(f"need rates > 0 and popularities of {POPULARITIES}; got {args.rates}, {args.popularity}")
    return args


def policies(targets: list[int]) -> list[tuple[str, str, int | None]]:
    """(label, routing policy, consolidation target)."""
    rows = [("round_robin", "round_robin", None), ("least_loaded", "least_loaded", None),
            ("consolidate", "consolidate", None)]
    return rows + [(f"consolidate_t{t}", "consolidate", t) for t in targets]


def sweep(args: argparse.Namespace, fit) -> list[dict]:
    rows = []
    base = ClusterConfig(gpus=args.gpus)
    for popularity in args.popularity:
        for rate in args.rates:
            trace = make_trace(args.requests, rate, popularity, seed=args.seed)
            for label, policy, target in policies(args.targets):
                t = time.perf_counter()
                res = simulate(trace, replace(base, target_batch=target), fit.model, fit.loads, policy,
                               rate=rate, popularity=popularity)
                rows.append(dict(res.to_json(), label=label, target_batch=target))
                print(f"{popularity:9} {rate:6g} req/s {label:16} {res.window_tokens_per_s:8.0f} tok/s "
                      f"p99 {res.latency_p99_s:6.1f} s busy/1k {res.busy_s_per_1k:6.0f} s "
                      f"({time.perf_counter() - t:.1f} s)", file=sys.stderr)
    return rows


def _row(rows: list[dict], popularity: str, rate: float, label: str) -> dict:
    return next(r for r in rows if r["popularity"] == popularity and r["rate"] == rate and r["label"] == label)


def criterion(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """Consolidation against least-loaded: busy-seconds and p99 at the lightest rate, throughput at the
    heaviest (the issue's criterion), for each consolidating label."""
    out = []
    light, heavy = min(args.rates), max(args.rates)
    for popularity in args.popularity:
        ll_l, ll_h = _row(rows, popularity, light, "least_loaded"), _row(rows, popularity, heavy, "least_loaded")
        for label, policy, _ in policies(args.targets):
            if policy != "consolidate":
                continue
            c_l, c_h = _row(rows, popularity, light, label), _row(rows, popularity, heavy, label)
            out.append({"popularity": popularity, "label": label, "light_rate": light, "heavy_rate": heavy,
                        "busy_change": c_l["busy_s_per_1k"] / ll_l["busy_s_per_1k"] - 1,
                        "p99_change": c_l["latency_p99_s"] / ll_l["latency_p99_s"] - 1,
                        "throughput_change": c_h["window_tokens_per_s"] / ll_h["window_tokens_per_s"] - 1})
    return out


def markdown(result: dict) -> str:
    s = result["settings"]
    m = result["cost_model"]["model"]
    fit = (f"Step cost model (ms) fitted to the engine benchmarks (docs/cluster.md): a={m['a']:.3f}, "
           f"b={m['b']:.4f}/seq, c={m['c']:.3e}/context token, d={m['d']:.4f}/adapter, e={m['e']:.3f} with any "
           f"adapter, p={m['p']:.4f}/prefill token; decode residuals RMS {result['cost_model']['decode_rms_ms']:.2f} "
           f"ms (max {result['cost_model']['decode_max_ms']:.2f}).")
    terms = ("Throughput: output tokens made between the first and the last arrival over that time. Latency: "
             "arrival to last token. Busy: seconds GPUs spent in steps, per 1,000 requests.")
    lines = [f"# Cluster simulation: {s['gpus']} simulated H200s, {s['requests']} requests per run", "",
             f"Command: `{result['command']}`", "", fit, "", terms, ""]
    for popularity in s["popularity"]:
        head = ("| req/s | policy | tok/s | req/s done | p50 / p99 latency (s) | p50 / p99 TTFT (s) | "
                "busy-s / 1k req | GPUs used | mean batch | migrations | preemptions | max queue |")
        lines += [f"## {popularity}", "", head, "|---:|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in result["rows"]:
            if r["popularity"] == popularity:
                lines.append(f"| {r['rate']:g} | {r['label']} | {r['window_tokens_per_s']:.0f} | {r['req_per_s']:.2f} | "
                             f"{r['latency_p50_s']:.1f} / {r['latency_p99_s']:.1f} | {r['ttft_p50_s']:.2f} / "
                             f"{r['ttft_p99_s']:.2f} | {r['busy_s_per_1k']:.0f} | {r['gpus_used']} | "
                             f"{r['mean_batch']:.1f} | {r['migrations']} | {r['preemptions']} | {r['max_router_queue']} |")
        lines.append("")
    lines += ["## Consolidation against least-loaded", "",
              "| popularity | policy | busy-s at lightest rate | p99 at lightest rate | throughput at heaviest rate |",
              "|---|---|---:|---:|---:|"]
    for c in result["criterion"]:
        lines.append(f"| {c['popularity']} | {c['label']} | {c['busy_change']:+.1%} | {c['p99_change']:+.1%} | "
                     f"{c['throughput_change']:+.1%} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, out_dir: Path, name: str) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for popularity in result["settings"]["popularity"]:
        fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 4))
        rows = [r for r in result["rows"] if r["popularity"] == popularity]
        for label in dict.fromkeys(r["label"] for r in rows):
            mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["rate"])
            for ax, (key, title) in zip(axes, METRICS):
                ax.plot([r["rate"] for r in mine], [r[key] for r in mine], marker="o", label=label)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("offered requests/s")
                ax.set_title(title)
        axes[2].set_yscale("log")
        axes[0].legend()
        fig.suptitle(f"{result['settings']['gpus']} simulated H200s, popularity {popularity}")
        fig.tight_layout()
        path = out_dir / f"{name}_{popularity}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    fit = fit_cost_model(args.results)
    rows = sweep(args, fit)
    fit_json = fit.to_json()
    fit_json["decode_rms_ms"] = (sum(r * r for r in fit.decode_residuals) / len(fit.decode_residuals)) ** 0.5
    fit_json["decode_max_ms"] = max(abs(r) for r in fit.decode_residuals)
    settings = dict(vars(args), cluster=asdict(ClusterConfig(gpus=args.gpus)))
    command = "python benchmarks/simulate_cluster.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"settings": settings, "command": command.strip(), "cost_model": fit_json, "rows": rows,
              "criterion": criterion(rows, args)}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{args.name}.md").write_text(markdown(result))
    if not args.no_plots:
        plot(result, out, args.name)
    print(markdown(result))


if __name__ == "__main__":
    main()
