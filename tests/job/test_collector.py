"""The event collector against a real nats-server (the `nats_url` fixture); events are published here."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from app.job.collector import EventCollector
from app.job.eventlog import read_events
from gyre.bus import Bus, subjects
from gyre.v1 import common_pb2, events_pb2

pytestmark = pytest.mark.integration


async def test_collector_records_events_before_and_after_it_starts_once_each(
    nats_url: str, run_dir: Path
) -> None:
    run_id = f"c{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="test-collector")
    await bus.ensure_streams()
    try:
        early = events_pb2.WeightsPublishedEvent(
            event_id=f"weights.{run_id}.1", run_id=run_id, weights=common_pb2.WeightVersion(version=1)
        )
        await bus.publish(subjects.weights(run_id), early, msg_id=early.event_id)
        other_run = events_pb2.WeightsPublishedEvent(event_id="weights.other.1", run_id="other")
        await bus.publish(subjects.weights(f"{run_id}x"), other_run, msg_id=f"{run_id}x.1")

        collector = EventCollector(bus, run_id, run_dir)
        seen: list[str] = []
        collector.on_event(lambda r: seen.append(r["type"]))
        await collector.start()
        step = events_pb2.StepEvent(
            event_id="t0-g0-e0.0",
            run_id=run_id,
            task_id="t0",
            execution_id="t0-g0-e0",
            prompt_token_ids=[1, 2, 3],
            completion_token_ids=[4, 5],
            completion_logprobs=[-0.1, -0.2],
            completion_versions=[1, 1],
        )
        await bus.publish(subjects.steps(run_id, "t0"), step, msg_id=step.event_id)
        scored = events_pb2.GroupScoredEvent(event_id="scored.t0-g0", run_id=run_id, reward_mean=0.5)
        await bus.publish(subjects.paths_scored(run_id), scored, msg_id=scored.event_id)
        for _ in range(100):
            if len(seen) >= 3:
                break
            await asyncio.sleep(0.05)
        num_written = await collector.stop()
    finally:
        await bus.close()

    records = read_events(run_dir / "events.jsonl")
    assert num_written == 3
    assert sorted(r["type"] for r in records) == ["GroupScoredEvent", "StepEvent", "WeightsPublishedEvent"]
    step_record = next(r for r in records if r["type"] == "StepEvent")
    assert step_record["event"]["completion_version_counts"] == {"1": 2}
    assert all(r["event"]["run_id"] == run_id for r in records)


def test_a_resumed_runs_log_continues_the_old_one_each_event_once_and_a_torn_line_is_cut(tmp_path) -> None:
    from app.job.eventlog import EVENT_LOG_NAME, EventLogWriter, read_events

    path = tmp_path / EVENT_LOG_NAME

    def rec(event_id: str) -> dict:
        return {
            "type": "WeightsPublishedEvent",
            "subject": "s",
            "recv_unix_s": 1.0,
            "event": {"event_id": event_id},
        }

    with EventLogWriter(path) as first:
        assert first.write(rec("a")) and first.write(rec("b"))
    with path.open("a") as fh:
        fh.write('{"type": "WeightsPublishedEvent", "event": {"event_id": "c"')  # killed mid-write
    with EventLogWriter(path) as resumed:  # the collector of the resumed run replays the bus from its start
        assert not resumed.write(rec("a")) and not resumed.write(rec("b"))
        assert resumed.write(rec("c")) and resumed.write(rec("d"))
    assert [r["event"]["event_id"] for r in read_events(path)] == ["a", "b", "c", "d"]
    assert path.read_text().count("\n") == 4
