"""Numbers a run report shows, computed from event log records alone (pure functions, no I/O).

Time axis: a *trainer step* s is the span from the publication of weight version s to that of
version s+1 (step 0 starts at the first event of the run). Every event is placed in the step
during which it happened (its `created_unix_s`, else the time it was received).

Reward (including partial progress), as the environment reports it: every ended execution scores
its final reward when FINISHED, else its progress (milestones reached / milestones total, or the
fraction of tests passing). One sample per group and step: the mean score of the group's
executions that ended in that step (executions of a group share a task, so they are not
independent samples). Without execution events, the scored groups' `GroupScoredEvent.reward_mean`
is used instead; it is always plotted too, as the signal the trainer trained on.

Learning verdict (the rule): with N trainer steps (steps 0..N-1 end with the publication of
versions 1..N), the first (last) 20% of steps are the first (last) k = max(1, round(0.2 * N)) of
them; the last window also holds what was scored after version N (the run's drain), the first
window also holds step 0's warm-up. `reward_first20` and `reward_last20`
are the mean reward of the samples in those steps, each with a 95% percentile-bootstrap interval.
The run **learned** iff the 95% bootstrap interval of the difference `last20 - first20` lies
entirely above 0 — the improvement is larger than the sampling noise of both windows. Below
MIN_SAMPLES_PER_WINDOW samples in either window (or fewer than 2 trainer steps) there is no verdict:
the run is "too few steps to judge", neither yes nor no (a percentile bootstrap of 2 samples is far
too narrow; a 1-step random run must not read as learned).

The per-step reward samples come from one place, `RewardSamples`, which both the report and the
live progress line (app/job/progress.py) feed with the same records: the live line's reward of a
step is the report's reward of that step.

Learning health, per step: the trainer's `entropy` (nats, of generated tokens), `kl_behaviour`
(KL from the behaviour policy) and `clip_fraction` (from the weights event's metrics, see
services/trainer/loss.py); the fraction of scored groups that teach nothing (zero variance: their
rewards all agree and every advantage is 0, `teaches_nothing`); the oracle's reward on the same tasks (the
environment's `progress.extra["oracle_reward"]`, when it reports one).

Stall (the rule, `detect_stall`): over a sliding window of STALL_WINDOW_STEPS steps, at least
STALL_ZERO_VARIANCE of the scored groups have zero variance while the mean reward is below
STALL_REWARD_FRACTION of the oracle's (1.0, the scorer's default maximum, when the environment
reports no oracle). The warning names the span of steps where that held.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from app.job.bootstrap import Interval, bootstrap_difference, bootstrap_mean
from app.job.stall_rule import (
    STALL_REWARD_FRACTION,
    STALL_WINDOW_STEPS,
    STALL_ZERO_VARIANCE,
    StallWarning,
)
from app.job.typed_events import (
    EventLogError,
    TypedRecord,
    enum_name,
    typed,
    typed_all,
)
from app.job.typed_events import execution_score as typed_execution_score
from app.job.typed_events import progress_fraction as typed_progress_fraction
from gyre.v1 import common_pb2, events_pb2

ROLES = ("rollout", "train", "switching", "idle")
ROLE_NAMES = {"DEVICE_ROLE_ROLLOUT": "rollout", "DEVICE_ROLE_TRAIN": "train", "DEVICE_ROLE_IDLE": "idle"}
_TERMINAL_KINDS = {"KIND_FINISHED", "KIND_TRUNCATED", "KIND_FAILED"}
ZERO_VARIANCE_STD = 1e-9  # a group whose reward_std is at most this has zero variance


def teaches_nothing(scored: events_pb2.GroupScoredEvent | dict[str, Any]) -> bool:
    """A GroupScoredEvent (proto3 JSON: zeros omitted) whose rewards all agree and whose tokens are
    all trained with advantage 0. Under per-call credit a group with equal final rewards can still
    teach (its calls' advantages differ), so reward_std alone would overstate silent groups."""
    if isinstance(scored, dict):
        scored = typed({"type": "GroupScoredEvent", "event": scored}).event  # type: ignore[assignment]
    assert isinstance(scored, events_pb2.GroupScoredEvent)
    return scored.reward_std <= ZERO_VARIANCE_STD and scored.advantage_abs_max <= ZERO_VARIANCE_STD


MIN_SAMPLES_PER_WINDOW = 8
"""Reward samples (groups) each window needs before the run is judged at all."""
TOO_FEW_TO_JUDGE = "too few steps to judge"
LEARNED_RULE = (
    "learned iff the 95% bootstrap interval of (reward_last20 - reward_first20) lies entirely above 0, "
    "i.e. the last 20% of trainer steps beat the first 20% by more than the sampling noise of both; "
    f"not judged ('{TOO_FEW_TO_JUDGE}') with fewer than {MIN_SAMPLES_PER_WINDOW} reward samples "
    "(groups) in either window"
)


@dataclass(frozen=True)
class RewardVerdict:
    first20: Interval
    last20: Interval
    delta: Interval
    learned: bool  # False when not judged
    first_steps: tuple[int, int]  # inclusive step range
    last_steps: tuple[int, int]
    rule: str = LEARNED_RULE
    judged: bool = True  # False: fewer than MIN_SAMPLES_PER_WINDOW samples in a window

    @property
    def outcome(self) -> str:
        """'yes', 'no' or 'too few steps to judge'."""
        return ("yes" if self.learned else "no") if self.judged else TOO_FEW_TO_JUDGE

    def why_not_judged(self) -> str:
        return (
            f"{self.first20.n} and {self.last20.n} reward samples (groups) in the first and last 20% of "
            f"steps; the verdict needs at least {MIN_SAMPLES_PER_WINDOW} in each"
        )


@dataclass
class StepRow:
    """What happened during one trainer step (see the module docstring for the time axis)."""

    step: int
    start_s: float  # seconds since run start
    end_s: float
    # reward incl. partial progress: one sample per group = mean score of its executions that ended
    # in this step (the environment's own numbers); without execution events, the scored groups'
    reward_samples: list[float] = field(default_factory=list)
    progress_samples: list[float] = field(default_factory=list)
    scored_samples: list[float] = field(
        default_factory=list
    )  # GroupScoredEvent.reward_mean (trainer's signal)
    num_groups: int = 0
    num_paths: int = 0
    num_exact_merged: int = 0
    num_near_duplicates: int = 0
    num_batches: int = 0
    batch_tokens: int = 0
    batch_flat_tokens: int = 0
    trainer_metrics: dict[str, float] = field(default_factory=dict)
    num_zero_variance_groups: int = 0  # scored groups with equal rewards and every advantage 0
    oracle_samples: list[float] = field(default_factory=list)  # oracle_reward of executions ended here

    @property
    def zero_variance_fraction(self) -> float:
        return self.num_zero_variance_groups / self.num_groups if self.num_groups else math.nan

    @property
    def oracle_mean(self) -> float:
        return statistics.fmean(self.oracle_samples) if self.oracle_samples else math.nan

    @property
    def reward_mean(self) -> float:
        return statistics.fmean(self.reward_samples) if self.reward_samples else math.nan

    @property
    def progress_mean(self) -> float:
        return statistics.fmean(self.progress_samples) if self.progress_samples else math.nan

    @property
    def tree_token_ratio(self) -> float:
        return self.batch_flat_tokens / self.batch_tokens if self.batch_tokens else math.nan


@dataclass(frozen=True)
class RoleSegment:
    device_id: str
    role: str  # one of ROLES
    start_s: float
    end_s: float


@dataclass
class RunAnalysis:
    run_id: str
    policy: str
    start_unix_s: float
    duration_s: float
    num_steps: int
    steps: list[StepRow]
    segments: list[RoleSegment]
    device_time_s: dict[str, float]
    num_reassignments: int
    staleness_token_counts: dict[int, int]
    num_untrained_tokens: int
    batch_max_staleness: list[int]
    execution_counts: dict[str, int]
    num_llm_calls: int
    num_completion_tokens: int
    num_migrations: int
    num_context_events: dict[str, int]
    verdict: RewardVerdict | None
    num_events: dict[str, int]
    # per execution: final context (prompt + completion of its largest call), calls, generated tokens
    execution_context_tokens: list[int] = field(default_factory=list)
    execution_num_calls: list[int] = field(default_factory=list)
    execution_generated_tokens: list[int] = field(default_factory=list)
    stall: StallWarning | None = None

    @property
    def device_idle_fraction(self) -> float:
        total = sum(self.device_time_s.values())
        idle = self.device_time_s.get("idle", 0.0) + self.device_time_s.get("switching", 0.0)
        return idle / total if total > 0 else math.nan

    @property
    def time_per_step_s(self) -> float:
        """Wall time of the run up to the last weight publication, divided by the number of steps."""
        if self.num_steps == 0:
            return math.nan
        return self.steps[self.num_steps - 1].end_s / self.num_steps

    @property
    def tokens_per_s(self) -> float:
        return self.num_completion_tokens / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def tree_token_ratio(self) -> float:
        tokens = sum(r.batch_tokens for r in self.steps)
        flat = sum(r.batch_flat_tokens for r in self.steps)
        return flat / tokens if tokens else math.nan


# ---------------------------------------------------------------------------------------------
# statistics


def window_steps(num_steps: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Inclusive step ranges of the first and last 20% of the steps 0..num_steps-1 (the last one
    extended to num_steps, the drain after the final publication)."""
    k = max(1, round(0.2 * num_steps))
    return (0, k - 1), (num_steps - k, num_steps)


def reward_verdict(steps: list[StepRow], num_steps: int, *, seed: int = 0) -> RewardVerdict | None:
    """reward_first20 / reward_last20 with intervals and the learning verdict (not judged below
    MIN_SAMPLES_PER_WINDOW samples in a window); None without 2 steps."""
    if num_steps < 2:
        return None
    (f0, f1), (l0, l1) = window_steps(num_steps)
    first = [x for r in steps if f0 <= r.step <= f1 for x in r.reward_samples]
    last = [x for r in steps if l0 <= r.step <= l1 for x in r.reward_samples]
    judged = min(len(first), len(last)) >= MIN_SAMPLES_PER_WINDOW
    delta = bootstrap_difference(first, last, seed=seed)
    return RewardVerdict(
        first20=bootstrap_mean(first, seed=seed),
        last20=bootstrap_mean(last, seed=seed + 2),
        delta=delta,
        learned=judged and not math.isnan(delta.low) and delta.low > 0,
        first_steps=(f0, f1),
        last_steps=(l0, l1),
        judged=judged,
    )


@dataclass
class RewardSamples:
    """The reward samples of each trainer step, from the records fed to `add` in any order: one
    per group and step, the mean score of the group's executions that ended in that step; without
    any execution event, the scored groups' reward_mean (module docstring). The report (`analyse`)
    and the live line (progress.RunTracker) both use it, so they show the same numbers."""

    publish_times: dict[int, float] = field(default_factory=dict)
    ended: list[tuple[float, str, float]] = field(default_factory=list)  # (time, group, score)
    scored: list[tuple[float, float]] = field(default_factory=list)  # (time, reward_mean)

    def add(self, r: TypedRecord) -> None:
        ev = r.event
        if isinstance(ev, events_pb2.WeightsPublishedEvent):
            version = int(ev.weights.version)
            if version not in self.publish_times or r.time < self.publish_times[version]:
                self.publish_times[version] = r.time
        elif isinstance(ev, events_pb2.GroupScoredEvent) and not math.isnan(ev.reward_mean):
            self.scored.append((r.time, ev.reward_mean))
        elif isinstance(ev, events_pb2.ExecutionEvent) and enum_name(ev, "kind") in _TERMINAL_KINDS:
            self.ended.append((r.time, ev.group_id or ev.execution_id, typed_execution_score(ev)))

    @property
    def num_steps(self) -> int:
        return max((v for v in self.publish_times if v > 0), default=0)

    def by_step(self) -> list[list[float]]:
        """Samples of steps 0..num_steps (what a step ended after the last publication: the last)."""
        clock, last = _StepClock(self.publish_times), self.num_steps
        out: list[list[float]] = [[] for _ in range(last + 1)]
        groups: dict[tuple[int, str], list[float]] = defaultdict(list)
        for t, group, score in self.ended:
            groups[(min(clock.step_at(t), last), group)].append(score)
        for (step, _group), scores in sorted(groups.items()):
            out[step].append(statistics.fmean(scores))
        if not groups:
            for t, reward in self.scored:
                out[min(clock.step_at(t), last)].append(reward)
        return out


def step_reward(row: StepRow) -> list[float]:
    """The reward samples of a step (executions' scores, else the scored groups')."""
    return row.reward_samples or row.scored_samples


def detect_stall(
    steps: list[StepRow],
    *,
    window: int = STALL_WINDOW_STEPS,
    zero_variance: float = STALL_ZERO_VARIANCE,
    reward_fraction: float = STALL_REWARD_FRACTION,
    default_oracle: float = 1.0,
) -> StallWarning | None:
    """The span of steps that met the stall rule (STALL_RULE), or None (a healthy run).

    Each window of `window` consecutive steps pools its scored groups, reward samples and oracle
    samples; it is stalled when zero-variance groups / groups >= `zero_variance` and mean reward <
    `reward_fraction` * mean oracle reward. The warning spans the first silent step of the first
    stalled window to the end of the last one."""
    flagged: list[tuple[int, int]] = []
    for end in range(window - 1, len(steps)):
        rows = steps[end - window + 1 : end + 1]
        groups = sum(r.num_groups for r in rows)
        rewards = [x for r in rows for x in step_reward(r)]
        if not groups or not rewards:
            continue
        oracle_samples = [x for r in rows for x in r.oracle_samples]
        oracle = statistics.fmean(oracle_samples) if oracle_samples else default_oracle
        zero = sum(r.num_zero_variance_groups for r in rows) / groups
        if zero >= zero_variance and statistics.fmean(rewards) < reward_fraction * oracle:
            flagged.append((rows[0].step, rows[-1].step))
    if not flagged:
        return None
    # the span starts at the first silent step of the first stalled window
    first = next(
        r.step
        for r in steps
        if flagged[0][0] <= r.step and r.num_groups and r.zero_variance_fraction >= zero_variance
    )
    last = flagged[-1][1]
    rows = [r for r in steps if first <= r.step <= last]
    oracle_samples = [x for r in rows for x in r.oracle_samples]
    return StallWarning(
        first_step=first,
        last_step=last,
        zero_variance_fraction=sum(r.num_zero_variance_groups for r in rows)
        / max(1, sum(r.num_groups for r in rows)),
        reward=statistics.fmean(x for r in rows for x in step_reward(r)),
        oracle=statistics.fmean(oracle_samples) if oracle_samples else default_oracle,
        oracle_reported=bool(oracle_samples),
        recovered=last < steps[-1].step,
    )


# ---------------------------------------------------------------------------------------------
# helpers over records


def event_time(record: dict[str, Any]) -> float:
    """When a logged event happened (seconds since the epoch; app/job/typed_events.py)."""
    return typed(record).time


def progress_fraction(progress: dict[str, Any] | None) -> float | None:
    """Partial progress in [0, 1] of a logged ProgressSignal (typed_events.progress_fraction)."""
    if not progress:
        return None
    try:
        signal = json_format.ParseDict(progress, common_pb2.ProgressSignal())
    except json_format.ParseError as exc:
        raise EventLogError(f"progress signal: {exc}") from None
    return typed_progress_fraction(signal)


def execution_score(ev: dict[str, Any]) -> float:
    """A logged ended execution's score including partial progress (typed_events.execution_score)."""
    message = typed({"type": "ExecutionEvent", "event": ev}).event
    assert isinstance(message, events_pb2.ExecutionEvent)
    return typed_execution_score(message)


class _StepClock:
    """Maps a time to the trainer step in progress then (see the module docstring)."""

    def __init__(self, publish_times: dict[int, float]) -> None:
        versions = sorted(v for v in publish_times if v > 0)
        self.versions = versions
        self.times = [publish_times[v] for v in versions]

    def step_at(self, t: float) -> int:
        i = bisect.bisect_right(self.times, t)
        return self.versions[i - 1] if i > 0 else 0


# ---------------------------------------------------------------------------------------------
# the analysis


def _role_of(lease: common_pb2.Lease) -> str:
    state = enum_name(lease, "state")
    if state in ("LEASE_STATE_RELEASED", "LEASE_STATE_GRANTED"):
        return "switching"
    return ROLE_NAMES.get(enum_name(lease, "role"), "idle")


def _role_segments(
    leases: list[tuple[float, events_pb2.LeaseEvent]], t0: float, t_end: float
) -> list[RoleSegment]:
    by_device: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for t, ev in sorted(leases, key=lambda x: x[0]):
        if ev.HasField("lease") and ev.lease.device_id:
            by_device[ev.lease.device_id].append((t - t0, _role_of(ev.lease)))
    segments: list[RoleSegment] = []
    for device, changes in sorted(by_device.items()):
        for i, (start, role) in enumerate(changes):
            end = changes[i + 1][0] if i + 1 < len(changes) else t_end - t0
            if end > start:
                segments.append(RoleSegment(device, role, start, end))
    return segments


def analyse(records: list[dict[str, Any]], *, seed: int = 0) -> RunAnalysis:
    """Everything the report shows, from event log records (any order). Every record is typed first
    (app/job/typed_events.py): a malformed one is an EventLogError naming it, not a silent 0."""
    if not records:
        raise ValueError("the event log holds no events: did the run start? (expected run_dir/events.jsonl)")
    rows_typed = typed_all(records)
    by_type: dict[str, list[TypedRecord]] = defaultdict(list)
    for r in rows_typed:
        by_type[r.type].append(r)
    times = [r.time for r in rows_typed]
    t0, t_end = min(times), max(times)

    run_ids = Counter(
        str(getattr(r.event, "run_id", "")) for r in rows_typed if getattr(r.event, "run_id", "")
    )
    run_id = run_ids.most_common(1)[0][0] if run_ids else ""

    publish_times: dict[int, float] = {}
    metrics_by_version: dict[int, dict[str, float]] = {}
    for r in by_type["WeightsPublishedEvent"]:
        assert isinstance(r.event, events_pb2.WeightsPublishedEvent)
        version = int(r.event.weights.version)
        if version not in publish_times or r.time < publish_times[version]:
            publish_times[version] = r.time
        metrics_by_version[version] = {k: float(v) for k, v in r.event.metrics.items()}
    clock = _StepClock(publish_times)
    num_steps = max((v for v in publish_times if v > 0), default=0)

    steps = [StepRow(step=s, start_s=0.0, end_s=0.0) for s in range(num_steps + 1)]
    for s, row in enumerate(steps):
        row.start_s = (publish_times.get(s, t0) if s > 0 else t0) - t0
        row.end_s = (publish_times[s + 1] if s + 1 in publish_times else t_end) - t0
        # metrics of the optimizer step that produced version s+1 belong to step s
        row.trainer_metrics = metrics_by_version.get(s + 1, {})

    for r in by_type["GroupScoredEvent"]:
        scored = r.event
        assert isinstance(scored, events_pb2.GroupScoredEvent)
        row = steps[min(clock.step_at(r.time), num_steps)]
        if not math.isnan(scored.reward_mean):
            row.scored_samples.append(scored.reward_mean)
        row.num_groups += 1
        row.num_paths += scored.num_paths
        row.num_exact_merged += scored.num_exact_merged
        row.num_near_duplicates += scored.num_near_duplicates
        row.num_zero_variance_groups += teaches_nothing(scored)

    execution_counts: Counter[str] = Counter()
    ended_at: dict[str, float] = {}
    for r in by_type["ExecutionEvent"]:
        ev = r.event
        assert isinstance(ev, events_pb2.ExecutionEvent)
        kind = enum_name(ev, "kind")
        execution_counts[kind.removeprefix("KIND_").lower()] += 1
        if kind in _TERMINAL_KINDS:
            ended_at[ev.execution_id] = r.time
            row = steps[min(clock.step_at(r.time), num_steps)]
            progress = ev.progress if ev.HasField("progress") else None
            frac = typed_progress_fraction(progress)
            score = typed_execution_score(ev)
            row.progress_samples.append(frac if frac is not None else score)
            if progress is not None and "oracle_reward" in progress.extra:
                row.oracle_samples.append(float(progress.extra["oracle_reward"]))
    rewards = RewardSamples()
    for r in rows_typed:
        rewards.add(r)
    for row, samples in zip(steps, rewards.by_step(), strict=True):
        row.reward_samples = samples

    batch_times: list[float] = []
    batch_versions: list[int] = []
    batch_max_staleness: list[int] = []
    for r in sorted(by_type["BatchReadyEvent"], key=lambda r: r.time):
        batch = r.event
        assert isinstance(batch, events_pb2.BatchReadyEvent)
        trainer_version = clock.step_at(r.time)
        batch_times.append(r.time)
        batch_versions.append(trainer_version)
        if batch.num_tokens > 0:
            batch_max_staleness.append(trainer_version - int(batch.min_policy_version))
        row = steps[min(trainer_version, num_steps)]
        row.num_batches += 1
        row.batch_tokens += int(batch.num_tokens)
        row.batch_flat_tokens += int(batch.num_flat_tokens)

    staleness: Counter[int] = Counter()
    untrained = 0
    num_calls = 0
    num_completion_tokens = 0
    num_migrations = 0
    context_events: Counter[str] = Counter()
    exec_context: dict[str, int] = defaultdict(int)
    exec_calls: Counter[str] = Counter()
    exec_generated: Counter[str] = Counter()
    for r in by_type["StepEvent"]:
        call, summary = r.event, r.step
        assert isinstance(call, events_pb2.StepEvent) and summary is not None
        num_calls += 1
        eid = call.execution_id
        n_out = summary.num_completion_tokens
        exec_context[eid] = max(exec_context[eid], summary.num_prompt_tokens + n_out)
        exec_calls[eid] += 1
        exec_generated[eid] += n_out
        num_completion_tokens += n_out
        num_migrations += call.num_migrations
        if call.context_event:
            context_events[call.context_event] += 1
        ready = ended_at.get(eid, r.time)
        i = bisect.bisect_left(batch_times, ready)
        for version, count in summary.version_counts.items():
            if i < len(batch_times):
                staleness[batch_versions[i] - version] += count
            else:
                untrained += count

    leases: list[tuple[float, events_pb2.LeaseEvent]] = []
    for r in by_type["LeaseEvent"]:
        assert isinstance(r.event, events_pb2.LeaseEvent)
        leases.append((r.time, r.event))
    segments = _role_segments(leases, t0, t_end)
    device_time = {role: 0.0 for role in ROLES}
    for seg in segments:
        device_time[seg.role] += seg.end_s - seg.start_s
    policies = Counter(  # REGISTERED is a worker joining the pool, not a policy decision
        ev.policy
        for _, ev in leases
        if ev.policy not in ("", "operator") and enum_name(ev, "kind") != "KIND_REGISTERED"
    )
    num_reassign = sum(1 for _, ev in leases if enum_name(ev, "kind") == "KIND_REASSIGN")

    return RunAnalysis(
        run_id=run_id,
        policy=policies.most_common(1)[0][0] if policies else "",
        start_unix_s=t0,
        duration_s=t_end - t0,
        num_steps=num_steps,
        steps=steps,
        segments=segments,
        device_time_s=device_time,
        num_reassignments=num_reassign,
        staleness_token_counts=dict(sorted(staleness.items())),
        num_untrained_tokens=untrained,
        batch_max_staleness=batch_max_staleness,
        execution_counts=dict(execution_counts),
        num_llm_calls=num_calls,
        num_completion_tokens=num_completion_tokens,
        num_migrations=num_migrations,
        num_context_events=dict(context_events),
        verdict=reward_verdict(steps, num_steps, seed=seed),
        num_events={k: len(v) for k, v in sorted(by_type.items())},
        execution_context_tokens=list(exec_context.values()),
        execution_num_calls=[exec_calls[e] for e in exec_context],
        execution_generated_tokens=[exec_generated[e] for e in exec_context],
        stall=detect_stall(steps),
    )
