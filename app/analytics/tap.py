"""Read events off JetStream without touching anyone's delivery state.

Reads go through the bus's reader (gyre/bus/reader.py: ephemeral ordered consumers, one per stream
the subject filter reaches); this module turns stored messages into typed, flat event records.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message

from app.analytics.flatten import Scalar, flatten
from gyre.bus import Bus, StoredMessage, subjects
from gyre.errors import InvalidArgument


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


def decode(stored: StoredMessage) -> EventRecord:
    """An EventRecord from a stored message; never raises on a bad payload (type says why)."""
    try:
        msg_type = subjects.event_type_for(stored.subject)
    except InvalidArgument:
        event: Message | None = None
        type_name = "unknown"
    else:
        try:
            event = msg_type.FromString(stored.data)
            type_name = msg_type.DESCRIPTOR.name
        except DecodeError:
            event, type_name = None, "undecodable"
    return EventRecord(
        subject=stored.subject,
        time=stored.time,
        stream=stored.stream,
        seq=stored.seq,
        type_name=type_name,
        msg=event,
        size_bytes=len(stored.data),
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
    async for stored in bus.follow(subject_filter, from_start=from_start, on_subscribed=on_subscribed):
        yield decode(stored)


async def read_all(bus: Bus, subject_filter: str = "gyre.>") -> list[EventRecord]:
    """Every event stored so far on `subject_filter`, stream by stream, each stream in order.

    Reads up to the last message that matched when the read of that stream began; events stored
    later may or may not be included.
    """
    return [decode(stored) async for stored in bus.replay(subject_filter)]
