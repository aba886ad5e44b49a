"""Settings read from the environment that switch a behaviour on, off, or to a named variant."""
from __future__ import annotations

import os

_ON = ("", "1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def env_switch(name: str, default: str, on: str, off: str, others: tuple[str, ...] = ()) -> str:
    """The environment variable `name` (unset: `default`) as `on` (also 1, true, yes, on or empty), `off` (also
    0, false, no, off) or one of `others`, case and surrounding blanks ignored; any other value is a ValueError
    that names the variable, the value and the choices."""
    raw = os.environ.get(name, default)
    value = raw.strip().lower()
    if value in _ON or value == on:
        return on
    if value in _OFF or value == off:
        return off
    if value in others:
        return value
    choices = ", ".join((f"{on} (or 1)", *others))
    raise ValueError(f"{name}={raw!r}: expected {choices}, or {off} (or 0)")
