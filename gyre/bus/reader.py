"""Reading what a stream has stored without touching anyone's delivery state: every read uses
ephemeral *ordered* consumers (no ack, no durable name, gone when the read ends), one per stream
the subject filter reaches, so a wide filter (``gyre.>``) still gets stream timestamps and can be
replayed from the start. `Bus.replay`, `Bus.num_stored` and `Bus.follow` are the entry points.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from gyre.bus import subjects

# Seconds to wait for the next message of a replay before concluding the stream has no more.
REPLAY_IDLE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class StoredMessage:
    """One message as a stream stored it."""

    subject: str
    data: bytes
    stream: str
    seq: int  # stream sequence number: unique and increasing within `stream`
    time: dt.datetime  # when the stream stored it (UTC)

    @classmethod
    def of(cls, msg: Msg) -> StoredMessage:
        meta = msg.metadata
        return cls(
            subject=msg.subject,
            data=msg.data,
            stream=meta.stream,
            seq=meta.sequence.stream,
            time=meta.timestamp.astimezone(dt.UTC),
        )


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


async def num_stored(js: JetStreamContext, subject_filter: str) -> int:
    """Messages the streams hold on `subject_filter` now (0 for a stream never declared)."""
    total = 0
    for stream, flt in stream_filters(subject_filter):
        try:
            info = await js.stream_info(stream, subjects_filter=flt)
        except nats.js.errors.NotFoundError:
            continue
        total += int(sum((info.state.subjects or {}).values()))
    return total


async def replay(
    js: JetStreamContext, subject_filter: str, *, idle_timeout_s: float = REPLAY_IDLE_TIMEOUT_S
) -> AsyncIterator[StoredMessage]:
    """Every message stored so far on `subject_filter`, stream by stream, each stream in order.

    Reads a stream up to the last message that matched when its read began (messages stored later
    may or may not be included), or until no message came for `idle_timeout_s` seconds. A stream
    that holds nothing on the filter, or was never declared, is skipped without subscribing."""
    for stream, flt in stream_filters(subject_filter):
        try:
            info = await js.stream_info(stream, subjects_filter=flt)
        except nats.js.errors.NotFoundError:
            continue
        if not sum((info.state.subjects or {}).values()):
            continue
        sub = await js.subscribe(
            flt, stream=stream, ordered_consumer=True, deliver_policy=api.DeliverPolicy.ALL
        )
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=idle_timeout_s)
                except TimeoutError:
                    break
                yield StoredMessage.of(msg)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def follow(
    js: JetStreamContext,
    subject_filter: str,
    *,
    from_start: bool = False,
    on_subscribed: Callable[[], None] | None = None,
    max_queued: int = 10_000,
) -> AsyncIterator[StoredMessage]:
    """Yield messages on `subject_filter` as they are stored, forever (cancel or close to stop).

    Messages of one stream come in stream order; those of different streams interleave in arrival
    order. `on_subscribed` is called once every consumer exists: anything stored after that call is
    seen, even without `from_start` (which replays each stream from its beginning first)."""
    queue: asyncio.Queue[Msg] = asyncio.Queue(maxsize=max_queued)
    policy = api.DeliverPolicy.ALL if from_start else api.DeliverPolicy.NEW

    async def forward(msg: Msg) -> None:
        await queue.put(msg)

    subs: list[Any] = []
    try:
        for stream, flt in stream_filters(subject_filter):
            subs.append(
                await js.subscribe(
                    flt, stream=stream, cb=forward, ordered_consumer=True, deliver_policy=policy
                )
            )
        if on_subscribed is not None:
            on_subscribed()
        while True:
            yield StoredMessage.of(await queue.get())
    finally:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
