"""Record every event of one run into `run_dir/events.jsonl` while the run goes on.

The collector reads the run's subjects of every Gyre stream with the analytics tap (ephemeral
ordered consumers: it never acks or creates durable consumers, so recording cannot change what
the services see). It replays each stream from its start, so starting it after the services is
fine, and `stop()` ends with a final sweep (`read_all`) that picks up whatever the live tail had
not delivered yet; the event log writer skips events it already holds (by event_id), so the
sweep and JetStream redelivery never duplicate a record.

`on_event(record)` callbacks (progress bars) run in the collector's task for every new record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.analytics import tap
from app.job.eventlog import EVENT_LOG_NAME, EventLogWriter, to_record
from gyre.bus import Bus

log = logging.getLogger("app.job.collector")

Record = dict[str, Any]


def run_filters(run_id: str) -> list[str]:
    """One subject filter per stream, covering every subject of `run_id` (weights have no suffix)."""
    return [
        f"gyre.leases.{run_id}.>",
        f"gyre.executions.{run_id}.>",
        f"gyre.steps.{run_id}.>",
        f"gyre.paths.{run_id}.>",
        f"gyre.weights.{run_id}",
        f"gyre.metrics.{run_id}.>",
    ]


class EventCollector:
    """Tails every stream of a run into an event log; see the module docstring for guarantees."""

    def __init__(self, bus: Bus, run_id: str, run_dir: Path) -> None:
        self.bus = bus
        self.run_id = run_id
        self.path = run_dir / EVENT_LOG_NAME
        self.writer = EventLogWriter(self.path)
        self.listeners: list[Callable[[Record], None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._subscribed = 0
        self._per_subject: dict[str, int] = {}  # events seen per subject (recorded or duplicate)
        self._stored_before: dict[str, int] = {}  # messages per filter at the previous resync()
        self._recorded_before: dict[str, int] = {}  # records per filter at the previous resync()

    def on_event(self, callback: Callable[[Record], None]) -> None:
        self.listeners.append(callback)

    def _record(self, rec: tap.EventRecord) -> None:
        if rec.msg is None:
            log.warning("skipped %s event on %s (%d bytes)", rec.type_name, rec.subject, rec.size_bytes)
            return
        record = to_record(rec.msg, rec.subject, rec.time.timestamp())
        if self.writer.write(record):
            self._per_subject[rec.subject] = self._per_subject.get(rec.subject, 0) + 1
            for callback in self.listeners:
                try:
                    callback(record)
                except Exception:  # a broken progress bar must not stop the recording
                    log.exception("event listener failed")

    async def _follow(self, subject_filter: str, subscribed: asyncio.Event) -> None:
        def mark() -> None:
            self._subscribed += 1
            if self._subscribed == len(run_filters(self.run_id)):
                subscribed.set()

        async for rec in tap.tail(self.bus, subject_filter, from_start=True, on_subscribed=mark):
            self._record(rec)

    async def start(self) -> None:
        """Subscribe to every stream; returns once all subscriptions exist."""
        subscribed = asyncio.Event()
        for flt in run_filters(self.run_id):
            self._tasks.append(asyncio.create_task(self._follow(flt, subscribed), name=f"collect:{flt}"))
        waiter = asyncio.create_task(subscribed.wait())
        done, _ = await asyncio.wait([waiter, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            waiter.cancel()
            for task in done:
                task.result()  # re-raise why a subscription failed

    def _num_recorded(self, subject_filter: str) -> int:
        prefix = subject_filter.removesuffix(".>")
        return sum(
            n
            for subject, n in self._per_subject.items()
            if subject == prefix or subject.startswith(prefix + ".")
        )

    async def _num_stored(self, subject_filter: str) -> int | None:
        """Messages the stream holds on `subject_filter` (None if unknown)."""
        try:
            return await self.bus.num_stored(subject_filter)
        except Exception:
            return None

    async def sweep(self) -> None:
        """Read again, from its start, every stream of the run whose live tail is behind (a stream
        already fully recorded is skipped, so the sweep of a large run stays cheap)."""
        for flt in run_filters(self.run_id):
            stored = await self._num_stored(flt)
            if stored is not None and self._num_recorded(flt) >= stored:
                continue
            try:
                for rec in await tap.read_all(self.bus, flt):
                    self._record(rec)
            except Exception as exc:  # the log keeps what the live tail saw
                log.warning("sweep of %s failed: %r", flt, exc)

    async def resync(self) -> None:
        """Keep the live tail honest while the run goes on: a follow task that ended is started
        again, and a filter whose recorded count is still below what its stream held at the previous
        resync (its ordered consumer did not survive a NATS restart) is resubscribed from the start
        of its stream; the writer drops what it already holds. Never raises."""
        for i, flt in enumerate(run_filters(self.run_id)):
            stored = await self._num_stored(flt)
            recorded = self._num_recorded(flt)
            # Behind = the stream held more than we recorded a resync ago, and nothing came since.
            behind = self._stored_before.get(flt, 0) > recorded == self._recorded_before.get(flt, -1)
            self._recorded_before[flt] = recorded
            if stored is not None:
                self._stored_before[flt] = stored
            task = self._tasks[i] if i < len(self._tasks) else None
            if task is not None and not task.done() and not behind:
                continue
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            log.warning("event tail of %s %s; resubscribing", flt, "stalled" if behind else "ended")
            self._stored_before.pop(flt, None)
            self._tasks[i] = asyncio.create_task(self._follow(flt, asyncio.Event()), name=f"collect:{flt}")

    async def stop(self) -> int:
        """Stop tailing, sweep every stream once more for missed events, close the log; return #records."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.sweep()
        self.writer.close()
        return self.writer.num_written
