"""Every NATS subject and JetStream stream of Gyre, declared in this one place.

Subject layout: ``gyre.<kind>.<run_id>[.<key>]``. Each builder takes one token per argument; a
token is an ID without dots or spaces, or the wildcard ``"*"`` (``">"`` for the last one), so
``steps(run_id, "*")`` is the filter of every task's steps in a run.

Delivery guarantee, the same for every stream (each declaration below adds who consumes and
how long messages are kept):

* **Publish**: at-least-once. ``Bus.publish`` waits for the stream's ack; a publisher that did
  not get the ack retries with the *same* ``msg_id`` (``Nats-Msg-Id``), and the stream stores a
  message once per ``(subject, msg_id, payload)`` within ``DUPLICATE_WINDOW_S`` (the Nats-Msg-Id
  header is ``<subject>/<msg_id>/<payload digest>``: equal event IDs of different runs never
  collide, and a message published first under a guessed id with another payload cannot make the
  stream drop the real event; consumers count such a conflict). Every event's ``event_id`` is its
  ``msg_id``.
* **Who**: with authentication on (gyre.bus.auth), only the services in a stream's ``producers``
  may publish on it and only those in ``consumers`` (and the read-only ``observer``) read it.
* **Consume**: at-least-once. Durable pull consumers ack a message only after the handler
  returned; a handler that raises gets the batch redelivered (after a delay), a crash before the
  ack redelivers it after ``ack_wait``. Handlers must therefore be idempotent (key their writes
  by ``event_id`` or by the natural key of the event). Order is per subject, not across subjects.
* **Storage**: file storage, limits retention (many consumers may read the same message), the
  message size limit is the server's ``max_payload`` (8 MiB in the embedded server).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from google.protobuf import any_pb2
from google.protobuf.message import Message

from gyre.errors import InvalidArgument
from gyre.v1 import events_pb2

PREFIX = "gyre"
# Seconds during which a repeated Nats-Msg-Id is dropped by the stream (JetStream dedup window).
DUPLICATE_WINDOW_S = 120.0

# Byte budget of the step stream (GYRE_STEPS). Compact steps cost ~0.05 bytes per flat token, so this
# holds about 10^11 tokens of history; when full the rollout's publisher waits (discard new).
STEPS_MAX_BYTES = 8 << 30

_TOKEN = re.compile(r"^[A-Za-z0-9_\-:]+$")
_DAY_S = 24 * 3600.0


def _token(value: str, what: str, *, last: bool = False) -> str:
    if value == "*" or (last and value == ">"):
        return value
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise InvalidArgument(
            f"{what}={value!r} is not a valid NATS subject token: use letters, digits, '_', '-' or ':' "
            f"(no dots, spaces or partial wildcards), or '*' to match any {what}"
        )
    return value


def leases(run_id: str, device_id: str) -> str:
    """Lease changes of one device (LeaseEvent)."""
    return f"{PREFIX}.leases.{_token(run_id, 'run_id')}.{_token(device_id, 'device_id', last=True)}"


def executions(run_id: str, task_id: str) -> str:
    """Execution lifecycle of one task's executions (ExecutionEvent)."""
    return f"{PREFIX}.executions.{_token(run_id, 'run_id')}.{_token(task_id, 'task_id', last=True)}"


def steps(run_id: str, task_id: str) -> str:
    """Interaction steps (LLM calls) of one task's executions (StepEvent)."""
    return f"{PREFIX}.steps.{_token(run_id, 'run_id')}.{_token(task_id, 'task_id', last=True)}"


def paths_batch(run_id: str) -> str:
    """A tree-packed batch is ready for the trainer (BatchReadyEvent)."""
    return f"{PREFIX}.paths.{_token(run_id, 'run_id')}.batch"


def paths_scored(run_id: str) -> str:
    """Scores and dedup decisions of one execution group (GroupScoredEvent)."""
    return f"{PREFIX}.paths.{_token(run_id, 'run_id')}.scored"


def paths_dropped(run_id: str) -> str:
    """A group that will never be trained, so its admission slot goes back (GroupDroppedEvent)."""
    return f"{PREFIX}.paths.{_token(run_id, 'run_id')}.dropped"


def weights(run_id: str) -> str:
    """A new weight version was published (WeightsPublishedEvent)."""
    return f"{PREFIX}.weights.{_token(run_id, 'run_id', last=True)}"


def metrics(run_id: str, service: str) -> str:
    """Periodic scalar metrics of one service (MetricsEvent)."""
    return f"{PREFIX}.metrics.{_token(run_id, 'run_id')}.{_token(service, 'service', last=True)}"


def dead_letters(run_id: str, service: str) -> str:
    """Messages `service` refused as invalid (google.protobuf.Any of the original; reason in headers)."""
    return f"{PREFIX}.dead.{_token(run_id, 'run_id')}.{_token(service, 'service', last=True)}"


@dataclass(frozen=True)
class StreamSpec:
    """One JetStream stream: its subjects, retention and the guarantee consumers rely on."""

    name: str
    subjects: tuple[str, ...]
    # Message type of every subject of the stream (decode with msg_type.FromString).
    msg_type: type[Message]
    # Messages older than this are deleted (seconds); 0 keeps them until the byte limit.
    max_age_s: float
    # The stream holds at most this many bytes; -1 means no limit. Beyond it the oldest messages are
    # dropped, or with `discard_new` new publishes are refused (the publisher retries: back-pressure,
    # nothing lost).
    max_bytes: int = -1
    discard_new: bool = False
    description: str = ""
    # Services that read the stream (durable or tail); the NATS permissions of gyre.bus.auth follow it.
    consumers: tuple[str, ...] = field(default=())
    # Services allowed to publish on the stream. A name alone may publish on every subject of the
    # stream; ``"<service>:<last token>"`` only on subjects whose last token is that (its own metrics).
    producers: tuple[str, ...] = field(default=())


STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(
        name="GYRE_LEASES",
        subjects=(f"{PREFIX}.leases.>",),
        msg_type=events_pb2.LeaseEvent,
        max_age_s=7 * _DAY_S,
        description=(
            "Scheduler -> rollout, trainer, analytics. At-least-once, dedup by event_id within the window. "
            "Consumers must also fence on lease.epoch: an event with an epoch older than the one they "
            "hold is stale and ignored, so redelivery and reordering across devices are harmless."
        ),
        consumers=("rollout", "trainer", "analytics"),
        producers=("scheduler",),
    ),
    StreamSpec(
        name="GYRE_EXECUTIONS",
        subjects=(f"{PREFIX}.executions.>",),
        msg_type=events_pb2.ExecutionEvent,
        max_age_s=7 * _DAY_S,
        description=(
            "Rollout -> trajectory, analytics. At-least-once, dedup by event_id. The trajectory store "
            "applies lifecycle transitions idempotently (a repeated FINISHED changes nothing). A "
            "restarted rollout reads it to end the executions its killed predecessor left running."
        ),
        consumers=("trajectory", "analytics", "rollout"),
        producers=("rollout",),
    ),
    StreamSpec(
        name="GYRE_STEPS",
        subjects=(f"{PREFIX}.steps.>",),
        msg_type=events_pb2.StepEvent,
        max_age_s=7 * _DAY_S,
        max_bytes=STEPS_MAX_BYTES,
        discard_new=True,
        description=(
            "Rollout -> trajectory (durable), analytics (tail). The bulk stream: at-least-once, dedup "
            "by event_id; the trajectory store keys each step by (execution_id, step index) so a "
            "redelivered step is stored once. Ordered per task subject. Steps are compact (a reference "
            "to the execution's previous call plus the new tokens) and at most ~1 MiB (longer ones in "
            "parts, gyre.bus.steps). At most 8 GiB: when full, publishes are refused and the rollout "
            "waits (never an unread step dropped); kept a week."
        ),
        consumers=("trajectory", "analytics"),
        producers=("rollout",),
    ),
    StreamSpec(
        name="GYRE_PATHS",
        subjects=(f"{PREFIX}.paths.>",),
        msg_type=events_pb2.BatchReadyEvent,
        max_age_s=7 * _DAY_S,
        description=(
            "Trajectory -> trainer (gyre.paths.<run>.batch, BatchReadyEvent), rollout (gyre.paths.<run>."
            "dropped, GroupDroppedEvent: a group that will never be trained gives its admission slot back) "
            "and analytics (gyre.paths.<run>.scored, GroupScoredEvent). At-least-once, dedup by event_id; "
            "the trainer pulls a batch by batch_id, which the trajectory service hands out once per consumer."
        ),
        consumers=("trainer", "rollout", "analytics"),
        producers=("trajectory",),
    ),
    StreamSpec(
        name="GYRE_WEIGHTS",
        subjects=(f"{PREFIX}.weights.>",),
        msg_type=events_pb2.WeightsPublishedEvent,
        max_age_s=7 * _DAY_S,
        description=(
            "Trainer -> rollout, trajectory, analytics. At-least-once, dedup by event_id "
            "('weights.<run>.<version>'). Versions only grow: a consumer ignores a version not newer "
            "than the one it has, so redelivery is harmless."
        ),
        consumers=("rollout", "trajectory", "analytics"),
        producers=("trainer",),
    ),
    StreamSpec(
        name="GYRE_METRICS",
        subjects=(f"{PREFIX}.metrics.>",),
        msg_type=events_pb2.MetricsEvent,
        max_age_s=1 * _DAY_S,
        max_bytes=1 << 30,
        description=(
            "Any service -> analytics. At-least-once, best effort: periodic snapshots, so a lost or "
            "repeated one only shifts a plot point. Kept one day, at most 1 GiB."
        ),
        consumers=("analytics",),
        producers=("scheduler:scheduler", "rollout:rollout", "trajectory:trajectory", "trainer:trainer"),
    ),
    StreamSpec(
        name="GYRE_DEAD_LETTERS",
        subjects=(f"{PREFIX}.dead.>",),
        msg_type=any_pb2.Any,
        max_age_s=7 * _DAY_S,
        max_bytes=1 << 30,
        description=(
            "Any consuming service -> operators, analytics. A message the service refused as invalid, on "
            "gyre.dead.<run>.<service>: the original payload in a google.protobuf.Any (type_url names its "
            "message type), headers Gyre-Dead-Reason (one line), Gyre-Dead-Subject and Gyre-Dead-Code (the "
            "counter label). Written once per refused message; kept a week, at most 1 GiB."
        ),
        consumers=("analytics",),
        producers=(
            "scheduler:scheduler",
            "rollout:rollout",
            "trajectory:trajectory",
            "trainer:trainer",
        ),
    ),
)

_SCORED_SUFFIX = ".scored"
_DROPPED_SUFFIX = ".dropped"


def stream_for(subject_filter: str) -> StreamSpec:
    """The stream whose subjects contain `subject_filter`; InvalidArgument if none (or several) does."""
    parts = subject_filter.split(".")
    if len(parts) >= 3 and parts[0] == PREFIX and parts[1] not in {"*", ">"}:
        for spec in STREAMS:
            if spec.subjects[0].split(".")[1] == parts[1]:
                return spec
    names = ", ".join(s.subjects[0] for s in STREAMS)
    raise InvalidArgument(
        f"subject {subject_filter!r} is not inside one Gyre stream; use a subject of gyre.bus.subjects ({names})"
    )


def event_type_for(subject: str) -> type[Message]:
    """Message type of a concrete subject (paths.<run>.scored carries GroupScoredEvent,
    paths.<run>.dropped GroupDroppedEvent)."""
    spec = stream_for(subject)
    if spec.name == "GYRE_PATHS" and subject.endswith(_SCORED_SUFFIX):
        return events_pb2.GroupScoredEvent
    if spec.name == "GYRE_PATHS" and subject.endswith(_DROPPED_SUFFIX):
        return events_pb2.GroupDroppedEvent
    return spec.msg_type
