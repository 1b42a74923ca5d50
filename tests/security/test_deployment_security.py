"""A real `Deployment` (embedded NATS and Postgres, scheduler and trajectory as processes) is closed
to anonymous clients end to end: NATS, gRPC and Postgres each refuse a caller without the run's
credentials, and accept the right service with its own."""

from __future__ import annotations

import asyncio
import json
import stat
import uuid
from pathlib import Path

import grpc
import psycopg
import pytest
import yaml

from app.launcher import Deployment
from gyre import rpc
from gyre.bus import Bus, auth, subjects
from gyre.errors import Unavailable
from gyre.v1 import events_pb2, trajectory_pb2, trajectory_pb2_grpc

SERVICES = ["scheduler", "trajectory"]


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "run_id": f"sec{uuid.uuid4().hex[:6]}",
                "run_dir": str(tmp_path / "run"),
                "launcher": {
                    "services": SERVICES,
                    "start_timeout_s": 240,
                    "stop_grace_s": 40,
                    "restart": False,
                },
            }
        )
    )
    return path


@pytest.mark.slow
@pytest.mark.integration
def test_a_gyre_up_deployment_refuses_anonymous_clients_on_nats_grpc_and_postgres(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("GYRE_NATS_URL", "GYRE_DATABASE_URL", rpc.TOKEN_ENV):
        monkeypatch.delenv(var, raising=False)
    with Deployment(_config(tmp_path)) as deployment:
        endpoints = deployment.endpoints
        run_dir = tmp_path / "run"
        assert stat.S_IMODE((run_dir / "endpoints.json").stat().st_mode) == 0o600
        assert stat.S_IMODE((run_dir / "secrets").stat().st_mode) == 0o700
        secrets = json.loads((run_dir / "secrets" / "credentials.json").read_text())
        assert stat.S_IMODE((run_dir / "secrets" / "credentials.json").stat().st_mode) == 0o600
        token = (run_dir / "secrets" / "grpc_token").read_text().strip()
        base_nats = endpoints.nats_url.split("@")[-1]
        asyncio.run(_check_nats("nats://" + base_nats, endpoints.nats_url, endpoints.run_id))
        asyncio.run(_check_grpc(endpoints.services["trajectory"].grpc_address, token))

        # Postgres: no login without a password; the scheduler's role reads none of the trajectory's tables.
        port = int(endpoints.database_url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(host="127.0.0.1", port=port, user="postgres", dbname="gyre").close()
        with psycopg.connect(
            host="127.0.0.1",
            port=port,
            user="gyre_trajectory",
            password=secrets["postgres"]["trajectory"],
            dbname="gyre",
        ) as conn:
            tables = [
                r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE tableowner = current_user")
            ]
        assert tables, "the trajectory's migrations ran as its own role"
        with psycopg.connect(
            host="127.0.0.1",
            port=port,
            user="gyre_scheduler",
            password=secrets["postgres"]["scheduler"],
            dbname="gyre",
        ) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(f"SELECT * FROM {tables[0]}")


async def _check_nats(base_url: str, observer_url: str, run_id: str) -> None:
    with pytest.raises(Unavailable, match="refused the login"):
        await Bus.connect(base_url, name="anonymous", connect_wait_s=2.0)
    assert auth.user_of(observer_url) == auth.OBSERVER
    observer = await Bus.connect(observer_url, name="observer")
    try:
        lease = events_pb2.LeaseEvent(event_id="forged", run_id=run_id)
        with pytest.raises(Unavailable):
            await observer.publish(subjects.leases(run_id, "d0"), lease, msg_id="forged", timeout_s=2.0)
        info = await observer.js.stream_info("GYRE_LEASES")
        assert info.state.messages == 0
    finally:
        await observer.close()


async def _check_grpc(address: str, token: str) -> None:
    async with rpc.channel(address, token="") as open_channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await trajectory_pb2_grpc.TrajectoryStub(open_channel).GetStats(trajectory_pb2.GetStatsRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with rpc.channel(address, token=token) as channel:
        stub = trajectory_pb2_grpc.TrajectoryStub(channel)
        await stub.GetStats(trajectory_pb2.GetStatsRequest())
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            async for _ in stub.PullBatch(trajectory_pb2.PullBatchRequest(consumer="thief", wait_s=0.1)):
                pass
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_run_credentials_are_private_reused_and_completed(tmp_path: Path) -> None:
    from app.launcher.credentials import RunCredentials

    first = RunCredentials.load_or_create(tmp_path)
    assert set(first.nats) == set(auth.ROLES) and set(first.postgres) == set(auth.SERVICE_ROLES)
    assert len({*first.nats.values(), *first.postgres.values(), first.grpc_token}) == len(auth.ROLES) + 5
    again = RunCredentials.load_or_create(tmp_path)
    assert again == first  # a restarted launcher finds the same secrets (the data dirs need them)
    path = tmp_path / "secrets" / "credentials.json"
    data = json.loads(path.read_text())
    del data["nats"]["observer"]  # written by a version without that role
    path.write_text(json.dumps(data))
    completed = RunCredentials.load_or_create(tmp_path)
    assert completed.nats["trainer"] == first.nats["trainer"] and completed.nats["observer"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert (tmp_path / "secrets" / "grpc_token").read_text().strip() == first.grpc_token
