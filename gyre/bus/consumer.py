"""Durable pull consumers of typed protobuf events (the Consumer guarantees of gyre/bus/nats_bus.py's
docstring: ack after the handler, nak with a growing delay, dead-letter what does not decode,
pipelined settling, identity checks). Started by `Bus.consume`, which is the only caller.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import nats.errors
import nats.js.errors
from google.protobuf.message import DecodeError, Message
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from gyre.bus.wire import (
    CONFLICT_LOG,
    CONFLICTING_IDS,
    CONSUMED,
    EVENT_ID_HEADER,
    MSG_ID_HEADER,
    SEEN_IDS,
    log,
)
from gyre.errors import InvalidArgument

M = TypeVar("M", bound=Message)
# A handler returns None when it is done with a batch, or an awaitable that completes when the batch
# is done (e.g. its database commit): the consumer then hands it the next batch meanwhile.
Handler = Callable[[list[M]], Awaitable[Awaitable[None] | None]]


class ConsumerHost(Protocol):
    """What a consumer needs of the bus that started it."""

    async def dead_letter(self, *args: Any, **kwargs: Any) -> None: ...

    def consumer_done(self, task: asyncio.Task[None]) -> None: ...

    def forget_consumer(self, consumer: Any) -> None: ...


@dataclass
class ConsumerStats:
    """Counts of one consumer since it started (messages, not batches)."""

    num_acked: int = 0
    num_naked: int = 0
    num_terminated: int = 0
    num_handler_errors: int = 0
    # Messages whose event id came before with a different payload (delivered too, and counted).
    num_conflicting_ids: int = 0


class Consumer(Generic[M]):
    """A running durable pull consumer; ``await stop()`` finishes the current batch and stops."""

    def __init__(
        self,
        bus: ConsumerHost,
        sub: JetStreamContext.PullSubscription,
        msg_type: type[M],
        handler: Handler[M],
        *,
        durable: str,
        batch_size: int,
        ack_wait_s: float,
        nak_delay_s: float,
        max_nak_delay_s: float,
        max_unsettled: int = 2,
    ) -> None:
        self._bus = bus
        self._sub = sub
        self._msg_type = msg_type
        self._handler = handler
        self.durable = durable
        self._batch_size = batch_size
        self._ack_wait_s = ack_wait_s
        self._nak_delay_s = nak_delay_s
        self._max_nak_delay_s = max_nak_delay_s
        self._max_unsettled = max_unsettled
        self._stopping = asyncio.Event()
        self.stats = ConsumerStats()
        # Event id -> payload digest of the last SEEN_IDS events (see _note_identity).
        self._seen: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.task: asyncio.Task[None] = asyncio.create_task(self._run(), name=f"consumer:{durable}")
        self.task.add_done_callback(bus.consumer_done)

    async def stop(self) -> None:
        """Stop fetching, let the batch in hand finish (acked or nak'ed), unsubscribe. Idempotent."""
        self._stopping.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()
        self._bus.forget_consumer(self)

    async def _run(self) -> None:
        """Fetch, then hand batches to the handler one after another, in fetch order.

        The next batch is fetched while the handler works on the current one (one batch ahead), and
        a batch whose handler returned an awaitable is settled (acked, or redelivered) when that
        completes while the next batch is already handed over (at most ``max_unsettled`` batches
        waiting). Every batch in hand has its ack deadline extended from the moment it arrives until
        it is settled. On stop, batches already fetched are still handled and settled, never left to
        time out.
        """
        ahead: asyncio.Task[tuple[list[Msg], asyncio.Task[None] | None]] | None = None
        unsettled: collections.deque[asyncio.Task[None]] = collections.deque()
        try:
            while not self._stopping.is_set():
                fetch = ahead if ahead is not None else asyncio.create_task(self._fetch())
                ahead = None
                msgs, keepalive = await fetch
                if not msgs:
                    continue
                if not self._stopping.is_set():
                    ahead = asyncio.create_task(self._fetch())
                while len(unsettled) >= self._max_unsettled:
                    await unsettled.popleft()
                later = await self._process(msgs, keepalive)
                if later is not None:
                    unsettled.append(later)
            if ahead is not None:
                msgs, keepalive = await ahead
                ahead = None
                if msgs and (later := await self._process(msgs, keepalive)) is not None:
                    unsettled.append(later)
            while unsettled:
                await unsettled.popleft()
        finally:
            if ahead is not None:
                ahead.cancel()
            for task in unsettled:
                task.cancel()

    async def _fetch(self) -> tuple[list[Msg], asyncio.Task[None] | None]:
        """One fetch of up to batch_size messages (empty after 1 s without any), with a task that
        keeps their ack deadline extended until the caller cancels it."""
        try:
            msgs = await self._sub.fetch(self._batch_size, timeout=1.0)
        except (TimeoutError, nats.errors.TimeoutError):
            return [], None
        except (
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.NoRespondersError,
            # 503 while a JetStream cluster elects a new leader for the stream or consumer (the server
            # that led it died): transient, the consumer's state lives on the other replicas.
            nats.js.errors.ServiceUnavailableError,
        ) as exc:
            if self._stopping.is_set():
                return [], None
            log.warning("consumer %s: fetch failed (%s); retrying in 1 s", self.durable, exc)
            await asyncio.sleep(1.0)
            return [], None
        if not msgs:
            return [], None
        return msgs, asyncio.create_task(self._extend_deadline(msgs))

    def _note_identity(self, msg: Msg) -> None:
        """Count a message whose event id this consumer already saw with another payload digest.
        Both are handed to the handler (which is idempotent by its natural key): nothing is dropped
        silently, and the counter says someone published a second, different event under one id."""
        headers = msg.headers or {}
        event_key, full_id = headers.get(EVENT_ID_HEADER), headers.get(MSG_ID_HEADER)
        if not event_key or not full_id:
            return
        digest = full_id.rsplit("/", 1)[-1]
        seen = self._seen.get(event_key)
        if seen is None:
            self._seen[event_key] = digest
            if len(self._seen) > SEEN_IDS:
                self._seen.popitem(last=False)
        elif seen != digest:
            self.stats.num_conflicting_ids += 1
            CONFLICTING_IDS.labels(self.durable).inc()
            CONFLICT_LOG.log(
                f"conflict:{self.durable}",
                "consumer %s: event id %s arrived again with a different payload; both delivered, counted",
                self.durable,
                event_key,
            )

    async def _process(
        self, msgs: list[Msg], keepalive: asyncio.Task[None] | None
    ) -> asyncio.Task[None] | None:
        """Decode `msgs` and hand the good ones to the handler. Settled here, unless the handler
        returned an awaitable: then a task is returned that settles the batch when it completes (and
        owns `keepalive` from then on)."""
        try:
            decoded: list[M] = []
            good: list[Msg] = []
            for msg in msgs:
                try:
                    decoded.append(self._msg_type.FromString(msg.data))
                    good.append(msg)
                except DecodeError as exc:
                    await self._bus.dead_letter(
                        msg.subject,
                        msg.data,
                        self._msg_type.DESCRIPTOR.full_name,
                        "undecodable",
                        f"consumer {self.durable}: {len(msg.data)} bytes are not a "
                        f"{self._msg_type.DESCRIPTOR.full_name}: {exc}",
                    )
                    await msg.term()
                    self.stats.num_terminated += 1
                    CONSUMED.labels(self.durable, "term").inc()
                    continue
                self._note_identity(msg)
            if not good:
                return None
            try:
                later = await self._handler(decoded)
            except Exception as exc:
                await self._refused_or_retry(good, decoded, exc)
                return None
            if later is None:
                await self._ack(good)
                return None
            task = asyncio.create_task(self._settle_later(good, decoded, later, keepalive))
            keepalive = None  # the settling task cancels it
            return task
        finally:
            if keepalive is not None:
                keepalive.cancel()

    async def _settle_later(
        self, good: list[Msg], decoded: list[M], later: Awaitable[None], keepalive: asyncio.Task[None] | None
    ) -> None:
        try:
            await later
        except Exception as exc:
            await self._refused_or_retry(good, decoded, exc)
        else:
            await self._ack(good)
        finally:
            if keepalive is not None:
                keepalive.cancel()

    def _redelivery_delay(self, num_delivered: int) -> float:
        """Seconds before a nak'ed message is delivered again: doubling per delivery, capped."""
        return min(self._nak_delay_s * 2 ** (num_delivered - 1), self._max_nak_delay_s)

    async def _ack(self, good: list[Msg]) -> None:
        for msg in good:
            await msg.ack()
        self.stats.num_acked += len(good)
        CONSUMED.labels(self.durable, "ack").inc(len(good))

    async def _refused_or_retry(self, good: list[Msg], decoded: list[M], exc: Exception) -> None:
        """The batch's handler raised `exc`: InvalidArgument -> find the refused messages one at a
        time; anything else -> redeliver the batch after a growing delay."""
        if isinstance(exc, InvalidArgument):
            await self._one_by_one(good, decoded)
            return
        self.stats.num_handler_errors += 1
        attempt = max(m.metadata.num_delivered for m in good)
        delay = self._redelivery_delay(attempt)
        log.error(
            "consumer %s: handler failed on a batch of %d (delivery %d); redelivering in %.2f s",
            self.durable,
            len(good),
            attempt,
            delay,
            exc_info=exc,
        )
        for msg in good:
            await msg.nak(delay=delay)
        self.stats.num_naked += len(good)
        CONSUMED.labels(self.durable, "nak").inc(len(good))

    async def _one_by_one(self, msgs: list[Msg], decoded: list[M]) -> None:
        """Hand each message of a refused batch to the handler alone (handlers are idempotent, so what
        the batch call already did is harmless): acked if it passes, dead-lettered and terminated if
        the handler raises InvalidArgument for it, nak'ed (redelivered) on any other error."""
        for msg, item in zip(msgs, decoded, strict=True):
            try:
                later = await self._handler([item])
                if later is not None:
                    await later
            except InvalidArgument as exc:
                await self._bus.dead_letter(
                    msg.subject,
                    msg.data,
                    self._msg_type.DESCRIPTOR.full_name,
                    "refused_by_handler",
                    f"consumer {self.durable}: {exc}",
                )
                await msg.term()
                self.stats.num_terminated += 1
                CONSUMED.labels(self.durable, "term").inc()
            except Exception:
                self.stats.num_handler_errors += 1
                delay = self._redelivery_delay(msg.metadata.num_delivered)
                log.exception(
                    "consumer %s: handler failed on one message; redelivering in %.2f s", self.durable, delay
                )
                await msg.nak(delay=delay)
                self.stats.num_naked += 1
                CONSUMED.labels(self.durable, "nak").inc()
            else:
                await msg.ack()
                self.stats.num_acked += 1
                CONSUMED.labels(self.durable, "ack").inc()

    async def _extend_deadline(self, msgs: list[Msg]) -> None:
        while True:
            await asyncio.sleep(self._ack_wait_s / 3)
            for msg in msgs:
                with contextlib.suppress(Exception):
                    await msg.in_progress()
