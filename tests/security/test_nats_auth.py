"""NATS authentication, subject permissions and message identity against a real nats-server.

The server here is an EmbeddedNats with one user per role of gyre.bus.auth, as `gyre up` starts it.
Every refusal is checked twice: the client sees an error, and the stream holds no such message.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import nats.errors
import pytest

from gyre.bus import Bus, auth, subjects
from gyre.bus.wire import MSG_ID_HEADER
from gyre.embedded import EmbeddedNats
from gyre.errors import Unavailable
from gyre.v1 import common_pb2, events_pb2

PASSWORDS = {role: auth.generate_password() for role in auth.ROLES}


@pytest.fixture(scope="module")
def secured_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL (without credentials) of a nats-server that requires a Gyre role's login."""
    with EmbeddedNats(tmp_path_factory.mktemp("nats-auth"), passwords=PASSWORDS) as server:
        assert server.url is not None
        yield server.url


def _url(base: str, role: str) -> str:
    return auth.url_with_credentials(base, role, PASSWORDS[role])


@pytest.fixture(scope="module")
async def admin_bus(secured_nats: str) -> AsyncIterator[Bus]:
    bus = await Bus.connect(_url(secured_nats, auth.ADMIN), name="admin")
    await bus.ensure_streams()
    yield bus
    await bus.close()


async def _connect(base: str, role: str) -> Bus:
    return await Bus.connect(_url(base, role), name=role)


async def _count(admin: Bus, stream: str, subject: str) -> int:
    info = await admin.js.stream_info(stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


def _lease(run_id: str) -> events_pb2.LeaseEvent:
    return events_pb2.LeaseEvent(event_id=f"lease-{uuid.uuid4().hex[:8]}", run_id=run_id)


def _weights(run_id: str, version: int) -> events_pb2.WeightsPublishedEvent:
    return events_pb2.WeightsPublishedEvent(
        event_id=f"weights.{run_id}.{version}",
        run_id=run_id,
        weights=common_pb2.WeightVersion(version=version, uri="file:///etc/passwd"),
    )


@pytest.mark.slow
async def test_an_anonymous_client_cannot_connect_so_cannot_publish_to_any_gyre_subject(
    secured_nats: str, admin_bus: Bus
) -> None:
    with pytest.raises(Unavailable, match="refused the login"):
        await Bus.connect(secured_nats, name="anonymous", connect_wait_s=2.0)
    # The raw client too, with a wrong password as well as without any.
    for url in (secured_nats, auth.url_with_credentials(secured_nats, "rollout", "guessed")):
        with pytest.raises((nats.errors.Error, OSError)):
            nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
            await nc.close()
    for spec in subjects.STREAMS:
        info = await admin_bus.js.stream_info(spec.name)
        assert info.state.messages == 0, f"{spec.name} holds messages nobody authorised published"


@pytest.mark.slow
async def test_the_rollouts_credentials_cannot_publish_a_lease_or_a_weights_event(
    secured_nats: str, admin_bus: Bus
) -> None:
    run_id = f"r{uuid.uuid4().hex[:8]}"
    rollout = await _connect(secured_nats, "rollout")
    try:
        with pytest.raises(Unavailable):
            await rollout.publish(subjects.leases(run_id, "d0"), _lease(run_id), msg_id="x", timeout_s=2.0)
        with pytest.raises(Unavailable):
            await rollout.publish(
                subjects.weights(run_id), _weights(run_id, 10**9), msg_id="y", timeout_s=2.0
            )
        # The rollout's own subjects are allowed: the refusal above is about *who*, not a broken server.
        step = events_pb2.StepEvent(event_id="s0", run_id=run_id, task_id="t")
        await rollout.publish(subjects.steps(run_id, "t"), step, msg_id=step.event_id)
        violations = list(rollout.permission_errors)
    finally:
        await rollout.close()
    assert await _count(admin_bus, "GYRE_LEASES", subjects.leases(run_id, "d0")) == 0
    assert await _count(admin_bus, "GYRE_WEIGHTS", subjects.weights(run_id)) == 0
    assert await _count(admin_bus, "GYRE_STEPS", subjects.steps(run_id, "t")) == 1
    assert sum("permissions violation" in v.lower() for v in violations) >= 2

    # Only the scheduler publishes leases and only the trainer weights.
    scheduler, trainer = await _connect(secured_nats, "scheduler"), await _connect(secured_nats, "trainer")
    try:
        await scheduler.publish(subjects.leases(run_id, "d0"), _lease(run_id), msg_id="l1")
        await trainer.publish(subjects.weights(run_id), _weights(run_id, 1), msg_id="w1")
        with pytest.raises(Unavailable):
            await trainer.publish(subjects.leases(run_id, "d0"), _lease(run_id), msg_id="l2", timeout_s=2.0)
    finally:
        await scheduler.close()
        await trainer.close()
    assert await _count(admin_bus, "GYRE_LEASES", subjects.leases(run_id, "d0")) == 1
    assert await _count(admin_bus, "GYRE_WEIGHTS", subjects.weights(run_id)) == 1


async def test_a_restarted_rollout_reads_back_the_steps_and_executions_it_published(
    secured_nats: str, admin_bus: Bus
) -> None:
    """What services/rollout/resume.py needs to resume executions after a kill (read-only)."""
    run_id = f"r{uuid.uuid4().hex[:8]}"
    first = await _connect(secured_nats, "rollout")
    try:
        step = events_pb2.StepEvent(event_id="s1", run_id=run_id, task_id="t", execution_id="e0")
        await first.publish(subjects.steps(run_id, "t"), step, msg_id=step.event_id)
        started = events_pb2.ExecutionEvent(
            event_id="x1", run_id=run_id, task_id="t", execution_id="e0",
            kind=events_pb2.ExecutionEvent.KIND_STARTED,
        )  # fmt: skip
        await first.publish(subjects.executions(run_id, "t"), started, msg_id=started.event_id)
    finally:
        await first.close()
    restarted = await _connect(secured_nats, "rollout")
    try:
        async with asyncio.timeout(20):
            steps = [m async for m in restarted.replay(subjects.steps(run_id, "t"), idle_timeout_s=2.0)]
            execs = [m async for m in restarted.replay(subjects.executions(run_id, "*"), idle_timeout_s=2.0)]
        violations = list(restarted.permission_errors)
    finally:
        await restarted.close()
    assert [events_pb2.StepEvent.FromString(m.data).execution_id for m in steps] == ["e0"]
    assert [events_pb2.ExecutionEvent.FromString(m.data).kind for m in execs] == [started.kind]
    assert not violations


@pytest.mark.slow
async def test_the_observer_reads_but_cannot_publish_or_manage_streams(
    secured_nats: str, admin_bus: Bus
) -> None:
    run_id = f"r{uuid.uuid4().hex[:8]}"
    trainer = await _connect(secured_nats, "trainer")
    await trainer.publish(subjects.weights(run_id), _weights(run_id, 3), msg_id="w3")
    await trainer.close()
    observer = await _connect(secured_nats, auth.OBSERVER)
    try:
        await observer.ensure_streams()  # the streams exist as declared: nothing to change, allowed
        seen = []
        async with asyncio.timeout(20):
            async for event in observer.tail(
                subjects.weights(run_id), events_pb2.WeightsPublishedEvent, from_start=True
            ):
                seen.append(event.weights.version)
                break
        assert seen == [3]
        with pytest.raises(Unavailable):
            await observer.publish(subjects.weights(run_id), _weights(run_id, 4), msg_id="w4", timeout_s=2.0)
        with pytest.raises(nats.errors.Error):
            await observer.nc.request("$JS.API.STREAM.DELETE.GYRE_WEIGHTS", b"", timeout=2.0)

        async def ignore(msgs: list[events_pb2.WeightsPublishedEvent]) -> None:
            return None

        with pytest.raises(Unavailable):  # no durable consumer (it could redefine a service's)
            await observer.consume(
                subjects.weights(run_id), events_pb2.WeightsPublishedEvent, ignore, durable="spy"
            )
    finally:
        await observer.close()
    assert await _count(admin_bus, "GYRE_WEIGHTS", subjects.weights(run_id)) == 1


async def test_a_message_id_taken_first_by_another_client_does_not_drop_the_real_event(
    secured_nats: str, admin_bus: Bus
) -> None:
    """An attacker (here with the trainer's own rights: the worst case) publishes first under the
    trainer's next predictable id; the real event is still stored and delivered, the conflict counted."""
    run_id = f"r{uuid.uuid4().hex[:8]}"
    attacker = await _connect(secured_nats, "trainer")
    trainer = await _connect(secured_nats, "trainer")
    rollout = await _connect(secured_nats, "rollout")
    subject = subjects.weights(run_id)
    event_id = f"weights.{run_id}.1"
    real = _weights(run_id, 1)
    fake = _weights(run_id, 10**9)
    try:
        # Both forms of pre-emption: the old predictable header, and our own header scheme.
        await attacker.js.publish(
            subject, fake.SerializeToString(), headers={MSG_ID_HEADER: f"{subject}/{event_id}"}
        )
        await attacker.publish(subject, fake, msg_id=event_id)
        ack = await trainer.publish(subject, real, msg_id=event_id)
        assert not ack.duplicate
        assert (await trainer.publish(subject, real, msg_id=event_id)).duplicate  # a retry stays deduplicated

        got: list[events_pb2.WeightsPublishedEvent] = []

        async def handle(msgs: list[events_pb2.WeightsPublishedEvent]) -> None:
            got.extend(msgs)

        consumer = await rollout.consume(
            subject, events_pb2.WeightsPublishedEvent, handle, durable=f"{run_id}-w"
        )
        async with asyncio.timeout(20):
            while len(got) < 3:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        await consumer.stop()
    finally:
        for bus in (attacker, trainer, rollout):
            await bus.close()
    assert real in got
    assert [g.weights.version for g in got].count(10**9) == 2
    # The raw pre-emption carried no Gyre-Msg-Id; the second fake and the real one share an event id.
    assert consumer.stats.num_conflicting_ids == 1


def test_permissions_follow_the_stream_declarations() -> None:
    rollout = auth.permissions("rollout")
    assert "gyre.steps.>" in rollout.publish and "gyre.executions.>" in rollout.publish
    assert not any(p.startswith(("gyre.leases", "gyre.weights", "gyre.paths")) for p in rollout.publish)
    assert "gyre.metrics.*.rollout" in rollout.publish
    # It reads back its own streams through ephemeral consumers only: no durable, no ack.
    assert "$JS.API.CONSUMER.CREATE.GYRE_STEPS" in rollout.publish
    assert not any(
        p.startswith(("$JS.ACK.GYRE_STEPS", "$JS.API.CONSUMER.DURABLE.CREATE.GYRE_STEPS"))
        for p in rollout.publish
    )
    assert auth.permissions("scheduler").publish.count("gyre.leases.>") == 1
    assert "gyre.weights.>" in auth.permissions("trainer").publish
    observer = auth.permissions(auth.OBSERVER)
    assert not any(p.startswith(("gyre.", "$JS.ACK", "$JS.API.CONSUMER.DURABLE")) for p in observer.publish)
    assert not any(".MSG.NEXT." in p for p in observer.publish)
    assert auth.permissions(auth.ADMIN).publish == ("$JS.API.>",)
    with pytest.raises(ValueError, match="unknown NATS role"):
        auth.permissions("thief")


def test_urls_carry_credentials_and_redact_them(tmp_path: Path) -> None:
    url = auth.url_with_credentials("nats://127.0.0.1:4222", "trainer", "p@ss/word")
    assert auth.user_of(url) == "trainer"
    assert "p@ss" not in auth.redact(url) and auth.redact(url) == "nats://trainer:***@127.0.0.1:4222"
    assert auth.redact("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
