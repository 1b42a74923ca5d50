"""`gyre events tail [SUBJECT]` and `gyre events export --format parquet --out FILE`.

Where NATS is, first match wins: --nats-url, $GYRE_NATS_URL, `nats_url` of --config, the
`nats_url` in <run_dir>/endpoints.json of a running `gyre up` (run_dir from --run-dir, else from
--config, else runs/default).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.errors import ConfigError, GyreError

if TYPE_CHECKING:
    from app.analytics.tap import EventRecord

DEFAULT_FILTER = "gyre.>"


def resolve_nats_url(nats_url: str | None, config: str | None, run_dir: str | None) -> str:
    """The NATS URL to use (see the module docstring for the order); ConfigError if none is found."""
    if nats_url:
        return nats_url
    if os.environ.get("GYRE_NATS_URL"):
        return os.environ["GYRE_NATS_URL"]
    from app.launcher.endpoints import Endpoints
    from gyre.config import load_common

    common = load_common(config)
    if common.nats_url:
        return common.nats_url
    directory = Path(run_dir) if run_dir else common.run_dir
    try:
        return Endpoints.read(directory).nats_url
    except ConfigError as exc:
        raise ConfigError(f"no NATS URL given and none found: {exc}; or pass --nats-url") from None


def _add_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats-url", help="NATS server URL (nats://host:4222)")
    p.add_argument("--config", help="run YAML; its nats_url / run_dir locate the deployment")
    p.add_argument("--run-dir", help="run directory of a running `gyre up` (reads its endpoints.json)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gyre events", description="The analytics tap over Gyre's event streams."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    tail = sub.add_parser("tail", help="print decoded events live, one line each")
    tail.add_argument(
        "subject", nargs="?", default=DEFAULT_FILTER, help=f"subject filter (default {DEFAULT_FILTER})"
    )
    tail.add_argument("--json", action="store_true", help="one JSON object per line instead of text")
    tail.add_argument("--from-start", action="store_true", help="replay stored events first, then follow")
    tail.add_argument(
        "--count", type=int, default=0, help="exit after this many events (0: run until Ctrl-C)"
    )
    _add_source_args(tail)
    export = sub.add_parser("export", help="read the streams from the start into a table file")
    export.add_argument("--format", choices=("parquet", "csv", "jsonl"), default="parquet")
    export.add_argument("--out", required=True, help="output file")
    export.add_argument(
        "--subject", action="append", help=f"subject filter, repeatable (default {DEFAULT_FILTER})"
    )
    _add_source_args(export)
    return parser


def _format(record: EventRecord, as_json: bool) -> str:
    from app.analytics.flatten import flatten, one_line

    if as_json:
        return json.dumps(record.row(), default=str)
    ts = record.time.strftime("%H:%M:%S.%f")[:-3]
    fields = one_line(flatten(record.msg)) if record.msg is not None else f"({record.size_bytes} bytes)"
    return f"{ts} {record.subject} {record.type_name} {fields}".rstrip()


async def _tail(args: argparse.Namespace, url: str) -> int:
    from app.analytics.tap import tail
    from gyre.bus import Bus

    bus = await Bus.connect(url, name="analytics-tail")
    try:
        await bus.ensure_streams()

        def subscribed() -> None:
            print(f"tailing {args.subject} on {url} (Ctrl-C to stop)", file=sys.stderr, flush=True)

        seen = 0
        async for record in tail(bus, args.subject, from_start=args.from_start, on_subscribed=subscribed):
            print(_format(record, args.json), flush=True)
            seen += 1
            if args.count and seen >= args.count:
                break
    finally:
        await bus.close()
    return 0


async def _export(args: argparse.Namespace, url: str) -> int:
    from app.analytics.export import to_table, write
    from app.analytics.tap import read_all
    from gyre.bus import Bus

    bus = await Bus.connect(url, name="analytics-export")
    try:
        records = []
        for flt in args.subject or [DEFAULT_FILTER]:
            records += await read_all(bus, flt)
    finally:
        await bus.close()
    table = to_table(records)
    out = write(table, Path(args.out), args.format)
    print(f"wrote {table.num_rows} events x {table.num_columns} columns to {out}")
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        url = resolve_nats_url(args.nats_url, args.config, args.run_dir)
        runner = _tail if args.command == "tail" else _export
        with contextlib.suppress(KeyboardInterrupt):
            return asyncio.run(runner(args, url))
        return 130
    except GyreError as exc:
        print(f"gyre events: {exc}", file=sys.stderr)
        return 2
