"""Supervision: a service (or the embedded nats-server) that exits is started again, on the same
address, counted, within a restart budget; a loop that dies takes its service out (NOT_SERVING,
exit 1) instead of leaving a zombie that says SERVING; an engine whose loop raises fails every
pending request with an error.

Real processes, real NATS and Postgres (the session fixtures or embedded servers), real gRPC
health. The only fault injected is at the outermost edge: SIGKILL, or the decode step of
tests/ops/engine_fault_service.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.launcher.healthcheck import check
from app.launcher.process import RestartPolicy

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FAULT_SERVICE = Path(__file__).with_name("engine_fault_service.py")
# The scheduler starts in seconds (no torch): process handling is tested with it.
LIGHT = "scheduler"
needs_light = pytest.mark.skipif(
    importlib.util.find_spec(f"services.{LIGHT}.__main__") is None, reason="no scheduler entry point"
)


def _config(tmp_path: Path, **launcher: Any) -> Path:
    path = tmp_path / "run.yaml"
    run = {
        "run_id": f"sup{uuid.uuid4().hex[:6]}",
        "run_dir": str(tmp_path / "run"),
        "launcher": {
            "services": [LIGHT],
            "start_timeout_s": 240,
            "stop_grace_s": 20,
            "restart_backoff_s": 0.2,
            **launcher,
        },
    }
    path.write_text(yaml.safe_dump(run))
    return path


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_restart_backoff_doubles_up_to_its_bound_and_the_budget_is_counted() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=60, initial_backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.backoff_s(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.allows(2) and not policy.allows(3)


@pytest.mark.slow
@needs_light
def test_a_killed_service_is_restarted_on_the_same_address_and_the_restart_is_counted(
    tmp_path: Path, nats_url: str, database_url: str
) -> None:
    from app.launcher import Deployment

    with Deployment(_config(tmp_path), nats_url=nats_url, database_url=database_url) as deployment:
        before = deployment.endpoints.services[LIGHT]
        os.kill(before.pid, signal.SIGKILL)
        _wait(lambda: any(r.serving_at for r in deployment.restarts), 240, "the restart")
        after = deployment.endpoints.services[LIGHT]
        health = check(after.grpc_address)
        stats = deployment.supervision_stats()
        dead = deployment.dead_services()
    assert after.grpc_address == before.grpc_address and after.pid != before.pid
    assert health == "SERVING"
    assert stats["restarts"] == {LIGHT: 1}
    event = stats["restart_events"][0]
    assert event["exit_code"] == -signal.SIGKILL and event["recovery_s"] > 0
    assert dead == []
    log = (tmp_path / "run" / "logs" / f"{LIGHT}.log").read_text()
    assert log.count(f"GYRE_READY {LIGHT}") == 2  # both incarnations wrote to the same log


@pytest.mark.slow
@needs_light
def test_a_service_that_spends_its_restart_budget_is_given_up_and_reported(
    tmp_path: Path, nats_url: str, database_url: str
) -> None:
    from app.launcher import Deployment, DeploymentError

    config = _config(tmp_path, max_restarts=1)
    with Deployment(config, nats_url=nats_url, database_url=database_url) as deployment:
        os.kill(deployment.endpoints.services[LIGHT].pid, signal.SIGKILL)
        _wait(lambda: any(r.serving_at for r in deployment.restarts), 240, "the first restart")
        os.kill(deployment.endpoints.services[LIGHT].pid, signal.SIGKILL)
        _wait(lambda: deployment.failed_services(), 60, "the supervisor to give up")
        with pytest.raises(DeploymentError) as down:
            deployment.check_alive()
        failed = deployment.failed_services()
    assert down.value.service == LIGHT
    assert "restart budget spent" in failed[LIGHT]


@needs_light
def test_with_restarts_off_a_dead_service_is_reported_with_its_log(
    tmp_path: Path, nats_url: str, database_url: str
) -> None:
    from app.launcher import Deployment, DeploymentError

    config = _config(tmp_path, restart=False)
    with Deployment(config, nats_url=nats_url, database_url=database_url) as deployment:
        os.kill(deployment.endpoints.services[LIGHT].pid, signal.SIGKILL)
        _wait(lambda: deployment.dead_services(), 30, "the exit to be seen")
        with pytest.raises(DeploymentError) as died:
            deployment.check_alive()
        restarts = list(deployment.restarts)
    assert died.value.service == LIGHT and f"GYRE_READY {LIGHT}" in died.value.log_tail
    assert restarts == []


@pytest.mark.slow
@needs_light
def test_a_killed_embedded_nats_server_comes_back_on_its_port_with_its_streams_and_clients_resume(
    tmp_path: Path, database_url: str
) -> None:
    from app.launcher import Deployment
    from gyre.bus import Bus

    async def publish_and_count(url: str, bus: Bus | None, subject: str, msg_id: str) -> tuple[Bus, int]:
        import nats

        bus = bus or await Bus.connect(url, name="test")
        for _attempt in range(10):  # a request written to the socket of the killed server is lost
            try:
                await bus.js.publish(subject, b"x", timeout=3, headers={"Nats-Msg-Id": msg_id})
                break
            except nats.errors.TimeoutError:
                continue
        info = await bus.js.stream_info("GYRE_METRICS", subjects_filter=subject)
        return bus, int(sum((info.state.subjects or {}).values()))

    from app.launcher.credentials import RunCredentials

    with Deployment(_config(tmp_path), database_url=database_url) as deployment:
        nats = deployment.embedded("nats")
        # The run's NATS is secured: publish as the rollout, on its own metrics subject.
        url = RunCredentials.load_or_create(tmp_path / "run").nats_url(nats.url, "rollout")
        subject = f"gyre.metrics.{uuid.uuid4().hex[:6]}.rollout"
        loop = asyncio.new_event_loop()
        try:
            bus, first = loop.run_until_complete(publish_and_count(url, None, subject, "m1"))
            os.kill(nats.pid, signal.SIGKILL)
            _wait(lambda: any(r.service == "nats" and r.serving_at for r in deployment.restarts), 60, "nats")
            # The client connected before the kill reconnects by itself and finds the stored message.
            _, second = loop.run_until_complete(publish_and_count(url, bus, subject, "m2"))
            loop.run_until_complete(bus.close())
        finally:
            loop.close()
        scheduler_health = check(deployment.endpoints.services[LIGHT].grpc_address)
        still_port = nats.port
        first_port = int(url.rsplit(":", 1)[1])
    assert (first, second) == (1, 2)  # the message stored before the kill survived it
    assert still_port == first_port
    assert scheduler_health == "SERVING"


@pytest.mark.slow
@needs_light
def test_a_deployment_on_a_three_node_nats_cluster_replicates_its_streams_and_restarts_a_killed_node(
    tmp_path: Path, database_url: str
) -> None:
    from app.launcher import Deployment
    from app.launcher.credentials import RunCredentials
    from gyre.bus import Bus, auth

    async def steps_stream() -> tuple[int, str]:
        bus = await Bus.connect(creds.nats_url(cluster.url, auth.ADMIN), name="test")
        try:
            info = await bus.js.stream_info("GYRE_STEPS")
        finally:
            await bus.close()
        assert info.cluster is not None and info.cluster.leader
        return int(info.config.num_replicas or 1), info.cluster.leader

    config = _config(tmp_path, nats_cluster_size=3)
    with Deployment(config, database_url=database_url) as deployment:
        cluster = deployment.embedded("nats")
        creds = RunCredentials.load_or_create(tmp_path / "run")
        replicas, leader = asyncio.run(steps_stream())
        # The scheduler got every node's URL, each with its own NATS user (not the admin's).
        service_urls = deployment._spawn_env[LIGHT]["GYRE_NATS_URL"].split(",")
        observer_urls = deployment.endpoints.nats_url.split(",")
        killed = cluster.index_of(leader)
        cluster.kill(killed)
        name = f"nats-n{killed}"
        _wait(lambda: any(r.service == name and r.serving_at for r in deployment.restarts), 90, name)
        back = cluster.nodes[killed].pid is not None
        leader_after = cluster.wait_for_meta_leader(30.0)
        scheduler_health = check(deployment.endpoints.services[LIGHT].grpc_address)
    assert replicas == 3
    assert len(service_urls) == 3 and all(auth.user_of(u) == LIGHT for u in service_urls)
    assert len(observer_urls) == 3 and all(auth.user_of(u) == auth.OBSERVER for u in observer_urls)
    assert back and leader_after in cluster.server_names()
    assert scheduler_health == "SERVING"


@pytest.mark.slow
def test_an_engine_whose_loop_raises_fails_its_pending_requests_and_its_service_exits_1(
    nats_url: str, database_url: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    env.update(GYRE_NATS_URL=nats_url, GYRE_DATABASE_URL=database_url)
    proc = subprocess.run(
        [sys.executable, str(FAULT_SERVICE)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    answered = [line for line in proc.stdout.splitlines() if line.startswith("REQUEST ")]
    assert "GYRE_READY enginefault" in proc.stdout
    assert len(answered) == 4, proc.stdout + proc.stderr
    assert all(" failed EngineFailed: " in line and "injected decode fault" in line for line in answered)
    assert proc.returncode == 1
    assert "shutting the service down" in proc.stderr + proc.stdout


async def test_a_supervised_task_that_raises_turns_health_not_serving_and_fails_the_runtime() -> None:
    from grpc_health.v1 import health_pb2

    from gyre import rpc
    from gyre.service import _CURRENT, Runtime, supervise

    server, port = rpc.create_server("127.0.0.1", 0)
    health = rpc.add_health(server)
    await rpc.set_serving(health, True, ("", "x"))
    rt = Runtime(common=None, bus=None, engine=None, server=server, port=port, name="x", health=health)  # type: ignore[arg-type]
    rt._failure = asyncio.get_running_loop().create_future()
    token = _CURRENT.set(rt)
    try:

        async def loop_that_dies() -> None:
            raise RuntimeError("loop died")

        task = supervise(asyncio.create_task(loop_that_dies()), "test-loop")
        await asyncio.gather(task, return_exceptions=True)
        failure = await asyncio.wait_for(rt._failure, 5)
        for _ in range(50):
            await asyncio.sleep(0.01)
            reply = await health.Check(health_pb2.HealthCheckRequest(service="x"), None)
            if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
    finally:
        _CURRENT.reset(token)
    assert isinstance(failure, RuntimeError)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_a_prompt_of_booleans_is_refused_and_the_engine_keeps_serving() -> None:
    from gyre.errors import InvalidArgument
    from gyre.model import ModelConfig
    from services.rollout.engines.base import EngineState, GenerationRequest, Sampling
    from services.rollout.engines.torch_engine import TorchEngine

    engine = TorchEngine("e0", "d0", ModelConfig.model_validate({}), init_seed=1)
    await engine.start()
    try:
        with pytest.raises(InvalidArgument, match="integer token ids"):
            await engine.generate(GenerationRequest("bad", [True, False], Sampling(max_tokens=2)))  # type: ignore[list-item]
        good = await engine.generate(
            GenerationRequest("good", [1, 2, 3], Sampling(max_tokens=2, stop_token_ids=()))
        )
        state = engine.state
    finally:
        await engine.close()
    assert good.finish_reason == "length" and len(good.token_ids) == 2
    assert state is EngineState.SERVING


async def test_a_restarted_trajectory_gate_starts_at_the_newest_published_weights(nats_url: str) -> None:
    """Its durable weights consumer acked every earlier event: the gate is seeded from the stream,
    or the rollout's current steps would be dead-lettered as 'version ahead' after a restart."""
    from gyre.bus import Bus, subjects
    from gyre.v1 import common_pb2, events_pb2
    from services.trajectory.config import TrajectoryConfig
    from services.trajectory.service import TrajectoryService
    from services.trajectory.validation import StepGate

    run = f"seed{uuid.uuid4().hex[:6]}"
    bus = await Bus.connect(nats_url, name="test")
    try:
        await bus.ensure_streams()
        fresh = StepGate(run, TrajectoryConfig())
        await TrajectoryService._seed_latest_weights(bus, fresh, run)
        for version in (3, 7):
            weights = common_pb2.WeightVersion(version=version)
            event = events_pb2.WeightsPublishedEvent(
                event_id=f"w.{run}.{version}", run_id=run, weights=weights
            )
            await bus.publish(subjects.weights(run), event)
        restarted = StepGate(run, TrajectoryConfig())
        await TrajectoryService._seed_latest_weights(bus, restarted, run)
    finally:
        await bus.close()
    assert fresh.latest_version == 0
    assert restarted.latest_version == 7


async def test_a_restarted_rollout_ends_the_executions_its_killed_predecessor_left_running(
    nats_url: str,
) -> None:
    from gyre.bus import Bus, subjects
    from gyre.v1 import events_pb2
    from services.rollout.executions import end_orphaned_executions
    from services.rollout.steps import BusStepSink

    run = f"orph{uuid.uuid4().hex[:6]}"
    E = events_pb2.ExecutionEvent

    def event(execution_id: str, kind: int, name: str) -> events_pb2.ExecutionEvent:
        return E(event_id=f"{execution_id}.{name}", run_id=run, task_id="t0", group_id="t0-g0",
                 execution_id=execution_id, kind=kind)  # type: ignore[arg-type]  # fmt: skip

    bus = await Bus.connect(nats_url, name="test")
    sink = BusStepSink(bus)
    sink.start()
    try:
        await bus.ensure_streams()
        assert await end_orphaned_executions(bus, sink, run) == []  # nothing on the bus yet
        for ev in (event("t0-g0-e0", E.KIND_STARTED, "started"), event("t0-g0-e1", E.KIND_STARTED, "started"),
                   event("t0-g0-e0", E.KIND_FINISHED, "finished")):  # fmt: skip
            await bus.publish(subjects.executions(run, "t0"), ev)
        orphans = await end_orphaned_executions(bus, sink, run)
        await sink.flush()
        again = await end_orphaned_executions(bus, sink, run)  # the FAILED events are on the bus now
        info = await bus.js.stream_info("GYRE_EXECUTIONS", subjects_filter=subjects.executions(run, "*"))
    finally:
        await sink.close()
        await bus.close()
    assert orphans == ["t0-g0-e1"]
    assert again == []
    assert sum((info.state.subjects or {}).values()) == 4  # 2 started, 1 finished, 1 failed (orphan)
