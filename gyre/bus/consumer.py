"""Durable pull consumers of typed protobuf events (the Consumer guarantees of gyre/bus/nats_bus.py's
docstring: ack after the handler, nak with a growing delay, dead-letter what does not decode,
pipelined settling, identity checks). Started by `Bus.consume`, which is the only caller.

Sized in bytes: each fetch is one JetStream pull request bounded by count *and* bytes
(``max_bytes``, at least the server's max_payload), so a backlog of megabyte messages never piles
more than the budget into the server's outbound buffer of this connection (the cause of "Slow
Consumer" disconnects) or into this process. Messages are decoded in a worker thread.

Parts: a message that is one part of a larger one (``Parts.key``, e.g. a StepEvent split by its
producer) is held, unacknowledged and with its ack deadline extended, until every part arrived;
the handler then gets the joined message, and all its parts are acked, redelivered or
dead-lettered together. Parts whose siblings do not arrive within ``max_hold_s`` (their producer
died mid-publication) are dead-lettered with that reason.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import nats.errors
import nats.js.errors
from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api

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


class Parts(Protocol[M]):
    """How a consumer recognises and joins the parts of a message split by its producer."""

    def key(self, msg: M) -> tuple[str, int, int] | None:
        """(key shared by the parts of one message, part index, number of parts); None: a whole message."""

    def join(self, parts: list[M]) -> M:
        """The whole message of all its parts (any order); ValueError if they do not form one."""


class BoundedPull:
    """Pull requests on a durable consumer bounded by messages and bytes (the server stops a request
    before the message that would exceed ``max_bytes``), read from this connection's own inbox."""

    def __init__(self, nc: NatsClient, stream: str, durable: str, max_bytes: int) -> None:
        self._nc = nc
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.max_bytes = max_bytes
        self._inbox = nc.new_inbox()
        self._sub: Subscription | None = None

    async def start(self) -> None:
        # Room for two requests in flight (a lingering one may still deliver while the next runs).
        limit = 2 * self.max_bytes + (1 << 20)
        self._sub = await self._nc.subscribe(self._inbox, pending_bytes_limit=limit, pending_msgs_limit=-1)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def fetch(self, batch: int, wait_s: float) -> list[Msg]:
        """Up to `batch` messages of at most `max_bytes` in all: what is there now, else what arrives
        within `wait_s` seconds (possibly nothing)."""
        assert self._sub is not None, "start() first"
        msgs = self._drain(batch)  # left by an earlier lingering request
        if msgs:
            return msgs
        deadline = time.monotonic() + wait_s
        await self._request(batch, no_wait=True)
        msgs = await self._collect(batch, deadline, linger=False)
        if msgs or time.monotonic() >= deadline:
            return msgs
        await self._request(batch, expires_s=max(0.01, deadline - time.monotonic() - 0.05))
        return await self._collect(batch, deadline, linger=True)

    async def _request(self, batch: int, *, no_wait: bool = False, expires_s: float = 0.0) -> None:
        req: dict[str, object] = {"batch": batch, "max_bytes": self.max_bytes}
        if no_wait:
            req["no_wait"] = True
        if expires_s:
            req["expires"] = int(expires_s * 1e9)
        await self._nc.publish(self._next, json.dumps(req).encode(), reply=self._inbox)

    def _drain(self, batch: int) -> list[Msg]:
        assert self._sub is not None
        out: list[Msg] = []
        queue = self._sub._pending_queue  # messages already received on the inbox
        while len(out) < batch and not queue.empty():
            msg = queue.get_nowait()
            self._sub._pending_size -= len(msg.data)
            if not JetStreamContext.is_status_msg(msg):
                out.append(msg)
        return out

    async def _collect(self, batch: int, deadline: float, *, linger: bool) -> list[Msg]:
        """Messages of the request just sent until it ends (a status: no messages, timeout, max bytes
        reached), `batch` arrived, or the deadline; once one arrived, a lingering request waits at
        most a moment for more."""
        assert self._sub is not None
        msgs: list[Msg] = []
        size = 0
        while len(msgs) < batch:
            wait = deadline - time.monotonic()
            if msgs and linger:
                wait = min(wait, 0.05)
            if wait <= 0:
                break
            try:
                msg = await self._sub.next_msg(timeout=wait)
            except (TimeoutError, nats.errors.TimeoutError):
                break
            status = JetStreamContext.is_status_msg(msg)
            if status == api.StatusCode.CONTROL_MESSAGE:
                continue
            if status:
                break  # 404 no messages, 408 request expired, 409 max bytes / max waiting: request over
            msgs.append(msg)
            size += len(msg.data)
            if size >= self.max_bytes:
                break
        return msgs


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
        sub: BoundedPull,
        msg_type: type[M],
        handler: Handler[M],
        *,
        durable: str,
        batch_size: int,
        ack_wait_s: float,
        nak_delay_s: float,
        max_nak_delay_s: float,
        max_unsettled: int = 2,
        parts: Parts[M] | None = None,
        max_hold_s: float = 600.0,
    ) -> None:
        self._bus = bus
        self._sub = sub
        self._parts = parts
        self._max_hold_s = max_hold_s
        # Part key -> (when its first part arrived, part index -> (its message, decoded)).
        self._held: dict[str, tuple[float, dict[int, tuple[Msg, M]]]] = {}
        self._held_keepalive: asyncio.Task[None] | None = None
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
        if self._held_keepalive is not None:
            self._held_keepalive.cancel()
        await self._sub.stop()
        self._bus.forget_consumer(self)

    @property
    def num_held(self) -> int:
        """Parts held until their siblings arrive."""
        return sum(len(parts) for _, parts in self._held.values())

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
            msgs = await self._sub.fetch(self._batch_size, wait_s=1.0)
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

    def _decode(self, msgs: list[Msg]) -> list[M | DecodeError]:
        """Each message decoded, or the error it raised (run in a worker thread)."""
        out: list[M | DecodeError] = []
        for msg in msgs:
            try:
                out.append(self._msg_type.FromString(msg.data))
            except DecodeError as exc:
                out.append(exc)
        return out

    async def _terminate(self, msgs: list[Msg], code: str, reason: str) -> None:
        """Dead-letter each of `msgs` (the original payload) with `reason` and terminate it."""
        for msg in msgs:
            await self._bus.dead_letter(
                msg.subject,
                msg.data,
                self._msg_type.DESCRIPTOR.full_name,
                code,
                f"consumer {self.durable}: {reason}",
            )
            await msg.term()
            self.stats.num_terminated += 1
            CONSUMED.labels(self.durable, "term").inc()

    async def _units(self, msgs: list[Msg]) -> list[tuple[list[Msg], M]]:
        """The batch as (messages, decoded) units: a whole message alone, a split one once all its
        parts arrived (held until then); undecodable messages and unjoinable parts dead-lettered."""
        units: list[tuple[list[Msg], M]] = []
        for msg, item in zip(msgs, await asyncio.to_thread(self._decode, msgs), strict=True):
            if isinstance(item, DecodeError):
                name = self._msg_type.DESCRIPTOR.full_name
                await self._terminate([msg], "undecodable", f"{len(msg.data)} bytes are not a {name}: {item}")
                continue
            self._note_identity(msg)
            key = self._parts.key(item) if self._parts is not None else None
            if key is None:
                units.append(([msg], item))
                continue
            assert self._parts is not None
            group_key, index, count = key
            _, held = self._held.setdefault(group_key, (time.monotonic(), {}))
            held[index] = (msg, item)  # a redelivered part replaces its earlier delivery
            if len(held) < count:
                continue
            del self._held[group_key]
            parts = [held[i] for i in sorted(held)]
            try:
                joined = self._parts.join([d for _, d in parts])
            except ValueError as exc:
                await self._terminate([m for m, _ in parts], "bad_parts", str(exc))
                continue
            units.append(([m for m, _ in parts], joined))
        await self._expire_held()
        if self._held and self._held_keepalive is None:
            self._held_keepalive = asyncio.create_task(self._keep_held())
        return units

    async def _expire_held(self) -> None:
        """Dead-letter parts whose siblings did not arrive within max_hold_s."""
        now = time.monotonic()
        for key, (since, held) in list(self._held.items()):
            if now - since > self._max_hold_s:
                del self._held[key]
                await self._terminate(
                    [m for m, _ in held.values()],
                    "incomplete_parts",
                    f"{len(held)} parts of {key} waited {now - since:.0f} s for the rest (producer died mid-publication?)",
                )

    async def _keep_held(self) -> None:
        """Extend the ack deadline of held parts while there are any."""
        try:
            while self._held:
                await asyncio.sleep(self._ack_wait_s / 3)
                for _, held in list(self._held.values()):
                    for msg, _ in list(held.values()):
                        with contextlib.suppress(Exception):
                            await msg.in_progress()
        finally:
            self._held_keepalive = None

    async def _process(
        self, msgs: list[Msg], keepalive: asyncio.Task[None] | None
    ) -> asyncio.Task[None] | None:
        """Decode `msgs` and hand the good ones to the handler. Settled here, unless the handler
        returned an awaitable: then a task is returned that settles the batch when it completes (and
        owns `keepalive` from then on)."""
        try:
            units = await self._units(msgs)
            if not units:
                return None
            try:
                later = await self._handler([item for _, item in units])
            except Exception as exc:
                await self._refused_or_retry(units, exc)
                return None
            if later is None:
                await self._ack(units)
                return None
            task = asyncio.create_task(self._settle_later(units, later, keepalive))
            keepalive = None  # the settling task cancels it
            return task
        finally:
            if keepalive is not None:
                keepalive.cancel()

    async def _settle_later(
        self, units: list[tuple[list[Msg], M]], later: Awaitable[None], keepalive: asyncio.Task[None] | None
    ) -> None:
        try:
            await later
        except Exception as exc:
            await self._refused_or_retry(units, exc)
        else:
            await self._ack(units)
        finally:
            if keepalive is not None:
                keepalive.cancel()

    def _redelivery_delay(self, num_delivered: int) -> float:
        """Seconds before a nak'ed message is delivered again: doubling per delivery, capped."""
        return min(self._nak_delay_s * 2 ** (num_delivered - 1), self._max_nak_delay_s)

    async def _ack(self, units: list[tuple[list[Msg], M]]) -> None:
        n = 0
        for msgs, _ in units:
            for msg in msgs:
                await msg.ack()
                n += 1
        self.stats.num_acked += n
        CONSUMED.labels(self.durable, "ack").inc(n)

    async def _nak(self, msgs: list[Msg], delay: float) -> None:
        for msg in msgs:
            await msg.nak(delay=delay)
        self.stats.num_naked += len(msgs)
        CONSUMED.labels(self.durable, "nak").inc(len(msgs))

    async def _refused_or_retry(self, units: list[tuple[list[Msg], M]], exc: Exception) -> None:
        """The batch's handler raised `exc`: InvalidArgument -> find the refused messages one at a
        time; anything else -> redeliver the batch after a growing delay."""
        if isinstance(exc, InvalidArgument):
            await self._one_by_one(units)
            return
        self.stats.num_handler_errors += 1
        good = [m for msgs, _ in units for m in msgs]
        attempt = max(m.metadata.num_delivered for m in good)
        delay = self._redelivery_delay(attempt)
        log.error(
            "consumer %s: handler failed on a batch of %d (delivery %d); redelivering in %.2f s",
            self.durable,
            len(units),
            attempt,
            delay,
            exc_info=exc,
        )
        await self._nak(good, delay)

    async def _one_by_one(self, units: list[tuple[list[Msg], M]]) -> None:
        """Hand each message of a refused batch to the handler alone (handlers are idempotent, so what
        the batch call already did is harmless): acked if it passes, dead-lettered and terminated if
        the handler raises InvalidArgument for it, nak'ed (redelivered) on any other error. A message
        joined from parts is settled as one: all its parts together."""
        for msgs, item in units:
            try:
                later = await self._handler([item])
                if later is not None:
                    await later
            except InvalidArgument as exc:
                await self._terminate(msgs, "refused_by_handler", str(exc))
            except Exception:
                self.stats.num_handler_errors += 1
                delay = self._redelivery_delay(max(m.metadata.num_delivered for m in msgs))
                log.exception(
                    "consumer %s: handler failed on one message; redelivering in %.2f s", self.durable, delay
                )
                await self._nak(msgs, delay)
            else:
                await self._ack([(msgs, item)])

    async def _extend_deadline(self, msgs: list[Msg]) -> None:
        while True:
            await asyncio.sleep(self._ack_wait_s / 3)
            for msg in msgs:
                with contextlib.suppress(Exception):
                    await msg.in_progress()
