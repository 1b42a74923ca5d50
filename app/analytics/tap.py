"""Read events off JetStream without touching anyone's delivery state.

Every read uses ephemeral *ordered* consumers (no ack, no durable name, gone when we disconnect),
one per stream the subject filter reaches, so a wide filter such as ``gyre.>`` still gets stream
timestamps and can replay from the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import nats.js.errors
from google.protobuf.message import DecodeError, Message
from nats.aio.msg import Msg
from nats.js import api

from app.analytics.flatten import Scalar, flatten
from gyre.bus import Bus, subjects
from gyre.errors import InvalidArgument

# Seconds to wait for the next message of a replay before concluding the stream has no more.
_REPLAY_IDLE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class EventRecord:
    """One event as read from its stream."""

    subject: str
    time: dt.datetime  # when the stream stored it (UTC)
    stream: str
    seq: int  # stream sequence number: unique and increasing within `stream`
    type_name: str  # protobuf message name, or "undecodable" / "unknown"
    msg: Message | None  # None when the payload does not decode as the subject's type
    size_bytes: int

    def row(self) -> dict[str, Scalar]:
        """Flat row: subject, time, stream, seq, type, size_bytes, then the event's own fields."""
        head: dict[str, Scalar] = {
            "subject": self.subject,
            "time": self.time.isoformat(),
            "stream": self.stream,
            "seq": self.seq,
            "type": self.type_name,
            "size_bytes": self.size_bytes,
        }
        return {**head, **(flatten(self.msg) if self.msg is not None else {})}


def stream_filters(subject_filter: str) -> list[tuple[str, str]]:
    """(stream name, filter inside that stream) pairs covered by `subject_filter`.

    ``gyre.steps.run1.>`` -> one pair; ``gyre.>`` or ``gyre.*.run1.>`` -> one per stream.
    InvalidArgument when the filter reaches no Gyre stream.
    """
    tokens = subject_filter.split(".")
    if len(tokens) >= 2 and tokens[0] == subjects.PREFIX and tokens[1] in {"*", ">"}:
        pairs = []
        for spec in subjects.STREAMS:
            kind = spec.subjects[0].split(".")[1]
            rest = tokens[2:] if tokens[1] == "*" else [">"]
            pairs.append((spec.name, ".".join([subjects.PREFIX, kind, *rest])))
        return pairs
    if subject_filter == ">":
        return stream_filters(f"{subjects.PREFIX}.>")
    return [(subjects.stream_for(subject_filter).name, subject_filter)]


def decode(msg: Msg) -> EventRecord:
    """An EventRecord from a JetStream message; never raises on a bad payload (type says why)."""
    meta = msg.metadata
    try:
        msg_type = subjects.event_type_for(msg.subject)
    except InvalidArgument:
        event: Message | None = None
        type_name = "unknown"
    else:
        try:
            event = msg_type.FromString(msg.data)
            type_name = msg_type.DESCRIPTOR.name
        except DecodeError:
            event, type_name = None, "undecodable"
    return EventRecord(
        subject=msg.subject,
        time=meta.timestamp.astimezone(dt.UTC),
        stream=meta.stream,
        seq=meta.sequence.stream,
        type_name=type_name,
        msg=event,
        size_bytes=len(msg.data),
    )


async def tail(
    bus: Bus,
    subject_filter: str = "gyre.>",
    *,
    from_start: bool = False,
    on_subscribed: Callable[[], None] | None = None,
) -> AsyncIterator[EventRecord]:
    """Yield events on `subject_filter` as they are stored, forever (cancel to stop).

    Events of one stream come in stream order; events of different streams interleave in arrival
    order. `on_subscribed` is called once every consumer exists: anything published after that
    call is seen, even without `from_start`.
    """
    queue: asyncio.Queue[Msg] = asyncio.Queue(maxsize=10_000)
    policy = api.DeliverPolicy.ALL if from_start else api.DeliverPolicy.NEW

    async def forward(msg: Msg) -> None:
        await queue.put(msg)

    subs: list[Any] = []
    try:
        for stream, flt in stream_filters(subject_filter):
            subs.append(
                await bus.js.subscribe(
                    flt, stream=stream, cb=forward, ordered_consumer=True, deliver_policy=policy
                )
            )
        if on_subscribed is not None:
            on_subscribed()
        while True:
            yield decode(await queue.get())
    finally:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def read_all(bus: Bus, subject_filter: str = "gyre.>") -> list[EventRecord]:
    """Every event stored so far on `subject_filter`, stream by stream, each stream in order.

    Reads up to the last message that matched when the read of that stream began; events stored
    later may or may not be included.
    """
    records: list[EventRecord] = []
    for stream, flt in stream_filters(subject_filter):
        try:
            info = await bus.js.stream_info(stream, subjects_filter=flt)
        except nats.js.errors.NotFoundError:
            continue  # the stream was never declared: no event of it exists
        expected = sum((info.state.subjects or {}).values())
        if expected == 0:
            continue
        sub = await bus.js.subscribe(
            flt, stream=stream, ordered_consumer=True, deliver_policy=api.DeliverPolicy.ALL
        )
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=_REPLAY_IDLE_TIMEOUT_S)
                except TimeoutError:
                    break
                records.append(decode(msg))
                if msg.metadata.num_pending == 0:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
    return records
