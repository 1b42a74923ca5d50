"""A service process under gyre.service: ready line, gRPC health, /metrics, graceful and failing exits."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gyre import rpc

TOY = Path(__file__).with_name("toy_service.py")
ROOT = Path(__file__).resolve().parents[2]


def _env(nats_url: str, database_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    env.update(GYRE_NATS_URL=nats_url, GYRE_DATABASE_URL=database_url, **extra)
    return env


@pytest.fixture
def toy_process(nats_url: str, database_url: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, str(TOY)],
        cwd=ROOT,
        env=_env(nats_url, database_url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _ready_line(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("GYRE_READY "):
            return line.split()
    raise AssertionError(
        f"no GYRE_READY line; exit {proc.wait()}, stderr:\n{proc.stderr.read() if proc.stderr else ''}"
    )


async def test_service_reports_ready_serves_health_and_metrics_and_drains_on_sigterm(
    toy_process: subprocess.Popen[str],
) -> None:
    _, name, grpc_port, metrics_port = _ready_line(toy_process)
    async with rpc.channel(f"127.0.0.1:{grpc_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        overall = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        named = await stub.Check(health_pb2.HealthCheckRequest(service="toy"))
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text

    toy_process.send_signal(signal.SIGTERM)
    out, err = await asyncio.to_thread(toy_process.communicate, timeout=60)

    assert name == "toy"
    assert overall.status == health_pb2.HealthCheckResponse.SERVING
    assert named.status == health_pb2.HealthCheckResponse.SERVING
    assert 'gyre_service_state{service="toy"} 1.0' in metrics
    assert toy_process.returncode == 0, err
    assert "TOY_DRAINED" in out


async def test_health_of_an_unknown_service_name_is_not_found(toy_process: subprocess.Popen[str]) -> None:
    _, _, grpc_port, _ = _ready_line(toy_process)
    async with rpc.channel(f"127.0.0.1:{grpc_port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_background_task_that_dies_takes_the_service_down_with_exit_code_1(
    nats_url: str, database_url: str
) -> None:
    proc = subprocess.run(
        [sys.executable, str(TOY)],
        cwd=ROOT,
        env=_env(nats_url, database_url, GYRE_TOY__CRASH_AFTER_S="0.2"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "toy-loop" in proc.stderr and "toy loop failed on purpose" in proc.stderr
    assert "TOY_DRAINED" in proc.stdout


def test_a_bad_config_value_exits_2_naming_the_field(nats_url: str, database_url: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(TOY)],
        cwd=ROOT,
        env=_env(nats_url, database_url, GYRE_TOY__CRASH_AFTER_S="soon"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "toy.crash_after_s" in proc.stderr


def test_without_nats_or_database_url_the_service_says_what_to_set(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    proc = subprocess.run(
        [sys.executable, str(TOY)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "GYRE_NATS_URL" in proc.stderr and "GYRE_DATABASE_URL" in proc.stderr
