"""GPU benchmark of loraplex's paged attention (ops.paged_attention, Triton) at Llama head shapes, bf16.

- decode: batch 1, 8, 32, 128 × context 512 and 4096, one query row per sequence, replayed from
  a CUDA graph (as the engine runs decode) and eager. Reported beside the memory floor: the K/V
  bytes the step must read / the copy bandwidth measured in the same run (a 1 GiB device-to-device
  copy, bytes read + written), and as achieved GB/s of K/V read.
- prefill: 8 sequences × 512 new tokens (causal), eager, as TFLOP/s beside torch's
  scaled_dot_product_attention (flash) on the same values laid out contiguously.
- mixed: one 512-token chunk over a 1536-token cached prefix plus 32 decode rows at 2048 (the
  shape of a chunked-prefill engine step), eager.

Pages are shuffled across sequences, block size 16. Each case rotates over several input sets
(disjoint pages, their own q) so that L2 (~50 MB) holds none of them across calls; the SDPA
baselines run on one set (small decode cases may then read from L2). Times are medians of
CUDA-event timings after warm-up (benchmarks/bench_lora_ops.py's `time_us`).

    python benchmarks/bench_attention.py --out benchmarks/results/attention.json --md benchmarks/results/attention.md
    python benchmarks/bench_attention.py --smoke      # tiny shapes on any device: checks the set-up, no timing
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loraplex import envs, ops  # noqa: E402
from loraplex.ops.attention import launchers as ak  # noqa: E402

HEAD_SHAPES = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}  # Hq, Hkv, head_dim
DECODE_BATCHES = [1, 8, 32, 128]
DECODE_CONTEXTS = [512, 4096]
PREFILL = (8, 512)  # sequences × new tokens
MIXED = dict(chunk=512, prefix=1536, decodes=32, decode_ctx=2048)
BLOCK_SIZE = 16
L2_CLEAR_BYTES = 128 << 20  # rotate input sets until this many bytes (> 2 × L2) separate two uses of one set
MAX_ROTATION_BYTES = 8 << 30
MAX_ROTATIONS = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rotations(bytes_per_set: int) -> int:
    return max(1, min(MAX_ROTATIONS, _cdiv(L2_CLEAR_BYTES, bytes_per_set), MAX_ROTATION_BYTES // max(bytes_per_set, 1)))


class Paged:
    """`rotations` input sets for one batch shape: one shared cache, each set on its own shuffled pages.

    Sequence s of every set has `cached[s]` tokens already in the cache and `new[s]` query rows
    (whose keys are in the cache too, as after store_kv)."""

    def __init__(self, cached: list[int], new: list[int], Hq: int, Hkv: int, D: int, dtype, device,
                 rotations: int, gen: torch.Generator, backend: str | None = None, block_size: int = BLOCK_SIZE):
        self.backend = backend
        self.lens = [c + n for c, n in zip(cached, new)]
        self.new = new
        self.Hq, self.Hkv, self.D = Hq, Hkv, D
        blocks = [_cdiv(L, block_size) for L in self.lens]
        per_set = sum(blocks)
        num_blocks = per_set * rotations
        self.k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen, device=device).to(dtype)
        self.v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen, device=device).to(dtype)
        perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
        S, width = len(self.lens), max(blocks)
        T = sum(new)
        self.sets = []
        for r in range(rotations):
            tables = torch.zeros(S, width, dtype=torch.int32, device=device)
            start = r * per_set
            for s, n in enumerate(blocks):
                tables[s, :n] = perm[start:start + n]
                start += n
            # q as the model has it: a view of the fused qkv projection's output
            qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen, device=device).to(dtype)
            self.sets.append(dict(q=qkv[:, :Hq * D].view(T, Hq, D), block_tables=tables,
                                  out=torch.empty(T, Hq, D, dtype=dtype, device=device)))
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32, device=device)
        starts = [0]
        for n in new:
            starts.append(starts[-1] + n)
        self.query_start = torch.tensor(starts, dtype=torch.int32, device=device)
        self.max_query_len, self.max_seq_len = max(new), max(self.lens)
        self.scale = D ** -0.5

    def call(self, i: int):
        st = self.sets[i]
        return lambda: ops.paged_attention(st["q"], self.k_cache, self.v_cache, st["block_tables"], self.seq_lens,
                                           self.query_start, max_query_len=self.max_query_len,
                                           max_seq_len=self.max_seq_len, scale=self.scale, out=st["out"],
                                           backend=self.backend)

    def kv_bytes_read(self) -> int:
        """K and V of every context token, once (what attention must read at least)."""
        return sum(self.lens) * self.Hkv * self.D * 2 * self.k_cache.element_size()

    def contiguous(self, i: int):
        """(q [S, Hq, n, D], k, v [S, Hkv, L, D]) of set i for SDPA (equal lengths only)."""
        st = self.sets[i]
        S, L, n = len(self.lens), self.lens[0], self.new[0]
        k = self.k_cache[st["block_tables"].long()].reshape(S, -1, self.Hkv, self.D)[:, :L].transpose(1, 2)
        v = self.v_cache[st["block_tables"].long()].reshape(S, -1, self.Hkv, self.D)[:, :L].transpose(1, 2)
        q = st["q"].reshape(S, n, self.Hq, self.D).transpose(1, 2)
        return q.contiguous(), k.contiguous(), v.contiguous()

    def check(self, i: int = 0) -> float:
        """Max abs difference between the op's output (already computed into set i's out) and the reference."""
        st = self.sets[i]
        ref = ops.paged_attention(st["q"], self.k_cache, self.v_cache, st["block_tables"], self.seq_lens,
                                  self.query_start, max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
                                  scale=self.scale, backend="reference")
        return (st["out"].float() - ref.float()).abs().max().item()


def sdpa_plain(q, k, v, scale: float, causal: bool) -> torch.Tensor:
    """fp32 SDPA on any device (the smoke run's check of the contiguous layout)."""
    k, v = (t.float().repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    return F.scaled_dot_product_attention(q.float(), k, v, is_causal=causal, scale=scale)


def _vs_sdpa(p: "Paged", sdpa_out: torch.Tensor) -> float:
    """Max abs difference between set 0's output and SDPA's [S, Hq, n, D] output."""
    S, n = len(p.lens), p.new[0]
    return (sdpa_out.float().transpose(1, 2).reshape(S * n, p.Hq, p.D) - p.sets[0]["out"].float()).abs().max().item()


def sdpa_flash(q, k, v, scale: float, causal: bool):
    """torch SDPA, flash backend when it takes the shapes (GQA via enable_gqa); returns (fn, backend name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gqa = q.shape[1] != k.shape[1]
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        try:
            fn()
        except RuntimeError:
            continue
        return fn, backend.name.lower()
    raise RuntimeError("no fused SDPA backend takes these shapes")


def _dtype(device: torch.device) -> torch.dtype:
    # bf16 on the GPU; the CPU smoke run takes fp16 (the interpreter has no bf16 tl.dot)
    return torch.bfloat16 if device.type == "cuda" else torch.float16


def _backend(smoke: bool) -> str | None:
    # the smoke run goes through the kernels wherever Triton can run them (the GPU, or the interpreter)
    return "triton" if smoke and ops.triton_interpreted() else None


def _time(fns, graph: bool = False) -> float:
    from bench_lora_ops import graphed, time_us
    return time_us([graphed(f) for f in fns] if graph else fns)


def bench_decode(name: str, heads, batch: int, ctx: int, copy_gbs: float | None, gen, device, smoke: bool) -> dict:
    Hq, Hkv, D = heads
    kv_per_set = batch * ctx * Hkv * D * 2 * 2
    rot = 1 if smoke else _rotations(kv_per_set)
    p = Paged([ctx - 1] * batch, [1] * batch, Hq, Hkv, D, _dtype(device), device, rot, gen, _backend(smoke))
    splits, _ = ak.plan_decode(batch, Hkv, ctx, 0, device, ak.decode_config(D, _dtype(device)))
    fns = [p.call(i) for i in range(rot)]
    fns[0]()
    row = dict(kind="decode", model=name, Hq=Hq, Hkv=Hkv, D=D, batch=batch, context=ctx, splits=splits,
               rotations=rot, kv_bytes=p.kv_bytes_read(), max_abs_err=p.check(0))
    if smoke:
        row["max_abs_diff_vs_sdpa"] = _vs_sdpa(p, sdpa_plain(*p.contiguous(0), p.scale, causal=False))
        return row
    row["graph_us"] = _time(fns, graph=True)
    row["eager_us"] = _time(fns)
    row["floor_us"] = row["kv_bytes"] / copy_gbs / 1e3
    row["gbs"] = row["kv_bytes"] / row["graph_us"] / 1e3
    row["frac_copy_bw"] = row["gbs"] / copy_gbs
    q, k, v = p.contiguous(0)
    try:
        fn, backend = sdpa_flash(q, k, v, p.scale, causal=False)
        row["sdpa_backend"], row["sdpa_us"] = backend, _time([fn])
        row["max_abs_diff_vs_sdpa"] = _vs_sdpa(p, fn())
    except RuntimeError as exc:  # pragma: no cover - depends on the torch build
        row["sdpa_backend"] = f"none ({exc})"
    return row


def bench_prefill(name: str, heads, gen, device, smoke: bool) -> dict:
    Hq, Hkv, D = heads
    S, L = (2, 64) if smoke else PREFILL
    p = Paged([0] * S, [L] * S, Hq, Hkv, D, _dtype(device), device, 1 if smoke else 2, gen, _backend(smoke))
    fns = [p.call(i) for i in range(len(p.sets))]
    fns[0]()
    flops = 4 * S * Hq * D * (L * (L + 1) // 2)  # QKᵀ and PV over the causal half, 2 flops per MAC
    row = dict(kind="prefill", model=name, Hq=Hq, Hkv=Hkv, D=D, batch=S, new_tokens=L, context=L, flops=flops,
               max_abs_err=p.check(0))
    if smoke:
        row["max_abs_diff_vs_sdpa"] = _vs_sdpa(p, sdpa_plain(*p.contiguous(0), p.scale, causal=True))
        return row
    row["eager_us"] = _time(fns)
    row["tflops"] = flops / row["eager_us"] / 1e6
    fn, backend = sdpa_flash(*p.contiguous(0), p.scale, causal=True)
    row["max_abs_diff_vs_sdpa"] = _vs_sdpa(p, fn())
    row["sdpa_backend"], row["sdpa_us"] = backend, _time([fn])
    row["sdpa_tflops"] = flops / row["sdpa_us"] / 1e6
    return row


def bench_mixed(name: str, heads, gen, device, smoke: bool) -> dict:
    Hq, Hkv, D = heads
    m = dict(chunk=40, prefix=30, decodes=3, decode_ctx=50) if smoke else MIXED
    cached = [m["prefix"]] + [m["decode_ctx"] - 1] * m["decodes"]
    new = [m["chunk"]] + [1] * m["decodes"]
    p = Paged(cached, new, Hq, Hkv, D, _dtype(device), device, 1 if smoke else 4, gen, _backend(smoke))
    fns = [p.call(i) for i in range(len(p.sets))]
    fns[0]()
    row = dict(kind="mixed", model=name, Hq=Hq, Hkv=Hkv, D=D, batch=len(new), new_tokens=sum(new),
               context=max(p.lens), kv_bytes=p.kv_bytes_read(), max_abs_err=p.check(0), **m)
    if not smoke:
        row["eager_us"] = _time(fns)
    return row


def markdown(env: dict, rows: list[dict]) -> str:
    lines = [f"# Paged attention, {env['device']} ({env['dtype']}, torch {env['torch']}, triton {env['triton']})", ""]
    if env.get("copy_gbs"):
        lines += [f"Copy bandwidth (read + write): {env['copy_gbs']:.0f} GB/s. Block size {BLOCK_SIZE}.", ""]
    lines += ["## Decode (one row per sequence; graph replay)", "",
              "| model | batch | context | splits | time µs | eager µs | floor µs | K/V GB/s | % of copy bw "
              "| SDPA µs (backend) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "decode":
            lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['splits']} | {_f(r, 'graph_us')} | "
                         f"{_f(r, 'eager_us')} | {_f(r, 'floor_us')} | {_f(r, 'gbs', 0)} | "
                         f"{_f(r, 'frac_copy_bw', 0, 100)} | {_f(r, 'sdpa_us')} ({r.get('sdpa_backend', '-')}) |")
    lines += ["", "## Prefill (causal, eager)", "",
              "| model | seqs × tokens | time µs | TFLOP/s | SDPA µs | SDPA TFLOP/s (backend) | max abs diff vs SDPA |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "prefill":
            lines.append(f"| {r['model']} | {r['batch']} × {r['new_tokens']} | {_f(r, 'eager_us')} | "
                         f"{_f(r, 'tflops')} | "
                         f"{_f(r, 'sdpa_us')} | {_f(r, 'sdpa_tflops')} ({r.get('sdpa_backend', '-')}) | "
                         f"{_f(r, 'max_abs_diff_vs_sdpa', 4)} |")
    lines += ["", "## Mixed step (eager)", "", "| model | rows | sequences | time µs | K/V MB |",
              "|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "mixed":
            lines.append(f"| {r['model']} | {r['new_tokens']} ({r['chunk']}-row chunk over {r['prefix']} + "
                         f"{r['decodes']} decodes at {r['decode_ctx']}) | {r['batch']} | {_f(r, 'eager_us')} | "
                         f"{r['kv_bytes'] / 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def _f(row: dict, key: str, digits: int = 1, mult: float = 1.0) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value * mult:.{digits}f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--md", type=Path, help="write a markdown table here")
    p.add_argument("--models", default=",".join(HEAD_SHAPES))
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, no timing: checks the set-up against the reference on any device "
                        "(on the CPU, run with TRITON_INTERPRET=1 to go through the kernels)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("bench_attention needs a CUDA GPU (or --smoke)")
    gen = torch.Generator(device=device).manual_seed(0)
    env = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(), torch=torch.__version__,
               triton=getattr(sys.modules.get("triton"), "__version__", "?"),
               dtype="bfloat16" if device.type == "cuda" else "float16",
               block_size=BLOCK_SIZE, backend=ops.resolve_backend(None, device), settings=envs.snapshot())
    copy_gbs = None
    if not args.smoke:
        from bench_lora_ops import copy_bandwidth_gbs
        copy_gbs = env["copy_gbs"] = copy_bandwidth_gbs()
        print(f"# {env['device']}  copy {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    for name in args.models.split(","):
        heads = HEAD_SHAPES[name] if not args.smoke else (HEAD_SHAPES[name][0] // 8, HEAD_SHAPES[name][1] // 8, 32)
        for ctx in (DECODE_CONTEXTS if not args.smoke else [40]):
            for batch in (DECODE_BATCHES if not args.smoke else [1, 3]):
                rows.append(bench_decode(name, heads, batch, ctx, copy_gbs, gen, device, args.smoke))
                print(json.dumps(rows[-1]), flush=True)
                torch.cuda.empty_cache() if device.type == "cuda" else None
        rows.append(bench_prefill(name, heads, gen, device, args.smoke))
        print(json.dumps(rows[-1]), flush=True)
        rows.append(bench_mixed(name, heads, gen, device, args.smoke))
        print(json.dumps(rows[-1]), flush=True)
    bad = [r for r in rows if not r["max_abs_err"] <= 0.05]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(markdown(env, rows))
    if bad:  # NaN compares false, so it lands here too
        raise SystemExit(f"{len(bad)} cases disagree with the reference: {bad[0]}")


if __name__ == "__main__":
    main()
