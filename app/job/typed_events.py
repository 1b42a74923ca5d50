"""Event log records as typed protobuf messages: the one place where a record's JSON becomes values.

`typed(record)` parses `record["event"]` with `json_format.ParseDict` into the gyre.v1 event message
its `type` names, so a malformed value (a version "abc", a string where a count belongs, a field the
message does not have) is an `EventLogError` naming the record and the field, never a silent 0.
Records of a type this version does not know (a newer producer's) are kept, with no message, and
counted but not analysed.

Step events are logged summarised (app/job/eventlog.py): their three summary fields
(`num_prompt_tokens`, `num_completion_tokens`, `completion_version_counts`) are checked and carried
beside the message as a `StepSummary`.

Times are seconds since the Unix epoch. `event_time` is when the event happened: its
`created_unix_s` or `finished_unix_s` (or its weights' `created_unix_s`), else when it was received.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from gyre.v1 import common_pb2, events_pb2

MESSAGES: dict[str, type[Message]] = {
    name: getattr(events_pb2, name) for name in events_pb2.DESCRIPTOR.message_types_by_name
}
_STEP_SUMMARY_KEYS = ("num_prompt_tokens", "num_completion_tokens", "completion_version_counts")


class EventLogError(ValueError):
    """A record of the event log does not hold the event its type names."""


@dataclass(frozen=True)
class StepSummary:
    """What the log keeps of a step's token arrays: counts, and tokens per policy version."""

    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    version_counts: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TypedRecord:
    """One event log record, typed. `event` is None for a type this version does not know."""

    type: str
    recv_unix_s: float
    event: Message | None
    step: StepSummary | None = None

    @property
    def time(self) -> float:
        """When the event happened (seconds since the epoch; see the module docstring)."""
        ev = self.event
        if ev is not None:
            for name in ("created_unix_s", "finished_unix_s"):
                if name in ev.DESCRIPTOR.fields_by_name and getattr(ev, name) > 0:
                    return float(getattr(ev, name))
            if isinstance(ev, events_pb2.WeightsPublishedEvent) and ev.weights.created_unix_s > 0:
                return float(ev.weights.created_unix_s)
        return self.recv_unix_s


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise EventLogError(f"{what} must be an integer, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise EventLogError(f"{what} must be an integer, got {value!r}") from None
    if number < 0:
        raise EventLogError(f"{what} must be >= 0, got {number}")
    return number


def _step_summary(data: dict[str, Any], where: str) -> StepSummary:
    counts = data.get("completion_version_counts") or {}
    if not isinstance(counts, dict):
        raise EventLogError(f"{where}: completion_version_counts must be a mapping, got {counts!r}")
    return StepSummary(
        num_prompt_tokens=_count(data.get("num_prompt_tokens", 0), f"{where}: num_prompt_tokens"),
        num_completion_tokens=_count(data.get("num_completion_tokens", 0), f"{where}: num_completion_tokens"),
        version_counts={
            _count(v, f"{where}: a policy version"): _count(n, f"{where}: tokens of version {v}")
            for v, n in counts.items()
        },
    )


def typed(record: dict[str, Any], *, index: int | None = None) -> TypedRecord:
    """`record` as a TypedRecord; EventLogError naming the record (and `index`, its line) if its
    event is not the message its type names."""
    type_name = str(record.get("type", ""))
    where = (
        f"event log record {index} ({type_name})" if index is not None else f"event log record ({type_name})"
    )
    try:
        recv = float(record.get("recv_unix_s", 0.0))
    except (TypeError, ValueError):
        raise EventLogError(
            f"{where}: recv_unix_s must be a number, got {record.get('recv_unix_s')!r}"
        ) from None
    data = record.get("event")
    if not isinstance(data, dict):
        raise EventLogError(f"{where}: 'event' must be a JSON object, got {type(data).__name__}")
    cls = MESSAGES.get(type_name)
    if cls is None:
        return TypedRecord(type_name, recv, None)
    step = None
    if type_name == "StepEvent":
        step = _step_summary(data, where)
        data = {k: v for k, v in data.items() if k not in _STEP_SUMMARY_KEYS}
    try:
        msg = json_format.ParseDict(data, cls())
    except json_format.ParseError as exc:
        raise EventLogError(f"{where}: {exc}") from None
    return TypedRecord(type_name, recv, msg, step)


def typed_all(records: list[dict[str, Any]]) -> list[TypedRecord]:
    """Every record typed, in order (EventLogError at the first bad one, naming its index)."""
    return [typed(r, index=i) for i, r in enumerate(records)]


def progress_fraction(progress: common_pb2.ProgressSignal | None) -> float | None:
    """Partial progress in [0, 1]: milestones first, else tests passing; None without either."""
    if progress is None:
        return None
    if progress.milestones_total > 0:
        return min(1.0, max(0.0, progress.milestones_reached / progress.milestones_total))
    if progress.HasField("tests_passed_fraction"):
        return min(1.0, max(0.0, progress.tests_passed_fraction))
    return None


def execution_score(ev: events_pb2.ExecutionEvent) -> float:
    """An ended execution's score including partial progress: final reward, else progress, else 0."""
    if ev.HasField("reward") and ev.kind == events_pb2.ExecutionEvent.KIND_FINISHED:
        return float(ev.reward)
    frac = progress_fraction(ev.progress if ev.HasField("progress") else None)
    return frac if frac is not None else 0.0


def enum_name(msg: Message, field_name: str) -> str:
    """The name of enum field `field_name` of `msg` (e.g. "KIND_REASSIGN")."""
    enum = msg.DESCRIPTOR.fields_by_name[field_name].enum_type
    number = getattr(msg, field_name)
    value = enum.values_by_number.get(number) if enum is not None else None
    return value.name if value is not None else str(number)
