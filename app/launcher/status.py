"""`gyre status [--run-dir DIR | --config FILE | --address NAME=HOST:PORT ...] [--json]`.

Shows each service's gRPC health, whether its /metrics answers, and whether its process is alive.
Reads `<run_dir>/endpoints.json` written by `gyre up` (run_dir from --run-dir, else the config,
else runs/default) unless addresses are given. Exit status 0 when every service is SERVING,
1 otherwise, 2 when there is nothing to check.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from gyre.errors import ConfigError, GyreError


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    grpc_address: str
    health: str  # SERVING, NOT_SERVING, UNREACHABLE: <code>, ...
    metrics: str  # "ok", "unreachable" or "" when unknown
    process: str  # "alive", "gone" or "" when unknown (addresses given by hand)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gyre status", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--run-dir", type=Path, help="run directory of a running `gyre up`")
    parser.add_argument("--config", type=Path, help="run YAML; its run_dir locates endpoints.json")
    parser.add_argument(
        "--address", action="append", default=[], metavar="NAME=HOST:PORT", help="check this gRPC server"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    return parser


def collect(args: argparse.Namespace) -> list[ServiceStatus]:
    """Statuses of the services named by the arguments (see the module docstring)."""
    import psutil

    from app.launcher.cli import metrics_ok
    from app.launcher.endpoints import Endpoints
    from app.launcher.healthcheck import check

    if args.address:
        out = []
        for item in args.address:
            name, sep, address = item.partition("=")
            if not sep or ":" not in address:
                raise ConfigError(
                    f"--address {item!r}: expected NAME=HOST:PORT, e.g. scheduler=127.0.0.1:50051"
                )
            out.append(ServiceStatus(name, address, check(address), "", ""))
        return out
    if args.run_dir is not None:
        run_dir = args.run_dir
    else:
        from gyre.config import load_common

        run_dir = load_common(args.config).run_dir
    endpoints = Endpoints.read(Path(run_dir))
    return [
        ServiceStatus(
            name=ep.name,
            grpc_address=ep.grpc_address,
            health=check(ep.grpc_address),
            metrics="ok" if metrics_ok(ep.metrics_url) else "unreachable",
            process="alive" if psutil.pid_exists(ep.pid) else "gone",
        )
        for ep in endpoints.services.values()
    ]


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        statuses = collect(args)
    except GyreError as exc:
        print(f"gyre status: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(s) for s in statuses], indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="gyre status")
        for column in ("service", "gRPC", "health", "metrics", "process"):
            table.add_column(column, overflow="fold")
        for s in statuses:
            style = "green" if s.health == "SERVING" else "red"
            table.add_row(s.name, s.grpc_address, f"[{style}]{s.health}[/{style}]", s.metrics, s.process)
        Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0 if statuses and all(s.health == "SERVING" for s in statuses) else 1
