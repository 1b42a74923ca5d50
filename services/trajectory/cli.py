"""`gyre trajectory export [RUN_DIR] --execution ID [--config F | --address host:port]`: every call
of an execution as JSON.

With ``RUN_DIR`` (a `gyre run` directory) the run is read back from its `config.yaml` alone: its
run id, and its database: the `database_url` there, else the run's embedded Postgres
(`RUN_DIR/postgres`), which this command starts for the export and stops after when the run left
it stopped (or reaches through the run's `endpoints.json` while the run still goes on), else
GYRE_DATABASE_URL. With ``--address`` the running service answers (ExportExecution over gRPC,
streamed one call per message). With ``--config`` (or GYRE_DATABASE_URL) the tree is rebuilt
straight from Postgres, so it works with the service down. Either way the JSON is written call by
call as the calls arrive.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

RUN_CONFIG = "config.yaml"  # app/job/run.py writes the effective configuration there


class _JsonWriter:
    """The ExportExecution stream written as one JSON object, call by call (never all in memory)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.opened = False

    def add(self, msg: Any) -> None:
        for c in msg.calls:
            if not self.opened:
                head = {"execution_id": msg.execution_id, "task_id": msg.task_id, "group_id": msg.group_id}
                self.out.write(json.dumps(head)[:-1] + ', "calls": [')
                self.opened = True
            else:
                self.out.write(", ")
            call = {
                "call_seq": c.call_seq,
                "agent_id": c.agent_id,
                "prompt_token_ids": list(c.prompt_token_ids),
                "completion_token_ids": list(c.completion_token_ids),
                "completion_logprobs": list(c.completion_logprobs),
                "completion_versions": list(c.completion_versions),
            }
            self.out.write(json.dumps(call))

    def close(self) -> None:
        self.out.write("]}\n" if self.opened else '{"calls": []}\n')


async def collect_export(stub: Any, execution_id: str) -> Any:
    """The ExportExecution stream of `execution_id` as one ExportExecutionResponse holding every call
    (for callers that want the whole execution in memory; the CLI streams instead)."""
    from gyre.v1 import trajectory_pb2

    whole = trajectory_pb2.ExportExecutionResponse()
    async for msg in stub.ExportExecution(trajectory_pb2.ExportExecutionRequest(execution_id=execution_id)):
        whole.execution_id, whole.task_id, whole.group_id = msg.execution_id, msg.task_id, msg.group_id
        whole.calls.extend(msg.calls)
    return whole


async def _via_grpc(address: str, execution_id: str, writer: _JsonWriter) -> None:
    from gyre import rpc
    from gyre.v1 import trajectory_pb2, trajectory_pb2_grpc

    async with rpc.channel(address) as channel:
        stub = trajectory_pb2_grpc.TrajectoryStub(channel)
        async for msg in stub.ExportExecution(
            trajectory_pb2.ExportExecutionRequest(execution_id=execution_id)
        ):
            writer.add(msg)


@contextlib.contextmanager
def run_database(run_dir: Path) -> Iterator[tuple[str, str]]:
    """(run id, database URL) of a run directory, from the config.yaml in RUN_DIR alone (no GYRE_*
    variable renames the run): the config's `database_url`; else the run's embedded Postgres,
    reached through endpoints.json while the run goes on, else started for the block and stopped
    after; else GYRE_DATABASE_URL. ConfigError when none of these exists."""
    from gyre.config import CommonConfig, build, load_yaml
    from gyre.embedded.postgres import postgres_running, started_for_reading
    from gyre.errors import ConfigError

    raw = load_yaml(run_dir / RUN_CONFIG)
    common = build(
        CommonConfig, {k: v for k, v in raw.items() if k in CommonConfig.model_fields}, where="run"
    )
    embedded = run_dir / "postgres"
    if common.database_url:
        yield common.run_id, common.database_url
    elif (embedded / "pgdata").exists() and postgres_running(embedded):
        endpoints = json.loads((run_dir / "endpoints.json").read_text())
        yield common.run_id, str(endpoints["database_url"])
    elif (embedded / "pgdata").exists():
        with started_for_reading(embedded) as url:
            yield common.run_id, url
    elif os.environ.get("GYRE_DATABASE_URL"):
        yield common.run_id, os.environ["GYRE_DATABASE_URL"]
    else:
        raise ConfigError(
            f"{run_dir}: no database_url in {RUN_CONFIG}, no embedded Postgres in {embedded}, "
            "and GYRE_DATABASE_URL is not set"
        )


def _export(config: str | None, database_url: str, run_id: str, execution_id: str) -> Iterator[Any]:
    from gyre import store
    from gyre.config import load_section
    from services.trajectory.config import TrajectoryConfig
    from services.trajectory.core import TrajectoryCore

    cfg = load_section(TrajectoryConfig, "trajectory", config)
    engine = store.create_engine(database_url)
    try:
        core = TrajectoryCore(run_id, cfg, engine)
        core.load()
        yield from core.export(execution_id)
    finally:
        engine.dispose()


def _via_database(config: str | None, execution_id: str) -> Iterator[Any]:
    from gyre.config import load_common
    from gyre.errors import ConfigError

    common = load_common(config)
    if common.database_url is None:
        raise ConfigError(
            "no database: pass RUN_DIR, --config with database_url, set GYRE_DATABASE_URL, or use --address"
        )
    yield from _export(config, common.database_url, common.run_id, execution_id)


def _via_run_dir(run_dir: Path, execution_id: str) -> Iterator[Any]:
    with run_database(run_dir) as (run_id, database_url):
        yield from _export(str(run_dir / RUN_CONFIG), database_url, run_id, execution_id)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gyre trajectory", description="Trajectory service tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser(
        "export", help="print every call of an execution (token ids, log-probs, versions) as JSON"
    )
    exp.add_argument(
        "run_dir",
        nargs="?",
        type=Path,
        help="a run directory: read it back from its config.yaml (its embedded Postgres started if stopped)",
    )
    exp.add_argument("--execution", required=True, help="execution ID, e.g. t0042-g0-e3")
    where = exp.add_mutually_exclusive_group()
    where.add_argument("--config", help="run YAML: read Postgres directly (run_id and database_url from it)")
    where.add_argument("--address", help="host:port of a running trajectory service")
    args = parser.parse_args(argv)
    if args.run_dir is not None and (args.config or args.address):
        parser.error("give RUN_DIR, --config or --address, not several")

    from gyre.errors import GyreError

    writer = _JsonWriter(sys.stdout)
    try:
        if args.address:
            asyncio.run(_via_grpc(args.address, args.execution, writer))
        elif args.run_dir is not None:
            for msg in _via_run_dir(args.run_dir, args.execution):
                writer.add(msg)
        else:
            for msg in _via_database(args.config, args.execution):
                writer.add(msg)
    except GyreError as exc:
        print(f"gyre trajectory export: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # grpc errors carry their own message
        details = getattr(exc, "details", None)
        print(f"gyre trajectory export: {details() if callable(details) else exc}", file=sys.stderr)
        return 1
    writer.close()
    return 0
