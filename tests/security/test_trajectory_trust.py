"""The trajectory service's trust boundary, against real NATS, Postgres and gRPC: who may take
batches, what a PullBatch version may do, and what happens to a poisoned group.

The service runs in-process (as tests/trajectory does), with vocab_size 512 and the trainer
"trainer-0" registered.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import sqlalchemy

from gyre import rpc, store
from gyre.bus import Bus, subjects
from gyre.bus.wire import DEAD_CODE_HEADER, DEAD_REASON_HEADER
from gyre.config import CommonConfig
from gyre.service import Runtime
from gyre.v1 import common_pb2, events_pb2, trajectory_pb2, trajectory_pb2_grpc
from services.trajectory.config import TrajectoryConfig
from services.trajectory.service import TrajectoryService
from services.trajectory.synthetic import WorkloadConfig, end_event, generate, step_event

MIGRATIONS = Path(__file__).resolve().parents[2] / "services" / "trajectory" / "migrations"
VOCAB = 512
TINY = WorkloadConfig(
    num_groups=2,
    group_size=3,
    task_prompt_tokens=64,
    num_turns=4,
    generated_tokens=12,
    observation_tokens=16,
    compaction_every=3,
    summary_tokens=8,
    retry_fraction=0.0,
    shared_early_turns=1,
    seed=11,
)


@dataclass
class Running:
    service: TrajectoryService
    server: grpc.aio.Server
    bus: Bus
    engine: sqlalchemy.Engine
    channel: grpc.aio.Channel
    stub: trajectory_pb2_grpc.TrajectoryStub

    async def stop(self) -> None:
        await self.service.stop()
        await self.channel.close()
        await self.server.stop(0)
        await self.bus.close()
        self.engine.dispose()


@pytest.fixture
async def running(nats_url: str, database_url: str) -> AsyncIterator[tuple[Running, str]]:
    run_id = f"r{random.randrange(1 << 30)}"
    await asyncio.to_thread(store.upgrade, database_url, MIGRATIONS, "alembic_version_trajectory")
    engine = store.create_engine(database_url)
    bus = await Bus.connect(nats_url, name="trajectory-trust")
    await bus.ensure_streams()
    server, port = rpc.create_server()
    common = CommonConfig(run_id=run_id, nats_url=nats_url, database_url=database_url)
    cfg = TrajectoryConfig.model_validate(
        {"ready_poll_s": 0.1, "batch_max_wait_s": 0.0, "vocab_size": VOCAB, "trainer_workers": ["trainer-0"]}
    )
    service = TrajectoryService(common, cfg)
    await service.start(
        Runtime(common=common, bus=bus, engine=engine, server=server, port=port, name="trajectory")
    )
    await server.start()
    channel = rpc.channel(f"127.0.0.1:{port}")
    run = Running(service, server, bus, engine, channel, trajectory_pb2_grpc.TrajectoryStub(channel))
    yield run, run_id
    await run.stop()


async def _stat(run: Running, name: str) -> float:
    resp = await run.stub.GetStats(trajectory_pb2.GetStatsRequest())
    return resp.values.get(name, 0.0)


async def _until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 40.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("condition not reached in time")


async def _publish(run: Running, run_id: str, steps: list[events_pb2.StepEvent], execs) -> None:  # type: ignore[no-untyped-def]
    for s in steps:
        await run.bus.publish(subjects.steps(run_id, s.task_id), s, msg_id=s.event_id)
    for ex in execs:
        ev = end_event(run_id, ex)
        await run.bus.publish(subjects.executions(run_id, ex.task_id), ev, msg_id=ev.event_id)


async def _pull(run: Running, consumer: str = "trainer-0", **kw: object) -> list[trajectory_pb2.BatchChunk]:
    req = trajectory_pb2.PullBatchRequest(consumer=consumer, **kw)  # type: ignore[arg-type]
    return [c async for c in run.stub.PullBatch(req)]


async def test_pull_batch_from_an_unregistered_consumer_is_permission_denied_and_takes_nothing(
    running: tuple[Running, str],
) -> None:
    run, run_id = running
    execs = generate(TINY)
    await _publish(run, run_id, [step_event(run_id, c) for ex in execs for c in ex.calls], execs)
    await _until(lambda: _has(run, "groups_scored", 2))
    with pytest.raises(grpc.aio.AioRpcError) as thief:
        await _pull(run, consumer="thief", wait_s=1.0)
    assert thief.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not a registered trainer" in (thief.value.details() or "")

    chunks = await _pull(run, wait_s=5.0)  # the registered trainer still gets everything
    assert chunks and chunks[-1].last
    batch_id = chunks[0].batch_id
    for consumer in ("thief", ""):
        with pytest.raises(grpc.aio.AioRpcError) as ack:
            await run.stub.AckBatch(
                trajectory_pb2.AckBatchRequest(batch_id=batch_id, consumer=consumer, trained_at_version=1)
            )
        assert ack.value.code() == grpc.StatusCode.PERMISSION_DENIED
    await run.stub.AckBatch(
        trajectory_pb2.AckBatchRequest(batch_id=batch_id, consumer="trainer-0", trained_at_version=1)
    )
    assert await _stat(run, "batch_requests_denied") == 3


async def test_a_forged_current_version_does_not_mark_groups_stale(running: tuple[Running, str]) -> None:
    run, run_id = running
    execs = generate(TINY)
    await _publish(run, run_id, [step_event(run_id, c) for ex in execs for c in ex.calls], execs)
    await _until(lambda: _has(run, "groups_scored", 2))
    chunks = await _pull(run, wait_s=5.0, current_version=10**12)
    assert chunks, "the groups (version 0, within max_staleness of the published version 0) were handed out"
    assert await _stat(run, "groups_dropped_stale") == 0
    assert await _stat(run, "pull_versions_clamped") == 1


async def test_a_poisoned_group_is_dead_lettered_and_the_good_groups_are_still_batched(
    running: tuple[Running, str],
) -> None:
    run, run_id = running
    execs = generate(TINY)
    poisoned_group = execs[0].group_id
    steps = []
    for ex in execs:
        for c in ex.calls:
            ev = step_event(run_id, c)
            if ex.group_id == poisoned_group:
                ev.completion_token_ids[0] = 100_000  # vocabulary is 512
            steps.append(ev)
    num_poisoned = sum(1 for ex in execs if ex.group_id == poisoned_group for _ in ex.calls)
    num_good = len(steps) - num_poisoned
    dead: list[tuple[str, str]] = []

    async def tail_dead() -> None:
        sub = await run.bus.js.subscribe(
            subjects.dead_letters(run_id, "trajectory"), stream="GYRE_DEAD_LETTERS", ordered_consumer=True
        )
        async for msg in sub.messages:
            dead.append(
                (
                    (msg.headers or {}).get(DEAD_CODE_HEADER, ""),
                    (msg.headers or {}).get(DEAD_REASON_HEADER, ""),
                )
            )

    tail = asyncio.create_task(tail_dead())
    try:
        await _publish(run, run_id, steps, execs)
        await _until(lambda: _has(run, "stored_calls", num_good))

        async def all_dead() -> bool:
            return len(dead) >= num_poisoned

        await _until(all_dead)
    finally:
        tail.cancel()
    assert {code for code, _ in dead} == {"token_out_of_vocab"}
    assert "token id 100000" in dead[0][1] and "[0, 512)" in dead[0][1]
    assert await _stat(run, "stored_calls") == num_good  # nothing good was dropped with them
    assert await _stat(run, "steps_dead_lettered_token_out_of_vocab") == num_poisoned
    # Training goes on: the good group is scored and handed to the trainer, without the poison.
    await _until(lambda: _has(run, "groups_scored", 1))
    chunks = await _pull(run, wait_s=5.0)
    assert chunks
    assert max(t for c in chunks for t in c.token_ids) < VOCAB
    assert poisoned_group not in {g for c in chunks for g in c.group_ids}


async def test_a_step_from_a_future_weights_version_waits_for_that_version(
    running: tuple[Running, str],
) -> None:
    run, run_id = running
    ex = generate(TINY)[0]
    steps = [step_event(run_id, c) for c in ex.calls]
    for s in steps:
        s.completion_versions[:] = [1] * len(s.completion_versions)  # version 1 not published yet
    summary = await run.stub.IngestSteps(iter(steps))
    assert (summary.num_stored, summary.num_waiting, summary.num_rejected) == (0, len(steps), 0)
    far = [step_event(run_id, c) for c in ex.calls][:1]
    far[0].completion_versions[:] = [10**9] * len(far[0].completion_versions)
    summary = await run.stub.IngestSteps(iter(far))
    assert summary.num_rejected == 1 and "ahead of the latest published" in summary.errors[0]

    weights = common_pb2.WeightVersion(version=1, uri="file:///w/v1")
    ev = events_pb2.WeightsPublishedEvent(event_id=f"weights.{run_id}.1", run_id=run_id, weights=weights)
    await run.bus.publish(subjects.weights(run_id), ev, msg_id=ev.event_id)
    await _until(lambda: _has(run, "latest_weights_version", 1))
    summary = await run.stub.IngestSteps(iter(steps))
    assert summary.num_stored == len(steps)


async def _has(run: Running, name: str, at_least: float) -> bool:
    return await _stat(run, name) >= at_least


async def test_an_execution_event_with_a_nan_reward_is_dead_lettered_and_its_group_still_trains(
    running: tuple[Running, str],
) -> None:
    run, run_id = running
    execs = [ex for ex in generate(TINY) if ex.group_id == generate(TINY)[0].group_id]
    for ex in execs:
        for c in ex.calls:
            ev = step_event(run_id, c)
            await run.bus.publish(subjects.steps(run_id, ev.task_id), ev, msg_id=ev.event_id)
    bad = end_event(run_id, execs[0])
    bad.reward = float("nan")
    await run.bus.publish(subjects.executions(run_id, bad.task_id), bad, msg_id="nan")
    await _until(lambda: _has(run, "executions_dead_lettered_bad_reward", 1))
    for ex in execs:  # the real endings, the first one corrected
        ev = end_event(run_id, ex)
        await run.bus.publish(subjects.executions(run_id, ev.task_id), ev, msg_id=ev.event_id)
    await _until(lambda: _has(run, "groups_scored", 1))
    assert await _pull(run, wait_s=5.0)


@pytest.mark.parametrize(
    "args", [{"max_tokens": -5}, {"wait_s": -1.0}, {"wait_s": float("nan")}, {"current_version": -3}]
)
async def test_pull_batch_arguments_no_trainer_sends_are_invalid(
    running: tuple[Running, str], args: dict[str, object]
) -> None:
    run, _ = running
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _pull(run, **args)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
