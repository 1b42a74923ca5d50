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
entirely above 0 — the improvement is larger than the sampling noise of both windows.

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

from app.job.bootstrap import Interval, bootstrap_difference, bootstrap_mean

ROLES = ("rollout", "train", "switching", "idle")
ROLE_NAMES = {"DEVICE_ROLE_ROLLOUT": "rollout", "DEVICE_ROLE_TRAIN": "train", "DEVICE_ROLE_IDLE": "idle"}
_TERMINAL_KINDS = {"KIND_FINISHED", "KIND_TRUNCATED", "KIND_FAILED"}
ZERO_VARIANCE_STD = 1e-9  # a group whose reward_std is at most this has zero variance


def teaches_nothing(scored: dict[str, Any]) -> bool:
    """A GroupScoredEvent (proto3 JSON: zeros omitted) whose rewards all agree and whose tokens are
    all trained with advantage 0. Under per-call credit a group with equal final rewards can still
    teach (its calls' advantages differ), so reward_std alone would overstate silent groups."""
    return (
        _f(scored.get("reward_std")) <= ZERO_VARIANCE_STD
        and _f(scored.get("advantage_abs_max")) <= ZERO_VARIANCE_STD
    )


STALL_WINDOW_STEPS = 10
STALL_ZERO_VARIANCE = 0.5
STALL_REWARD_FRACTION = 0.9
STALL_RULE = (
    f"stalled iff, over {STALL_WINDOW_STEPS} consecutive trainer steps, at least {STALL_ZERO_VARIANCE:.0%} of "
    f"the scored groups have zero variance (equal rewards, every advantage 0: no learning signal) while the mean reward "
    f"is below {STALL_REWARD_FRACTION:.0%} of the oracle's"
)
LEARNED_RULE = (
    "learned iff the 95% bootstrap interval of (reward_last20 - reward_first20) lies entirely above 0, "
    "i.e. the last 20% of trainer steps beat the first 20% by more than the sampling noise of both"
)


@dataclass(frozen=True)
class RewardVerdict:
    first20: Interval
    last20: Interval
    delta: Interval
    learned: bool
    first_steps: tuple[int, int]  # inclusive step range
    last_steps: tuple[int, int]
    rule: str = LEARNED_RULE


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


@dataclass(frozen=True)
class StallWarning:
    """Steps `first_step`..`last_step` met the stall rule (STALL_RULE); numbers pooled over them."""

    first_step: int
    last_step: int
    zero_variance_fraction: float
    reward: float
    oracle: float
    oracle_reported: bool
    recovered: bool = False  # the last steps of the run no longer met the rule
    rule: str = STALL_RULE

    def message(self) -> str:
        oracle = (
            f"the oracle's {self.oracle:.3f}"
            if self.oracle_reported
            else f"{self.oracle:.3f} (no oracle reported)"
        )
        advice = (
            f"groups carried a learning signal again after step {self.last_step}"
            if self.recovered
            else "raise trainer.entropy_coef, lower trainer.lr, or sample larger groups"
        )
        return (
            f"WARNING learning stalled in steps {self.first_step}-{self.last_step}: "
            f"{self.zero_variance_fraction:.0%} of groups had zero variance (no learning signal) "
            f"while the reward was {self.reward:.3f}, below {oracle}; {advice}"
        )


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
    """reward_first20 / reward_last20 with intervals and the learning verdict; None without 2 steps."""
    if num_steps < 2:
        return None
    (f0, f1), (l0, l1) = window_steps(num_steps)
    first = [x for r in steps if f0 <= r.step <= f1 for x in r.reward_samples]
    last = [x for r in steps if l0 <= r.step <= l1 for x in r.reward_samples]
    delta = bootstrap_difference(first, last, seed=seed)
    learned = not math.isnan(delta.low) and delta.low > 0
    return RewardVerdict(
        first20=bootstrap_mean(first, seed=seed),
        last20=bootstrap_mean(last, seed=seed + 2),
        delta=delta,
        learned=learned,
        first_steps=(f0, f1),
        last_steps=(l0, l1),
    )


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


def _f(x: Any, default: float = 0.0) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return default


def event_time(record: dict[str, Any]) -> float:
    """When the event happened: its `created_unix_s` (or a nested weights/step time), else receipt time."""
    ev = record["event"]
    for key in ("created_unix_s", "finished_unix_s"):
        if _f(ev.get(key)) > 0:
            return _f(ev[key])
    weights = ev.get("weights") or {}
    if _f(weights.get("created_unix_s")) > 0:
        return _f(weights["created_unix_s"])
    return _f(record.get("recv_unix_s"))


def progress_fraction(progress: dict[str, Any] | None) -> float | None:
    """Partial progress in [0, 1] from a ProgressSignal dict: milestones first, else tests passing."""
    if not progress:
        return None
    total = _f(progress.get("milestones_total"))
    if total > 0:
        return min(1.0, max(0.0, _f(progress.get("milestones_reached")) / total))
    if "tests_passed_fraction" in progress:
        return min(1.0, max(0.0, _f(progress["tests_passed_fraction"])))
    return None


def execution_score(ev: dict[str, Any]) -> float:
    """An ended execution's score including partial progress: final reward, else progress, else 0."""
    if "reward" in ev and ev.get("kind") == "KIND_FINISHED":
        return _f(ev["reward"])
    frac = progress_fraction(ev.get("progress"))
    return frac if frac is not None else 0.0


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


def _role_of(lease: dict[str, Any]) -> str:
    state = lease.get("state", "")
    if state in ("LEASE_STATE_RELEASED", "LEASE_STATE_GRANTED"):
        return "switching"
    return ROLE_NAMES.get(lease.get("role", ""), "idle")


def _role_segments(leases: list[tuple[float, dict[str, Any]]], t0: float, t_end: float) -> list[RoleSegment]:
    by_device: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for t, ev in sorted(leases, key=lambda x: x[0]):
        lease = ev.get("lease") or {}
        device = lease.get("device_id")
        if device:
            by_device[str(device)].append((t - t0, _role_of(lease)))
    segments: list[RoleSegment] = []
    for device, changes in sorted(by_device.items()):
        for i, (start, role) in enumerate(changes):
            end = changes[i + 1][0] if i + 1 < len(changes) else t_end - t0
            if end > start:
                segments.append(RoleSegment(device, role, start, end))
    return segments


def analyse(records: list[dict[str, Any]], *, seed: int = 0) -> RunAnalysis:
    """Everything the report shows, from event log records (any order)."""
    if not records:
        raise ValueError("the event log holds no events: did the run start? (expected run_dir/events.jsonl)")
    by_type: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_type[r["type"]].append(r)
    times = [event_time(r) for r in records]
    t0, t_end = min(times), max(times)

    run_ids = Counter(str(r["event"].get("run_id", "")) for r in records if r["event"].get("run_id"))
    run_id = run_ids.most_common(1)[0][0] if run_ids else ""

    publish_times: dict[int, float] = {}
    metrics_by_version: dict[int, dict[str, float]] = {}
    for r in by_type["WeightsPublishedEvent"]:
        version = int(_f((r["event"].get("weights") or {}).get("version")))
        t = event_time(r)
        if version not in publish_times or t < publish_times[version]:
            publish_times[version] = t
        metrics_by_version[version] = {k: _f(v) for k, v in (r["event"].get("metrics") or {}).items()}
    clock = _StepClock(publish_times)
    num_steps = max((v for v in publish_times if v > 0), default=0)

    steps = [StepRow(step=s, start_s=0.0, end_s=0.0) for s in range(num_steps + 1)]
    for s, row in enumerate(steps):
        row.start_s = (publish_times.get(s, t0) if s > 0 else t0) - t0
        row.end_s = (publish_times[s + 1] if s + 1 in publish_times else t_end) - t0
        # metrics of the optimizer step that produced version s+1 belong to step s
        row.trainer_metrics = metrics_by_version.get(s + 1, {})

    for r in by_type["GroupScoredEvent"]:
        ev = r["event"]
        row = steps[min(clock.step_at(event_time(r)), num_steps)]
        row.scored_samples.append(_f(ev.get("reward_mean", 0.0), math.nan))  # proto3 JSON omits 0
        row.num_groups += 1
        row.num_paths += int(_f(ev.get("num_paths")))
        row.num_exact_merged += int(_f(ev.get("num_exact_merged")))
        row.num_near_duplicates += int(_f(ev.get("num_near_duplicates")))
        row.num_zero_variance_groups += teaches_nothing(ev)
    for row in steps:
        row.scored_samples = [x for x in row.scored_samples if not math.isnan(x)]

    execution_counts: Counter[str] = Counter()
    ended_at: dict[str, float] = {}
    group_scores: dict[tuple[int, str], list[float]] = defaultdict(list)
    for r in by_type["ExecutionEvent"]:
        ev = r["event"]
        kind = str(ev.get("kind", "KIND_UNSPECIFIED"))
        execution_counts[kind.removeprefix("KIND_").lower()] += 1
        if kind in _TERMINAL_KINDS:
            t = event_time(r)
            ended_at[str(ev.get("execution_id", ""))] = t
            row = steps[min(clock.step_at(t), num_steps)]
            frac = progress_fraction(ev.get("progress"))
            row.progress_samples.append(frac if frac is not None else execution_score(ev))
            oracle = ((ev.get("progress") or {}).get("extra") or {}).get("oracle_reward")
            if oracle is not None:
                row.oracle_samples.append(_f(oracle))
            group = str(ev.get("group_id") or ev.get("execution_id", ""))
            group_scores[(row.step, group)].append(execution_score(ev))
    for (step, _group), scores in sorted(group_scores.items()):
        steps[step].reward_samples.append(statistics.fmean(scores))
    if not group_scores:
        for row in steps:
            row.reward_samples = list(row.scored_samples)

    batch_times: list[float] = []
    batch_versions: list[int] = []
    batch_max_staleness: list[int] = []
    for r in sorted(by_type["BatchReadyEvent"], key=event_time):
        ev = r["event"]
        t = event_time(r)
        trainer_version = clock.step_at(t)
        batch_times.append(t)
        batch_versions.append(trainer_version)
        if int(_f(ev.get("num_tokens"))) > 0:
            batch_max_staleness.append(trainer_version - int(_f(ev.get("min_policy_version"))))
        row = steps[min(trainer_version, num_steps)]
        row.num_batches += 1
        row.batch_tokens += int(_f(ev.get("num_tokens")))
        row.batch_flat_tokens += int(_f(ev.get("num_flat_tokens")))

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
        ev = r["event"]
        num_calls += 1
        eid = str(ev.get("execution_id", ""))
        n_out = int(_f(ev.get("num_completion_tokens")))
        exec_context[eid] = max(exec_context[eid], int(_f(ev.get("num_prompt_tokens"))) + n_out)
        exec_calls[eid] += 1
        exec_generated[eid] += n_out
        num_completion_tokens += int(_f(ev.get("num_completion_tokens")))
        num_migrations += int(_f(ev.get("num_migrations")))
        if ev.get("context_event"):
            context_events[str(ev["context_event"])] += 1
        ready = ended_at.get(str(ev.get("execution_id", "")), event_time(r))
        i = bisect.bisect_left(batch_times, ready)
        for version_text, count in (ev.get("completion_version_counts") or {}).items():
            if i < len(batch_times):
                staleness[batch_versions[i] - int(version_text)] += int(count)
            else:
                untrained += int(count)

    leases = [(event_time(r), r["event"]) for r in by_type["LeaseEvent"]]
    segments = _role_segments(leases, t0, t_end)
    device_time = {role: 0.0 for role in ROLES}
    for seg in segments:
        device_time[seg.role] += seg.end_s - seg.start_s
    policies = Counter(  # REGISTERED is a worker joining the pool, not a policy decision
        str(ev.get("policy"))
        for _, ev in leases
        if ev.get("policy") not in (None, "", "operator") and ev.get("kind") != "KIND_REGISTERED"
    )
    num_reassign = sum(1 for _, ev in leases if ev.get("kind") == "KIND_REASSIGN")

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
