"""Batched asynchronous publish with a bounded window of un-acked messages (the Publisher
guarantees of gyre/bus/nats_bus.py's docstring). Made by `Bus.publisher`.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import nats.js.errors
from google.protobuf.message import Message
from nats.aio.client import Client as NatsClient
from nats.js import api

from gyre.bus.wire import PUBLISH_DUPLICATES, PUBLISHED
from gyre.errors import InvalidArgument, Unavailable


class PublisherHost(Protocol):
    """What a publisher needs of the bus that made it."""

    nc: NatsClient

    def encode(
        self, subject: str, msg: Message, msg_id: str | None
    ) -> tuple[bytes, dict[str, str] | None]: ...


class Publisher:
    """Batched asynchronous publish with a bounded window of un-acked messages (back-pressure).

    Errors of earlier messages surface at the next ``publish`` or at ``flush``.
    """

    def __init__(self, bus: PublisherHost, max_pending: int, stall_timeout_s: float) -> None:
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
        data, headers = self._bus.encode(subject, msg, msg_id)
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
