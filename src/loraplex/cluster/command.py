"""`loraplex serve --replicas N`: the command line's settings as the Ray Serve application's arguments
(`ClusterOptions`), run by `app.run_cluster`. Ray is imported only here, and only then."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def serve_replicas(args: argparse.Namespace, engine: dict, server: dict, adapters: dict[str, Path],
                   packed: list[Path]) -> int:
    """Serve with `args.replicas` engine replicas; the exit status (1 when Ray Serve is not installed)."""
    try:
        from .app import run_cluster
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "ray":
            print("error: --replicas runs the engines under Ray Serve: pip install 'loraplex[cluster]'",
                  file=sys.stderr)
            return 1
        raise
    options: dict[str, Any] = {
        "replicas": args.replicas, "engine": {k: _plain(v) for k, v in engine.items()},
        "server": {k: _plain(v) for k, v in server.items()},
        "adapters": {name: str(folder) for name, folder in adapters.items()}, "packed": [str(p) for p in packed]}
    if args.router_queue is not None:
        options["router_queue"] = args.router_queue
    if args.routing_policy is not None:
        options["policy"] = args.routing_policy
    return run_cluster(options, ray_address=args.ray_address)


def _plain(value: Any) -> Any:
    """Paths as text: the options travel to Ray's processes (and read like a config file's)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value
