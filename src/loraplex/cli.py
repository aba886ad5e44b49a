"""The `loraplex` command: `op-demo` (the batched LoRA op on this machine), `convert` (pack adapters)."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch


def op_demo(args: argparse.Namespace) -> int:
    """Serve a mixed batch of requests, each with its own adapter, in one add_lora call."""
    from loraplex import ops
    from loraplex.workloads import popularity_slots

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    K = N = args.hidden
    seg_lens = [int(v) for v in rng.integers(1, args.max_len + 1, size=args.requests)]
    slots = popularity_slots(args.popularity, args.requests, rng)
    slots = [s % args.adapters for s in slots]
    slots[0] = -1  # one request on the bare base model
    a = (torch.randn(args.adapters, args.rank, K, generator=gen) * K ** -0.5).to(device, dtype)
    b = (torch.randn(args.adapters, N, args.rank, generator=gen) * args.rank ** -0.5).to(device, dtype)
    ranks = torch.full((args.adapters,), args.rank, dtype=torch.int32, device=device)
    scalings = torch.full((args.adapters,), 2.0, device=device)
    x = torch.randn(sum(seg_lens), K, generator=gen).to(device, dtype)
    y = torch.randn(sum(seg_lens), N, generator=gen).to(device, dtype)

    batch = ops.LoraBatch.from_lengths(seg_lens, slots, device)
    backend = ops.resolve_backend(None, device)
    expected = y.double().clone()  # the documented semantics, as a float64 loop over requests
    start = 0
    for n, slot in zip(seg_lens, slots):
        if slot >= 0:
            rows = slice(start, start + n)
            expected[rows] += 2.0 * (x[rows].double() @ a[slot].double().T) @ b[slot].double().T
        start += n
    out = ops.add_lora(y.clone(), x, a, b, batch, ranks, scalings)  # first call compiles
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        ops.add_lora(y.clone(), x, a, b, batch, ranks, scalings)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / args.iters * 1e3
    err = ((out.double() - expected).norm() / (expected - y.double()).norm()).item()
    print(f"loraplex op-demo on {device} ({backend} backend, {str(dtype).replace('torch.', '')})")
    print(f"  {args.requests} requests, {sum(seg_lens)} tokens, {len(set(s for s in slots if s >= 0))} adapters "
          f"of rank {args.rank}, hidden {K}, popularity {args.popularity}")
    print(f"  per request (tokens:slot): " + " ".join(f"{n}:{s}" for n, s in zip(seg_lens, slots)))
    print(f"  add_lora: {ms:.3f} ms per call; error vs a float64 loop, relative to the LoRA delta: {err:.1e}")
    return 0 if err < 2e-2 else 1


def _parse_lora(value: str) -> tuple[str, str]:
    name, sep, folder = value.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {value!r}")
    return name, folder


def convert_cmd(args: argparse.Namespace) -> int:
    """Validate PEFT adapter folders against a base model and pack them into one safetensors file."""
    from pathlib import Path

    from loraplex.adapters import AdapterError, PackedFile, convert
    from loraplex.adapters.packed import DTYPES
    from loraplex.models import ModelConfig

    loras = list(args.lora or [])
    for parent in args.lora_dir or []:
        if not Path(parent).is_dir():
            print(f"error: --lora-dir {parent}: not a folder", file=sys.stderr)
            return 2
        subdirs = sorted(p for p in Path(parent).iterdir() if (p / "adapter_config.json").is_file())
        if not subdirs:
            print(f"error: {parent}: no adapter folders (subfolders with adapter_config.json)", file=sys.stderr)
            return 2
        loras += [(p.name, str(p)) for p in subdirs]
    if not loras:
        print("error: give at least one --lora NAME=DIR or --lora-dir DIR", file=sys.stderr)
        return 2
    try:
        model = ModelConfig.from_pretrained(args.base)
        t0 = time.perf_counter()
        path = convert(model, loras, args.out, dtype=None if args.dtype == "auto" else DTYPES[args.dtype],
                       progress=not args.quiet)
        packed = PackedFile(path, model)
    except (AdapterError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = path.stat().st_size
    print(f"packed {len(packed.specs)} adapters ({str(packed.dtype).replace('torch.', '')}) into {path}: "
          f"{size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s")
    if not args.quiet:
        for spec in packed.specs[:20]:
            print(f"  {spec.describe()}")
        if len(packed.specs) > 20:
            print(f"  … and {len(packed.specs) - 20} more")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraplex", description="Serve many LoRA adapters of one model.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("op-demo", help="run the batched multi-LoRA op on a random mixed batch")
    demo.add_argument("--device", default="auto", help="cuda, cpu or auto (default)")
    demo.add_argument("--requests", type=int, default=12, help="requests (segments) in the batch")
    demo.add_argument("--max-len", type=int, default=16, help="longest request in tokens")
    demo.add_argument("--adapters", type=int, default=6, help="adapter slots in the pool")
    demo.add_argument("--rank", type=int, default=16)
    demo.add_argument("--hidden", type=int, default=1024, help="K = N of the projection")
    demo.add_argument("--popularity", default="zipf", help="distinct, uniform, zipf, identical or skewed")
    demo.add_argument("--iters", type=int, default=10, help="timed calls")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=op_demo)
    conv = sub.add_parser("convert", help="validate PEFT adapters and pack them into one safetensors file")
    conv.add_argument("--base", required=True, help="the base model's folder (its config.json is read)")
    conv.add_argument("--lora", nargs="+", type=_parse_lora, metavar="NAME=DIR", help="PEFT adapter folders")
    conv.add_argument("--lora-dir", nargs="+", metavar="DIR",
                      help="folders whose subfolders are PEFT adapters, each named after its subfolder")
    conv.add_argument("--out", required=True, help="output folder; adapters.safetensors is written there")
    conv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                      help="stored precision; auto keeps the sources' (float32 when they differ)")
    conv.add_argument("--quiet", action="store_true", help="no progress bar or listing")
    conv.set_defaults(func=convert_cmd)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
