"""gyre.bus against a real nats-server with JetStream (session fixture `nats_url`).

Each test uses its own run_id, so tests share the streams without seeing each other's events.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from gyre.bus import Bus, subjects
from gyre.errors import InvalidArgument, PayloadTooLarge, Unavailable
from gyre.v1 import events_pb2


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    bus = await Bus.connect(nats_url, name="test")
    await bus.ensure_streams()
    yield bus
    await bus.close()


@pytest.fixture
def run_id() -> str:
    return f"r{uuid.uuid4().hex[:10]}"


def _step(run_id: str, seq: int, execution: str = "e1") -> events_pb2.StepEvent:
    return events_pb2.StepEvent(
        event_id=f"{run_id}.{execution}.{seq}",
        run_id=run_id,
        task_id="t1",
        execution_id=execution,
        call_seq=seq,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        completion_logprobs=[-0.5, -1.25],
        completion_versions=[7, 7],
    )


async def _until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Poll until `predicate` holds; fail (not hang) after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 (the handlers under test own no event to set)
            await asyncio.sleep(0.02)


async def test_typed_event_round_trips_through_a_durable_consumer(bus: Bus, run_id: str) -> None:
    sent = _step(run_id, 0)
    await bus.publish(subjects.steps(run_id, "t1"), sent, msg_id=sent.event_id)
    got: list[events_pb2.StepEvent] = []

    async def handle(msgs: list[events_pb2.StepEvent]) -> None:
        got.extend(msgs)

    consumer = await bus.consume(
        subjects.steps(run_id, "*"), events_pb2.StepEvent, handle, durable=f"{run_id}-rt"
    )
    await _until(lambda: len(got) >= 1)
    await consumer.stop()
    assert got == [sent]
    assert consumer.stats.num_acked == 1


async def test_a_batch_whose_handler_fails_is_redelivered_and_processed_once(bus: Bus, run_id: str) -> None:
    for seq in range(3):
        await bus.publish(subjects.steps(run_id, "t1"), _step(run_id, seq), msg_id=f"{run_id}.e1.{seq}")
    processed: list[str] = []
    calls = 0

    async def flaky(msgs: list[events_pb2.StepEvent]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("first attempt fails on purpose")
        processed.extend(m.event_id.removeprefix(run_id + ".") for m in msgs)

    consumer = await bus.consume(
        subjects.steps(run_id, "*"), events_pb2.StepEvent, flaky, durable=f"{run_id}-flaky", nak_delay_s=0.05
    )
    await _until(lambda: len(processed) >= 3)
    await consumer.stop()
    assert sorted(processed) == ["e1.0", "e1.1", "e1.2"]
    assert consumer.stats.num_handler_errors == 1
    assert consumer.stats.num_naked >= 1


async def test_a_handler_may_defer_its_commit_the_next_batch_is_handed_over_and_acks_wait_for_it(
    bus: Bus, run_id: str
) -> None:
    for seq in range(3):
        await bus.publish(subjects.steps(run_id, "t1"), _step(run_id, seq), msg_id=f"{run_id}.e1.{seq}")
    handed: list[list[str]] = []
    commits: list[asyncio.Future[None]] = []

    async def insert_then_commit_later(msgs: list[events_pb2.StepEvent]) -> asyncio.Future[None]:
        handed.append([m.event_id.removeprefix(run_id + ".") for m in msgs])
        commits.append(asyncio.get_running_loop().create_future())
        return commits[-1]

    consumer = await bus.consume(
        subjects.steps(run_id, "*"),
        events_pb2.StepEvent,
        insert_then_commit_later,
        durable=f"{run_id}-defer",
        batch_size=1,
        nak_delay_s=0.05,
        max_unsettled=2,
    )
    # Two batches handed over while neither is committed; the third waits for a free slot.
    await _until(lambda: len(handed) == 2)
    assert consumer.stats.num_acked == 0
    commits[0].set_result(None)
    await _until(lambda: consumer.stats.num_acked == 1 and len(handed) == 3)
    commits[1].set_exception(RuntimeError("the commit failed on purpose"))
    await _until(lambda: consumer.stats.num_naked == 1 and len(handed) == 4)
    commits[2].set_result(None)
    commits[3].set_result(None)  # the redelivered e1.1
    await _until(lambda: consumer.stats.num_acked == 3)
    await consumer.stop()
    assert handed[:3] == [["e1.0"], ["e1.1"], ["e1.2"]]  # handed over in stream order
    assert handed[3] == ["e1.1"]  # the failed commit was redelivered, not acked
    assert consumer.stats.num_handler_errors == 1


async def test_a_duplicate_publish_with_the_same_msg_id_is_stored_once(bus: Bus, run_id: str) -> None:
    subject = subjects.steps(run_id, "t1")
    first = await bus.publish(subject, _step(run_id, 0), msg_id=f"{run_id}.e1.0")
    again = await bus.publish(subject, _step(run_id, 0), msg_id=f"{run_id}.e1.0")
    await bus.publish(
        subject, _step(run_id, 1), msg_id=f"{run_id}.e1.1"
    )  # sentinel: arrives after any duplicate
    seen: list[str] = []

    async def handle(msgs: list[events_pb2.StepEvent]) -> None:
        seen.extend(m.event_id.removeprefix(run_id + ".") for m in msgs)

    consumer = await bus.consume(
        subjects.steps(run_id, "*"), events_pb2.StepEvent, handle, durable=f"{run_id}-dup"
    )
    await _until(lambda: "e1.1" in seen)
    await consumer.stop()
    assert again.duplicate and again.seq == first.seq
    assert seen == ["e1.0", "e1.1"]


@pytest.mark.slow
async def test_a_durable_consumer_resumes_after_its_last_ack(bus: Bus, run_id: str) -> None:
    subject, durable = subjects.executions(run_id, "t1"), f"{run_id}-resume"
    seen: list[str] = []

    async def handle(msgs: list[events_pb2.ExecutionEvent]) -> None:
        seen.extend(m.event_id.removeprefix(run_id + ".") for m in msgs)

    await bus.publish(subject, events_pb2.ExecutionEvent(event_id=f"{run_id}.a"), msg_id=f"{run_id}.a")
    consumer = await bus.consume(
        subjects.executions(run_id, "*"), events_pb2.ExecutionEvent, handle, durable=durable
    )
    await _until(lambda: seen == ["a"])
    await consumer.stop()
    await bus.publish(subject, events_pb2.ExecutionEvent(event_id=f"{run_id}.b"), msg_id=f"{run_id}.b")
    consumer = await bus.consume(
        subjects.executions(run_id, "*"), events_pb2.ExecutionEvent, handle, durable=durable
    )
    await _until(lambda: "b" in seen)
    await consumer.stop()
    assert seen == ["a", "b"]


async def test_an_undecodable_message_is_terminated_not_redelivered(bus: Bus, run_id: str) -> None:
    subject = subjects.steps(run_id, "t1")
    await bus.js.publish(subject, b"\xff\xff\xff\xff", headers={"Nats-Msg-Id": f"{run_id}.garbage"})
    await bus.publish(subject, _step(run_id, 0), msg_id=f"{run_id}.e1.0")
    seen: list[str] = []

    async def handle(msgs: list[events_pb2.StepEvent]) -> None:
        seen.extend(m.event_id.removeprefix(run_id + ".") for m in msgs)

    consumer = await bus.consume(
        subjects.steps(run_id, "*"), events_pb2.StepEvent, handle, durable=f"{run_id}-term", batch_size=1
    )
    await _until(lambda: "e1.0" in seen)
    await consumer.stop()
    info = await bus.js.consumer_info("GYRE_STEPS", f"{run_id}-term")
    assert seen == ["e1.0"]
    assert consumer.stats.num_terminated == 1
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_batched_publisher_keeps_at_most_max_pending_unacked_and_stores_everything(
    bus: Bus, run_id: str
) -> None:
    pub = bus.publisher(max_pending=8)
    most_pending = 0
    for seq in range(200):
        await pub.publish(subjects.steps(run_id, "t1"), _step(run_id, seq), msg_id=f"{run_id}.e1.{seq}")
        most_pending = max(most_pending, pub.num_pending)
    await pub.flush()
    info = await bus.js.stream_info("GYRE_STEPS", subjects_filter=subjects.steps(run_id, "*"))
    assert most_pending <= 8
    assert pub.num_published == 200
    assert info.state.subjects == {subjects.steps(run_id, "t1"): 200}


async def test_a_payload_over_the_server_limit_is_a_clear_error(bus: Bus, run_id: str) -> None:
    huge = events_pb2.MetricsEvent(event_id="big", service="x" * (bus.max_payload + 1))
    with pytest.raises(PayloadTooLarge, match="max_payload"):
        await bus.publish(subjects.metrics(run_id, "test"), huge, msg_id=f"{run_id}.big")
    with pytest.raises(PayloadTooLarge):
        await bus.publisher().publish(subjects.metrics(run_id, "test"), huge, msg_id=f"{run_id}.big")
    assert bus.max_payload == 8 * 1024 * 1024


async def test_tail_yields_events_published_after_it_started(bus: Bus, run_id: str) -> None:
    await bus.publish(
        subjects.weights(run_id), events_pb2.WeightsPublishedEvent(event_id="old"), msg_id=f"{run_id}.old"
    )
    stream = bus.tail(subjects.weights(run_id), events_pb2.WeightsPublishedEvent)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.5)  # let the ephemeral consumer start before the event is published
    await bus.publish(
        subjects.weights(run_id), events_pb2.WeightsPublishedEvent(event_id="new"), msg_id=f"{run_id}.new"
    )
    async with asyncio.timeout(20):
        got = await first
    await stream.aclose()
    assert got.event_id == "new"


async def test_equal_msg_ids_on_different_runs_are_both_stored(bus: Bus, run_id: str) -> None:
    other_run = run_id + "x"
    first = await bus.publish(subjects.steps(run_id, "t1"), _step(run_id, 0), msg_id="e1.0")
    second = await bus.publish(subjects.steps(other_run, "t1"), _step(other_run, 0), msg_id="e1.0")
    assert not first.duplicate and not second.duplicate
    assert second.seq != first.seq


def test_subject_builders_reject_ids_that_would_change_the_subject_shape() -> None:
    assert subjects.steps("run1", "*") == "gyre.steps.run1.*"
    assert subjects.event_type_for(subjects.paths_scored("run1")) is events_pb2.GroupScoredEvent
    with pytest.raises(InvalidArgument, match="task_id"):
        subjects.steps("run1", "task.with.dots")
    with pytest.raises(InvalidArgument, match="run_id"):
        subjects.leases("run 1", "d0")


async def test_connecting_to_a_port_without_nats_is_unavailable_not_a_hang() -> None:
    from gyre.embedded import free_port
    from gyre.errors import Unavailable

    with pytest.raises(Unavailable, match="cannot connect to NATS"):
        await Bus.connect(f"nats://127.0.0.1:{free_port()}", name="test", connect_wait_s=1.0)


async def test_a_message_the_handler_refuses_is_dead_lettered_and_its_batch_mates_are_handled(
    bus: Bus, run_id: str
) -> None:
    """A handler raising InvalidArgument for one message: the batch is retried one by one, the bad
    message goes to the dead-letter stream (never redelivered), the good ones are handled and acked."""
    for seq in range(4):
        await bus.publish(subjects.steps(run_id, "t1"), _step(run_id, seq), msg_id=f"{run_id}.e1.{seq}")
    handled: list[int] = []

    async def refuses_seq_2(msgs: list[events_pb2.StepEvent]) -> None:
        if any(m.call_seq == 2 for m in msgs):
            raise InvalidArgument("call 2 can never be handled")
        handled.extend(m.call_seq for m in msgs)

    consumer = await bus.consume(
        subjects.steps(run_id, "*"),
        events_pb2.StepEvent,
        refuses_seq_2,
        durable=f"{run_id}-refuse",
        batch_size=8,
    )
    await _until(lambda: consumer.stats.num_acked + consumer.stats.num_terminated >= 4)
    await consumer.stop()
    assert sorted(handled) == [0, 1, 3]
    assert (consumer.stats.num_acked, consumer.stats.num_terminated, consumer.stats.num_naked) == (3, 1, 0)
    assert bus.num_dead_letters["refused_by_handler"] == 1
    info = await bus.js.stream_info(
        "GYRE_DEAD_LETTERS", subjects_filter=subjects.dead_letters(run_id, "test")
    )
    assert (info.state.subjects or {}).get(subjects.dead_letters(run_id, "test")) == 1


async def test_last_is_the_newest_stored_message_of_a_subject_or_none(bus: Bus, run_id: str) -> None:
    """What a restarted service starts from although its durable consumer acked it (weights)."""
    subject = subjects.weights(run_id)
    assert await bus.last(subject, events_pb2.WeightsPublishedEvent) is None
    for version in (3, 7):
        event = events_pb2.WeightsPublishedEvent(event_id=f"w.{run_id}.{version}", run_id=run_id)
        event.weights.version = version
        await bus.publish(subject, event, msg_id=event.event_id)
    last = await bus.last(subject, events_pb2.WeightsPublishedEvent)
    assert last is not None and last.weights.version == 7


async def test_a_publish_no_stream_answers_yet_is_repeated_until_one_does_and_stored_once(
    bus: Bus, run_id: str
) -> None:
    """What a leader election after a cluster node's death looks like to a publisher: for a few
    seconds nobody answers for the stream. Bus.publish repeats the same message (same id) until the
    stream is back, within its patience, and the stream stores it once."""
    subject = f"gyretest.{run_id}.late"
    stream = f"GYRETEST_{run_id.upper()}"
    publish = asyncio.create_task(bus.publish(subject, _step(run_id, 0), msg_id="once", patience_s=20.0))
    await asyncio.sleep(1.5)  # several unanswered attempts
    assert not publish.done()
    await bus.js.add_stream(name=stream, subjects=[subject])
    try:
        ack = await publish
        info = await bus.js.stream_info(stream)
        assert ack.stream == stream and info.state.messages == 1
    finally:
        await bus.js.delete_stream(stream)


async def test_a_publish_nobody_answers_within_its_patience_is_unavailable(bus: Bus, run_id: str) -> None:
    with pytest.raises(Unavailable, match="attempt"):
        await bus.publish(
            f"gyretest.{run_id}.none", _step(run_id, 0), msg_id="x", timeout_s=0.5, patience_s=2.0
        )
