"""`loraplex demo`: several streams, each with its own adapter (and one on the base model), generating at once
through one engine in a terminal UI (demo/tui.py), with the engine's batches shown live.

Without --model it runs the demo model that ships with loraplex (demo/assets.py) and its adapters, each
pane with a prompt that shows its adapter off; --model DIR --lora NAME=DIR … runs your own.
When stdout or stderr is not a terminal (a pipe, CI), or with --plain, it prints plain text instead
(demo/streams.py: a line per finished generation, then a summary). --once generates once per stream and
exits, in either mode.
Heavy imports (torch, textual, the engine) happen inside `demo_cmd`: `loraplex --help` stays fast.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraplex import envs
from loraplex.cli_flags import HelpFormatter, add_lora_flag

DEFAULT_PROMPT = "Once upon a time"   # for a model of your own, when --prompt is not given


def _is_terminal() -> bool:
    """Whether the terminal UI can draw: stdout and stderr (where Textual writes) are both terminals."""
    try:
        return sys.stdout.isatty() and sys.stderr.isatty() and not envs.dumb_terminal()
    except (AttributeError, ValueError):   # replaced or closed streams
        return False


def add_demo_parser(subparsers) -> None:
    """Add the `demo` command to the `loraplex` subparsers."""
    demo = subparsers.add_parser(
        "demo", help="watch several adapters generate at once, batched, in a terminal UI",
        description="Several panes, each streaming with its own LoRA adapter (and one with the base model),\n"
                    "all generating at once through one engine, so they share every batch. The status bar\n"
                    "shows tokens/s and each step's batch size and adapters. Keys: q quit, r restart, "
                    "p pause/resume.\nIn a pipe or CI (stdout or stderr not a terminal), or with --plain, it "
                    "prints plain text:\none line per finished generation, then a summary.",
        formatter_class=HelpFormatter, allow_abbrev=False)
    demo.add_argument("--model", metavar="DIR",
                      help="A Hugging Face model folder; default: the small demo model that ships with loraplex "
                           "and its adapters.")
    add_lora_flag(demo, "Add a pane for the PEFT adapter folder DIR, named NAME.")
    demo.add_argument("--prompt", metavar="TEXT",
                      help="The prompt of every pane; default: one per adapter that shows it off (the demo "
                           f"model), or {DEFAULT_PROMPT!r}.")
    demo.add_argument("--max-tokens", type=int, default=128, metavar="N",
                      help="Most tokens per generation; default: 128.")
    demo.add_argument("--temperature", type=float, default=0.8, metavar="NUM",
                      help="Sampling temperature, 0 for greedy; default: 0.8.")
    demo.add_argument("--top-p", type=float, default=0.95, metavar="NUM",
                      help="Nucleus sampling threshold in (0, 1]; default: 0.95.")
    demo.add_argument("--device", metavar="DEVICE",
                      help="cuda, cuda:N or cpu; default: cuda when available, else cpu.")
    demo.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"],
                      help="Precision; default: auto (the checkpoint's on a GPU, float32 on the CPU).")
    demo.add_argument("--once", action="store_true",
                      help="Generate once per pane and exit, instead of starting again after each one.")
    demo.add_argument("--plain", action="store_true",
                      help="Print plain text (a line per finished generation) instead of the terminal UI; "
                           "the default when stdout or stderr is not a terminal.")
    demo.set_defaults(func=demo_cmd)


def _builtin_model():
    """The shipped demo model's folder, adapters and prompts; CommandError if this install lacks them."""
    from loraplex.cli_commands import CommandError
    try:
        from loraplex.demo.assets import demo_adapters, demo_model_dir, demo_prompts
        return demo_model_dir(), demo_adapters(), demo_prompts()
    except (ImportError, OSError) as e:
        raise CommandError(f"the built-in demo model is not available ({e}); give --model DIR "
                           f"[--lora NAME=DIR ...] to run the demo with a model of your own") from e


def _panes(args: argparse.Namespace, adapters: dict[str, Path], prompts: dict[str | None, str]):
    from loraplex.demo.tui import PaneSpec

    def prompt(adapter: str | None) -> str:
        if args.prompt is not None:
            return args.prompt
        return prompts.get(adapter, prompts.get(None, DEFAULT_PROMPT))

    return [PaneSpec("base model", None, prompt(None))] + [PaneSpec(name, name, prompt(name)) for name in adapters]


def demo_cmd(args: argparse.Namespace) -> int:
    """Load the model and adapters into one engine, run the UI until q, then stop the engine."""
    from loraplex.cli_commands import CommandError, _adapters, refused
    from loraplex.sampling import SamplingParams

    with refused():
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    loras = _adapters(args)   # the --lora NAME=DIR pairs, checked as serve and generate check them
    if args.model is None:
        model, adapters, prompts = _builtin_model()
        adapters = {**adapters, **loras}
    else:
        if not Path(args.model).is_dir():
            raise CommandError(f"--model {args.model}: not a folder")
        model, adapters, prompts = Path(args.model), loras, {}
    plain = args.plain or not _is_terminal()
    if not plain:
        try:
            from loraplex.demo.tui import DemoApp
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("loraplex"):
                raise CommandError(f"loraplex demo needs the textual package (pip install textual), or "
                                   f"--plain: {e}") from e
            raise
    from loraplex.config import EngineConfig
    from loraplex.demo.streams import StepMonitor
    from loraplex.engine.async_engine import AsyncEngine

    settings = {k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v is not None}
    with refused():   # a bad setting, model folder or adapter (AdapterError is a ValueError)
        config = EngineConfig.from_kwargs(str(model), **settings)
    print(f"loading {model} and {len(adapters)} adapters on {config.device} ({config.dtype}) …", file=sys.stderr)
    monitor = StepMonitor()
    with refused():
        engine = AsyncEngine(config, adapters, observer=monitor)
    panes = _panes(args, adapters, prompts)
    try:
        if plain:
            import asyncio

            from loraplex.demo.streams import run_plain
            return asyncio.run(run_plain(engine, panes, params, loop_forever=not args.once, monitor=monitor))
        app = DemoApp(engine, panes, params, loop_forever=not args.once, monitor=monitor,
                      exit_when_done=args.once)
        app.run()
    finally:
        engine.shutdown()
    if args.once and app.finished:   # the screen is gone: leave each pane's text behind in plain text
        for i in range(len(panes)):
            print(app.describe(i))
    return app.return_code or 0
