"""The `loraplex` command line: `serve` (the OpenAI-compatible server), `generate` (prompts in, text out),
`convert` (pack adapters into one file) and `op-demo` (the batched LoRA op on this machine); the commands
themselves are in cli_commands.py.

The engine and server flags are built from the fields of `EngineConfig` and `ServerSettings` (their
metadata holds each one's help and group; see cli_flags.py), so a new setting is a new flag.
Heavy imports (torch, the server) happen inside the commands: `loraplex --help` stays fast.
"""
from __future__ import annotations

import argparse
import sys

from loraplex.cli_commands import (
    CommandError,
    _bench_cmd,
    _parse_adapter,
    convert_cmd,
    generate_cmd,
    op_demo,
    serve_cmd,
)
from loraplex.cli_flags import (
    GROUPS,
    REPEATED,
    HelpFormatter,
    add_dataclass_flags,
    add_lora_flag,
    argument_groups,
    count_advanced,
)

_PRESETS_NOTE = """\
--model takes a Hugging Face model folder, or dummy:<preset> for random weights of a published
shape (nothing to download; for benchmarks; --dummy-layers N builds fewer layers).
Presets: {presets}."""


class _Formatter(HelpFormatter):
    """Fills in the preset names only when help is printed: listing them imports torch."""

    def _format_text(self, text: str) -> str:
        if "{presets}" in text:
            from loraplex.models.presets import PRESETS
            text = text.replace("{presets}", ", ".join(sorted(PRESETS)))
        return super()._format_text(text)


class _DeprecatedAlias(argparse.Action):
    """An old name of a flag (convert's --base, now --model): stores the value, with a warning."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is deprecated; use --{self.dest}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _help_all(parser: argparse.ArgumentParser, show_all: bool, hidden: int) -> None:
    """--help-all: the help with the tuning flags that --help leaves out."""
    parser.add_argument("--help-all", action="help",
                        help="Show this help with every flag" + ("." if show_all else f" ({hidden} more)."))


def _serve_parser(sub, show_all: bool = False) -> None:
    from loraplex.config import EngineConfig
    from loraplex.server.settings import ServerSettings

    serve = sub.add_parser("serve", help="serve a model and its adapters over an OpenAI-compatible HTTP API",
                           usage="loraplex serve [--model DIR] [--lora NAME=DIR ...] [--packed FILE ...] [options]",
                           description="Serve a base model and many LoRA adapters over an OpenAI-compatible "
                                       "HTTP API;\nevery adapter is a model a client can name.",
                           epilog=_PRESETS_NOTE, formatter_class=_Formatter, allow_abbrev=False)
    _help_all(serve, show_all, count_advanced(EngineConfig, ServerSettings))
    groups = argument_groups(serve, GROUPS)
    flags = add_dataclass_flags(serve, groups, EngineConfig, "engine", optional=("model",), show_all=show_all)
    flags |= add_dataclass_flags(serve, groups, ServerSettings, "server", show_all=show_all)
    add_lora_flag(groups["adapters"], "Serve the PEFT adapter folder DIR as model NAME.")
    groups["adapters"].add_argument("--packed", action="extend", nargs="+", metavar="FILE",
                                    help="Serve every adapter of a packed file (see loraplex convert)." + REPEATED)
    cluster = serve.add_argument_group("replicas (Ray Serve: pip install 'loraplex[cluster]')")
    cluster.add_argument("--replicas", type=int, metavar="N",
                         help="Serve N engine replicas, one per GPU; default: 1.")
    cluster.add_argument("--ray-address", metavar="ADDR",
                         help="The Ray cluster to join; default: local or new.")
    cluster.add_argument("--router-queue", type=int, metavar="N",
                         help="Requests waiting for room before 429; default: 64.")
    cluster.add_argument("--routing-policy", choices=("consolidate", "least_loaded", "round_robin"), metavar="NAME",
                         help="consolidate (default), least_loaded, round_robin.")
    serve.set_defaults(func=serve_cmd, flag_names=flags)


def _generate_parser(sub, show_all: bool = False) -> None:
    from loraplex.config import EngineConfig

    gen = sub.add_parser("generate", help="complete prompts offline (no server) and print the text",
                         usage="loraplex generate PROMPT [PROMPT ...] [--adapter NAME[=WEIGHT] ...] [--model DIR] "
                               "[--lora NAME=DIR ...] [options]",
                         description="Complete each PROMPT with the engine (no server) and print the text;\n"
                                     "several prompts run as one batch.",
                         epilog=_PRESETS_NOTE, formatter_class=_Formatter, allow_abbrev=False)
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="A prompt (text); several run as one batch.")
    _help_all(gen, show_all, count_advanced(EngineConfig))
    sampling = gen.add_argument_group("generation")
    sampling.add_argument("--max-tokens", type=int, default=64, metavar="N",
                          help="Most tokens to generate per prompt; default: 64.")
    sampling.add_argument("--temperature", type=float, default=0.0, metavar="NUM",
                          help="Sampling temperature, 0 for greedy; default: 0.")
    sampling.add_argument("--top-p", type=float, metavar="NUM",
                          help="Sample from the fewest tokens whose probabilities add up to this, in (0, 1]; "
                               "default: 1 (off).")
    sampling.add_argument("--top-k", type=int, metavar="N", help="Sample from the N most likely tokens; default: off.")
    sampling.add_argument("--seed", type=int, metavar="N",
                          help="Sampling seed of the prompts: the same seed gives the same text; default: "
                               "--engine-seed's generator.")
    sampling.add_argument("--stop", action="append", metavar="TEXT",
                          help="End the text before this string. Repeat the flag for more.")
    sampling.add_argument("--ignore-eos", action="store_true", help="Keep generating past the end-of-text token.")
    sampling.add_argument("--stream", action="store_true", help="Print the text as it is made (one prompt only).")
    groups = argument_groups(gen, [g for g in GROUPS if g != "server"])
    # --seed is the requests' sampling seed here; the engine's seed (dummy weights) moves to --engine-seed
    flags = add_dataclass_flags(gen, groups, EngineConfig, "engine", rename={"seed": "engine_seed"},
                                optional=("model",), show_all=show_all)
    add_lora_flag(groups["adapters"], "Load the PEFT adapter folder DIR as NAME.", before_positionals=True)
    groups["adapters"].add_argument("--adapter", action="append", type=_parse_adapter, metavar="NAME[=WEIGHT]",
                                    help="The --lora adapter every prompt runs with; default: none (the base model). "
                                         "Repeat it to combine up to 4 adapters, each LoRA scaled by its WEIGHT "
                                         "(default 1): --adapter sql=0.7 --adapter formal=0.3."),
    gen.set_defaults(func=generate_cmd, flag_names=flags)


def _bench_parser(sub) -> None:
    from loraplex.bench.flags import add_arguments

    bench = sub.add_parser("bench", help="offline text-generation benchmark: loraplex against transformers + PEFT",
                           description="Run the same requests through loraplex, its backbone and transformers "
                                       "(+ PEFT);\nwrite JSON, a markdown table and bar charts.",
                           formatter_class=_Formatter)
    add_arguments(bench)
    bench.set_defaults(func=_bench_cmd)


def build_parser(show_all: bool = False) -> argparse.ArgumentParser:
    """The `loraplex` command line; `show_all`: the help lists the tuning flags too (--help-all)."""
    from loraplex import __version__
    from loraplex.demo.demo_command import add_demo_parser

    parser = argparse.ArgumentParser(prog="loraplex", description="Serve many LoRA adapters of one model.")
    parser.add_argument("--version", action="version", version=f"loraplex {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    _serve_parser(sub, show_all)
    _generate_parser(sub, show_all)
    add_demo_parser(sub)
    _bench_parser(sub)
    conv = sub.add_parser("convert", help="validate PEFT adapters and pack them into one safetensors file",
                          usage="loraplex convert --model DIR (--lora NAME=DIR ... | --lora-dir DIR ...) --out DIR "
                                "[options]", formatter_class=HelpFormatter, allow_abbrev=False)
    conv.add_argument("--model", metavar="DIR", help="The base model's folder (its config.json is read).")
    conv.add_argument("--base", dest="model", action=_DeprecatedAlias, help=argparse.SUPPRESS)
    add_lora_flag(conv, "Pack the PEFT adapter folder DIR as NAME.")
    conv.add_argument("--lora-dir", action="extend", nargs="+", metavar="DIR",
                      help="Pack every subfolder of DIR that is a PEFT adapter, named after the subfolder."
                           + REPEATED)
    conv.add_argument("--out", required=True, metavar="DIR",
                      help="Output folder; adapters.safetensors is written there.")
    conv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                      help="Stored precision; auto keeps the sources' (float32 when they differ).")
    conv.add_argument("--quiet", action="store_true", help="No progress bar or listing.")
    conv.set_defaults(func=convert_cmd)
    demo = sub.add_parser("op-demo", help="run the batched multi-LoRA op on a random mixed batch (the kernel "
                                          "alone; `demo` runs the model)")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    show_all = "--help-all" in (sys.argv[1:] if argv is None else argv)
    args = build_parser(show_all).parse_args(argv)
    try:
        return args.func(args)
    except CommandError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # Ctrl-C: no traceback (the LLM's exit has aborted its requests)
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
