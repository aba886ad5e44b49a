"""Command-line flags built from a dataclass's fields: each field's metadata holds its help text and
its --help group, its type gives the flag's type, and a flag the user leaves out stores nothing, so
the dataclass's own default rules. A new setting is a new flag with nothing to add by hand.
"""
from __future__ import annotations

import argparse
import dataclasses
import textwrap
import types
import typing
from pathlib import Path

# --help sections, in this order; each dataclass field's metadata names one of them.
GROUPS = ("model", "batching", "memory", "adapters", "execution", "server")

# Metavars that read better than the type's; every other flag gets one from its type.
_METAVARS = {"model": "DIR|dummy:PRESET", "tokenizer": "DIR", "device": "DEVICE", "host": "ADDR",
             "api_key": "KEY", "admin_api_key": "KEY", "adapter_roots": "DIR", "served_model_name": "NAME"}
_TYPE_METAVARS = {int: "N", float: "NUM", str: "STR", Path: "PATH"}

class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Flag and help on one line where they fit, and lines never broken inside a flag's name (--api-key)."""

    def __init__(self, prog: str, **kwargs) -> None:
        kwargs.setdefault("max_help_position", 28)
        super().__init__(prog, **kwargs)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


# Every flag that takes several values (--lora, --adapter-root, ...) takes them both ways:
# `--lora a=X --lora b=Y` and `--lora a=X b=Y` (argparse's "extend" with nargs="+").
REPEATED = " Repeat the flag or list several."


def parse_lora(value: str) -> tuple[str, str]:
    """A --lora value: NAME=DIR."""
    name, sep, folder = value.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {value!r}")
    return name, folder


def add_lora_flag(group, help: str, *, before_positionals: bool = False) -> None:
    """--lora NAME=DIR, the same grammar in every command. `before_positionals`: the command also takes
    positional arguments, which a space-separated --lora list would swallow; its error says so."""
    parse = parse_lora
    if before_positionals:
        def parse(value: str) -> tuple[str, str]:
            try:
                return parse_lora(value)
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"{e}; to give a prompt after --lora values, put -- before "
                                                 f"it, or put the prompts first") from None
    group.add_argument("--lora", action="extend", nargs="+", type=parse, metavar="NAME=DIR", help=help + REPEATED)


@dataclasses.dataclass(frozen=True)
class _FlagSpec:
    """What argparse needs for one dataclass field."""
    kind: type            # int, float, str, bool, Path: the value type after None is dropped
    repeated: bool        # a list field: the flag is given once per element


def _flag_spec(hint) -> _FlagSpec:
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        return _FlagSpec(item, True)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        # `str | Path` takes the text as given: the dataclass keeps (and checks) what the user wrote.
        kind = str if str in args else args[0] if len(args) == 1 else None
        if kind is None:
            raise TypeError(f"no command-line type for {hint}")
        return _FlagSpec(kind, False)
    return _FlagSpec(hint, False)


def _flag_name(name: str, repeated: bool) -> str:
    # a list field is given once per element, so its flag is singular: adapter_roots → --adapter-root
    if repeated and name.endswith("s"):
        name = name[:-1]
    return "--" + name.replace("_", "-")


def add_dataclass_flags(parser: argparse.ArgumentParser, groups: dict[str, argparse._ArgumentGroup], cls: type,
                        prefix: str, rename: dict[str, str] | None = None,
                        optional: tuple[str, ...] = (), show_all: bool = True) -> dict[str, str]:
    """One flag per field of dataclass `cls`, in the group its metadata names, stored as `prefix.field`.

    Nothing is stored for a flag the user leaves out, so the dataclass's own default rules; the help
    shows that default. `rename` gives a field another flag (where a command's own flag has its name).
    Fields in `optional` are optional flags even without a default (the command fills them in).
    Fields whose metadata says "advanced" (tuning knobs) are left out of the help unless `show_all`
    (`--help-all`); their flags work either way.
    Returns `Cls.field` → flag, to point error messages at the flag.
    """
    hints = typing.get_type_hints(cls)
    flags = {}
    for f in dataclasses.fields(cls):
        text, group = f.metadata.get("help"), f.metadata.get("group")
        if not text or group not in groups:
            raise TypeError(f"{cls.__name__}.{f.name} needs metadata with a 'help' and a 'group' of {sorted(groups)}")
        spec = _flag_spec(hints[f.name])
        flag = _flag_name((rename or {}).get(f.name, f.name), spec.repeated)
        required = (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                    and f.name not in optional)
        if not required and f.default is not None and f.default is not dataclasses.MISSING and spec.kind is not bool:
            text = f"{text.rstrip('.')}; default: {f.default}."
        hidden = f.metadata.get("advanced", False) and not show_all
        kwargs: dict = {"dest": f"{prefix}.{f.name}", "default": argparse.SUPPRESS, "required": required,
                        "help": text.replace("%", "%%")}
        if spec.kind is bool:
            kwargs["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
        else:
            kwargs["type"] = spec.kind
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            else:
                kwargs["metavar"] = _METAVARS.get(f.name, _TYPE_METAVARS.get(spec.kind, "VALUE"))
            if spec.repeated:
                kwargs["action"], kwargs["nargs"] = "extend", "+"
                kwargs["help"] += REPEATED
        if hidden:
            kwargs["help"] = argparse.SUPPRESS
        groups[group].add_argument(flag, **kwargs)
        flags[f"{cls.__name__}.{f.name}"] = flag
    return flags


def count_advanced(*classes: type) -> int:
    """How many flags `--help` leaves out (see add_dataclass_flags)."""
    return sum(bool(f.metadata.get("advanced")) for cls in classes for f in dataclasses.fields(cls))


def given(args: argparse.Namespace, prefix: str) -> dict:
    """The `prefix.field` values the user gave, keyed by field."""
    return {k[len(prefix) + 1:]: v for k, v in vars(args).items() if k.startswith(prefix + ".")}


def argument_groups(parser: argparse.ArgumentParser, names: typing.Iterable[str]) -> dict[str, argparse._ArgumentGroup]:
    return {name: parser.add_argument_group(name) for name in names}
