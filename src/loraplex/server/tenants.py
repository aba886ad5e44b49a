"""API keys scoped to tenants (`loraplex serve --api-keys FILE`): who may use which adapters.

The file (JSON; YAML too where PyYAML is installed, by the suffix .yaml / .yml) names each tenant
once, with its keys and what they open; docs/server.md documents it for operators::

    {"tenants": {
        "acme":  {"keys": ["sk-acme-1"], "adapters": ["acme-*", "shared"], "base_model": true},
        "ops":   {"key": "sk-ops", "adapters": ["*"], "manage_adapters": true, "metrics": true}}}

- `keys` (a list) or `key` (one): the bearer keys of this tenant; every key in the file is unique.
- `adapters`: adapter names or glob patterns (`*`, `?`, `[abc]`; fnmatch, case-sensitive) it may
  use; default none. An adapter it may not use is, to it, an adapter that does not exist (404),
  and `/v1/models` lists only what it may use.
- `base_model`: whether it may use the base model (default true).
- `manage_adapters`: whether it may load and remove adapters (`/v1/adapters`,
  `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`), only under names its `adapters` allow
  (default false).
- `metrics`: whether it may read `/metrics` when `--metrics-require-key` is on (default false).

Tenant names label the per-tenant series in /metrics (never the keys): 1-64 characters, letters,
digits and `._-`; "none" and "other" are reserved. Unknown fields are refused, naming them.

`KeyRing` holds the parsed file and reloads it when it changes (checked on each request) or when
asked (`request_reload()`, from the SIGHUP handler; done by the next `check()`); a file that cannot
be read or parsed then is logged and the keys in force stay. Keys are looked up by their SHA-256, so a lookup's time does not depend on how much of a
key matched.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("loraplex.server")

RESERVED_TENANTS = ("none", "other")   # metrics labels: no tenant (--api-key, open), past the cap
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_FIELDS = {"key", "keys", "adapters", "base_model", "manage_adapters", "metrics"}


class KeysFileError(ValueError):
    """The keys file is unreadable or malformed; the message names the file's field at fault."""


@dataclass(frozen=True)
class Access:
    """What one caller may do. `adapters` None: every adapter."""

    tenant: str | None                     # its name in the keys file (None: --api-key, admin key, open)
    adapters: tuple[str, ...] | None = None
    base_model: bool = True
    manage: bool = False
    metrics: bool = False

    def may_use(self, adapter: str) -> bool:
        return self.adapters is None or any(fnmatch.fnmatchcase(adapter, p) for p in self.adapters)

    def may_use_model(self, name: str, base_name: str) -> bool:
        """May it use the API model `name` (the base model's name, or an adapter's)?"""
        return self.base_model if name == base_name else self.may_use(name)


FULL = Access(None, None, True, True, True)            # the admin key, or a server with no keys
USE_ALL = Access(None, None, True, False, True)        # --api-key beside a separate --admin-api-key


def _bool(where: str, value, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise KeysFileError(f"{where} must be true or false, got {value!r:.40}")
    return value


def parse_tenants(data) -> dict[bytes, Access]:
    """The keys file's content → {sha256(key): Access}; KeysFileError naming the field at fault."""
    if not isinstance(data, dict) or set(data) != {"tenants"} or not isinstance(data["tenants"], dict):
        raise KeysFileError('the file must hold one object {"tenants": {NAME: {...}, ...}}')
    by_hash: dict[bytes, Access] = {}
    for name, entry in data["tenants"].items():
        where = f"tenants.{name}"
        if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name) or name in RESERVED_TENANTS:
            raise KeysFileError(f"tenant name {name!r:.70} is not allowed: 1-64 letters, digits and ._- "
                                f"(not 'none' or 'other')")
        if not isinstance(entry, dict):
            raise KeysFileError(f"{where} must be an object")
        unknown = sorted(set(entry) - _FIELDS)
        if unknown:
            raise KeysFileError(f"{where}: unknown field {unknown[0]!r:.40} (known: {', '.join(sorted(_FIELDS))})")
        if ("key" in entry) == ("keys" in entry):
            raise KeysFileError(f"{where} needs 'key' (one) or 'keys' (a list), not both or neither")
        keys = [entry["key"]] if "key" in entry else entry["keys"]
        if not isinstance(keys, list) or not keys:
            raise KeysFileError(f"{where}.keys must be a non-empty list of strings")
        patterns = entry.get("adapters", [])
        if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
            raise KeysFileError(f"{where}.adapters must be a list of adapter names or glob patterns")
        access = Access(name, tuple(patterns), _bool(f"{where}.base_model", entry.get("base_model"), True),
                        _bool(f"{where}.manage_adapters", entry.get("manage_adapters"), False),
                        _bool(f"{where}.metrics", entry.get("metrics"), False))
        for i, key in enumerate(keys):
            if not isinstance(key, str) or not key or not key.isascii() or not key.isprintable() or " " in key:
                raise KeysFileError(f"{where}.keys[{i}] must be a non-empty string of printable ASCII, no spaces")
            digest = key_hash(key)
            if digest in by_hash:
                raise KeysFileError(f"{where}.keys[{i}] is also a key of tenant {by_hash[digest].tenant!r}")
            by_hash[digest] = access
    return by_hash


def key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def read_keys_file(path: Path) -> dict[bytes, Access]:
    """Read and parse the keys file (YAML by its suffix, where PyYAML is installed; else JSON)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KeysFileError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ModuleNotFoundError:
            raise KeysFileError(f"{path} is YAML, which needs PyYAML (pip install pyyaml); or write it as JSON") \
                from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise KeysFileError(f"{path} is not valid YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise KeysFileError(f"{path} is not valid JSON: {e}") from None
    try:
        return parse_tenants(data)
    except KeysFileError as e:
        raise KeysFileError(f"{path}: {e}") from None


class KeyRing:
    """The keys file in force: `lookup(key)` → Access or None; reloaded when the file changes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._signature = self._stat()
        self._keys = read_keys_file(self.path)   # a bad file at start is the operator's error: raised
        self._reload_requested = False
        self.reloads = 0

    def _stat(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    @property
    def tenants(self) -> list[str]:
        return sorted({a.tenant for a in self._keys.values()})

    def lookup(self, key: str) -> Access | None:
        self.check()
        return self._keys.get(key_hash(key))

    def request_reload(self) -> None:
        """Reload at the next `check()` (safe in a signal handler: no lock, no I/O)."""
        self._reload_requested = True

    def check(self) -> None:
        """Reload if asked to, or if the file changed since it was last read (cheap: one stat)."""
        if self._reload_requested:
            self._reload_requested = False
            self.reload("SIGHUP")
        elif self._stat() != self._signature:
            self.reload("the file changed")

    def reload(self, why: str = "SIGHUP") -> bool:
        """Read the file again; on failure the keys in force stay (logged). True if it reloaded."""
        with self._lock:
            self._signature = self._stat()
            try:
                keys = read_keys_file(self.path)
            except Exception as e:  # noqa: BLE001 -- whatever the file holds, the keys in force stay
                log.error("API keys not reloaded (%s): %s; the previous keys stay in force", why, e)
                return False
            self._keys = keys
            self.reloads += 1
        log.info("API keys reloaded from %s (%s): %d tenant(s)", self.path, why, len(self.tenants))
        return True
