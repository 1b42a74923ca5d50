"""Compact steps end to end against real NATS and Postgres: the rollout's publisher (BusStepSink) sends
each call as a reference to the previous one plus the differing tokens, in parts when long; the
trajectory service rebuilds exactly what was generated, refuses what it cannot rebuild, and exports
call by call. Nothing is faked: the publisher, the bus consumer and the service are the real ones."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gyre.bus import Bus, subjects
from gyre.bus.steps import StepCompactor, join_stored_parts, split_step, token_crc32
from gyre.v1 import events_pb2, trajectory_pb2
from services.rollout.resume import ResumePlan
from services.rollout.steps import BusStepSink, StepNotPublished
from services.trajectory.cli import collect_export
from tests.trajectory.test_trajectory_service import start, stat, unique_run, wait_for

pytestmark = pytest.mark.integration

THINK_OPEN, THINK_CLOSE = 7, 8


def branching_history(
    run_id: str, execution_id: str, *, num_calls: int = 12, first_prompt: int = 300, seed: int = 0
) -> list[events_pb2.StepEvent]:
    """Full-prompt steps of one execution whose history branches the ways agents make it branch:
    earlier reasoning stripped from later prompts (every call), and every 4th call a compaction that
    replaces all but the opening and the last turn by a summary."""
    rng = np.random.default_rng(seed)
    opening = rng.integers(100, 50_000, first_prompt).tolist()
    turns: list[list[int]] = []  # what later prompts show of each turn (reasoning stripped)
    steps = []
    for k in range(num_calls):
        if k and k % 4 == 0:
            summary = rng.integers(100, 50_000, 20).tolist()
            turns = [summary, turns[-1]]
        prompt = opening + [t for turn in turns for t in turn]
        reasoning = rng.integers(100, 50_000, int(rng.integers(5, 40))).tolist()
        answer = rng.integers(100, 50_000, int(rng.integers(3, 20))).tolist()
        completion = [THINK_OPEN, *reasoning, THINK_CLOSE, *answer]
        observation = rng.integers(100, 50_000, int(rng.integers(10, 60))).tolist()
        turns.append(answer + observation)
        steps.append(
            events_pb2.StepEvent(
                event_id=f"{execution_id}.{k}",
                run_id=run_id,
                task_id="t0",
                group_id="t0-g0",
                execution_id=execution_id,
                call_seq=k,
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                completion_logprobs=[-0.5] * len(completion),
                completion_versions=[0] * len(completion),
                agent_id="main",
                finished_unix_s=1000.0 + k,
            )
        )
    return steps


def started_event(run_id: str, execution_id: str) -> events_pb2.ExecutionEvent:
    return events_pb2.ExecutionEvent(
        event_id=f"{execution_id}.started",
        run_id=run_id,
        task_id="t0",
        group_id="t0-g0",
        execution_id=execution_id,
        kind=events_pb2.ExecutionEvent.KIND_STARTED,
        environment="test",
    )


async def published(
    bus: Bus, steps: list[events_pb2.StepEvent], *, max_step_bytes: int = 1 << 20
) -> BusStepSink:
    sink = BusStepSink(bus, max_step_bytes=max_step_bytes)
    sink.start()
    await sink.publish_execution(started_event(steps[0].run_id, steps[0].execution_id))
    for s in steps:
        await sink.publish_step(s)
    await sink.flush()
    return sink


def assert_exported_exactly(
    exported: trajectory_pb2.ExportExecutionResponse, steps: list[events_pb2.StepEvent]
) -> None:
    assert [c.call_seq for c in exported.calls] == [s.call_seq for s in steps]
    for c, s in zip(exported.calls, steps, strict=True):
        assert list(c.prompt_token_ids) == list(s.prompt_token_ids)
        assert list(c.completion_token_ids) == list(s.completion_token_ids)
        assert list(c.completion_versions) == list(s.completion_versions)


async def test_compact_steps_of_a_stripped_reasoning_and_compaction_history_round_trip_exactly(
    nats_url, database_url
):
    run_id = unique_run()
    steps = branching_history(run_id, "t0-g0-e0")
    run = await start(nats_url, database_url, run_id)
    try:
        sink = await published(run.bus, steps)
        full_bytes = sum(s.ByteSize() for s in steps)
        assert sink.num_wire_bytes < full_bytes / 2  # only the differing tokens travel
        await wait_for(lambda: _stat_at_least(run, "steps_stored", len(steps)), timeout_s=60)
        assert_exported_exactly(await collect_export(run.stub, "t0-g0-e0"), steps)
        # What crossed the wire is compact: every call after the first names its predecessor.
        stored = [
            events_pb2.StepEvent.FromString(m.data)
            async for m in run.bus.replay(subjects.steps(run_id, "t0"))
        ]
        assert [s.prompt_base_call_seq for s in stored[1:]] == [s.call_seq - 1 for s in steps[1:]]
        assert all(
            s.prompt_num_tokens == len(f.prompt_token_ids) for s, f in zip(stored[1:], steps[1:], strict=True)
        )
        # Durable resume reads the same stored steps and rebuilds every full prompt.
        plan = await ResumePlan.load(run.bus, run_id, idle_timeout_s=1.0)
        (point,) = [p for p in plan.points if p.execution_id == "t0-g0-e0"]
        assert [list(s.prompt_token_ids) for s in point.steps] == [list(s.prompt_token_ids) for s in steps]
    finally:
        await run.stop()


async def test_a_step_over_the_bound_is_split_into_parts_and_reassembled(nats_url, database_url):
    run_id = unique_run()
    # A first prompt of 20K tokens (~60 KB) and a long completion, under a bound of 16 KiB.
    steps = branching_history(run_id, "t0-g0-e1", num_calls=5, first_prompt=20_000, seed=1)
    long_completion = list(range(1000, 4000))
    steps[2].completion_token_ids[:] = long_completion
    steps[2].completion_logprobs[:] = [-1.0] * len(long_completion)
    steps[2].completion_versions[:] = [0] * len(long_completion)
    steps = branching_history_continued(steps)
    bound = 16 << 10
    run = await start(nats_url, database_url, run_id)
    try:
        sink = await published(run.bus, steps, max_step_bytes=bound)
        assert sink.num_parts >= 4
        stored = [m async for m in run.bus.replay(subjects.steps(run_id, "t0"))]
        assert max(len(m.data) for m in stored) <= bound
        await wait_for(lambda: _stat_at_least(run, "steps_stored", len(steps)), timeout_s=60)
        assert_exported_exactly(await collect_export(run.stub, "t0-g0-e1"), steps)
        plan = await ResumePlan.load(run.bus, run_id, idle_timeout_s=1.0)
        (point,) = [p for p in plan.points if p.execution_id == "t0-g0-e1"]
        assert [list(s.completion_token_ids) for s in point.steps] == [
            list(s.completion_token_ids) for s in steps
        ]
        assert [list(s.prompt_token_ids) for s in point.steps] == [list(s.prompt_token_ids) for s in steps]
    finally:
        await run.stop()


def branching_history_continued(steps: list[events_pb2.StepEvent]) -> list[events_pb2.StepEvent]:
    """Make every later prompt extend the (edited) previous call's prompt + completion again."""
    for prev, cur in zip(steps, steps[1:], strict=False):
        cur.prompt_token_ids[:] = [*prev.prompt_token_ids, *prev.completion_token_ids, 42, 43]
    return steps


def test_split_and_join_are_inverse_and_respect_the_bound():
    (step,) = branching_history("r", "e", num_calls=1, first_prompt=50_000)
    parts = split_step(step, 32 << 10)
    assert len(parts) > 1 and all(p.ByteSize() <= 32 << 10 for p in parts)
    assert [p.part_index for p in parts] == list(range(len(parts)))
    (joined,) = join_stored_parts(parts)
    assert joined == step
    assert join_stored_parts(parts[:-1]) == []  # an incomplete publication is not a step


def test_the_compact_form_takes_the_longest_common_prefix_with_prompt_and_completion():
    steps = branching_history("r", "e", num_calls=6)
    compactor = StepCompactor()
    wire = [compactor.compact(s) for s in steps]
    assert not wire[0].HasField("prompt_base_call_seq")
    for prev, full, w in zip(steps, steps[1:], wire[1:], strict=False):
        sequence = [*prev.prompt_token_ids, *prev.completion_token_ids]
        prompt = list(full.prompt_token_ids)
        k = w.prompt_base_len
        assert sequence[:k] + list(w.prompt_token_ids) == prompt
        assert k == len(prompt) or k == len(sequence) or sequence[k] != prompt[k]  # longest
        assert w.prompt_crc32 == token_crc32(prompt)


async def test_an_unresolvable_reference_is_dead_lettered_not_stored(nats_url, database_url):
    run_id = unique_run()
    steps = branching_history(run_id, "t0-g0-e2", num_calls=2)
    compactor = StepCompactor()
    wire = [compactor.compact(s) for s in steps]
    beyond = events_pb2.StepEvent()
    beyond.CopyFrom(wire[1])
    beyond.prompt_base_len = 10**6  # longer than the base call
    wrong = events_pb2.StepEvent()
    wrong.CopyFrom(wire[1])
    wrong.prompt_crc32 ^= 1  # the rebuilt prompt will not match what the producer says it sent
    run = await start(nats_url, database_url, run_id)
    try:
        subject = subjects.steps(run_id, "t0")
        for i, s in enumerate([wire[0], beyond, wrong]):
            await run.bus.publish(subject, s, msg_id=f"{s.event_id}.{i}")
        await wait_for(lambda: _stat_at_least(run, "steps_unresolved", 2), timeout_s=60)
        assert run.bus.num_dead_letters["unresolved_reference"] == 2
        assert await stat(run, "steps_stored") == 1
        dead = [m async for m in run.bus.replay(subjects.dead_letters(run_id, "trajectory"))]
        assert len(dead) == 2
    finally:
        await run.stop()


async def test_a_step_that_cannot_be_published_fails_its_execution(nats_url):
    run_id = unique_run()
    bus = await Bus.connect(nats_url, name="rollout-test")
    await bus.ensure_streams()
    try:
        (step,) = branching_history(run_id, "t0-g0-e3", num_calls=1)
        step.engine_ids.extend(["engine-" + "x" * 100] * 100)  # 10 KB of metadata in every part
        sink = BusStepSink(bus, max_step_bytes=4096)
        sink.start()
        with pytest.raises(StepNotPublished, match="could not be published"):
            await sink.publish_step(step)
        with pytest.raises(StepNotPublished):  # and every later call of the execution
            await sink.publish_step(step)
        finished = started_event(run_id, "t0-g0-e3")
        finished.kind, finished.event_id, finished.reward = (
            events_pb2.ExecutionEvent.KIND_FINISHED,
            "x.finished",
            1.0,
        )
        await sink.publish_execution(finished)
        await sink.flush()
        (ended,) = [
            events_pb2.ExecutionEvent.FromString(m.data)
            async for m in bus.replay(subjects.executions(run_id, "t0"), idle_timeout_s=1.0)
        ]
        assert ended.kind == events_pb2.ExecutionEvent.KIND_FAILED
        assert "could not be published" in ended.error and not ended.HasField("reward")
        assert sink.num_unpublishable == 1
    finally:
        await bus.close()


async def test_fetches_are_bounded_in_bytes_not_only_in_count(nats_url):
    run_id = unique_run()
    bus = await Bus.connect(nats_url, name="bounded-fetch-test")
    await bus.ensure_streams()
    seen: list[int] = []
    try:
        # 24 steps of ~700 KB each under a fetch budget below one max_payload: each fetch is held to
        # about one max_payload, where a count of 512 would take all 24 (17 MB) at once.
        big = branching_history(run_id, "t0-g0-e4", num_calls=1, first_prompt=200_000)[0]
        for i in range(24):
            await bus.publish(subjects.steps(run_id, "t0"), big, msg_id=f"big.{i}")

        all_seen = asyncio.Event()

        async def handler(batch: list[events_pb2.StepEvent]) -> None:
            seen.append(sum(s.ByteSize() for s in batch))
            if sum(seen) >= 24 * big.ByteSize():
                all_seen.set()

        consumer = await bus.consume(
            subjects.steps(run_id, "*"),
            events_pb2.StepEvent,
            handler,
            durable=f"bounded-{run_id}",
            batch_size=512,
            fetch_max_bytes=1 << 20,
        )
        await asyncio.wait_for(all_seen.wait(), timeout=60)
        await consumer.stop()
        assert consumer.stats.num_acked >= 24
        assert max(seen) <= bus.max_payload + (64 << 10)
        assert len(seen) >= 24 * big.ByteSize() // (bus.max_payload + (64 << 10))
    finally:
        await bus.close()


async def test_export_of_a_long_execution_streams_one_call_per_message(nats_url, database_url):
    run_id = unique_run()
    steps = branching_history(run_id, "t0-g0-e5", num_calls=24, first_prompt=30_000, seed=5)
    steps = branching_history_continued(steps)  # no compaction: every prompt ~30K+ tokens
    compactor = StepCompactor()
    run = await start(nats_url, database_url, run_id)
    try:
        summary = await run.stub.IngestSteps(iter([compactor.compact(s) for s in steps]))
        assert summary.num_stored == len(steps)
        request = trajectory_pb2.ExportExecutionRequest(execution_id="t0-g0-e5")
        messages = [m async for m in run.stub.ExportExecution(request)]
        assert [len(m.calls) for m in messages] == [1] * len(steps)
        total = sum(m.ByteSize() for m in messages)
        assert max(m.ByteSize() for m in messages) < total / 10
        whole = trajectory_pb2.ExportExecutionResponse(calls=[c for m in messages for c in m.calls])
        assert_exported_exactly(whole, steps)
    finally:
        await run.stop()


async def _stat_at_least(run, name: str, n: int) -> bool:  # type: ignore[no-untyped-def]
    return await stat(run, name) >= n
