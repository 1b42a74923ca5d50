"""`gyre trajectory export --execution ID [--config F | --address host:port]`: every call of an execution as JSON.

With ``--address`` the running service answers (ExportExecution over gRPC, streamed one call per
message). With ``--config`` (or GYRE_DATABASE_URL) the tree is rebuilt straight from Postgres, so it
works with the service down. Either way the JSON is written call by call as the calls arrive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator
from typing import Any, TextIO


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


def _via_database(config: str | None, execution_id: str) -> Iterator[Any]:
    from gyre import store
    from gyre.config import load_common, load_section
    from gyre.errors import ConfigError
    from services.trajectory.config import TrajectoryConfig
    from services.trajectory.core import TrajectoryCore

    common = load_common(config)
    if common.database_url is None:
        raise ConfigError(
            "no database: pass --config with database_url, set GYRE_DATABASE_URL, or use --address"
        )
    cfg = load_section(TrajectoryConfig, "trajectory", config)
    engine = store.create_engine(common.database_url)
    try:
        core = TrajectoryCore(common.run_id, cfg, engine)
        core.load()
        yield from core.export(execution_id)
    finally:
        engine.dispose()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gyre trajectory", description="Trajectory service tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser(
        "export", help="print every call of an execution (token ids, log-probs, versions) as JSON"
    )
    exp.add_argument("--execution", required=True, help="execution ID, e.g. t0042-g0-e3")
    where = exp.add_mutually_exclusive_group()
    where.add_argument("--config", help="run YAML: read Postgres directly (run_id and database_url from it)")
    where.add_argument("--address", help="host:port of a running trajectory service")
    args = parser.parse_args(argv)

    from gyre.errors import GyreError

    writer = _JsonWriter(sys.stdout)
    try:
        if args.address:
            asyncio.run(_via_grpc(args.address, args.execution, writer))
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
