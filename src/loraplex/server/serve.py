"""`loraplex serve`: load the engine and its adapters, then serve the app with uvicorn until
SIGINT/SIGTERM, which stop new requests and let those in flight finish (up to
`graceful_shutdown_s`) before the engine shuts down. SIGHUP reloads the keys file (--api-keys).

Exit status: 0 after a drained shutdown (uvicorn would re-raise the signal, so the process would
die by it: 143; we do not let it), 1 if the engine failed (the server then stops at once, so an
orchestrator restarts it rather than leave it answering 503), 2 for a bad start (flags, adapters,
keys file).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
from pathlib import Path

import uvicorn

from ..adapters import AdapterError
from ..config import EngineConfig
from .settings import ServerSettings

log = logging.getLogger("loraplex.server")


def _say(message: str) -> None:
    print(f"loraplex: {message}", file=sys.stderr, flush=True)


def build_state(config: EngineConfig, settings: ServerSettings, adapters: dict[str, Path], packed: list[Path]):
    """The engine (loaded), its adapters (validated) and the server's state around them."""
    from ..engine.async_engine import AsyncEngine
    from ..engine.engine import Engine
    from .metrics import ServerMetrics
    from .state import ServerState, default_model_name
    from .tenants import KeyRing

    keyring = KeyRing(settings.api_keys) if settings.api_keys is not None else None   # before the model loads
    engine = Engine(config)
    try:
        sources: dict[str, str] = {}
        for name, folder in adapters.items():
            engine.add_adapter(name, folder)
            sources[name] = str(folder)
        for path in packed:
            for name in engine.adapters.register_packed(path):
                sources[name] = str(path)
        for i in range(settings.synthetic_adapters):
            engine.adapters.register_synthetic(f"syn-{i}", config.max_lora_rank, seed=i + 1)
            sources[f"syn-{i}"] = "synthetic"
        model_name = settings.served_model_name or default_model_name(config.model)
        if model_name in sources:
            raise ValueError(f"an adapter is named {model_name!r}, like the base model; rename one "
                             f"(--served-model-name sets the base model's name)")
        engine.freeze_heap()   # the adapters' specs too (engine/gc_heap.py)
    except BaseException:
        engine.close()
        raise
    state = ServerState(AsyncEngine(config, engine=engine), settings,
                        ServerMetrics(max_adapter_labels=settings.max_adapter_labels), model_name, keyring=keyring)
    state.register_existing(sources)
    return state


def run_server(config: EngineConfig, settings: ServerSettings, *, adapters: dict[str, Path],
               packed: list[Path]) -> int:
    from .app import create_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:   # bound now (a busy port fails before the model loads), listening only once serving starts
        sock = _bind(settings.host, settings.port)
    except OSError as e:
        print(f"error: cannot listen on {settings.host}:{settings.port}: {e}", file=sys.stderr)
        return 1
    start = time.monotonic()
    _say(f"loading {config.model} on {config.device} ({config.dtype}) …")
    rings: list = []   # a SIGHUP asks for a reload from now: while the model loads, it must not kill the server
    previous_hup = _on_sighup(rings) if settings.api_keys is not None else None
    try:
        state = build_state(config, settings, adapters, packed)
    except (AdapterError, ValueError, OSError) as e:   # KeysFileError is a ValueError
        sock.close()
        _restore_sighup(previous_hup)
        print(f"error: {e}", file=sys.stderr)
        return 2
    if state.keyring is not None:
        rings.append(state.keyring)
    host, port = sock.getsockname()[:2]
    names = sorted(state.adapters)
    shown = ", ".join(names[:8]) + (f", … ({len(names)} in all)" if len(names) > 8 else "")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        _say(f"serving {state.model_name}" + (f" with {len(names)} adapter(s): {shown}" if names else " (no adapters)")
             + f" at http://{host}:{port}/v1 (ready in {time.monotonic() - start:.1f} s)")
        watch = asyncio.create_task(_watch(state, server))
        try:
            yield
        finally:
            watch.cancel()
            state.accepting = False
            state.engine.shutdown()
            _say("stopped" if state.engine.error is None else f"stopped: the engine failed ({state.engine.error!r})")

    app = create_app(state, lifespan=lifespan)
    uv_config = uvicorn.Config(app, log_level=settings.log_level,
                               timeout_graceful_shutdown=settings.graceful_shutdown_s,
                               access_log=settings.log_level == "debug")
    server = _Server(uv_config, state)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        state.engine.shutdown()   # (again, harmlessly): a second Ctrl-C skips the lifespan's shutdown
        _restore_sighup(previous_hup)
    return 0 if state.engine.error is None else 1


WATCH_S = 0.5


async def _watch(state, server: uvicorn.Server) -> None:
    """Every WATCH_S while serving: a reload a SIGHUP asked for; and once the engine has failed,
    stop serving (the process then exits 1: run_server)."""
    while state.engine.error is None:
        if state.keyring is not None:
            state.keyring.check()
        await asyncio.sleep(WATCH_S)
    log.error("the engine failed (%r): shutting the server down", state.engine.error)
    state.accepting = False
    server.should_exit = True


def _on_sighup(rings: list):
    """SIGHUP asks each KeyRing in `rings` for a reload (done by its next check: a signal handler
    takes no lock); returns the handler it replaced (None where there is no SIGHUP)."""
    if not hasattr(signal, "SIGHUP"):
        return None

    def on_hup(sig, frame) -> None:
        for ring in rings:
            ring.request_reload()
    return signal.signal(signal.SIGHUP, on_hup)


def _restore_sighup(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGHUP, previous)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, but a shutdown signal first stops new requests (503 on open connections)."""

    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self.loraplex_state = state

    def handle_exit(self, sig, frame) -> None:
        self.loraplex_state.accepting = False
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signals it caught once it has drained, so the process would die by
        # SIGTERM (143) after a clean shutdown, and an engine failure could not show as exit 1
        captured = getattr(self, "_captured_signals", None)   # (uvicorn >= 0.29.1)
        if captured is not None:
            captured.clear()
