"""Live progress of a run, driven by its events (the collector's `on_event` callbacks).

`RunTracker` folds event records into the few numbers a person watches (trainer step, reward and
the oracle's, learning health — entropy, KL to the behaviour policy, clip fraction, zero-variance
groups —, device roles, tokens/s, executions); `LiveProgress` draws them with rich — bars on a
terminal, one plain line per trainer step otherwise (CI logs stay readable) — and prints a stall
warning (the report's rule, `app.job.analysis.detect_stall`) once, when it first holds.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from app.job.analysis import (
    ROLE_NAMES,
    RewardSamples,
    StepRow,
    detect_stall,
    teaches_nothing,
)
from app.job.stall_rule import StallWarning
from app.job.typed_events import typed

Record = dict[str, Any]


_HEALTH = (("entropy", "entropy", 3), ("kl_behaviour", "kl", 4), ("clip_fraction", "clip", 3))


class RunTracker:
    """Running totals of a run's events; `steps_done` fires when `target_steps` versions exist."""

    def __init__(self, target_steps: int, run_id: str = "") -> None:
        self.target_steps = target_steps
        self.run_id = run_id
        self.version = 0
        self.version_times: dict[int, float] = {}
        self.last_metrics: dict[str, float] = {}
        self.rewards: list[float] = []  # group rewards, in arrival order
        self.reward_samples = RewardSamples()  # the report's per-step reward samples, same records
        self.roles: dict[str, str] = {}
        self.executions: dict[str, int] = {"started": 0, "ended": 0}
        self.num_steps_seen = 0
        self.num_tokens = 0
        self.num_batches = 0
        self.groups_dropped = 0  # groups the trajectory service will never train (GroupDroppedEvent)
        self._token_window: deque[tuple[float, int]] = deque()
        self.started_at = time.time()
        self.steps_done = asyncio.Event()
        self.step_versions: list[int] = []  # weight versions in arrival order (monotonicity check)
        self.step_groups: dict[int, list[int]] = {}  # version -> [groups scored, zero-variance groups]
        self.step_oracle: dict[int, list[float]] = {}  # version -> oracle_reward of ended executions

    def update(self, record: Record) -> None:
        kind, ev = record["type"], record["event"]
        now = time.time()
        if kind in ("WeightsPublishedEvent", "GroupScoredEvent", "ExecutionEvent"):
            self.reward_samples.add(typed(record))
        if kind == "WeightsPublishedEvent":
            v = int((ev.get("weights") or {}).get("version", 0))
            self.step_versions.append(v)
            self.version = max(self.version, v)
            self.version_times.setdefault(v, now)
            self.last_metrics = {k: float(x) for k, x in (ev.get("metrics") or {}).items()}
            if self.version >= self.target_steps:
                self.steps_done.set()
        elif kind == "GroupScoredEvent":
            self.rewards.append(float(ev.get("reward_mean", 0.0)))
            counts = self.step_groups.setdefault(self.version, [0, 0])
            counts[0] += 1
            counts[1] += teaches_nothing(ev)
        elif kind == "ExecutionEvent":
            if ev.get("kind") in ("KIND_STARTED", "KIND_RESUMED"):  # resumed: live again in this run
                self.executions["started"] += 1
            elif ev.get("kind"):
                self.executions["ended"] += 1
                oracle = ((ev.get("progress") or {}).get("extra") or {}).get("oracle_reward")
                if oracle is not None:
                    self.step_oracle.setdefault(self.version, []).append(float(oracle))
        elif kind == "StepEvent":
            self.num_steps_seen += 1
            n = int(ev.get("num_completion_tokens", 0))
            self.num_tokens += n
            self._token_window.append((now, n))
        elif kind == "LeaseEvent":
            lease = ev.get("lease") or {}
            state = lease.get("state", "")
            role = ROLE_NAMES.get(lease.get("role", ""), "idle")
            if state in ("LEASE_STATE_RELEASED", "LEASE_STATE_GRANTED"):
                role = "switching"
            if lease.get("device_id"):
                self.roles[str(lease["device_id"])] = role
        elif kind == "BatchReadyEvent":
            self.num_batches += 1
        elif kind == "GroupDroppedEvent":
            self.groups_dropped += 1

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        now = time.time()
        while self._token_window and self._token_window[0][0] < now - window_s:
            self._token_window.popleft()
        span = min(window_s, max(now - self.started_at, 1e-6))
        return sum(n for _, n in self._token_window) / span

    def recent_reward(self) -> float | None:
        """The reward of the latest step with a sample: the report's reward of that step."""
        steps = [xs for xs in self.reward_samples.by_step() if xs]
        return statistics.fmean(steps[-1]) if steps else None

    def first_reward(self) -> float | None:
        """The reward of the first step with a sample: the report's reward of that step."""
        steps = [xs for xs in self.reward_samples.by_step() if xs]
        return statistics.fmean(steps[0]) if steps else None

    def oracle_reward(self) -> float | None:
        """Mean oracle reward of the ended executions (None: the environment reports none)."""
        values = [x for xs in self.step_oracle.values() for x in xs]
        return statistics.fmean(values) if values else None

    def zero_variance_fraction(self) -> float | None:
        """Share of the groups scored in the latest step that had any that teach nothing (equal
        rewards, every advantage 0)."""
        for v in sorted(self.step_groups, reverse=True):
            groups, zero = self.step_groups[v]
            if groups:
                return zero / groups
        return None

    def stall(self) -> StallWarning | None:
        """The report's stall rule over the steps seen so far (None: no stall)."""
        rows = []
        samples = self.reward_samples.by_step()
        for v in range(self.version + 1):
            groups, zero = self.step_groups.get(v, [0, 0])
            rows.append(
                StepRow(
                    step=v,
                    start_s=0.0,
                    end_s=0.0,
                    reward_samples=list(samples[v]) if v < len(samples) else [],
                    num_groups=groups,
                    num_zero_variance_groups=zero,
                    oracle_samples=list(self.step_oracle.get(v, [])),
                )
            )
        return detect_stall(rows)

    def health(self) -> str:
        """entropy / KL / clip fraction of the last trainer step, zero-variance groups, oracle reward."""
        m = self.last_metrics
        parts = [f"{label} {m[name]:.{digits}f}" for name, label, digits in _HEALTH if name in m]
        zero = self.zero_variance_fraction()
        if zero is not None:
            parts.append(f"zero-var groups {zero:.0%}")
        oracle = self.oracle_reward()
        if oracle is not None:
            parts.append(f"oracle {oracle:.3f}")
        return "  ".join(parts)

    def role_summary(self) -> str:
        counts: dict[str, int] = {}
        for role in self.roles.values():
            counts[role] = counts.get(role, 0) + 1
        return " ".join(f"{role}={n}" for role, n in sorted(counts.items())) or "(no leases yet)"

    def step_label(self) -> str:
        """`step N/TARGET`, never past the target: a step the trainer finished while the job was
        stopping it is counted as extra, not as a step beyond 100%."""
        shown = min(self.version, self.target_steps)
        extra = self.version - shown
        return f"step {shown}/{self.target_steps}" + (f" (+{extra} while stopping)" if extra else "")

    def line(self) -> str:
        r = self.recent_reward()
        r0 = self.first_reward()
        reward = f"{r:.3f} (step-0 {r0:.3f})" if r is not None and r0 is not None else "n/a"
        loss = self.last_metrics.get("loss")
        return (
            f"{self.step_label()}  reward {reward}  "
            f"{'loss ' + format(loss, '.4f') + '  ' if loss is not None else ''}"
            f"{self.health() + '  ' if self.health() else ''}"
            f"devices {self.role_summary()}  tokens/s {self.tokens_per_s():.0f}  "
            f"executions {self.executions['ended']}/{self.executions['started']}  batches {self.num_batches}"
        )


class LiveProgress:
    """Draws a RunTracker: rich bars on a terminal, one line per new trainer step otherwise."""

    def __init__(self, tracker: RunTracker, console: Console | None = None) -> None:
        self.tracker = tracker
        self.console = console or Console()
        self._interactive = self.console.is_terminal
        self._progress = Progress(
            TextColumn("[bold]trainer steps"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        )
        self._task = self._progress.add_task("steps", total=tracker.target_steps)
        self._live: Live | None = None
        self._printed_version = -1
        self.stall_warned = False
        self._checked_version = -1

    def _table(self) -> Table:
        t = self.tracker
        table = Table.grid(padding=(0, 2))
        r = t.recent_reward()
        r0 = t.first_reward()
        table.add_row(
            "reward",
            f"{r:.3f}" if r is not None else "n/a",
            "first step",
            f"{r0:.3f}" if r0 is not None else "n/a",
        )
        table.add_row("devices", t.role_summary(), "tokens/s", f"{t.tokens_per_s():.0f}")
        table.add_row(
            "executions",
            f"{t.executions['ended']} ended / {t.executions['started']} started",
            "LLM calls",
            str(t.num_steps_seen),
        )
        loss = t.last_metrics.get("loss")
        table.add_row("batches", str(t.num_batches), "loss", f"{loss:.4f}" if loss is not None else "n/a")
        oracle = t.oracle_reward()
        table.add_row(
            "learning", t.health() or "n/a", "oracle", f"{oracle:.3f}" if oracle is not None else "n/a"
        )
        return table

    def __enter__(self) -> LiveProgress:
        if self._interactive:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4)
            self._live.__enter__()
        return self

    def _render(self) -> Group:
        return Group(self._progress, self._table())

    def refresh(self) -> None:
        """Redraw (terminal) or print a line when the trainer step advanced (non-terminal)."""
        self._progress.update(self._task, completed=min(self.tracker.version, self.tracker.target_steps))
        if self._live is not None:
            self._live.update(self._render())
        elif self.tracker.version != self._printed_version:
            self._printed_version = self.tracker.version
            self.console.print(self.tracker.line(), highlight=False, soft_wrap=True)
        if not self.stall_warned and self.tracker.version != self._checked_version:
            self._checked_version = self.tracker.version
            stall = self.tracker.stall()
            if stall is not None:  # said once, in both modes (the report repeats it)
                self.stall_warned = True
                self.console.print(stall.message(), style="bold red", highlight=False, soft_wrap=True)

    async def run(self, interval_s: float = 0.5) -> None:
        """Refresh every `interval_s` until cancelled."""
        while True:
            self.refresh()
            await asyncio.sleep(interval_s)

    def __exit__(self, *exc: object) -> None:
        self.refresh()
        if self._live is not None:
            self._live.__exit__(None, None, None)
