"""`python -m app.launcher.streams [--replicas N] [--nats-url URL]`: declare Gyre's JetStream streams.

For deployments whose NATS the launcher does not start (docker compose, Kubernetes): run once, as a
user that may manage streams, before or beside the services. Every stream of gyre.bus.subjects is
created with `--replicas` replicas, or scaled to that count if it exists (a service that started
first created it with 1); a stream that already matches is left alone, so running it again is
harmless. The URL comes from `--nats-url` or GYRE_NATS_URL (a comma-separated list for a cluster).
It waits up to `--connect-wait-s` for NATS. Exit 0 once every stream is declared, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

from app.launcher.servers import ensure_streams, run_async
from gyre.bus.auth import redact
from gyre.errors import GyreError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.launcher.streams", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--replicas", type=int, default=3, help="replicas of every stream (default 3)")
    parser.add_argument("--nats-url", default=os.environ.get("GYRE_NATS_URL"), help="default: GYRE_NATS_URL")
    args = parser.parse_args(argv)
    if not args.nats_url:
        print("streams: no NATS URL (--nats-url or GYRE_NATS_URL)", file=sys.stderr)
        return 1
    shown = ",".join(redact(u) for u in args.nats_url.split(","))
    try:
        run_async(ensure_streams(args.nats_url, args.replicas))
    except GyreError as exc:
        print(f"streams: {shown}: {exc}", file=sys.stderr)
        return 1
    print(f"streams: declared with {args.replicas} replicas on {shown}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
