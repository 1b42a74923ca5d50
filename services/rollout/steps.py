"""Step and execution events out of the rollout service: one publisher, bounded, lossless.

`StepSink` is the interface the agent loop and the OpenAI endpoint write to. `BusStepSink`
publishes on NATS JetStream (subjects from gyre.bus.subjects):

- bounded buffer: `publish_*` waits while `max_buffer` events are queued (back-pressure on the
  agents instead of unbounded memory or dropped events);
- batched: a background task sends up to `batch_size` events with the bus's async publisher and
  waits for all their acks (`flush`);
- no loss: a batch whose acks do not all arrive is sent again, whole, after a back-off. Each
  event's `msg_id` is its `event_id`, so the stream stores a re-sent event once (dedup window).
  The one exception is an event larger than the server's max_payload, which no retry can store:
  it is logged as an error and counted in `num_oversized`.
- validated where produced: a step that fails gyre.validation (token ids outside `vocab_size`,
  non-finite or positive log-probs, lengths that differ, missing ids...) is not published on the
  step stream; it goes to the dead-letter stream with its reason (``Bus.dead_letter``: a counter per
  reason, rate-limited logging) and is counted in `num_invalid`. The consumer checks again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from google.protobuf.message import Message

from gyre.bus import Bus, subjects
from gyre.errors import GyreError, InvalidArgument, PayloadTooLarge
from gyre.v1 import events_pb2
from gyre.validation import Problem, execution_problem, step_problem

log = logging.getLogger(__name__)


class StepSink(Protocol):
    async def publish_step(self, event: events_pb2.StepEvent) -> None: ...
    async def publish_execution(self, event: events_pb2.ExecutionEvent) -> None: ...


class MemoryStepSink:
    """Keeps events in lists (for in-process use such as the bench; not a stand-in for NATS in tests)."""

    def __init__(self) -> None:
        self.steps: list[events_pb2.StepEvent] = []
        self.executions: list[events_pb2.ExecutionEvent] = []

    async def publish_step(self, event: events_pb2.StepEvent) -> None:
        self.steps.append(event)

    async def publish_execution(self, event: events_pb2.ExecutionEvent) -> None:
        self.executions.append(event)


class BusStepSink:
    def __init__(
        self,
        bus: Bus,
        *,
        max_buffer: int = 10_000,
        batch_size: int = 256,
        retry_backoff_s: float = 1.0,
        vocab_size: int | None = None,
    ) -> None:
        self.bus = bus
        self.vocab_size = vocab_size
        self.batch_size = batch_size
        self.retry_backoff_s = retry_backoff_s
        self._queue: asyncio.Queue[tuple[str, Message, str]] = asyncio.Queue(maxsize=max_buffer)
        self._publisher = bus.publisher(max_pending=max(batch_size, 1))
        self._task: asyncio.Task[None] | None = None
        self.num_published = 0
        self.num_retried_batches = 0
        self.num_oversized = 0
        self.num_invalid = 0

    def start(self) -> asyncio.Task[None]:
        """Run the publishing loop as a task of this object (tests, bench); services spawn `run()`."""
        self._task = asyncio.create_task(self.run(), name="step-publisher")
        return self._task

    async def publish_step(self, event: events_pb2.StepEvent) -> None:
        """Queue `event` for the step stream, or dead-letter it if it is invalid (never raises for that)."""
        problem = step_problem(event, vocab_size=self.vocab_size)
        try:
            subject = subjects.steps(event.run_id, event.task_id)
        except InvalidArgument as exc:  # ids that cannot be subject tokens
            problem = problem or Problem("bad_subject_token", str(exc))
            subject = subjects.steps("unknown", "unknown")
        if problem is not None:
            self.num_invalid += 1
            await self.bus.dead_letter(
                subject,
                event.SerializeToString(),
                "gyre.v1.StepEvent",
                problem.code,
                problem.reason,
                service="rollout",
            )
            return
        await self._queue.put((subject, event, event.event_id))

    async def publish_execution(self, event: events_pb2.ExecutionEvent) -> None:
        """Queue `event` for the execution stream, or dead-letter it if it is invalid."""
        problem = execution_problem(event)
        try:
            subject = subjects.executions(event.run_id, event.task_id)
        except InvalidArgument as exc:
            problem = problem or Problem("bad_subject_token", str(exc))
            subject = subjects.executions("unknown", "unknown")
        if problem is not None:
            self.num_invalid += 1
            await self.bus.dead_letter(
                subject,
                event.SerializeToString(),
                "gyre.v1.ExecutionEvent",
                problem.code,
                problem.reason,
                service="rollout",
            )
            return
        await self._queue.put((subject, event, event.event_id))

    @property
    def num_buffered(self) -> int:
        return self._queue.qsize()

    async def run(self) -> None:
        """The publishing loop (runs until cancelled)."""
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            while True:
                try:
                    for subject, msg, msg_id in batch:
                        try:
                            await self._publisher.publish(subject, msg, msg_id=msg_id)
                        except PayloadTooLarge as exc:  # can never be stored: count and log loudly, once
                            self.num_oversized += 1
                            log.error("event %s dropped: %s", msg_id, exc)
                    await self._publisher.flush()
                    break
                except GyreError as exc:  # Unavailable: re-send the whole batch; dedup keeps it once
                    self.num_retried_batches += 1
                    log.warning("step batch of %d not acknowledged (%s); re-sending", len(batch), exc)
                    await asyncio.sleep(self.retry_backoff_s)
            self.num_published += len(batch)
            for _ in batch:
                self._queue.task_done()

    async def flush(self) -> None:
        """Return once every event handed over so far is stored on its stream."""
        if self._task is not None and self._task.done():
            self._task.result()  # surface a crash
        await self._queue.join()

    async def close(self) -> None:
        await self.flush()
        if self._task is not None:
            self._task.cancel()


def now_s() -> float:
    return time.time()
