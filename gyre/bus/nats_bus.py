"""Typed protobuf events over NATS JetStream: publish, batched async publish, durable consumers, tail.

Guarantees (see gyre/bus/subjects.py for each stream):

* ``Bus.publish`` returns once the stream stored the message (or recognised ``(subject, msg_id)``
  as a duplicate within the dedup window). Retrying with the same ``msg_id`` is always safe.
* ``Publisher`` keeps at most ``max_pending`` un-acked messages in flight; ``publish`` waits when
  the window is full (back-pressure). ``flush()`` returns when every message was stored and raises
  ``Unavailable`` if any was not; republish those with the same ``msg_id``.
* ``Consumer`` (durable pull consumer, explicit ack): a batch is acked after the handler returned,
  nak'ed with a growing delay when it raised (redelivered, so handlers must be idempotent), and a
  message that does not decode is terminated (never redelivered), copied to the dead-letter stream
  with its reason and counted (logging is rate-limited). Until a batch is settled, its ack deadline
  is extended, so a slow handler does not cause redelivery.
* Pipelining: the next batch is fetched while the handler works, and a handler may return an
  awaitable (its commit) instead of waiting for it: the batch is then acked (or redelivered) when
  that completes, while the next batch is already handed over. Handlers are still called one at a
  time, in stream order; only the settling overlaps.
* Identity: ``Nats-Msg-Id`` is ``<subject>/<msg_id>/<payload digest>`` (see message_id_headers): a
  retry of the same event is dropped by the stream, while a message published first under a guessed
  id cannot make the stream drop the real event. A consumer counts (``num_conflicting_ids``) an event
  id it sees again with a different payload, and delivers both.
* A handler that raises InvalidArgument refuses a message for good: the batch is handed over again
  one message at a time, and each message the handler still refuses is dead-lettered and
  terminated (the others acked, or redelivered on any other error). Any other exception means
  "not now": the batch is redelivered.
* ``Bus.dead_letter`` is how a handler refuses an invalid message itself: the original payload goes to
  ``gyre.dead.<run>.<service>`` with its reason, a counter per reason code, a rate-limited log line.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import nats
import nats.errors
import nats.js.errors
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from prometheus_client import Counter

from gyre.bus import auth, subjects
from gyre.errors import InvalidArgument, PayloadTooLarge, Unavailable

log = logging.getLogger("gyre.bus")

M = TypeVar("M", bound=Message)
# A handler returns None when it is done with a batch, or an awaitable that completes when the batch
# is done (e.g. its database commit): the consumer then hands it the next batch meanwhile.
Handler = Callable[[list[M]], Awaitable[Awaitable[None] | None]]

MSG_ID_HEADER = "Nats-Msg-Id"
# The event's own id, `<subject>/<msg_id>`, without the payload digest (duplicate detection).
EVENT_ID_HEADER = "Gyre-Msg-Id"
DEAD_REASON_HEADER = "Gyre-Dead-Reason"
DEAD_SUBJECT_HEADER = "Gyre-Dead-Subject"
DEAD_CODE_HEADER = "Gyre-Dead-Code"
# Bytes of "NATS/1.0\r\n" + the final "\r\n" of a header block; each header adds ": " and "\r\n".
_HEADER_BLOCK_OVERHEAD = len("NATS/1.0\r\n") + len("\r\n")
# Event ids a consumer remembers to spot a second, different payload under the same id.
_SEEN_IDS = 65_536

PUBLISHED = Counter("gyre_bus_published_total", "Messages stored by JetStream", ["stream"])
PUBLISH_DUPLICATES = Counter(
    "gyre_bus_publish_duplicates_total",
    "Publishes dropped by the stream as duplicates of a msg_id (same event id and same payload)",
    ["stream"],
)
CONSUMED = Counter(
    "gyre_bus_consumed_total",
    "Messages a durable consumer finished, by outcome (ack, nak = redelivered later, term = undecodable)",
    ["consumer", "outcome"],
)
CONFLICTING_IDS = Counter(
    "gyre_bus_conflicting_ids_total",
    "Messages whose event id a consumer had already seen with a different payload (both were delivered)",
    ["consumer"],
)
DEAD_LETTERS = Counter(
    "gyre_dead_letters_total",
    "Messages refused as invalid and sent to GYRE_DEAD_LETTERS",
    ["service", "code"],
)
DEAD_LETTERS_LOST = Counter(
    "gyre_dead_letters_lost_total", "Dead letters that could not be stored (the refusal stands)", ["service"]
)


def message_id_headers(subject: str, msg_id: str, data: bytes) -> dict[str, str]:
    """Headers of a message with event id `msg_id`: ``Nats-Msg-Id`` is
    ``<subject>/<msg_id>/<blake2b-96 of the payload>``, so JetStream drops only a repeat of the *same*
    event (a retry), and a message published first under a guessed id with another payload cannot
    make the stream drop the real one; ``Gyre-Msg-Id`` (``<subject>/<msg_id>``) lets consumers see
    and count two different payloads under one id."""
    event_key = f"{subject}/{msg_id}"
    digest = hashlib.blake2b(data, digest_size=12).hexdigest()
    return {MSG_ID_HEADER: f"{event_key}/{digest}", EVENT_ID_HEADER: event_key}


def _headers_size(headers: dict[str, str]) -> int:
    return _HEADER_BLOCK_OVERHEAD + sum(len(k) + len(v) + 4 for k, v in headers.items())


def _one_line(text: str, limit: int) -> str:
    """A header-safe value: printable ASCII on one line, at most `limit` characters."""
    flat = "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in text)
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _same_stream_config(have: api.StreamConfig, want: api.StreamConfig) -> bool:
    """True when the server's stream config matches ours in everything ensure_streams sets."""

    def close(a: float | None, b: float | None) -> bool:
        return abs((a or 0.0) - (b or 0.0)) < 1e-3

    return (
        sorted(have.subjects or []) == sorted(want.subjects or [])
        and (have.description or "") == (want.description or "")
        and have.retention == want.retention
        and have.storage == want.storage
        and have.discard == want.discard
        and (have.max_bytes if have.max_bytes is not None else -1) == want.max_bytes
        and close(have.max_age, want.max_age)
        and close(have.duplicate_window, want.duplicate_window)
    )


class RateLimitedLog:
    """Logs at most `per_window` lines per key and window of `window_s` seconds; the first line of
    the next window says how many were suppressed (a flood of bad messages is a few lines a minute)."""

    def __init__(self, logger: logging.Logger, per_window: int = 5, window_s: float = 60.0) -> None:
        self._log = logger
        self._per_window = per_window
        self._window_s = window_s
        self._state: dict[str, tuple[float, int, int]] = {}  # key -> (window start, logged, suppressed)

    def log(self, key: str, fmt: str, *args: object) -> bool:
        """Log a WARNING unless `key` used up its lines this window; True if it was logged."""
        now = time.monotonic()
        start, logged, suppressed = self._state.get(key, (now, 0, 0))
        if now - start >= self._window_s:
            if suppressed:
                self._log.warning(
                    "%d more %r lines suppressed in the last %.0f s", suppressed, key, now - start
                )
            start, logged, suppressed = now, 0, 0
        if logged >= self._per_window:
            self._state[key] = (start, logged, suppressed + 1)
            return False
        self._state[key] = (start, logged + 1, suppressed)
        self._log.warning(fmt, *args)
        return True


_DEAD_LOG = RateLimitedLog(log)
_CONFLICT_LOG = RateLimitedLog(log)
_DENIED_LOG = RateLimitedLog(log)


def _stream_label(subject: str) -> str:
    try:
        return subjects.stream_for(subject).name
    except InvalidArgument:
        return "other"


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
        bus: Bus,
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
        # Event id -> payload digest of the last _SEEN_IDS events (see _note_identity).
        self._seen: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.task: asyncio.Task[None] = asyncio.create_task(self._run(), name=f"consumer:{durable}")
        self.task.add_done_callback(bus._on_consumer_done)

    async def stop(self) -> None:
        """Stop fetching, let the batch in hand finish (acked or nak'ed), unsubscribe. Idempotent."""
        self._stopping.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()
        self._bus._consumers.discard(self)

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
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError) as exc:
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
            if len(self._seen) > _SEEN_IDS:
                self._seen.popitem(last=False)
        elif seen != digest:
            self.stats.num_conflicting_ids += 1
            CONFLICTING_IDS.labels(self.durable).inc()
            _CONFLICT_LOG.log(
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


class Publisher:
    """Batched asynchronous publish with a bounded window of un-acked messages (back-pressure).

    Errors of earlier messages surface at the next ``publish`` or at ``flush``.
    """

    def __init__(self, bus: Bus, max_pending: int, stall_timeout_s: float) -> None:
        if max_pending < 1:
            raise InvalidArgument(f"max_pending must be >= 1, got {max_pending}")
        self._bus = bus
        self._js = bus.nc.jetstream(publish_async_max_pending=max_pending)
        self._stall_timeout_s = stall_timeout_s
        self._pending: set[asyncio.Future[api.PubAck]] = set()
        self._num_failed = 0
        self._first_error: BaseException | None = None
        self.num_published = 0

    @property
    def num_pending(self) -> int:
        """Messages sent but not yet acknowledged by the stream."""
        return len(self._pending)

    async def publish(self, subject: str, msg: Message, *, msg_id: str | None = None) -> None:
        """Send `msg`; waits only while `max_pending` messages are un-acked."""
        self._raise_failures()
        data, headers = self._bus._encode(subject, msg, msg_id)
        try:
            fut = await self._js.publish_async(
                subject, data, wait_stall=self._stall_timeout_s, headers=headers
            )
        except nats.js.errors.TooManyStalledMsgsError:
            raise Unavailable(
                f"{self.num_pending} publishes un-acknowledged for {self._stall_timeout_s} s; "
                "is NATS reachable and the stream declared (Bus.ensure_streams)?"
            ) from None
        self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future[api.PubAck]) -> None:
        self._pending.discard(fut)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self._num_failed += 1
            self._first_error = self._first_error or exc
            return
        self.num_published += 1
        ack = fut.result()
        PUBLISHED.labels(ack.stream).inc()
        if ack.duplicate:
            PUBLISH_DUPLICATES.labels(ack.stream).inc()

    def _raise_failures(self) -> None:
        if self._num_failed:
            n, err = self._num_failed, self._first_error
            self._num_failed, self._first_error = 0, None
            raise Unavailable(
                f"{n} async publishes failed (first error: {err!r}); republish them with the same msg_id"
            )

    async def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every message sent so far is stored; Unavailable if one failed or timed out."""
        pending = list(self._pending)
        if pending:
            done, not_done = await asyncio.wait(pending, timeout=timeout_s)
            for fut in not_done:
                fut.cancel()
            if not_done:
                raise Unavailable(
                    f"{len(not_done)} publishes not acknowledged within {timeout_s} s; "
                    "republish them with the same msg_id (dedup makes it harmless)"
                )
        self._raise_failures()


class Bus:
    """A NATS connection with JetStream, typed for Gyre's protobuf events."""

    def __init__(self, nc: NatsClient, name: str) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.name = name
        self._consumers: set[Consumer[Any]] = set()
        # The server's last 100 "permissions violation" errors on this connection (a publish or
        # subscribe its NATS user may not do; the publish then times out as Unavailable).
        self.permission_errors: list[str] = []
        # Messages this connection sent to the dead-letter stream, by code (see dead_letter).
        self.num_dead_letters: collections.Counter[str] = collections.Counter()
        # Called with the exception when a consumer's task dies unexpectedly (gyre.service sets it).
        self.on_consumer_failure: Callable[[BaseException], None] | None = None

    @classmethod
    async def connect(cls, url: str, *, name: str, connect_wait_s: float = 10.0) -> Bus:
        """Connect to NATS at `url`, retrying for about `connect_wait_s` seconds (Unavailable after);
        once connected, reconnect forever after a disconnection.

        Credentials go in the URL (``nats://user:password@host:4222``, see gyre.bus.auth); with a user,
        the connection's reply inbox is ``_INBOX_<user>``, the only inbox that user may subscribe to.
        A refused login raises Unavailable at once (no retries); the password is never logged."""
        connected = False
        reconnect_wait_s = 0.5
        shown = auth.redact(url)
        user = auth.user_of(url)
        refused: list[BaseException] = []
        denied: list[str] = []

        async def _error(exc: Exception) -> None:
            if isinstance(exc, nats.errors.AuthorizationError) or "Authorization Violation" in str(exc):
                refused.append(exc)
            if "permissions violation" in str(exc).lower():
                denied.append(str(exc))
                del denied[:-100]
                _DENIED_LOG.log(f"denied:{name}", "nats (%s): the server refused: %s", name, exc)
                return
            if connected:
                log.warning("nats (%s): %s", name, exc)
            else:
                log.debug("nats (%s): connect attempt failed: %s", name, exc)

        async def _disconnected() -> None:
            if connected and not (nc.is_closed or nc.is_draining):
                log.warning("nats (%s): disconnected from %s", name, shown)

        async def _reconnected() -> None:
            log.info("nats (%s): reconnected", name)

        nc = NatsClient()
        # nats-py annotates these two as int but takes seconds as float.
        timing: dict[str, Any] = {
            "connect_timeout": min(2.0, connect_wait_s),
            "reconnect_time_wait": reconnect_wait_s,
        }
        if user is not None:
            timing["inbox_prefix"] = auth.inbox_prefix(user)
        try:
            await nc.connect(
                url,
                name=f"gyre-{name}",
                max_reconnect_attempts=max(1, int(connect_wait_s / reconnect_wait_s)),
                allow_reconnect=True,
                error_cb=_error,
                disconnected_cb=_disconnected,
                reconnected_cb=_reconnected,
                **timing,
            )
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            if refused or isinstance(exc, nats.errors.AuthorizationError):
                raise Unavailable(
                    f"NATS at {shown} refused the login of {user or 'an anonymous client'}: authorization "
                    "violation; give this service its own credentials (nats://user:password@host:port, "
                    "see docs/operations.md#security)"
                ) from None
            raise Unavailable(
                f"cannot connect to NATS at {shown} within {connect_wait_s} s ({type(exc).__name__}); "
                "is nats-server running?"
            ) from None
        connected = True
        nc.options["max_reconnect_attempts"] = -1  # from now on, ride out server restarts
        bus = cls(nc, name)
        bus.permission_errors = denied
        return bus

    @property
    def max_payload(self) -> int:
        """Largest message (payload + headers) the server accepts, in bytes."""
        return int(self.nc.max_payload)

    async def ensure_streams(self) -> None:
        """Make every stream of gyre.bus.subjects.STREAMS exist with its declared config.

        A stream that already has that config is left alone, so a service whose NATS user may only
        read stream info (gyre.bus.auth: only ``admin`` manages streams) passes once the launcher
        declared them; a missing or different stream is created or updated, which needs that right."""
        for spec in subjects.STREAMS:
            config = api.StreamConfig(
                name=spec.name,
                description=spec.description,
                subjects=list(spec.subjects),
                retention=api.RetentionPolicy.LIMITS,
                storage=api.StorageType.FILE,
                max_age=spec.max_age_s,
                max_bytes=spec.max_bytes,
                duplicate_window=subjects.DUPLICATE_WINDOW_S,
                discard=api.DiscardPolicy.OLD,
            )
            try:
                info = await self.js.stream_info(spec.name)
            except nats.js.errors.NotFoundError:
                info = None
            except nats.errors.TimeoutError as exc:
                raise Unavailable(
                    f"no answer to stream info of {spec.name} ({exc!r}); does this NATS user have the "
                    "JetStream API rights of gyre.bus.auth?"
                ) from exc
            if info is not None and _same_stream_config(info.config, config):
                continue
            try:
                if info is None:
                    await self.js.add_stream(config)
                else:
                    await self.js.update_stream(config)
            except nats.js.errors.BadRequestError:
                await self.js.update_stream(config)
            except nats.errors.TimeoutError as exc:
                raise Unavailable(
                    f"stream {spec.name} is missing or differs from gyre.bus.subjects and this NATS user "
                    f"({self.name}) may not change it; declare the streams as the admin user first "
                    "(the launcher does, or `gyre up`)"
                ) from exc

    def _encode(self, subject: str, msg: Message, msg_id: str | None) -> tuple[bytes, dict[str, str] | None]:
        data = msg.SerializeToString()
        headers = message_id_headers(subject, msg_id, data) if msg_id else None
        size = len(data) + (_headers_size(headers) if headers else 0)
        if size > self.max_payload:
            raise PayloadTooLarge(
                f"{type(msg).__name__} on {subject} is {size} bytes, over the NATS server's max_payload of "
                f"{self.max_payload} bytes; send bulk data over gRPC (or raise max_payload in the server config)"
            )
        return data, headers

    async def dead_letter(
        self, subject: str, payload: bytes, type_name: str, code: str, reason: str, *, service: str = ""
    ) -> None:
        """Store a refused message on the dead-letter stream (gyre.dead.<run>.<service>) with its
        reason, count it (gyre_dead_letters_total{service, code}) and log it (at most a few lines per
        code and minute). `code` is a short label (``undecodable``, ``token_out_of_vocab``...), `reason`
        one human line. Never raises: a dead letter that cannot be stored is logged and counted."""
        service = service or self.name
        DEAD_LETTERS.labels(service, code).inc()
        self.num_dead_letters[code] += 1
        _DEAD_LOG.log(code, "%s refused a message on %s (%s): %s", service, subject, code, reason)
        parts = subject.split(".")
        try:
            dead_subject = subjects.dead_letters(parts[2] if len(parts) > 2 else "unknown", service)
        except InvalidArgument:
            dead_subject = subjects.dead_letters("unknown", service)
        letter = any_pb2.Any(type_url=f"type.googleapis.com/{type_name}", value=payload)
        headers = {
            DEAD_REASON_HEADER: _one_line(reason, 1024),
            DEAD_SUBJECT_HEADER: _one_line(subject, 512),
            DEAD_CODE_HEADER: _one_line(code, 64),
        }
        try:
            await self.js.publish(dead_subject, letter.SerializeToString(), timeout=10.0, headers=headers)
        except Exception as exc:  # the refusal itself stands; only the copy is lost
            DEAD_LETTERS_LOST.labels(service).inc()
            log.warning("dead letter of %s on %s could not be stored: %r", service, subject, exc)

    async def publish(
        self, subject: str, msg: Message, *, msg_id: str | None = None, timeout_s: float = 10.0
    ) -> api.PubAck:
        """Store `msg` on its stream and wait for the ack. `msg_id` is the dedup key (pass event_id);
        None only where duplicates are harmless. Unavailable if the stream does not answer in time."""
        data, headers = self._encode(subject, msg, msg_id)
        try:
            ack = await self.js.publish(subject, data, timeout=timeout_s, headers=headers)
        except (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError) as exc:
            raise Unavailable(
                f"no ack from JetStream for {subject} within {timeout_s} s ({exc!r}); retry with the same "
                "msg_id; if it persists, check that the streams exist (Bus.ensure_streams)"
            ) from exc
        PUBLISHED.labels(ack.stream).inc()
        if ack.duplicate:
            PUBLISH_DUPLICATES.labels(ack.stream).inc()
        return ack

    async def last(self, subject: str, msg_type: type[M]) -> M | None:
        """The newest message stored on `subject` (a concrete subject), decoded; None when none is.
        For state a restarted service must start from although its durable consumer acked it (the
        newest weights version). Undecodable: InvalidArgument."""
        try:
            stored = await self.js.get_last_msg(subjects.stream_for(subject).name, subject)
        except nats.js.errors.NotFoundError:
            return None
        if not stored.data:
            return None
        try:
            return msg_type.FromString(stored.data)
        except DecodeError as exc:
            raise InvalidArgument(f"the last message on {subject} is not a {msg_type.__name__}") from exc

    def publisher(self, max_pending: int = 10_000, *, stall_timeout_s: float = 30.0) -> Publisher:
        """A batched async publisher holding at most `max_pending` un-acked messages."""
        return Publisher(self, max_pending, stall_timeout_s)

    async def consume(
        self,
        subject_filter: str,
        msg_type: type[M],
        handler: Handler[M],
        *,
        durable: str,
        batch_size: int = 512,
        ack_wait_s: float = 30.0,
        nak_delay_s: float = 0.5,
        max_nak_delay_s: float = 30.0,
        deliver_new: bool = False,
        max_unsettled: int = 2,
    ) -> Consumer[M]:
        """Start a durable pull consumer named `durable` on `subject_filter` (see the module docstring).

        The consumer's position survives restarts (same `durable`). `deliver_new` only matters when
        the durable is first created: start at new messages instead of the stream's beginning.
        A redelivered batch waits `nak_delay_s * 2**(attempt-1)` seconds, at most `max_nak_delay_s`.
        `max_unsettled`: batches whose handler returned an awaitable that may wait for it at once
        while the next batch is handed over.
        """
        if batch_size < 1:
            raise InvalidArgument(f"batch_size must be >= 1, got {batch_size}")
        if max_unsettled < 1:
            raise InvalidArgument(f"max_unsettled must be >= 1, got {max_unsettled}")
        spec = subjects.stream_for(subject_filter)
        config = api.ConsumerConfig(
            name=durable,
            durable_name=durable,
            filter_subject=subject_filter,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=-1,
            max_ack_pending=max(1000, 4 * batch_size),
            max_waiting=64,
            deliver_policy=api.DeliverPolicy.NEW if deliver_new else api.DeliverPolicy.ALL,
        )
        try:
            await self.js.add_consumer(spec.name, config)
        except nats.js.errors.NotFoundError as exc:
            raise Unavailable(
                f"stream {spec.name} does not exist; call Bus.ensure_streams() before consuming"
            ) from exc
        except nats.errors.TimeoutError as exc:
            raise Unavailable(
                f"no answer creating consumer {durable} on {spec.name}: the server is slow, or this NATS user "
                f"({self.name}) may not read that stream with a durable consumer (gyre.bus.auth)"
            ) from exc
        sub = await self.js.pull_subscribe_bind(durable=durable, stream=spec.name)
        consumer: Consumer[M] = Consumer(
            self,
            sub,
            msg_type,
            handler,
            durable=durable,
            batch_size=batch_size,
            ack_wait_s=ack_wait_s,
            nak_delay_s=nak_delay_s,
            max_nak_delay_s=max_nak_delay_s,
            max_unsettled=max_unsettled,
        )
        self._consumers.add(consumer)
        return consumer

    def _on_consumer_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        assert exc is not None
        log.error("consumer task %s died: %r", task.get_name(), exc, exc_info=exc)
        if self.on_consumer_failure is not None:
            self.on_consumer_failure(exc)

    async def tail(
        self, subject_filter: str, msg_type: type[M], *, from_start: bool = False
    ) -> AsyncIterator[M]:
        """Yield decoded messages on `subject_filter` as they arrive (ephemeral ordered consumer,
        nothing acked or kept); `from_start` replays the stream first. Undecodable ones are skipped."""
        async for subject, data in self.tail_raw(subject_filter, from_start=from_start):
            try:
                yield msg_type.FromString(data)
            except DecodeError:
                _DEAD_LOG.log(
                    "tail:undecodable",
                    "tail: skipped undecodable message on %s (%d bytes)",
                    subject,
                    len(data),
                )

    async def tail_raw(
        self, subject_filter: str, *, from_start: bool = False
    ) -> AsyncIterator[tuple[str, bytes]]:
        """Yield (subject, payload) on `subject_filter`; decode with subjects.event_type_for(subject).

        A filter inside one stream uses an ordered JetStream consumer; a wider one (``gyre.>``) a plain
        NATS subscription, which sees new messages only."""
        try:
            spec: subjects.StreamSpec | None = subjects.stream_for(subject_filter)
        except InvalidArgument:
            if from_start:
                raise
            spec = None
        sub: Any
        if spec is not None:
            sub = await self.js.subscribe(
                subject_filter,
                stream=spec.name,
                ordered_consumer=True,
                deliver_policy=api.DeliverPolicy.ALL if from_start else api.DeliverPolicy.NEW,
            )
        else:
            sub = await self.nc.subscribe(subject_filter)
        try:
            async for msg in sub.messages:
                yield msg.subject, msg.data
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def close(self, timeout_s: float = 10.0) -> None:
        """Stop every consumer (finishing their batches), then drain and close the connection.
        Never raises: with the server gone (reset connection, timeout) the connection is just closed,
        so a caller's own shutdown (writing a report, exiting) always runs on."""
        await asyncio.gather(*(c.stop() for c in list(self._consumers)), return_exceptions=True)
        if self.nc.is_closed:
            return
        start = time.monotonic()
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=timeout_s)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            log.warning("nats drain did not finish after %.1f s (%r); closing", time.monotonic() - start, exc)
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.close()
