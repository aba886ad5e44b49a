"""The commands of `loraplex` (cli.py builds their parsers): `serve`, `generate`, `convert`, `op-demo`
and `bench`, with what serve and generate share: the --lora adapters, the demo model when no --model is
given, and CommandError, the refused command line that `main` prints without a traceback.
Heavy imports (torch, the server) happen inside the commands: `loraplex --help` stays fast.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
import typing
from pathlib import Path

from loraplex.cli_flags import given

if typing.TYPE_CHECKING:
    from loraplex import LLM, SamplingParams
    from loraplex.adapters.composition import Composition


class CommandError(Exception):
    """A refused command line: `main` prints `error: <message>` and returns 2, with no traceback."""


@contextlib.contextmanager
def refused(flags: dict[str, str] | None = None):
    """A setting, adapter or model the library refuses (ValueError, AdapterError, OSError) becomes a
    CommandError; when the message names a dataclass field (`EngineConfig.port`), the flag is added."""
    try:
        yield
    except (ValueError, OSError) as e:
        text = str(e)
        for name, flag in (flags or {}).items():
            if re.search(rf"\b{re.escape(name)}\b", text) and flag not in text:
                text += f" [{flag}]"
                break
        raise CommandError(text) from e


def _adapters(args: argparse.Namespace) -> dict[str, Path]:
    """The --lora NAME=DIR pairs as a dict."""
    adapters: dict[str, Path] = {}
    for name, folder in args.lora or []:
        if name in adapters:
            raise CommandError(f"--lora {name}: the name is given twice")
        if not Path(folder).is_dir():
            raise CommandError(f"--lora {name}={folder}: {folder} is not a folder")
        adapters[name] = Path(folder)
    return adapters


DEMO_MODEL_NAME = "loraplex-demo"   # the API name of the shipped demo model, however it is given


def _with_demo(engine_settings: dict, adapters: dict[str, Path]) -> tuple[dict, dict[str, Path]]:
    """No --model: the demo model shipped with loraplex, with its adapters beside any --lora given.
    (Its dtype follows EngineConfig's rule, as any model's: float32 on the CPU.)"""
    if "model" in engine_settings:
        return engine_settings, adapters
    from loraplex.demo.assets import DemoModelMissing, demo_adapters, demo_model_dir
    try:
        model, shipped = demo_model_dir(), demo_adapters()
    except DemoModelMissing as e:
        raise CommandError(f"no --model given, and {e}") from e
    print(f"no --model given: the demo model ({model}) with adapters {', '.join(shipped)}", file=sys.stderr)
    return dict(engine_settings, model=str(model)), {**shipped, **adapters}


def _is_demo_model(model: str | Path) -> bool:
    """Whether `model` is the folder of the demo model shipped with loraplex."""
    from loraplex.demo.assets import DATA_DIR
    try:
        return Path(model).resolve() == (DATA_DIR / "model").resolve()
    except (OSError, ValueError):   # not a path at all (dummy:<preset>, odd characters)
        return False


def serve_cmd(args: argparse.Namespace) -> int:
    """Start the OpenAI-compatible HTTP server; returns its exit status when it stops."""
    from loraplex.config import EngineConfig
    from loraplex.server.settings import ServerSettings

    server_settings = given(args, "server")
    engine_settings, adapters = _with_demo(given(args, "engine"), _adapters(args))
    if _is_demo_model(engine_settings["model"]):   # the same name with or without --model
        server_settings.setdefault("served_model_name", DEMO_MODEL_NAME)
    with refused(args.flag_names):
        config = EngineConfig(**engine_settings)
        settings = ServerSettings(**server_settings)
    packed = [Path(p) for p in args.packed or []]
    for path in packed:
        if not path.exists():
            raise CommandError(f"--packed {path}: no such file or folder")
    if args.replicas is not None:   # several engines under Ray Serve (loraplex/cluster); Ray is imported only then
        from loraplex.cluster.command import serve_replicas
        with refused():
            return serve_replicas(args, engine_settings, server_settings, adapters, packed)
    if any(flag is not None for flag in (args.ray_address, args.router_queue, args.routing_policy)):
        raise CommandError("--ray-address, --router-queue and --routing-policy go with --replicas N")
    try:
        from loraplex.server.serve import run_server
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("loraplex"):
            print(f"error: loraplex serve needs the server's packages (fastapi, uvicorn): {e}", file=sys.stderr)
            return 1
        raise
    return run_server(config, settings, adapters=adapters, packed=packed)


def _sampling_settings(args: argparse.Namespace) -> dict:
    settings = {"max_tokens": args.max_tokens, "temperature": args.temperature, "ignore_eos": args.ignore_eos}
    for name in ("top_p", "top_k", "seed", "stop"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    return settings


def generate_cmd(args: argparse.Namespace) -> int:
    """Run the prompts through the engine (offline, no server) and print the completions."""
    from loraplex import LLM, SamplingParams
    from loraplex.config import EngineConfig

    if args.stream and len(args.prompts) > 1:
        raise CommandError("--stream takes one prompt")
    with refused():
        params = SamplingParams(**_sampling_settings(args))
    engine_settings, adapters = _with_demo(given(args, "engine"), _adapters(args))
    adapter = _generate_adapter(args.adapter or [], adapters)
    with refused(args.flag_names):   # checked before the model loads: a bad setting costs no time
        config = EngineConfig(**engine_settings)
    if config.is_dummy and config.tokenizer is None:
        raise CommandError(f"--model {config.model}: dummy models have no tokenizer; give --tokenizer DIR "
                           f"for text prompts")
    with refused(args.flag_names):   # the model folder, the adapters (AdapterError is a ValueError)
        llm = LLM(engine_settings.pop("model"), adapters=adapters, **engine_settings)
    with llm, refused():             # a prompt the engine refuses: too long, ...
        if args.stream:
            return _stream(llm, args.prompts[0], params, adapter)
        outputs = llm.generate(args.prompts, params, adapter=adapter)
    status = 0
    for i, (prompt, out) in enumerate(zip(args.prompts, outputs)):
        if len(args.prompts) > 1:
            if i:
                print()
            print(f"==> prompt {i + 1}: {prompt!r:.70} <==")
        print(out.text)
        if out.finish_reason == "error":
            print(f"error: prompt {i + 1}: {out.error}", file=sys.stderr)
            status = 1
    return status


def _parse_adapter(value: str) -> tuple[str, float]:
    """An --adapter value of generate: NAME (weight 1) or NAME=WEIGHT."""
    name, sep, weight = value.partition("=")
    try:
        if not name or (sep and not weight):
            raise ValueError
        return name, float(weight) if sep else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME or NAME=WEIGHT, got {value!r}") from None


def _generate_adapter(pairs: list[tuple[str, float]], adapters: dict[str, Path]) -> str | Composition | None:
    """The adapter every prompt of generate runs with, from its --adapter values: None (the base model), a name
    (one adapter at weight 1), or a composition of up to 4 weighted adapters; each must be a --lora name."""
    from loraplex.adapters.composition import Composition

    for name, _ in pairs:
        if name not in adapters:
            raise CommandError(f"--adapter {name}: not among the --lora names ({', '.join(adapters) or 'none given'})")
    with refused():   # a name given twice, more than 4 adapters, a weight that is not finite
        composition = Composition.from_pairs(pairs, "--adapter")
    return None if composition is None else composition.single or composition


def _stream(llm: LLM, prompt: str, params: SamplingParams, adapter: str | Composition | None) -> int:
    """Print the text of one request as the engine makes it."""
    engine = llm.engine
    engine.add_request("cli-stream", prompt, params, adapter)
    last = None
    while engine.has_unfinished():
        outputs = engine.step()
        for out in outputs:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            last = out
        if engine.last_step is None and not outputs:
            time.sleep(0.0005)   # nothing could run: waiting on an adapter load
    print()
    if last is not None and last.finish_reason == "error":
        print(f"error: {last.error}", file=sys.stderr)
        return 1
    return 0


def op_demo(args: argparse.Namespace) -> int:
    """Serve a mixed batch of requests, each with its own adapter, in one add_lora call."""
    import numpy as np
    import torch

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
    print("  per request (tokens:slot): " + " ".join(f"{n}:{s}" for n, s in zip(seg_lens, slots)))
    print(f"  add_lora: {ms:.3f} ms per call; error vs a float64 loop, relative to the LoRA delta: {err:.1e}")
    return 0 if err < 2e-2 else 1


def convert_cmd(args: argparse.Namespace) -> int:
    """Validate PEFT adapter folders against a base model and pack them into one safetensors file."""
    from pathlib import Path

    from loraplex.adapters import AdapterError, PackedFile, convert
    from loraplex.adapters.packed import DTYPES
    from loraplex.models import ModelConfig

    if args.model is None:
        print("error: give the base model: --model DIR (its config.json is read)", file=sys.stderr)
        return 2
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
        model = ModelConfig.from_pretrained(args.model)
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


def _bench_cmd(args: argparse.Namespace) -> int:
    from loraplex.bench.textgen import run
    return run(args)
