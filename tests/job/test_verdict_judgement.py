"""The learning verdict knows when it cannot judge, summary.json never holds nan, and the live
line's reward is the report's (synthetic event logs from tests/job/conftest.py; no services run)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.job.analysis import MIN_SAMPLES_PER_WINDOW, TOO_FEW_TO_JUDGE, analyse
from app.job.eventlog import read_events
from app.job.progress import RunTracker
from app.job.report import build_report, headline


def _keep(path: Path, keep: Callable[[dict[str, Any]], bool]) -> None:
    records = [r for r in read_events(path) if keep(r)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _no_nan(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_no_nan(v) for v in value.values())
    if isinstance(value, list):
        return all(_no_nan(v) for v in value)
    return True


def test_a_short_run_with_a_rising_reward_is_too_few_steps_to_judge_not_learned(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    # 2 steps of 4 groups: n=4 vs n=8 samples (below the minimum), a steep rise that a percentile
    # bootstrap of so few samples would call significant
    synthetic_run(tmp_path, num_steps=2, reward_slope=0.3)
    report = build_report(tmp_path)
    v = report.analysis.verdict
    assert v is not None and not v.judged and not v.learned
    assert min(v.first20.n, v.last20.n) < MIN_SAMPLES_PER_WINDOW
    assert v.delta.low > 0  # what the old rule would have called "learned: yes"
    lines = headline(report.analysis)
    assert lines[-1].startswith(f"learned: {TOO_FEW_TO_JUDGE}") and "learned: yes" not in "\n".join(lines)
    assert report.summary["verdict"] == TOO_FEW_TO_JUDGE and report.summary["learned"] is False
    assert report.summary["min_samples_per_window"] == MIN_SAMPLES_PER_WINDOW


def test_the_same_rise_over_enough_steps_is_judged(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    synthetic_run(tmp_path, num_steps=10, reward_slope=0.06)
    v = build_report(tmp_path).analysis.verdict
    assert v is not None and v.judged and v.learned and v.outcome == "yes"
    assert min(v.first20.n, v.last20.n) >= MIN_SAMPLES_PER_WINDOW


def test_a_window_without_samples_gives_no_nan_in_summary_json(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    # as `make run-swe`: no execution ends in the last window (long executions, few steps), so the
    # window holds no reward sample; the report printed `reward_last20: nan`
    path = synthetic_run(tmp_path, num_steps=5, reward_slope=0.05)
    t_last = max(
        float(r["event"]["weights"].get("created_unix_s", 0.0))
        for r in read_events(path)
        if r["type"] == "WeightsPublishedEvent"
    )
    window_start = t_last - 10.0  # the last window: steps 4..5 (publications of versions 4 and 5)
    _keep(
        path,
        lambda r: (
            not (
                r["type"] in ("ExecutionEvent", "GroupScoredEvent")
                and float(r["event"].get("created_unix_s", 0.0)) >= window_start
            )
        ),
    )
    report = build_report(tmp_path)
    v = report.analysis.verdict
    assert v is not None and v.last20.n == 0 and not v.judged
    text = (tmp_path / "summary.json").read_text()
    assert "NaN" not in text and _no_nan(json.loads(text))
    summary = json.loads(text)
    assert summary["reward_last20"] is None and summary["verdict"] == TOO_FEW_TO_JUDGE
    assert "nan" not in "\n".join(headline(report.analysis))
    assert "reward_last20:  n/a (n=0)" in "\n".join(headline(report.analysis))


def test_the_live_line_shows_the_reports_reward_of_each_step(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    path = synthetic_run(tmp_path, num_steps=6, reward_slope=0.05)
    records = read_events(path)
    analysis = analyse(records)
    per_step = [statistics.fmean(r.reward_samples) for r in analysis.steps if r.reward_samples]
    tracker = RunTracker(target_steps=6)
    for record in records:
        tracker.update(record)
    assert tracker.recent_reward() == per_step[-1]
    assert tracker.first_reward() == per_step[0]
    assert f"reward {per_step[-1]:.3f} (step-0 {per_step[0]:.3f})" in tracker.line()
    # fed the records one by one, the live line's reward at each point is the report's of that prefix
    tracker = RunTracker(target_steps=6)
    for n, record in enumerate(records, 1):
        tracker.update(record)
        if record["type"] == "WeightsPublishedEvent":
            prefix = [r.reward_samples for r in analyse(records[:n]).steps if r.reward_samples]
            assert tracker.recent_reward() == statistics.fmean(prefix[-1])
