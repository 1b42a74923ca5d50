"""The trajectory service's trust boundary: which steps it stores, who may take batches, and what a
PullBatch's version may say. Kept apart from the ingest and batching code so that it reads (and
changes) on its own.

Execution events pass `StepGate.split_executions`: invalid ones are dead-lettered (ingest then
refuses them again and records them in traj_rejections). Steps (from NATS or IngestSteps) pass
`StepGate.split` before ingest:

* invalid under gyre.validation (vocabulary, log-probs, lengths, ids, versions far ahead...): refused,
  copied to the dead-letter stream with the reason (``Bus.dead_letter``: counter per code,
  rate-limited log) and never stored — the other steps of the batch are unaffected;
* *early* (a version at most ``max_version_lead`` ahead of the newest WeightsPublishedEvent seen):
  held back; the NATS handler then lets the batch be redelivered, by which time the weights event
  has normally arrived;
* the rest go on to ingest (which still rejects what needs the stored tree to judge).

Batches: only a consumer in ``trainer_workers`` may PullBatch / AckBatch (PERMISSION_DENIED
otherwise), may resume or ack only a batch handed to itself, and its ``current_version`` is clamped
to one past the newest weights version seen (`clamp_version`), so a forged 10^12 cannot mark every
group stale.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from gyre.bus import subjects
from gyre.bus.wire import RateLimitedLog
from gyre.errors import InvalidArgument, PermissionDenied
from gyre.v1 import events_pb2, trajectory_pb2
from gyre.validation import Problem, execution_problem, is_early, step_problem
from services.trajectory.config import TrajectoryConfig

log = logging.getLogger("gyre.trajectory.validation")
# Longest a PullBatch may wait for a batch (seconds); a trainer waits seconds, not hours.
MAX_PULL_WAIT_S = 600.0
_CLAMP_LOG = RateLimitedLog(log)

# (subject, payload, message type, code, reason) -> stored on the dead-letter stream.
DeadLetter = Callable[[str, bytes, str, str, str], Awaitable[None]]


@dataclass
class GateResult:
    """Steps of one batch, sorted by what happens to them."""

    valid: list[events_pb2.StepEvent] = field(default_factory=list)
    early: list[events_pb2.StepEvent] = field(default_factory=list)
    refused: list[tuple[events_pb2.StepEvent, Problem]] = field(default_factory=list)


class StepGate:
    """Consumer-side step checks plus the newest weights version this service has seen."""

    def __init__(self, run_id: str, cfg: TrajectoryConfig, dead_letter: DeadLetter | None = None) -> None:
        self.run_id = run_id
        self.cfg = cfg
        self.dead_letter = dead_letter
        # Newest WeightsPublishedEvent version seen; 0 is the initial model every engine starts with.
        self.latest_version = 0
        self.counters: collections.Counter[str] = collections.Counter()

    def note_weights(self, version: int) -> None:
        """A WeightsPublishedEvent of `version` arrived (versions only grow; older ones change nothing)."""
        if version > self.latest_version:
            self.latest_version = version

    async def split(self, steps: Sequence[events_pb2.StepEvent]) -> GateResult:
        """Sort `steps` (module docstring); refused ones are dead-lettered before this returns."""
        out = GateResult()
        for step in steps:
            problem = step_problem(
                step,
                vocab_size=self.cfg.vocab_size,
                latest_version=self.latest_version,
                max_version_lead=self.cfg.max_version_lead,
            )
            if problem is None and step.run_id != self.run_id:
                problem = Problem(
                    "wrong_run", f"step {step.event_id!r} belongs to run {step.run_id!r}, not {self.run_id!r}"
                )
            if problem is not None:
                out.refused.append((step, problem))
                self.counters[f"steps_dead_lettered_{problem.code}"] += 1
                if self.dead_letter is not None:
                    subject = _subject_of(step, self.run_id)
                    await self.dead_letter(
                        subject, step.SerializeToString(), "gyre.v1.StepEvent", problem.code, problem.reason
                    )
            elif is_early(step, self.latest_version):
                out.early.append(step)
                self.counters["steps_early"] += 1
            else:
                out.valid.append(step)
        return out

    async def split_executions(
        self, events: Sequence[events_pb2.ExecutionEvent]
    ) -> list[events_pb2.ExecutionEvent]:
        """The valid execution events of `events`; the others are dead-lettered (gyre.validation's
        execution_problem with the run's reward range, and the run id)."""
        valid = []
        for ev in events:
            problem = execution_problem(ev, reward_range=(self.cfg.reward_min, self.cfg.reward_max))
            if problem is None and ev.run_id != self.run_id:
                problem = Problem(
                    "wrong_run", f"execution event {ev.event_id!r} belongs to run {ev.run_id!r}"
                )
            if problem is None:
                valid.append(ev)
                continue
            self.counters[f"executions_dead_lettered_{problem.code}"] += 1
            if self.dead_letter is not None:
                try:
                    subject = subjects.executions(ev.run_id or self.run_id, ev.task_id or "unknown")
                except InvalidArgument:
                    subject = subjects.executions(self.run_id, "unknown")
                await self.dead_letter(
                    subject, ev.SerializeToString(), "gyre.v1.ExecutionEvent", problem.code, problem.reason
                )
        return valid

    def check_consumer(self, consumer: str) -> None:
        """PermissionDenied unless `consumer` is a registered trainer worker."""
        if consumer not in self.cfg.trainer_workers:
            self.counters["batch_requests_denied"] += 1
            raise PermissionDenied(
                f"consumer {consumer!r} is not a registered trainer of run {self.run_id!r} (registered: "
                f"{self.cfg.trainer_workers}); set trajectory.trainer_workers to the trainer's worker_id"
            )

    def check_pull(self, request: trajectory_pb2.PullBatchRequest) -> None:
        """InvalidArgument for PullBatch arguments no trainer sends: a negative token budget or
        version, a negative or non-finite wait (a wait above MAX_PULL_WAIT_S is cut to it)."""
        if request.max_tokens < 0:
            raise InvalidArgument(
                f"max_tokens must be >= 0 (0 = the service default), got {request.max_tokens}"
            )
        if not math.isfinite(request.wait_s) or request.wait_s < 0.0:
            raise InvalidArgument(f"wait_s must be a finite number of seconds >= 0, got {request.wait_s}")
        if request.current_version < 0:
            raise InvalidArgument(f"current_version must be >= 0, got {request.current_version}")

    def check_owner(self, consumer: str, batch_consumer: str | None, batch_id: str) -> None:
        """PermissionDenied if batch `batch_id` was handed to another consumer than `consumer`."""
        if batch_consumer and batch_consumer != consumer:
            self.counters["batch_requests_denied"] += 1
            raise PermissionDenied(
                f"batch {batch_id!r} was handed to {batch_consumer!r}, not to {consumer!r}; only its "
                "consumer may resume or ack it"
            )

    def clamp_version(self, current_version: int) -> int:
        """`current_version` limited to one past the newest weights version seen (counted when cut)."""
        ceiling = self.latest_version + 1
        if current_version > ceiling:
            self.counters["pull_versions_clamped"] += 1
            _CLAMP_LOG.log(
                "clamp",
                "PullBatch current_version %d is ahead of the newest published weights (%d); using %d",
                current_version,
                self.latest_version,
                ceiling,
            )
            return ceiling
        return current_version


def _subject_of(step: events_pb2.StepEvent, run_id: str) -> str:
    """The steps subject of `step`, or of run_id's unknown task when its ids are not subject tokens."""
    try:
        return subjects.steps(step.run_id or run_id, step.task_id or "unknown")
    except InvalidArgument:
        return subjects.steps(run_id, "unknown")
