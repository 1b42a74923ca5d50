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
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats
import nats.errors
import nats.js.errors
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client as NatsClient
from nats.js import api

from gyre.bus import auth, subjects
from gyre.bus.consumer import BoundedPull, Consumer, Handler, M, Parts
from gyre.bus.publisher import Publisher
from gyre.bus.reader import REPLAY_IDLE_TIMEOUT_S, StoredMessage, follow, num_stored, replay
from gyre.bus.steps import STEP_PARTS
from gyre.bus.wire import (
    DEAD_CODE_HEADER,
    DEAD_LETTERS,
    DEAD_LETTERS_LOST,
    DEAD_LOG,
    DEAD_REASON_HEADER,
    DEAD_SUBJECT_HEADER,
    DENIED_LOG,
    PUBLISH_DUPLICATES,
    PUBLISH_RETRIES,
    PUBLISHED,
    headers_size,
    log,
    message_id_headers,
    one_line,
    same_stream_config,
)
from gyre.errors import InvalidArgument, PayloadTooLarge, Unavailable
from gyre.v1 import events_pb2

# How long Bus.publish keeps repeating an unanswered publish (s): a JetStream leader election after a
# cluster node dies takes a few seconds; a single server that stays down fails after this.
PUBLISH_PATIENCE_S = 30.0
# Errors that mean "nobody answered this publish yet", not "refused": safe to repeat with the same id.
_UNANSWERED = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)


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
        once connected, reconnect forever after a disconnection. `url` may list several servers of
        one cluster, comma-separated (``nats://a:4222,nats://b:4222``): the client connects to one
        and fails over to the others.

        Credentials go in the URL (``nats://user:password@host:4222``, see gyre.bus.auth); with a user,
        the connection's reply inbox is ``_INBOX_<user>``, the only inbox that user may subscribe to.
        A refused login raises Unavailable at once (no retries); the password is never logged."""
        connected = False
        reconnect_wait_s = 0.5
        urls = [u.strip() for u in url.split(",") if u.strip()]
        shown = ",".join(auth.redact(u) for u in urls)
        user = auth.user_of(urls[0]) if urls else None
        refused: list[BaseException] = []
        denied: list[str] = []

        async def _error(exc: Exception) -> None:
            if isinstance(exc, nats.errors.AuthorizationError) or "Authorization Violation" in str(exc):
                refused.append(exc)
            if "permissions violation" in str(exc).lower():
                denied.append(str(exc))
                del denied[:-100]
                DENIED_LOG.log(f"denied:{name}", "nats (%s): the server refused: %s", name, exc)
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
                urls if len(urls) > 1 else url,
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

    async def ensure_streams(self, *, replicas: int | None = None) -> None:
        """Make every stream of gyre.bus.subjects.STREAMS exist with its declared config.

        `replicas`: on how many servers of a JetStream cluster each stream is stored (3 in
        production: a stream then survives the loss of one server without losing an acked
        message); a stream with another count is scaled to it. None (the default, what every
        service calls) creates a missing stream with 1 and keeps the count of an existing one, so
        a service never scales down streams an operator declared with 3.

        A stream that already has that config is left alone, so a service whose NATS user may only
        read stream info (gyre.bus.auth: only ``admin`` manages streams) passes once the launcher
        declared them; a missing or different stream is created or updated, which needs that right."""
        if replicas is not None and replicas < 1:
            raise InvalidArgument(f"replicas must be >= 1, got {replicas}")
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
                discard=api.DiscardPolicy.NEW if spec.discard_new else api.DiscardPolicy.OLD,
                num_replicas=replicas,
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
            if info is not None and replicas is None:
                config.num_replicas = info.config.num_replicas  # keep it, also through an update
            if info is not None and same_stream_config(info.config, config):
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

    def encode(self, subject: str, msg: Message, msg_id: str | None) -> tuple[bytes, dict[str, str] | None]:
        data = msg.SerializeToString()
        headers = message_id_headers(subject, msg_id, data) if msg_id else None
        size = len(data) + (headers_size(headers) if headers else 0)
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
        DEAD_LOG.log(code, "%s refused a message on %s (%s): %s", service, subject, code, reason)
        parts = subject.split(".")
        try:
            dead_subject = subjects.dead_letters(parts[2] if len(parts) > 2 else "unknown", service)
        except InvalidArgument:
            dead_subject = subjects.dead_letters("unknown", service)
        letter = any_pb2.Any(type_url=f"type.googleapis.com/{type_name}", value=payload)
        headers = {
            DEAD_REASON_HEADER: one_line(reason, 1024),
            DEAD_SUBJECT_HEADER: one_line(subject, 512),
            DEAD_CODE_HEADER: one_line(code, 64),
        }
        try:
            await self.js.publish(dead_subject, letter.SerializeToString(), timeout=10.0, headers=headers)
        except Exception as exc:  # the refusal itself stands; only the copy is lost
            DEAD_LETTERS_LOST.labels(service).inc()
            log.warning("dead letter of %s on %s could not be stored: %r", service, subject, exc)

    async def publish(
        self,
        subject: str,
        msg: Message,
        *,
        msg_id: str | None = None,
        timeout_s: float = 10.0,
        patience_s: float = PUBLISH_PATIENCE_S,
    ) -> api.PubAck:
        """Store `msg` on its stream and wait for the ack. `msg_id` is the dedup key (pass event_id);
        None only where duplicates are harmless.

        Each attempt waits up to `timeout_s` for the ack; an attempt that gets no answer (a stream
        whose leader is being elected after a nats-server of a cluster died answers "no responders"
        or "unavailable" for a few seconds) is repeated, with the same Nats-Msg-Id so the stream stores
        the message once, until `patience_s` seconds have passed since the first; then Unavailable."""
        data, headers = self.encode(subject, msg, msg_id)
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            left = patience_s - (time.monotonic() - started)
            try:
                ack = await self.js.publish(
                    subject, data, timeout=max(0.5, min(timeout_s, left)), headers=headers
                )
                break
            except _UNANSWERED as exc:
                left = patience_s - (time.monotonic() - started)
                refusal = self._refused_publish(subject)
                if refusal:  # not unanswered but forbidden: the server said so; repeating cannot help
                    raise Unavailable(
                        f"the server refused this connection's user a publish to {subject} ({refusal})"
                    ) from exc
                if left <= 0:
                    raise Unavailable(
                        f"no ack from JetStream for {subject} in {attempt} attempt(s) over "
                        f"{time.monotonic() - started:.1f} s ({exc!r}); retry with the same msg_id; if it "
                        "persists, check that the streams exist (Bus.ensure_streams)"
                    ) from exc
                PUBLISH_RETRIES.inc()
                await asyncio.sleep(min(left, 0.25 * attempt))
        PUBLISHED.labels(ack.stream).inc()
        if ack.duplicate:
            PUBLISH_DUPLICATES.labels(ack.stream).inc()
        return ack

    def _refused_publish(self, subject: str) -> str:
        """The server's permissions-violation error for a publish to `subject` on this connection, if
        it sent one ('' otherwise)."""
        for error in reversed(self.permission_errors):
            if "publish" in error.lower() and f'"{subject}"' in error:
                return error
        return ""

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
        fetch_max_bytes: int = 16 << 20,
        parts: Parts[M] | None = None,
    ) -> Consumer[M]:
        """Start a durable pull consumer named `durable` on `subject_filter` (see the module docstring).

        The consumer's position survives restarts (same `durable`). `deliver_new` only matters when
        the durable is first created: start at new messages instead of the stream's beginning.
        A redelivered batch waits `nak_delay_s * 2**(attempt-1)` seconds, at most `max_nak_delay_s`.
        `max_unsettled`: batches whose handler returned an awaitable that may wait for it at once
        while the next batch is handed over. `fetch_max_bytes`: bound of one fetch in bytes (at
        least the server's max_payload is used), beside `batch_size` messages. `parts`: how split
        messages are joined (default: StepEvent parts for StepEvent, none otherwise).
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
        sub = BoundedPull(self.nc, spec.name, durable, max(fetch_max_bytes, self.max_payload + (64 << 10)))
        await sub.start()
        if parts is None and msg_type is events_pb2.StepEvent:
            parts = STEP_PARTS  # type: ignore[assignment]
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
            parts=parts,
        )
        self._consumers.add(consumer)
        return consumer

    def forget_consumer(self, consumer: Consumer[Any]) -> None:
        """Drop a stopped consumer from those `close` stops (Consumer.stop calls it)."""
        self._consumers.discard(consumer)

    def consumer_done(self, task: asyncio.Task[None]) -> None:
        """Log and report a consumer task that died (Consumer calls it when its task ends)."""
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
                DEAD_LOG.log(
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

    def replay(
        self, subject_filter: str, *, idle_timeout_s: float = REPLAY_IDLE_TIMEOUT_S
    ) -> AsyncIterator[StoredMessage]:
        """Every message stored so far on `subject_filter` (any Gyre filter, wide ones stream by
        stream), each stream in order, acking nothing (gyre.bus.reader.replay)."""
        return replay(self.js, subject_filter, idle_timeout_s=idle_timeout_s)

    async def num_stored(self, subject_filter: str) -> int:
        """Messages the streams hold on `subject_filter` now (gyre.bus.reader.num_stored)."""
        return await num_stored(self.js, subject_filter)

    def follow(
        self,
        subject_filter: str,
        *,
        from_start: bool = False,
        on_subscribed: Callable[[], None] | None = None,
    ) -> AsyncIterator[StoredMessage]:
        """Messages on `subject_filter` as they are stored, with their stream metadata, from every
        stream the filter reaches (gyre.bus.reader.follow)."""
        return follow(self.js, subject_filter, from_start=from_start, on_subscribed=on_subscribed)

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
