"""Issue 26: a nats-server kill in a 3-node cluster loses no message and no step.

A 3-node EmbeddedNatsCluster with one user per role (as `gyre up` secures its server), Gyre's
streams declared with 3 replicas by the admin user, a rollout-role Bus publishing StepEvents and a
trajectory-role Bus consuming them with a durable consumer. After a third of the steps, the node
leading the steps stream is SIGKILLed; publishing goes on, retrying each unacked step with the same
message id (as services/rollout/steps.py does). The stream must hold every step exactly once and
the consumer must have received every one; the killed node, restarted, catches up.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest

from gyre.bus import Bus, auth, subjects
from gyre.embedded.nats_cluster import EmbeddedNatsCluster
from gyre.errors import Unavailable
from gyre.v1 import events_pb2

PASSWORDS = {role: auth.generate_password() for role in auth.ROLES}
NUM_STEPS = 300
KILL_AFTER = 100
STREAM = "GYRE_STEPS"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmbeddedNatsCluster]:
    with EmbeddedNatsCluster(tmp_path / "nats", size=3, passwords=PASSWORDS) as c:
        yield c


def _url(cluster: EmbeddedNatsCluster, role: str) -> str:
    """The server list of `cluster` with `role`'s credentials in every URL."""
    return ",".join(auth.url_with_credentials(u, role, PASSWORDS[role]) for u in cluster.urls)


def _step(run_id: str, seq: int) -> events_pb2.StepEvent:
    return events_pb2.StepEvent(
        event_id=f"{run_id}.e1.{seq}",
        run_id=run_id,
        task_id="t1",
        execution_id="e1",
        call_seq=seq,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        completion_logprobs=[-0.5, -1.25],
        completion_versions=[7, 7],
    )


async def _publish_until_acked(
    bus: Bus, subject: str, step: events_pb2.StepEvent, errors: Counter[str]
) -> None:
    """Bus.publish with the step's event_id as message id, retried until the stream acks it."""
    while True:
        try:
            await bus.publish(subject, step, msg_id=step.event_id, timeout_s=2.0)
            return
        except (Unavailable, nats.errors.Error, nats.js.errors.Error) as exc:
            errors[type(exc).__name__] += 1
            await asyncio.sleep(0.1)


async def _until(predicate: Callable[[], bool], timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 (polling a handler's counters)
            await asyncio.sleep(0.05)


async def _replay_ids(bus: Bus, subject_filter: str) -> list[str]:
    """Event ids of every stored step, in stream order. Creating the replay's ephemeral consumer can
    time out while the cluster still counts the killed node as a peer to place it on: retried."""
    for attempt in range(5):
        try:
            return [
                events_pb2.StepEvent.FromString(m.data).event_id async for m in bus.replay(subject_filter)
            ]
        except nats.errors.TimeoutError:
            if attempt == 4:
                raise
            await asyncio.sleep(1.0)
    raise AssertionError("unreachable")


@pytest.mark.slow
async def test_killing_the_steps_stream_leader_loses_no_message_and_no_step(
    cluster: EmbeddedNatsCluster,
) -> None:
    run_id = f"r{uuid.uuid4().hex[:10]}"
    subject = subjects.steps(run_id, "t1")
    admin = await Bus.connect(_url(cluster, auth.ADMIN), name="admin")
    await admin.ensure_streams(replicas=3)
    info = await admin.js.stream_info(STREAM)
    assert info.config.num_replicas == 3
    assert info.cluster is not None and len(info.cluster.replicas or []) == 2

    rollout = await Bus.connect(_url(cluster, "rollout"), name="rollout")
    await rollout.ensure_streams()  # as every service does at start: keeps the 3 replicas
    assert (await admin.js.stream_info(STREAM)).config.num_replicas == 3
    trajectory = await Bus.connect(_url(cluster, "trajectory"), name="trajectory")
    received: Counter[str] = Counter()

    async def handle(msgs: list[events_pb2.StepEvent]) -> None:
        received.update(m.event_id for m in msgs)

    await trajectory.consume(
        f"{subjects.PREFIX}.steps.{run_id}.>",
        events_pb2.StepEvent,
        handle,
        durable=f"trajectory-{run_id}",
        batch_size=32,
        ack_wait_s=5.0,
    )

    errors: Counter[str] = Counter()
    killed: int | None = None
    meta_leader_before: str | None = None
    killed_at = failover_s = 0.0
    for seq in range(NUM_STEPS):
        if seq == KILL_AFTER:
            info = await admin.js.stream_info(STREAM)
            assert info.cluster is not None and info.cluster.leader
            killed = cluster.index_of(info.cluster.leader)
            meta_leader_before = cluster.meta_leader()
            cluster.kill(killed)
            killed_at = time.monotonic()
        await _publish_until_acked(rollout, subject, _step(run_id, seq), errors)
        if seq == KILL_AFTER:
            failover_s = time.monotonic() - killed_at
    assert killed is not None
    await _until(lambda: len(received) >= NUM_STEPS, timeout_s=60.0)

    info = await admin.js.stream_info(STREAM, subjects_filter=subject)
    stored = int((info.state.subjects or {}).get(subject, 0))
    new_leader = info.cluster.leader if info.cluster else None
    meta_leader_after = cluster.wait_for_meta_leader(30.0)
    observer = await Bus.connect(_url(cluster, auth.OBSERVER), name="observer")
    stored_ids = await _replay_ids(observer, f"{subjects.PREFIX}.steps.{run_id}.>")
    expected = {_step(run_id, seq).event_id for seq in range(NUM_STEPS)}

    # The killed node comes back on its own store and catches up with what it missed.
    cluster.restart(killed)
    caught_up: int | None = None
    async with asyncio.timeout(60.0):
        while caught_up != NUM_STEPS:
            await asyncio.sleep(0.2)
            caught_up = cluster.stored_on(killed, STREAM)  # the node's own copy (its /jsz)

    print(
        f"\ncluster kill: published {NUM_STEPS} steps, killed node {killed} "
        f"({cluster.server_names()[killed]}, the steps stream leader) after {KILL_AFTER}; "
        f"new leader {new_leader}; meta leader {meta_leader_before} -> {meta_leader_after}; failover {failover_s:.2f} s (kill -> next ack); publish retries "
        f"{dict(errors)}; stored {stored} ({len(set(stored_ids))} distinct of {len(stored_ids)} replayed); "
        f"received {len(received)} distinct ({sum(received.values())} deliveries); restarted node "
        f"caught up: {caught_up}"
    )
    assert stored == NUM_STEPS
    assert sorted(stored_ids) == sorted(expected)  # no loss, no duplicate
    assert set(received) == expected
    assert caught_up == NUM_STEPS
    for bus in (observer, trajectory, rollout, admin):
        await bus.close()


@pytest.mark.slow
async def test_the_streams_command_scales_streams_a_service_created_with_one_replica_to_three(
    cluster: EmbeddedNatsCluster,
) -> None:
    import subprocess
    import sys

    # A service that started before the declaration created the streams with 1 replica.
    rollout = await Bus.connect(_url(cluster, auth.ADMIN), name="early-service")
    await rollout.ensure_streams()
    assert (await rollout.js.stream_info(STREAM)).config.num_replicas == 1
    cmd = [
        sys.executable,
        "-m",
        "app.launcher.streams",
        "--replicas",
        "3",
        "--nats-url",
        _url(cluster, auth.ADMIN),
    ]
    done = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert PASSWORDS[auth.ADMIN] not in done.stdout + done.stderr  # the login is never printed
    replicas = {
        spec.name: (await rollout.js.stream_info(spec.name)).config.num_replicas for spec in subjects.STREAMS
    }
    assert set(replicas.values()) == {3}, replicas
    again = await asyncio.to_thread(
        subprocess.run, [*cmd[:-1], _url(cluster, "rollout")], capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr  # already declared: nothing to change, a reader passes too
    await rollout.close()
