"""What `bench_serving.py` measured, as numbers: per-request timings (`RequestRecord`), one summary
row per offered rate (`summarize`), and the row as a console line, a markdown table and a plot.

Definitions (all times from `time.perf_counter()` on the client, in seconds since the rate began):
- TTFT: first chunk that carries a token − the moment the request was sent.
- TPOT: (end − first token) / (completion tokens − 1); requests of one token are left out.
- ITL: the gap between consecutive token-carrying chunks (one entry per chunk after the first).
- E2E: end − sent. Makespan: first send → last end. Achieved rate: completed / makespan.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

STATS = ("p50", "p90", "p99", "mean")
CLIENT_CPU_WARN = 0.8      # share of one core the client process used over a rate
SEND_LAG_WARN_MS = 50.0    # the latest send after its scheduled arrival


class StreamError(RuntimeError):
    """The server reported an error inside a stream, or the stream broke off."""


@dataclass
class RequestRecord:
    index: int
    model: str                        # the base model or adapter it asked for
    prompt_len: int
    output_len: int                   # max_tokens asked for (ignore_eos: the tokens expected)
    scheduled_s: float                # its Poisson arrival time
    sent_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)      # each token-carrying chunk's arrival
    chunk_tokens: list[int] = field(default_factory=list)   # the tokens each of them carried
    completion_tokens: int = 0        # counted in chunks, then the usage chunk's (it comes last)
    finish_reason: str | None = None
    error: str | None = None

    def add_event(self, event: dict, now: float) -> None:
        """One streamed /v1/completions event (parsed JSON) that arrived at `now`. A chunk's tokens
        are its logprobs entries when asked for, else 1 if it has text; the usage chunk's total
        replaces the count."""
        if event.get("error"):
            raise StreamError(f"error event: {json.dumps(event['error'])}")
        if event.get("usage"):
            self.completion_tokens = event["usage"]["completion_tokens"]
            return
        for choice in event.get("choices") or ():
            lp = choice.get("logprobs")
            n = len(lp["tokens"]) if lp and lp.get("tokens") else int(bool(choice.get("text")))
            if n:
                if self.first_token_s is None:
                    self.first_token_s = now
                self.chunk_s.append(now)
                self.chunk_tokens.append(n)
                self.completion_tokens += n
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and self.first_token_s is not None

    def to_json(self) -> dict:
        out = asdict(self)
        for key in ("scheduled_s", "sent_s", "first_token_s", "end_s"):
            if out[key] is not None:
                out[key] = round(out[key], 6)
        out["chunk_s"] = [round(t, 6) for t in self.chunk_s]
        return out


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean in milliseconds (linear interpolation); None each when there are no values."""
    if not values_s:
        return dict.fromkeys(STATS)
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "p99": round(float(p99), 3),
            "mean": round(float(ms.mean()), 3)}


def summarize(rate: float, records: list[RequestRecord], *, client_cpu: float | None = None) -> dict:
    """One row: load, throughput, latency percentiles, errors; over the requests this rate sent."""
    sent = [r for r in records if r.sent_s is not None]
    done = [r for r in sent if r.ok]
    failed = [r for r in sent if not r.ok]
    ends = [r.end_s for r in done]
    makespan = max(ends) - min(r.sent_s for r in sent) if done else None
    out_tokens = sum(r.completion_tokens for r in done)
    ttft = [r.first_token_s - r.sent_s for r in done]
    tpot = [(r.end_s - r.first_token_s) / (r.completion_tokens - 1) for r in done if r.completion_tokens > 1]
    itl = [b - a for r in done for a, b in zip(r.chunk_s, r.chunk_s[1:])]
    e2e = [r.end_s - r.sent_s for r in done]
    lags = [r.sent_s - r.scheduled_s for r in sent]
    counted = sum(sum(r.chunk_tokens) for r in done)
    errors = Counter((r.error or "no token or no end")[:200] for r in failed)
    return {
        "rate_rps": rate,
        "requests": len(records),
        "sent": len(sent),
        "not_sent": len(records) - len(sent),       # past --duration-cap-s
        "completed": len(done),
        "errors": len(failed),
        "error_messages": dict(errors.most_common(5)),
        "makespan_s": None if makespan is None else round(makespan, 3),
        "achieved_rps": None if not makespan else round(len(done) / makespan, 3),
        "prompt_tokens": sum(r.prompt_len for r in done),
        "output_tokens": out_tokens,
        "output_tok_s": None if not makespan else round(out_tokens / makespan, 1),
        "short_outputs": sum(r.completion_tokens != r.output_len for r in done),   # ignore_eos: should be 0
        "tokens_per_chunk": round(counted / max(1, sum(len(r.chunk_s) for r in done)), 3),
        "ttft_ms": stats_ms(ttft),
        "tpot_ms": stats_ms(tpot),
        "itl_ms": stats_ms(itl),
        "e2e_ms": stats_ms(e2e),
        "max_send_lag_ms": round(max(lags) * 1e3, 3) if lags else None,   # client late to send: client-bound
        "client_cpu": None if client_cpu is None else round(client_cpu, 3),
    }


def client_bound(row: dict) -> str | None:
    """Why the client, not the server, may have set this row's numbers (None: no sign of it)."""
    why = []
    if row["client_cpu"] is not None and row["client_cpu"] > CLIENT_CPU_WARN:
        why.append(f"client CPU {row['client_cpu']:.0%} of one core")
    if row["max_send_lag_ms"] is not None and row["max_send_lag_ms"] > SEND_LAG_WARN_MS:
        why.append(f"a request left {row['max_send_lag_ms']:.0f} ms after its arrival time")
    return "; ".join(why) or None


# ---- text -----------------------------------------------------------------------------------------
def _f(value: float | None, digits: int = 1) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


HEADER = ("| offered req/s | achieved req/s | output tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms "
          "| ITL p50 / p99 ms | E2E p50 / p99 s | done | errors |")


def table_line(row: dict) -> str:
    t, p, i, e = row["ttft_ms"], row["tpot_ms"], row["itl_ms"], row["e2e_ms"]
    e2e = [None if e[k] is None else e[k] / 1e3 for k in ("p50", "p99")]
    return (f"| {row['rate_rps']:g} | {_f(row['achieved_rps'], 2)} | {_f(row['output_tok_s'])} "
            f"| {_f(t['p50'])} / {_f(t['p90'])} / {_f(t['p99'])} | {_f(p['p50'])} / {_f(p['p90'])} / {_f(p['p99'])} "
            f"| {_f(i['p50'])} / {_f(i['p99'])} | {_f(e2e[0], 2)} / {_f(e2e[1], 2)} "
            f"| {row['completed']}/{row['requests']} | {row['errors']} |")


def markdown(result: dict) -> str:
    w, s = result["workload"], result["server"]
    lines = [
        "# Online serving benchmark",
        "",
        f"GPU: {result['gpu']}; date: {result['date']}.",
        f"Server: `{s['launch'] or s['url']}`; base model `{s['base_model']}`, {s['adapters_served']} adapters served.",
        (f"Workload: {w['requests']} requests per rate, popularity {w['popularity']} "
         f"({'base model only' if w['no_adapters'] else str(w['adapters_used']) + ' adapters used'}), "
         f"lengths {w['lengths']} (max_len {w['max_len']}; {w['prompt_tokens']} prompt and {w['output_tokens']} "
         f"output tokens), seed {w['seed']}; Poisson arrivals, open loop, streaming, greedy, ignore_eos; "
         f"tokens counted {'by logprobs' if result['client']['logprobs'] else 'as text chunks'}."),
        "",
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
    ]
    lines += [table_line(row) for row in result["rows"]]
    lines += ["", ("TTFT from send to the first token-carrying chunk; TPOT = (end − first token) / (tokens − 1); "
                   "ITL between token-carrying chunks; achieved = completed / (first send → last end).")]
    for row in result["rows"]:
        if row["errors"]:
            lines.append(f"- {row['rate_rps']:g} req/s: {row['errors']} errors: {row['error_messages']}")
        if row["not_sent"]:
            lines.append(f"- {row['rate_rps']:g} req/s: {row['not_sent']} requests not sent (duration cap)")
        if client_bound(row):
            lines.append(f"- {row['rate_rps']:g} req/s: the client may limit these numbers: {client_bound(row)}")
        if row["short_outputs"]:
            lines.append(f"- {row['rate_rps']:g} req/s: {row['short_outputs']} outputs shorter than max_tokens")
    return "\n".join(lines) + "\n"


# ---- plot -----------------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    """TTFT and TPOT (p50, p99) and achieved vs offered throughput, against offered load."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = result["rows"]
    x = [r["rate_rps"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token"), (axes[1], "tpot_ms", "time per output token")):
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            y = [np.nan if r[key][stat] is None else r[key][stat] for r in rows]
            ax.plot(x, y, style, label=stat)
        finite = [v for r in rows for v in (r[key]["p50"], r[key]["p99"]) if v]
        if finite and max(finite) / min(finite) > 50:
            ax.set_yscale("log")
        ax.set(title=title, xlabel="offered load (req/s)", ylabel="ms")
        ax.legend()
        ax.grid(alpha=0.3)
    ax = axes[2]
    ax.plot(x, [np.nan if r["achieved_rps"] is None else r["achieved_rps"] for r in rows], "o-", label="achieved")
    ax.plot(x, x, ":", color="gray", label="offered")
    ax.set(title="throughput", xlabel="offered load (req/s)", ylabel="completed req/s")
    ax.legend()
    ax.grid(alpha=0.3)
    if x and max(x) / min(x) >= 4:   # rates are usually a geometric series
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [f"{v:g}" for v in x])
        axes[2].set_yscale("log", base=2)   # the offered diagonal stays straight
        axes[2].yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    w = result["workload"]
    who = "base model only" if w["no_adapters"] else f"{w['popularity']} popularity over {w['adapters_used']} adapters"
    fig.suptitle(f"loraplex serve, {result['gpu']}: {w['requests']} requests/rate, {who}, "
                 f"{w['lengths']} lengths ({result['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- files ----------------------------------------------------------------------------------------
def gpu_name() -> str:
    try:
        import torch
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:   # noqa: BLE001 -- no torch or no driver: the client side is a CPU
        return "cpu"


def write_outputs(result: dict, out: Path, md: Path | None, png: Path | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if md is not None:
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(markdown(result))
    if png is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        plot(result, png)
