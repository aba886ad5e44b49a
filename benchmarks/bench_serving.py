"""Online serving benchmark: Poisson arrivals at several rates against a running `loraplex serve`.

For each offered rate λ (req/s) the same workload (`loraplex.bench.workload`: lengths, adapter
popularity, random prompt token ids) is sent open loop: request i leaves at its Poisson arrival
time (exponential gaps from a seeded rng, one unit-rate draw scaled by 1/λ, so every rate sees the
same pattern) however many are in flight. Each is a streamed /v1/completions request (prompt as
token ids, max_tokens = its output length, temperature 0, ignore_eos, usage in the last chunk)
through the official async `openai` client. Adapter index i names the i-th served adapter in
natural name order (syn-2 before syn-10), modulo their count; `--no-adapters` sends everything to
the base model (a baseline of the same load). A few warm-up requests (not counted) go first.

Tokens are counted by asking for `logprobs=0` (the chosen token's logprob only): every chunk then
lists the tokens it carries, even when it has no text (a model without a tokenizer streams no text
at all, and a byte-level tokenizer holds back partial characters). `--no-logprobs` counts one
token per text-carrying chunk instead (totals still come from `usage`).

Metrics per rate (definitions in serving_report.py): achieved req/s and output tok/s over the
makespan, TTFT / TPOT / ITL / end-to-end percentiles, errors (a failed request is counted with its
message, never fatal), the client's lateness in sending and its CPU use (near 1.0 means the client,
not the server, limits the numbers).

    python benchmarks/bench_serving.py --launch "loraplex serve --model dummy:llama-2-7b \\
        --synthetic-adapters 100 --max-lora-rank 16 --max-gpu-adapters 64" --rates 1,2,4,8 \\
        --requests 200 --popularity skewed --lengths punica --max-len 2048 \\
        --out benchmarks/results/serving.json --md benchmarks/results/serving.md \\
        --plot benchmarks/results/serving.png

`--url` targets a server already running; `--launch` starts one (adding `--port` with a free port
when the command names none), waits for GET /health, and stops it with SIGTERM at the end. The
server's max_model_len must hold `--max-len`; `--vocab-size` must not exceed the model's.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from serving_report import (
    HEADER,
    RequestRecord,
    StreamError,
    client_bound,
    gpu_name,
    summarize,
    table_line,
    write_outputs,
)

from loraplex.bench.workload import LENGTHS, POPULARITIES, Workload, make_workload

WARMUP_MAX_TOKENS = 16


class BenchError(RuntimeError):
    """The benchmark cannot run (no server, a refused workload); the message says why."""


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Send times (s) of n requests arriving as a Poisson process of `rate` req/s: cumulative sums
    of exponential gaps of mean 1/rate; the same seed gives the same pattern, scaled by 1/rate."""
    if not rate > 0 or not np.isfinite(rate):
        raise ValueError(f"rate must be a positive finite number of requests per second, got {rate}")
    return np.cumsum(np.random.default_rng(seed).standard_exponential(n) / rate)


def natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


# ---- a server of our own ------------------------------------------------------------------------
def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:]) or "(no output)"


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2.0) as response:
            return response.status == 200
    except (OSError, ValueError):   # refused, reset, 503 (HTTPError), a timeout
        return False


@contextlib.contextmanager
def launched(command: str, timeout_s: float, log_path: Path) -> Iterator[str]:
    """Start `command` (a `loraplex serve ...` line), yield its /v1 URL once GET /health is 200, then
    SIGTERM it and wait. Output goes to `log_path`; its tail is in the error if the server dies."""
    argv = shlex.split(command)
    if not argv:
        raise BenchError("--launch got an empty command")
    if argv[0] == "loraplex" and shutil.which("loraplex") is None:
        argv = [sys.executable, "-m", "loraplex.cli", *argv[1:]]
    port = _flag(argv, "--port")
    if port is None or port == "0":
        port = str(_free_port())
        argv = [a for i, a in enumerate(argv) if not (a == "--port" or a.startswith("--port=")
                                                       or (i and argv[i - 1] == "--port"))] + ["--port", port]
    host = _flag(argv, "--host") or "127.0.0.1"
    address = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://{address}:{port}"
    with contextlib.suppress(OSError), socket.create_connection((address, int(port)), timeout=1.0):
        raise BenchError(f"{address}:{port} is already taken (another server?): drop --port from --launch "
                         "to get a free one, or benchmark that server with --url")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise BenchError(f"cannot start the server {shlex.join(argv)!r}: {e}") from None
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            code = proc.poll()
            if code is not None:
                raise BenchError(f"the server exited with code {code} before GET /health answered 200; "
                                 f"command: {shlex.join(argv)}\n--- its last output ({log_path}) ---\n"
                                 f"{_tail(log_path)}")
            if _healthy(base):
                break
            if time.monotonic() > deadline:
                raise BenchError(f"the server did not become healthy within {timeout_s:g} s (--launch-timeout-s); "
                                 f"command: {shlex.join(argv)}\n--- its last output ({log_path}) ---\n"
                                 f"{_tail(log_path)}")
            time.sleep(0.25)
        print(f"server up at {base} (log: {log_path})", flush=True)
        yield base + "/v1"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---- the client -----------------------------------------------------------------------------------
async def served_models(client) -> tuple[str, list[str]]:
    """(base model, adapters in natural name order) from GET /v1/models."""
    import openai
    try:
        listed = (await client.models.list()).data
    except openai.APIError as e:
        raise BenchError(f"GET {client.base_url}models failed: {type(e).__name__}: {e}") from None
    base = [m.id for m in listed if (m.model_extra or {}).get("parent") is None]
    adapters = [m.id for m in listed if (m.model_extra or {}).get("parent") is not None]
    if len(base) != 1:
        raise BenchError(f"GET /v1/models should list one base model (parent null), got {base}")
    return base[0], sorted(adapters, key=natural_key)


async def send_one(client, rec: RequestRecord, prompt: list[int], t0: float, *, logprobs: bool,
                   timeout_s: float) -> None:
    """Stream one completion, filling `rec` with its timings (seconds since t0) or its error.

    The official client sends the request (auth, errors as `openai.APIStatusError`); the events are
    read as raw lines and `json.loads`: the client's per-chunk models cost ~2× the CPU, and a
    client that falls behind inflates the very latencies it measures."""
    extra = {"logprobs": 0} if logprobs else {}

    async def stream() -> bool:
        done = False
        async with client.completions.with_streaming_response.create(
                model=rec.model, prompt=prompt, max_tokens=rec.output_len, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **extra) as response:
            async for line in response.iter_lines():   # read to the end: the connection goes back to the pool
                if line.startswith("data:") and not done:
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done, rec.end_s = True, time.perf_counter() - t0
                    else:
                        rec.add_event(json.loads(data), time.perf_counter() - t0)
        return done

    rec.sent_s = time.perf_counter() - t0
    try:
        done = await asyncio.wait_for(stream(), timeout_s)
        if not done:
            raise StreamError("the stream ended without 'data: [DONE]'")
        if rec.first_token_s is None:
            rec.error = ("the stream carried no token" + ("" if logprobs else
                         " text (a model without a tokenizer streams none: drop --no-logprobs)"))
    except asyncio.TimeoutError:
        rec.error = f"timed out after {timeout_s:g} s (--timeout-s)"
    except Exception as e:   # noqa: BLE001 -- any failure is this request's error, never the run's
        rec.error = f"{type(e).__name__}: {e}"[:500]


async def run_requests(client, records: list[RequestRecord], prompts: list[list[int]], *,
                       logprobs: bool, timeout_s: float, cap_s: float | None) -> float:
    """Send each record at its `scheduled_s` (open loop) and wait for all; returns the client's CPU
    share over the run. Records scheduled after `cap_s` are not sent."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    tasks = []
    for rec, prompt in zip(records, prompts):
        if cap_s is not None and rec.scheduled_s > cap_s:
            break
        delay = t0 + rec.scheduled_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send_one(client, rec, prompt, t0, logprobs=logprobs, timeout_s=timeout_s)))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    return (time.process_time() - cpu0) / wall if wall > 0 else 0.0


def make_client(url: str, api_key: str, timeout_s: float):
    import openai
    from openai._constants import DEFAULT_CONNECTION_LIMITS
    # No pool limit: an open-loop client must never queue requests on its own side (the default
    # is 1000 connections). The Limits class is whichever HTTP library this openai version uses.
    limits = type(DEFAULT_CONNECTION_LIMITS)(max_connections=None, max_keepalive_connections=1024)
    timeout = openai.Timeout(timeout_s, connect=30.0)
    return openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=timeout,
                              http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=timeout))


async def bench(args: argparse.Namespace, url: str, api_key: str, workload: Workload,
                prompts: list[list[int]], rates: list[float]) -> tuple[dict, list[dict], dict]:
    async with make_client(url, api_key, args.timeout_s) as client:
        base, adapters = await served_models(client)
        if not args.no_adapters and not adapters:
            raise BenchError("the server serves no adapters: start it with --synthetic-adapters N or --lora "
                             "NAME=DIR, or pass --no-adapters to benchmark the base model")
        names = [base if args.no_adapters else adapters[r.adapter % len(adapters)] for r in workload.requests]
        if not args.no_adapters and workload.num_adapters > len(adapters):
            print(f"note: the workload uses {workload.num_adapters} adapter indices, the server serves "
                  f"{len(adapters)}: indices wrap modulo {len(adapters)}", flush=True)
        server = {"url": url, "base_model": base, "adapters_served": len(adapters)}
        stats = {"adapters_used": len(set(names)) if not args.no_adapters else 0}

        def records(arrivals: np.ndarray, n: int, cap_tokens: int | None = None) -> list[RequestRecord]:
            return [RequestRecord(r.index, names[r.index], r.prompt_len,
                                  r.output_len if cap_tokens is None else min(r.output_len, cap_tokens), float(at))
                    for r, at in zip(workload.requests[:n], arrivals)]

        if args.warmup:
            n = min(args.warmup, len(workload.requests))
            warm = records(np.zeros(n), n, WARMUP_MAX_TOKENS)
            await run_requests(client, warm, prompts[:n], logprobs=not args.no_logprobs, timeout_s=args.timeout_s,
                               cap_s=None)
            if all(r.error for r in warm):
                raise BenchError(f"every warm-up request failed, e.g. {warm[0].error}"
                                 + (" (lower --vocab-size to the model's)" if "vocabulary" in warm[0].error else ""))
            print(f"warm-up: {sum(r.ok for r in warm)}/{n} requests done", flush=True)

        rows, raw = [], {}
        print(HEADER, flush=True)
        for rate in rates:
            recs = records(poisson_arrivals(len(workload.requests), rate, args.seed), len(workload.requests))
            cpu = await run_requests(client, recs, prompts, logprobs=not args.no_logprobs,
                                     timeout_s=args.timeout_s, cap_s=args.duration_cap_s)
            row = summarize(rate, recs, client_cpu=cpu)
            rows.append(row)
            print(table_line(row), flush=True)
            if row["sent"] and row["errors"] == row["sent"]:
                print(f"  every request at {rate:g} req/s failed, e.g. {next(iter(row['error_messages']))}",
                      flush=True)
            elif row["errors"]:
                print(f"  {row['errors']} errors: {row['error_messages']}", flush=True)
            if client_bound(row):
                print(f"  warning: the client may limit these numbers: {client_bound(row)}", flush=True)
            if args.raw:
                raw[f"{rate:g}"] = [r.to_json() for r in recs]
        return {**server, **stats}, rows, raw


# ---- the command ----------------------------------------------------------------------------------
def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BenchError(f"--rates takes comma-separated numbers of requests per second, got {text!r}") from None
    if not rates or not all(r > 0 and np.isfinite(r) for r in rates):
        raise BenchError(f"--rates needs positive finite rates, got {text!r}")
    return rates


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    where.add_argument("--launch", help="a `loraplex serve ...` command to start (and stop) for the run")
    ap.add_argument("--launch-timeout-s", type=float, default=900.0, help="wait this long for /health")
    ap.add_argument("--server-log", type=Path, help="the launched server's output (default: a temp file)")
    ap.add_argument("--api-key", help="bearer key (default: --launch's --api-key, else none)")
    ap.add_argument("--rates", default="1,2,4,8", help="offered loads, req/s, comma-separated")
    ap.add_argument("--requests", type=int, default=200, help="requests per rate")
    ap.add_argument("--popularity", choices=POPULARITIES, default="skewed")
    ap.add_argument("--lengths", choices=LENGTHS, default="punica")
    ap.add_argument("--max-len", type=int, default=2048, help="punica lengths: prompt + output ≤ this")
    ap.add_argument("--prompt-len", type=int, default=128, help="fixed lengths: prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="fixed lengths: output tokens")
    ap.add_argument("--vocab-size", type=int, default=32000, help="prompt ids are drawn below this (≤ the model's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-adapters", action="store_true", help="send every request to the base model")
    ap.add_argument("--no-logprobs", action="store_true", help="count one token per text chunk (see above)")
    ap.add_argument("--warmup", type=int, default=8, help="uncounted requests sent at once before the first rate")
    ap.add_argument("--duration-cap-s", type=float, help="per rate, send no request scheduled after this")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/serving.json"))
    ap.add_argument("--md", type=Path, help="markdown table")
    ap.add_argument("--plot", type=Path, help="PNG of latency and throughput vs offered load")
    ap.add_argument("--raw", action="store_true", help="keep every request's timings in the JSON")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.warmup < 0 or args.vocab_size < 4:
        ap.error("--requests must be ≥ 1, --warmup ≥ 0 and --vocab-size ≥ 4")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rates = parse_rates(args.rates)
    workload = make_workload(args.requests, args.popularity, lengths=args.lengths, max_len=args.max_len,
                             seed=args.seed, prompt_len=args.prompt_len, output_len=args.output_len)
    prompts = workload.prompt_ids(args.vocab_size)
    api_key = args.api_key or (_flag(shlex.split(args.launch), "--api-key") if args.launch else None) or "none"
    with contextlib.ExitStack() as stack:
        url = args.url
        if args.launch:
            log = args.server_log or Path(tempfile.mkdtemp(prefix="loraplex-bench-")) / "server.log"
            url = stack.enter_context(launched(args.launch, args.launch_timeout_s, log))
        server, rows, raw = asyncio.run(bench(args, url, api_key, workload, prompts, rates))
    server["launch"] = args.launch
    result = {
        "gpu": gpu_name(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "server": {k: server[k] for k in ("url", "launch", "base_model", "adapters_served")},
        "workload": {"requests": args.requests, "popularity": args.popularity, "lengths": args.lengths,
                     "max_len": workload.max_len, "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "seed": args.seed, "vocab_size": args.vocab_size, "no_adapters": args.no_adapters,
                     "adapters_used": server["adapters_used"], "prompt_tokens": workload.prompt_tokens,
                     "output_tokens": workload.output_tokens},
        "client": {"logprobs": not args.no_logprobs, "warmup": args.warmup, "duration_cap_s": args.duration_cap_s,
                   "timeout_s": args.timeout_s, "arrivals": "poisson, open loop"},
        "rows": rows,
    }
    if args.raw:
        result["raw"] = raw
    write_outputs(result, args.out, args.md, args.plot)
    print(f"wrote {', '.join(str(p) for p in (args.out, args.md, args.plot) if p)}", flush=True)
    return result


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        sys.exit(f"error: {e}")
