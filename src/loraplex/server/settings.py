"""`ServerSettings`: how the HTTP server listens, authenticates and bounds its work (the engine's own
settings are `EngineConfig`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass
class ServerSettings:
    """Checked on construction; errors name the field."""

    # Each field's metadata holds its "help" (one sentence: meaning, units, what None means) and its
    # "group"; `loraplex serve` builds its flags from them, so a new field is a new flag.
    host: str = field(default="127.0.0.1", metadata={
        "group": "server", "help": "Address to listen on (0.0.0.0: every interface)."})
    port: int = field(default=8000, metadata={
        "group": "server", "help": "TCP port to listen on (0: any free port)."})
    api_key: str | None = field(default=None, metadata={
        "group": "server", "help": "When set, every endpoint but /health needs the header "
                                  "'Authorization: Bearer KEY'; default: no key, open to all."})
    admin_api_key: str | None = field(default=None, metadata={
        "group": "server", "help": "Key for the adapter-management endpoints (GET/POST/DELETE "
                                  "/v1/adapters); default: api_key."})
    adapter_roots: list[Path] = field(default_factory=list, metadata={
        "group": "adapters", "help": "Folders inside which adapters may be loaded at run time "
                                    "(POST /v1/adapters); default: none (no run-time loads)."})
    served_model_name: str | None = field(default=None, metadata={
        "group": "server", "help": "The base model's name in the API; default: the model folder's name "
                                  "(loraplex-demo for the demo model shipped with loraplex)."})
    max_waiting_requests: int = field(default=1024, metadata={
        "group": "server", "help": "Requests that may queue beyond the running batch; past that the server "
                                  "answers 429."})
    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata={
        "group": "server", "help": "Largest request body in bytes (at least 1024); larger ones get 413."})
    max_adapter_labels: int = field(default=100, metadata={
        "group": "server", "advanced": True,
        "help": "Distinct adapter labels in /metrics; requests for the others count as "
                "'other'."})
    graceful_shutdown_s: float = field(default=60.0, metadata={
        "group": "server", "help": "Seconds requests in flight may take to finish after SIGTERM."})
    synthetic_adapters: int = field(default=0, metadata={
        "group": "server", "advanced": True,
        "help": "Also serve this many random adapters named syn-0, syn-1, … of rank "
                "--max-lora-rank on every projection (for benchmarks: no files needed)."})
    log_level: str = field(default="info", metadata={
        "group": "server", "choices": LOG_LEVELS, "help": "Log level of the server (uvicorn's)."})
    api_keys: Path | None = field(default=None, metadata={
        "group": "server", "help": "A JSON (or YAML) file of tenants: their keys, the adapters each may use, "
                                  "whether it may manage adapters (docs/server.md); reloaded on SIGHUP and when "
                                  "it changes. Works beside --api-key."})
    metrics_require_key: bool = field(default=False, metadata={
        "group": "server", "help": "Make /metrics need a key (the admin key, --api-key, or a tenant allowed "
                                  "'metrics'); default: open, for Prometheus scrapers."})

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"ServerSettings.host must be a non-empty string, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"ServerSettings.port must be an integer in [0, 65535], got {self.port!r}")
        for name in ("api_key", "admin_api_key", "served_model_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"ServerSettings.{name} must be None or a non-empty string, got {value!r}")
        roots = []
        for root in self.adapter_roots:
            path = Path(root).expanduser()
            if not path.is_dir():
                raise ValueError(f"ServerSettings.adapter_roots: {root} is not a folder")
            roots.append(path.resolve())
        self.adapter_roots = roots
        if self.api_keys is not None:
            keys = Path(self.api_keys).expanduser()
            if not keys.is_file():
                raise ValueError(f"ServerSettings.api_keys: {self.api_keys} is not a file")
            self.api_keys = keys
        if not isinstance(self.metrics_require_key, bool):
            raise ValueError(f"ServerSettings.metrics_require_key must be a bool, got {self.metrics_require_key!r}")
        for name, minimum in (("max_waiting_requests", 0), ("max_body_bytes", 1024), ("max_adapter_labels", 1),
                              ("synthetic_adapters", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"ServerSettings.{name} must be an integer >= {minimum}, got {value!r}")
        g = self.graceful_shutdown_s
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0:
            raise ValueError(f"ServerSettings.graceful_shutdown_s must be a finite number >= 0, got {g!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"ServerSettings.log_level must be critical, error, warning, info or debug, "
                             f"got {self.log_level!r}")

    @property
    def admin_key(self) -> str | None:
        """The key the adapter-management endpoints need (None: open)."""
        return self.admin_api_key if self.admin_api_key is not None else self.api_key
