"""What the dashboard shows, read from a run directory (pure reads; re-read when a file changes).

Sources: `<run_dir>/events.jsonl` (every event of the run, appended while it runs),
`<run_dir>/trajectory/trees.jsonl` (every group's branch tree, written by `gyre run` when the job
ends: app/job/trees.py) and the run's faults and recoveries (app/job/faults.py: final_stats.json,
written when the job ends, chaos.json and stall.json). Numbers are the report's: curves are `app.job.tracking.learning_rows` of
the same `RunAnalysis`, device lanes are the analysis' role segments.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.job.analysis import RunAnalysis, analyse, event_time, execution_score, progress_fraction
from app.job.eventlog import EVENT_LOG_NAME, read_events
from app.job.faults import read_faults
from app.job.tracking import learning_rows
from app.job.trees import trees_path

Record = dict[str, Any]

# curve name -> (title, learning-row keys drawn on it)
CURVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "reward": ("reward (with partial progress) and scored reward", ("reward", "scored_reward")),
    "health": ("entropy (nats) and KL to behaviour", ("entropy", "kl_behaviour")),
    "clip": ("clip fraction and zero-variance group fraction", ("clip_fraction", "zero_variance_fraction")),
    "tokens": ("batch tokens: tree-packed and flat", ("batch_tokens", "batch_flat_tokens")),
    "dedup": ("dedup: exact merges and near duplicates", ("num_exact_merged", "num_near_duplicates")),
    "staleness": ("largest batch staleness (versions)", ("staleness_max",)),
}


@dataclass(frozen=True)
class Marker:
    """A point event on a device lane (a reassignment or a migration), or on every lane (a fault or a
    stall, app.job.faults), at t_s seconds since the start."""

    device_id: str  # "" for a fault or a stall: it marks every lane
    t_s: float
    kind: str  # "reassign" | "migration" | "fault" | "stall"
    label: str  # the tooltip
    until_s: float | None = None  # fault / stall: back (serving) again; None: never
    target: str = ""  # fault: the service or server it hit


def _fault_markers(run_dir: Path, t0: float) -> list[Marker]:
    return [Marker("", m.t_s, m.kind, m.what, m.until_s, m.label) for m in read_faults(run_dir, t0).marks()]


@dataclass(frozen=True)
class BusySample:
    device_id: str
    t_s: float
    busy: bool


@dataclass
class ExecutionRow:
    execution_id: str
    group_id: str
    status: str = "running"
    turns: int = 0
    tokens: int = 0  # generated (completion) tokens, over every call
    context_tokens: int = 0  # largest prompt + completion of one call
    score: float = math.nan
    progress: float = math.nan


@dataclass
class RunView:
    """One read of the run."""

    run_dir: Path
    analysis: RunAnalysis | None
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    markers: list[Marker] = field(default_factory=list)
    busy: list[BusySample] = field(default_factory=list)
    executions: list[ExecutionRow] = field(default_factory=list)
    num_records: int = 0

    @property
    def devices(self) -> list[str]:
        if self.analysis is None:
            return []
        return sorted({s.device_id for s in self.analysis.segments})


def _f(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return 0.0


def _markers(records: list[Record], t0: float) -> list[Marker]:
    out: list[Marker] = []
    for r in records:
        ev = r["event"]
        if r["type"] == "LeaseEvent" and ev.get("kind") == "KIND_REASSIGN":
            lease = ev.get("lease") or {}
            to = str(lease.get("target_role") or lease.get("role") or "").removeprefix("DEVICE_ROLE_").lower()
            out.append(
                Marker(
                    str(lease.get("device_id", "")),
                    event_time(r) - t0,
                    "reassign",
                    f"reassign -> {to}: {ev.get('reason', '')}",
                )
            )
        elif r["type"] == "StepEvent" and int(_f(ev.get("num_migrations"))) > 0:
            engines = [str(e) for e in ev.get("engine_ids") or []]
            source = engines[0].rsplit("-e", 1)[0] if engines else ""
            out.append(
                Marker(
                    source,
                    event_time(r) - t0,
                    "migration",
                    f"{ev.get('execution_id')} migrated over {' -> '.join(engines)}",
                )
            )
    return out


def _busy(records: list[Record], t0: float) -> list[BusySample]:
    out: list[BusySample] = []
    for r in records:
        ev = r["event"]
        if r["type"] != "MetricsEvent" or ev.get("service") != "scheduler":
            continue
        for key, value in (ev.get("values") or {}).items():
            if key.startswith("busy."):
                out.append(BusySample(key.removeprefix("busy."), event_time(r) - t0, _f(value) > 0))
    return out


def _executions(records: list[Record]) -> list[ExecutionRow]:
    rows: dict[str, ExecutionRow] = {}

    def row(ev: dict[str, Any]) -> ExecutionRow:
        eid = str(ev.get("execution_id", ""))
        if eid not in rows:
            rows[eid] = ExecutionRow(eid, str(ev.get("group_id", "")))
        return rows[eid]

    for r in records:
        ev = r["event"]
        if r["type"] == "StepEvent":
            x = row(ev)
            x.turns += 1
            completion = int(_f(ev.get("num_completion_tokens")))
            x.tokens += completion
            x.context_tokens = max(x.context_tokens, int(_f(ev.get("num_prompt_tokens"))) + completion)
            frac = progress_fraction(ev.get("progress"))
            if frac is not None:
                x.progress = frac
        elif r["type"] == "ExecutionEvent":
            x = row(ev)
            kind = str(ev.get("kind", "")).removeprefix("KIND_").lower()
            if kind != "started":
                x.status = kind
                x.score = execution_score(ev)
            frac = progress_fraction(ev.get("progress"))
            if frac is not None and kind != "started":
                x.progress = frac
    return sorted(rows.values(), key=lambda x: x.execution_id)


def read_run(run_dir: Path) -> RunView:
    """Everything the overview and the executions table show (an empty view before any event)."""
    path = run_dir / EVENT_LOG_NAME
    records = read_events(path) if path.is_file() else []
    if not records:
        return RunView(run_dir, None)
    analysis = analyse(records)
    rows = learning_rows(analysis, records)
    curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for step, values in rows:
        for name, value in values.items():
            if math.isfinite(value):
                curves[name].append((step, value))
    return RunView(
        run_dir,
        analysis,
        curves=dict(curves),
        markers=_markers(records, analysis.start_unix_s) + _fault_markers(run_dir, analysis.start_unix_s),
        busy=_busy(records, analysis.start_unix_s),
        executions=_executions(records),
        num_records=len(records),
    )


def read_trees(run_dir: Path) -> dict[str, dict[str, Any]]:
    """group_id -> the group's tree view (services/trajectory/tree_view.py); empty before the export."""
    path = trees_path(run_dir)
    out: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            view = json.loads(line)
        except ValueError:
            continue
        out[str(view["group_id"])] = view
    return out
