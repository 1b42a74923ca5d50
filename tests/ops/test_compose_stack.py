"""The docker-compose stack for real: built, started, training, a killed container brought back by
its restart policy and training going on, no batch trained twice or lost (gyre chaos's counters);
every anonymous or wrong-credential client refused.

scripts/compose_stack.sh prepares the host as it would for a user (Docker installed and dockerd
started where missing, compose v2, the base and service images, built only when their inputs
changed; secrets generated), here into this test's own env file and compose project, with a run
config like the quickstart's (the services train by themselves: `rollout.continuous`). The stack is
docker-compose.yml + deploy/compose.cpu.yml + deploy/compose.local.yml (images built here, nothing
pulled) + an override that mounts that run config and publishes ports on free loopback ports only.

Skipped only where Docker can be neither reached nor installed (not root, no daemon answering):
on CI, as root, a failure to install or start Docker fails the test with the script's output.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
import yaml

from app.chaos_counts import batch_states, final_trainer_state
from gyre import rpc
from gyre.bus import Bus, auth, subjects
from gyre.errors import Unavailable
from gyre.v1 import events_pb2, trajectory_pb2, trajectory_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compose_stack.sh"
SERVICES = ("scheduler", "trajectory", "trainer", "rollout")
RUN_ID = "composetest"
PREPARE_TIMEOUT_S = 1800  # a bare machine: apt, mmdebstrap, three image builds (about 6 minutes here)
UP_TIMEOUT_S = 420
TRAIN_TIMEOUT_S = 600

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(3600)]


def _docker_reachable() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def _run_config(path: Path) -> None:
    """The quickstart's run config, as one container per service reads it."""
    config = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    for section in ("job", "launcher"):
        config.pop(section, None)
    config.update(run_id=RUN_ID, run_dir="/data/run")
    config["trainer"]["checkpoint_every"] = 2  # a restarted trainer resumes from a recent checkpoint
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def _override(path: Path, run_config: Path) -> None:
    """Mount `run_config`; publish only NATS, Postgres and the trajectory's gRPC, on free loopback ports
    (`!reset` / `!override`: Compose's tags that replace a list instead of appending to it)."""
    lines = ["services:"]
    for name in SERVICES:
        ports = '!override ["127.0.0.1::50051"]' if name == "trajectory" else "!reset []"
        lines += [
            f"  {name}:",
            f"    volumes: [{json.dumps(f'{run_config}:/etc/gyre/run.yaml:ro')}]",
            f"    ports: {ports}",
        ]
    lines += ["  nats:", '    ports: !override ["127.0.0.1::4222"]']
    lines += ["  postgres:", '    ports: !override ["127.0.0.1::5432"]']
    path.write_text("\n".join(lines) + "\n")


class Stack:
    """One compose project of this test, driven through scripts/compose_stack.sh."""

    def __init__(self, tmp_path: Path) -> None:
        self.project = f"gyretest{uuid.uuid4().hex[:8]}"
        self.env_file = tmp_path / "compose.env"
        self.run_dir = tmp_path / "run"
        self.run_dir.mkdir()
        self.override = tmp_path / "compose.test.yml"
        run_config = tmp_path / "run.yaml"
        _run_config(run_config)
        _override(self.override, run_config)
        self.env = {
            **os.environ,
            "COMPOSE_PROJECT_NAME": self.project,
            "GYRE_ENV_FILE": str(self.env_file),
            "GYRE_COMPOSE_FILES": str(self.override),
            "GYRE_RUN_ID": RUN_ID,
        }

    def script(self, *args: str, timeout_s: float) -> str:
        done = subprocess.run(
            [str(SCRIPT), *args],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            pytest.fail(
                f"compose_stack.sh {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
            )
        return done.stdout

    def compose(self, *args: str, timeout_s: float = 120) -> str:
        return self.script("compose", *args, timeout_s=timeout_s)

    def secrets(self) -> dict[str, str]:
        pairs = (line.partition("=") for line in self.env_file.read_text().splitlines())
        return {key: value for key, sep, value in pairs if sep and not key.startswith("#")}

    def port(self, service: str, port: int) -> int:
        return int(self.compose("port", service, str(port)).strip().rsplit(":", 1)[1])

    def container(self, service: str) -> str:
        return self.compose("ps", "-a", "-q", service).strip()

    def inspect(self, service: str) -> dict[str, Any]:
        out = subprocess.run(
            ["docker", "inspect", self.container(service)], capture_output=True, text=True, check=True
        ).stdout
        state: dict[str, Any] = json.loads(out)[0]
        return state

    def diagnostics(self) -> str:
        ps = subprocess.run(
            [str(SCRIPT), "compose", "ps", "-a"], env=self.env, cwd=ROOT, capture_output=True, text=True
        )
        logs = subprocess.run(
            [str(SCRIPT), "compose", "logs", "--no-color", "--tail", "40"],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        return f"{ps.stdout}{ps.stderr}\n{logs.stdout[-12000:]}{logs.stderr[-2000:]}"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    if os.geteuid() != 0 and not _docker_reachable():
        pytest.skip(
            "no Docker daemon answers and this is not root, so scripts/compose_stack.sh cannot install one"
        )
    stack = Stack(tmp_path)
    started = time.monotonic()
    stack.script("prepare", timeout_s=PREPARE_TIMEOUT_S)
    print(f"prepared in {time.monotonic() - started:.0f} s")
    try:
        yield stack
    except BaseException:
        print(stack.diagnostics())
        raise
    finally:
        subprocess.run(
            [str(SCRIPT), "compose", "down", "-v", "--remove-orphans", "--timeout", "10"],
            env=stack.env,
            cwd=ROOT,
            capture_output=True,
            timeout=300,
        )


async def _last_weights_unix_s(url: str) -> float:
    bus = await Bus.connect(url, name="compose-test", connect_wait_s=10.0)
    try:
        event = await bus.last(subjects.weights(RUN_ID), events_pb2.WeightsPublishedEvent)
    finally:
        await bus.close()
    assert event is not None
    return float(event.weights.created_unix_s)


async def _weights_version(url: str) -> int:
    bus = await Bus.connect(url, name="compose-test", connect_wait_s=10.0)
    try:
        event = await bus.last(subjects.weights(RUN_ID), events_pb2.WeightsPublishedEvent)
    finally:
        await bus.close()
    return event.weights.version if event is not None else -1


def _wait_for_version(url: str, at_least: int, stack: Stack) -> int:
    deadline = time.monotonic() + TRAIN_TIMEOUT_S
    version = -1
    while time.monotonic() < deadline:
        version = asyncio.run(_weights_version(url))
        if version >= at_least:
            return version
        time.sleep(2.0)
    pytest.fail(
        f"weights version {version} after {TRAIN_TIMEOUT_S} s, waiting for {at_least}\n{stack.diagnostics()}"
    )


async def _nats_refuses_strangers(host_port: str, secrets: dict[str, str]) -> None:
    with pytest.raises(Unavailable, match="refused the login"):
        await Bus.connect(f"nats://{host_port}", name="anonymous", connect_wait_s=2.0)
    with pytest.raises(Unavailable, match="refused the login"):
        await Bus.connect(f"nats://trainer:wrong@{host_port}", name="wrong", connect_wait_s=2.0)
    password = secrets[auth.password_variable(auth.OBSERVER)]
    observer = await Bus.connect(f"nats://observer:{password}@{host_port}", name="observer")
    try:
        forged = events_pb2.LeaseEvent(event_id="forged", run_id=RUN_ID)
        with pytest.raises(Unavailable):
            await observer.publish(subjects.leases(RUN_ID, "d0"), forged, msg_id="forged", timeout_s=2.0)
    finally:
        await observer.close()


async def _grpc_refuses_callers_without_the_token(address: str, token: str) -> None:
    async with rpc.channel(address, token="") as open_channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await trajectory_pb2_grpc.TrajectoryStub(open_channel).GetStats(trajectory_pb2.GetStatsRequest())
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with rpc.channel(address, token="wrong") as wrong_channel:
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await trajectory_pb2_grpc.TrajectoryStub(wrong_channel).GetStats(trajectory_pb2.GetStatsRequest())
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with rpc.channel(address, token=token) as channel:
        await trajectory_pb2_grpc.TrajectoryStub(channel).GetStats(trajectory_pb2.GetStatsRequest())


def _postgres_refuses_strangers(port: int, secrets: dict[str, str]) -> None:
    for user, password in (("gyre", None), ("gyre", "gyre"), ("postgres", None), ("gyre_trainer", "wrong")):
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(host="127.0.0.1", port=port, user=user, password=password, dbname="gyre").close()
    with psycopg.connect(
        host="127.0.0.1",
        port=port,
        user="gyre_trajectory",
        password=secrets["GYRE_POSTGRES_PASSWORD_TRAJECTORY"],
        dbname="gyre",
    ) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE tableowner = current_user AND schemaname = 'public'"
            )
        ]
    assert tables, "the trajectory's migrations ran as its own role"
    with psycopg.connect(
        host="127.0.0.1",
        port=port,
        user="gyre_rollout",
        password=secrets["GYRE_POSTGRES_PASSWORD_ROLLOUT"],
        dbname="gyre",
    ) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(f"SELECT * FROM {tables[0]}")


def _wait_restarted_and_healthy(stack: Stack, service: str, restarts_before: int) -> dict[str, Any]:
    deadline = time.monotonic() + UP_TIMEOUT_S
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        state = stack.inspect(service)
        health = state["State"].get("Health", {}).get("Status")
        if state["RestartCount"] > restarts_before and state["State"]["Running"] and health == "healthy":
            return state
        time.sleep(2.0)
    pytest.fail(f"{service} not restarted and healthy: {state.get('State')}\n{stack.diagnostics()}")


def test_the_compose_stack_trains_refuses_strangers_and_survives_a_killed_trainer_container(
    stack: Stack,
) -> None:
    started = time.monotonic()
    stack.compose("up", "-d", "--wait", "--wait-timeout", str(UP_TIMEOUT_S), timeout_s=UP_TIMEOUT_S + 60)
    print(f"every container healthy {time.monotonic() - started:.0f} s after up")
    secrets = stack.secrets()
    nats_host_port = f"127.0.0.1:{stack.port('nats', 4222)}"
    observer_url = f"nats://observer:{secrets[auth.password_variable(auth.OBSERVER)]}@{nats_host_port}"

    before_kill = _wait_for_version(observer_url, 2, stack)
    print(f"weights version {before_kill} {time.monotonic() - started:.0f} s after up")

    asyncio.run(_nats_refuses_strangers(nats_host_port, secrets))
    asyncio.run(
        _grpc_refuses_callers_without_the_token(
            f"127.0.0.1:{stack.port('trajectory', 50051)}", secrets["GYRE_GRPC_TOKEN"]
        )
    )
    _postgres_refuses_strangers(stack.port("postgres", 5432), secrets)

    restarts = stack.inspect("trainer")["RestartCount"]
    killed_at = _wait_for_version(observer_url, before_kill, stack)
    # SIGKILL from the host to the container's init, as the OOM killer or a crash ends it. (`docker
    # kill` would not do: Docker counts it as a manual stop, which no restart policy undoes.)
    os.kill(stack.inspect("trainer")["State"]["Pid"], signal.SIGKILL)
    state = _wait_restarted_and_healthy(stack, "trainer", restarts)
    print(f"trainer restarted ({state['RestartCount']} restarts) and healthy again")
    after = _wait_for_version(observer_url, killed_at + 2, stack)
    print(f"weights version {after} after the kill at version {killed_at}")
    for service in ("scheduler", "trajectory", "rollout"):
        assert stack.inspect(service)["State"]["Running"], service

    # gyre chaos's loss counters for a trainer kill: no batch trained twice, none lost.
    stack.compose("stop", "trainer", timeout_s=120)  # drains: its final checkpoint lists every trained batch
    last_step_unix = asyncio.run(_last_weights_unix_s(observer_url))
    subprocess.run(
        ["docker", "cp", f"{stack.container('trainer')}:/data/run/trainer", str(stack.run_dir / "trainer")],
        check=True,
        capture_output=True,
    )
    trained = list(final_trainer_state(stack.run_dir).get("trained_batch_ids", []))
    assert trained, "the trainer's final checkpoint lists no trained batch"
    twice = sorted({b for b in trained if trained.count(b) > 1})
    assert not twice, f"batches trained twice: {twice}"
    trajectory_url = (
        f"postgresql+psycopg://gyre_trajectory:{secrets['GYRE_POSTGRES_PASSWORD_TRAJECTORY']}"
        f"@127.0.0.1:{stack.port('postgres', 5432)}/gyre"
    )
    handed = {
        b: row
        for b, row in batch_states(trajectory_url, RUN_ID).items()
        if row["state"] == "delivered" or (row["state"] == "acked" and (row["trained_at_version"] or 0) >= 0)
    }
    lost = [
        b
        for b, row in handed.items()
        if b not in trained and float(row["delivered_unix_s"] or 0) < last_step_unix
    ]
    assert not lost, f"batches handed to the trainer before its last step and never trained: {lost}"
    print(f"{len(set(trained))} batches trained, none twice, none lost")
