"""`gyre trajectory export --execution ID [--config F | --address host:port]`: every call of an execution as JSON.

With ``--address`` the running service answers (ExportExecution over gRPC). With ``--config`` (or
GYRE_DATABASE_URL) the tree is rebuilt straight from Postgres, so it works with the service down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any


def _to_json(resp: Any) -> dict[str, Any]:
    return {
        "execution_id": resp.execution_id,
        "task_id": resp.task_id,
        "group_id": resp.group_id,
        "calls": [
            {
                "call_seq": c.call_seq,
                "agent_id": c.agent_id,
                "prompt_token_ids": list(c.prompt_token_ids),
                "completion_token_ids": list(c.completion_token_ids),
                "completion_logprobs": list(c.completion_logprobs),
                "completion_versions": list(c.completion_versions),
            }
            for c in resp.calls
        ],
    }


async def _via_grpc(address: str, execution_id: str) -> Any:
    from gyre import rpc
    from gyre.v1 import trajectory_pb2, trajectory_pb2_grpc

    async with rpc.channel(address) as channel:
        stub = trajectory_pb2_grpc.TrajectoryStub(channel)
        return await stub.ExportExecution(trajectory_pb2.ExportExecutionRequest(execution_id=execution_id))


def _via_database(config: str | None, execution_id: str) -> Any:
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
        return core.export(execution_id)
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

    try:
        if args.address:
            resp = asyncio.run(_via_grpc(args.address, args.execution))
        else:
            resp = _via_database(args.config, args.execution)
    except GyreError as exc:
        print(f"gyre trajectory export: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # grpc errors carry their own message
        details = getattr(exc, "details", None)
        print(f"gyre trajectory export: {details() if callable(details) else exc}", file=sys.stderr)
        return 1
    json.dump(_to_json(resp), sys.stdout)
    sys.stdout.write("\n")
    return 0
