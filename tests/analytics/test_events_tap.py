"""The analytics tap against a real nats-server: `gyre events tail` in its own process shows an
event another process publishes, and `gyre events export` turns the streams into a table."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from app.analytics.flatten import flatten, one_line
from gyre.bus import Bus, stream_filters, subjects
from gyre.errors import InvalidArgument
from gyre.v1 import common_pb2, events_pb2

# The installed `gyre` command, next to this interpreter (the venv's bin/).
GYRE = str(Path(sys.executable).with_name("gyre"))

PUBLISH_ONE_METRICS_EVENT = """
import asyncio, sys
from gyre.bus import Bus, subjects
from gyre.v1 import events_pb2

async def main(url, run_id):
    bus = await Bus.connect(url, name="test-publisher")
    await bus.ensure_streams()
    event = events_pb2.MetricsEvent(event_id=f"{run_id}.m1", run_id=run_id, service="rollout",
                                    values={"tokens_per_s": 123.5}, created_unix_s=1.0)
    await bus.publish(subjects.metrics(run_id, "rollout"), event, msg_id=event.event_id)
    await bus.close()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _read_line_with_deadline(stream: object, deadline_s: float) -> str:
    """A line from a pipe, or '' after the deadline (the caller's assertion then fails)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)  # type: ignore[arg-type]
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if sel.select(timeout=0.5):
            return stream.readline()  # type: ignore[attr-defined,no-any-return]
    return ""


def test_flatten_keeps_zero_scalars_names_enums_and_counts_repeated_fields() -> None:
    step = events_pb2.StepEvent(
        event_id="e.0",
        task_id="t1",
        call_seq=0,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        progress=common_pb2.ProgressSignal(),
    )
    row = flatten(step)
    assert row["call_seq"] == 0
    assert row["prompt_token_ids.count"] == 3
    assert row["completion_token_ids.count"] == 2
    execution = events_pb2.ExecutionEvent(kind=events_pb2.ExecutionEvent.KIND_FINISHED)
    row = flatten(execution)
    assert row["kind"] == "KIND_FINISHED"
    assert row["reward"] is None  # optional and unset: absent, not 0.0
    assert row["progress"] is None
    weights = events_pb2.WeightsPublishedEvent(metrics={"loss": 0.25})
    assert flatten(weights)["metrics.loss"] == 0.25
    assert "metrics.loss=0.25" in one_line(flatten(weights))


def test_a_wide_filter_reaches_every_stream_and_a_narrow_one_exactly_one() -> None:
    assert {s for s, _ in stream_filters("gyre.>")} == {s.name for s in subjects.STREAMS}
    assert ("GYRE_STEPS", "gyre.steps.r1.>") in stream_filters("gyre.*.r1.>")
    assert stream_filters("gyre.steps.r1.*") == [("GYRE_STEPS", "gyre.steps.r1.*")]
    with pytest.raises(InvalidArgument):
        stream_filters("other.subject")


@pytest.mark.integration
def test_events_tail_shows_an_event_published_by_another_process(nats_url: str) -> None:
    run_id = f"tail{uuid.uuid4().hex[:6]}"
    tail = subprocess.Popen(
        [GYRE, "events", "tail", f"gyre.metrics.{run_id}.>", "--nats-url", nats_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        banner = _read_line_with_deadline(tail.stderr, 60)
        assert banner.startswith("tailing"), banner
        subprocess.run(
            [sys.executable, "-c", PUBLISH_ONE_METRICS_EVENT, nats_url, run_id], check=True, timeout=60
        )
        line = _read_line_with_deadline(tail.stdout, 30)
    finally:
        tail.terminate()
        tail.wait(10)
    assert f"gyre.metrics.{run_id}.rollout MetricsEvent" in line
    assert "values.tokens_per_s=123.5" in line
    assert "service=rollout" in line


@pytest.mark.integration
async def test_events_export_writes_one_parquet_row_per_stored_event(nats_url: str, tmp_path: Path) -> None:
    run_id = f"exp{uuid.uuid4().hex[:6]}"
    bus = await Bus.connect(nats_url, name="test-export")
    await bus.ensure_streams()
    for i in range(3):
        step = events_pb2.StepEvent(
            event_id=f"x{i}.0",
            run_id=run_id,
            task_id="t1",
            execution_id=f"x{i}",
            completion_token_ids=[1] * i,
        )
        await bus.publish(subjects.steps(run_id, "t1"), step, msg_id=step.event_id)
    await bus.publish(subjects.steps(run_id, "t1"), step, msg_id=step.event_id)  # a retry: stored once
    done = events_pb2.ExecutionEvent(
        event_id="x0.done",
        run_id=run_id,
        task_id="t1",
        kind=events_pb2.ExecutionEvent.KIND_FINISHED,
        reward=1.0,
    )
    await bus.publish(subjects.executions(run_id, "t1"), done, msg_id=done.event_id)
    await bus.close()

    out = tmp_path / "events.parquet"
    proc = await asyncio.to_thread(
        subprocess.run,
        [GYRE, "events", "export", "--format", "parquet", "--out", str(out)]
        + ["--subject", f"gyre.*.{run_id}.>", "--nats-url", nats_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    table = pq.read_table(out)
    rows = table.to_pylist()
    assert sorted(r["type"] for r in rows) == ["ExecutionEvent", "StepEvent", "StepEvent", "StepEvent"]
    steps = sorted((r for r in rows if r["type"] == "StepEvent"), key=lambda r: r["execution_id"])
    assert [r["completion_token_ids.count"] for r in steps] == [0, 1, 2]
    finished = next(r for r in rows if r["type"] == "ExecutionEvent")
    assert (finished["kind"], finished["reward"]) == ("KIND_FINISHED", 1.0)
    assert str(table.schema.field("time").type).startswith("timestamp")
