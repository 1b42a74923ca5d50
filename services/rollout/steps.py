"""Step and execution events out of the rollout service: one publisher, bounded, compact, lossless.

`StepSink` is the interface the agent loop, the OpenAI and Anthropic endpoints and the external
harness write to, each with full prompts. `BusStepSink` publishes on NATS JetStream (subjects from
gyre.bus.subjects):

- compact: every step goes out as a reference to the same execution's previous published call plus
  the tokens that differ (gyre.bus.steps.StepCompactor, the one implementation), with the full
  prompt's length and CRC-32 for the consumer's check. At 1M tokens an ordinary call puts its new
  turn on the wire instead of its whole history;
- bounded messages: a step whose message would exceed `max_step_bytes` (at most half the server's
  max_payload) is split into parts (gyre.bus.steps.split_step) published in order;
- bounded buffer: `publish_*` waits while `max_buffer` events are queued (back-pressure on the
  agents instead of unbounded memory or dropped events);
- batched: a background task sends up to `batch_size` messages with the bus's async publisher and
  waits for all their acks (`flush`);
- no loss: a batch whose acks do not all arrive is sent again, whole, after a back-off. Each
  message's `msg_id` is its event_id (plus the part), so the stream stores a re-sent one once.
- nothing dropped silently: a step that cannot be published (a part still over the server's
  max_payload, metadata alone over the bound) fails its execution: `publish_step` raises
  `StepNotPublished` (for that step and every later one of the execution), later steps of the
  execution already queued are not sent (their references would dangle), and the execution's end
  event goes out as FAILED with the reason. Counted in `num_unpublishable`.
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
from gyre.bus.steps import DEFAULT_STEP_MAX_BYTES, StepCompactor, split_step
from gyre.errors import GyreError, InvalidArgument, PayloadTooLarge
from gyre.v1 import events_pb2
from gyre.validation import Problem, execution_problem, step_problem

log = logging.getLogger(__name__)


_ENDS = frozenset(
    {
        events_pb2.ExecutionEvent.KIND_FINISHED,
        events_pb2.ExecutionEvent.KIND_TRUNCATED,
        events_pb2.ExecutionEvent.KIND_FAILED,
    }
)


class StepNotPublished(RuntimeError):
    """A step of this execution cannot be published: the execution fails with this reason."""


class StepSink(Protocol):
    async def publish_step(self, event: events_pb2.StepEvent) -> None: ...
    async def publish_execution(self, event: events_pb2.ExecutionEvent) -> None: ...
    def remember(self, event: events_pb2.StepEvent) -> None:
        """Note a stored call (full prompt) a resumed execution replayed: its next call is sent compact."""


class MemoryStepSink:
    """Keeps events in lists (for in-process use such as the bench; not a stand-in for NATS in tests)."""

    def __init__(self) -> None:
        self.steps: list[events_pb2.StepEvent] = []
        self.executions: list[events_pb2.ExecutionEvent] = []

    async def publish_step(self, event: events_pb2.StepEvent) -> None:
        self.steps.append(event)

    async def publish_execution(self, event: events_pb2.ExecutionEvent) -> None:
        self.executions.append(event)

    def remember(self, event: events_pb2.StepEvent) -> None:
        pass


class BusStepSink:
    def __init__(
        self,
        bus: Bus,
        *,
        max_buffer: int = 10_000,
        batch_size: int = 256,
        retry_backoff_s: float = 1.0,
        vocab_size: int | None = None,
        max_step_bytes: int = DEFAULT_STEP_MAX_BYTES,
    ) -> None:
        """`max_step_bytes`: bound of one step message (a longer step is split into parts); at most
        half the server's max_payload is used, whatever is asked."""
        self.bus = bus
        self.vocab_size = vocab_size
        self.batch_size = batch_size
        self.retry_backoff_s = retry_backoff_s
        self.max_step_bytes = max(4096, min(max_step_bytes, bus.max_payload // 2))
        self._queue: asyncio.Queue[tuple[str, Message, str]] = asyncio.Queue(maxsize=max_buffer)
        self._publisher = bus.publisher(max_pending=max(batch_size, 1))
        self._task: asyncio.Task[None] | None = None
        self._compactor = StepCompactor()
        # Execution id -> why one of its steps could not be published (until its end event is sent).
        self._failed: dict[str, str] = {}
        self.num_published = 0
        self.num_retried_batches = 0
        self.num_unpublishable = 0
        self.num_invalid = 0
        self.num_parts = 0  # extra messages from steps split into parts
        self.num_wire_bytes = 0  # step bytes handed to the publisher (parts included, retries not)

    def start(self) -> asyncio.Task[None]:
        """Run the publishing loop as a task of this object (tests, bench); services spawn `run()`."""
        self._task = asyncio.create_task(self.run(), name="step-publisher")
        return self._task

    def remember(self, event: events_pb2.StepEvent) -> None:
        self._compactor.remember(event)

    async def publish_step(self, event: events_pb2.StepEvent) -> None:
        """Queue `event` (full prompt) for the step stream, compact and in parts; dead-letter it if it
        is invalid (never raises for that); StepNotPublished if it cannot be published."""
        if (failed := self._failed.get(event.execution_id)) is not None:
            raise StepNotPublished(failed)
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
        wire = self._compactor.compact(event)
        try:
            parts = split_step(wire, self.max_step_bytes)
        except ValueError as exc:
            raise StepNotPublished(self._fail(event.execution_id, str(exc))) from None
        self.num_parts += len(parts) - 1
        for part in parts:
            msg_id = (
                event.event_id if len(parts) == 1 else f"{event.event_id}.part{part.part_index}of{len(parts)}"
            )
            await self._queue.put((subject, part, msg_id))

    def _fail(self, execution_id: str, reason: str) -> str:
        reason = f"a step could not be published: {reason}"
        self.num_unpublishable += 1
        log.error("execution %s fails: %s", execution_id, reason)
        self._failed.setdefault(execution_id, reason)
        self._compactor.forget(execution_id)
        return self._failed[execution_id]

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
        if event.kind in _ENDS:
            self._compactor.forget(event.execution_id)
        await self._queue.put((subject, event, event.event_id))

    @property
    def num_buffered(self) -> int:
        return self._queue.qsize()

    def _outgoing(self, item: tuple[str, Message, str]) -> tuple[str, Message, str] | None:
        """What to send for a queued item: None for a step of a failed execution (its reference would
        dangle), its end event turned FAILED with the reason (the failure then forgotten)."""
        subject, msg, msg_id = item
        reason = self._failed.get(getattr(msg, "execution_id", ""))
        if reason is None:
            return item
        if isinstance(msg, events_pb2.StepEvent):
            return None
        if isinstance(msg, events_pb2.ExecutionEvent) and msg.kind in _ENDS:
            del self._failed[msg.execution_id]
            failed = events_pb2.ExecutionEvent()
            failed.CopyFrom(msg)
            failed.kind = events_pb2.ExecutionEvent.KIND_FAILED
            failed.ClearField("reward")
            failed.error = reason[:2000]
            failed.event_id = f"{msg.execution_id}.failed"
            return subject, failed, failed.event_id
        return item

    async def run(self) -> None:
        """The publishing loop (runs until cancelled)."""
        while True:
            queued = [await self._queue.get()]
            while len(queued) < self.batch_size and not self._queue.empty():
                queued.append(self._queue.get_nowait())
            # What each queued item became (decided once, in order, so a retry re-sends the same).
            sending: dict[int, tuple[str, Message, str] | None] = {}
            while True:
                try:
                    for i, item in enumerate(queued):
                        if i not in sending:
                            sending[i] = self._outgoing(item)
                        out = sending[i]
                        if out is None:
                            continue
                        subject, msg, msg_id = out
                        try:
                            await self._publisher.publish(subject, msg, msg_id=msg_id)
                        except PayloadTooLarge as exc:  # can never be stored: the execution fails
                            sending[i] = None
                            self._fail(getattr(msg, "execution_id", ""), str(exc))
                    await self._publisher.flush()
                    break
                except GyreError as exc:  # Unavailable: re-send the whole batch; dedup keeps it once
                    self.num_retried_batches += 1
                    log.warning("step batch of %d not acknowledged (%s); re-sending", len(queued), exc)
                    await asyncio.sleep(self.retry_backoff_s)
            sent = [out[1] for out in sending.values() if out is not None]
            self.num_published += len(sent)
            self.num_wire_bytes += sum(m.ByteSize() for m in sent if isinstance(m, events_pb2.StepEvent))
            for _ in queued:
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
