"""`gyre up [--config FILE] [--check] [--service NAME ...] [--host H] [--port NAME=PORT ...]`: run a deployment.

Starts NATS and Postgres (embedded unless GYRE_NATS_URL / GYRE_DATABASE_URL or the config name
external ones) and every service as its own process (app.launcher.deployment), prints the
endpoints and serves until Ctrl-C / SIGTERM, then stops everything in reverse order; meanwhile it
restarts a service that exits (launcher.restart, with backoff and a restart budget). With --check
it verifies that every service is healthy and serves /metrics, stops, and exits 0. `--port` and
`--metrics-port` fix a service's ports (a container or pod hosting several services, probed on
known ports: deploy/k8s/worker.yaml runs `gyre up --service trainer --service rollout` so one
node's devices can move between the two roles).
Exit status: 0 stopped cleanly, 1 a service failed (its log tail is printed), 2 bad usage/config,
130 interrupted during start.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from gyre.errors import GyreError


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while the deployment was starting."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gyre up", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", type=Path, help="run YAML (see docs/configuration.md)")
    parser.add_argument("--check", action="store_true", help="verify every service is healthy, stop, exit 0")
    parser.add_argument(
        "--service",
        action="append",
        dest="services",
        metavar="NAME",
        help="start only this service (repeatable; default: launcher.services of the config, else all)",
    )
    parser.add_argument("--run-dir", type=Path, help="override run_dir of the config")
    parser.add_argument(
        "--host", help="interface the services bind (overrides launcher.host; 0.0.0.0 in a pod)"
    )
    parser.add_argument(
        "--port",
        action="append",
        default=[],
        metavar="NAME=PORT",
        help="gRPC port of service NAME (repeatable)",
    )
    parser.add_argument(
        "--metrics-port",
        action="append",
        default=[],
        metavar="NAME=PORT",
        help="Prometheus /metrics port of service NAME (repeatable)",
    )
    return parser


def service_ports(ports: list[str], metrics_ports: list[str]) -> dict[str, list[str]]:
    """Per-service command-line arguments for `--port NAME=PORT` / `--metrics-port NAME=PORT`;
    GyreError naming a malformed one."""
    args: dict[str, list[str]] = {}
    for flag, values in (("--port", ports), ("--metrics-port", metrics_ports)):
        for value in values:
            name, _, port = value.partition("=")
            if not name or not port.isdigit():
                raise GyreError(f"{flag} takes NAME=PORT (e.g. {flag} trainer=50053), got {value!r}")
            args.setdefault(name, []).extend([flag, port])
    return args


def endpoints_table(endpoints: object) -> object:
    """A rich Table of a deployment's endpoints."""
    from rich.table import Table

    from app.launcher.endpoints import Endpoints

    assert isinstance(endpoints, Endpoints)
    table = Table(title=f"gyre run {endpoints.run_id} — {endpoints.run_dir}")
    for column in ("service", "gRPC", "metrics", "pid", "log"):
        table.add_column(column, overflow="fold")
    embedded = set(endpoints.embedded)
    from gyre.bus.auth import redact

    shown = ",".join(redact(u) for u in endpoints.nats_url.split(","))  # a cluster lists every node
    table.add_row("nats", shown, "", "", "embedded" if "nats" in embedded else "external")
    table.add_row(
        "postgres",
        _hide_password(endpoints.database_url),
        "",
        "",
        "embedded" if "postgres" in embedded else "external",
    )
    for ep in endpoints.services.values():
        table.add_row(ep.name, ep.grpc_address, ep.metrics_url, str(ep.pid), ep.log_path)
    return table


def _hide_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


def metrics_ok(url: str, timeout_s: float = 5.0) -> bool:
    """True when `url` answers 200 with Prometheus text."""
    import httpx

    try:
        reply = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return reply.status_code == 200 and "# HELP" in reply.text


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from rich.console import Console

    from app.launcher.deployment import Deployment, DeploymentError
    from app.launcher.healthcheck import check

    console = Console(stderr=True)
    stop_requested = threading.Event()
    starting = True

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_requested.set()
        if starting:
            raise Interrupted(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    deployment: Deployment | None = None
    try:
        deployment = Deployment(
            args.config,
            services=args.services,
            run_dir=args.run_dir,
            host=args.host,
            service_args=service_ports(args.port, args.metrics_port),
            on_progress=lambda line: console.print(f"[dim]gyre up:[/dim] {line}"),
        )
        endpoints = deployment.start()
        starting = False
        # Not a terminal (a log, a test): wide enough that addresses and paths stay on one line.
        Console(width=None if sys.stdout.isatty() else 200).print(endpoints_table(endpoints))
        if args.check:
            failures = []
            for ep in endpoints.services.values():
                health = check(ep.grpc_address)
                if health != "SERVING":
                    failures.append(f"{ep.name}: gRPC health {health}")
                if not metrics_ok(ep.metrics_url):
                    failures.append(f"{ep.name}: no Prometheus metrics at {ep.metrics_url}")
            deployment.check_alive()
            if failures:
                console.print("[red]gyre up --check failed:[/red]\n  " + "\n  ".join(failures))
                return 1
            console.print(f"[green]gyre up --check: {len(endpoints.services)} services healthy[/green]")
            return 0
        console.print("serving; Ctrl-C or SIGTERM stops everything")
        while not stop_requested.wait(0.5):
            deployment.check_alive()
        return 0
    except Interrupted as exc:
        console.print(f"gyre up: {exc} during start; stopping")
        return 130
    except DeploymentError as exc:
        console.print(f"gyre up: {exc}", style="red", markup=False, highlight=False)
        return 1
    except GyreError as exc:
        console.print(f"gyre up: {exc}", markup=False, highlight=False)
        return 2
    finally:
        starting = False
        if deployment is not None:
            t0 = time.monotonic()
            # Ignore further signals while stopping: a half-done stop is what leaves orphans.
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)
            deployment.stop()
            console.print(f"[dim]gyre up:[/dim] stopped in {time.monotonic() - t0:.1f} s")
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
