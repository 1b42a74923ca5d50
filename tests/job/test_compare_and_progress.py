"""`gyre compare` and the live-progress tracker on SYNTHETIC event logs (the `synthetic_run` fixture)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

from app.job import compare
from app.job.eventlog import EVENT_LOG_NAME, read_events
from app.job.progress import LiveProgress, RunTracker


@pytest.mark.slow
def test_compare_prints_each_run_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], synthetic_run: Callable[..., Path]
) -> None:
    rising, flat = tmp_path / "rising", tmp_path / "flat"
    # 10 steps: 8 group samples in the first window, the verdict's minimum (5 would be too few to judge)
    synthetic_run(rising, num_steps=10, reward_slope=0.06)
    synthetic_run(flat, num_steps=10, reward_slope=0.0)
    quickstart = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
    (rising / "config.yaml").write_text(quickstart.read_text())
    assert compare.main([str(rising), str(flat), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[str(rising)]["measured"]["learned"] is True
    assert out[str(rising)]["measured"]["num_steps"] == 10
    predicted = out[str(rising)]["predicted"]
    assert predicted is not None, out[str(rising)]["prediction_note"]
    assert predicted["time_per_step_s"] > 0 and 0 <= predicted["idle_fraction_busy"] <= 1
    assert "device_idle_fraction" not in predicted  # the summary's lease-based share has that name
    assert out[str(flat)]["predicted"] is None and "config.yaml" in out[str(flat)]["prediction_note"]
    console = Console(record=True, width=160)
    console.print(compare.compare_table([rising, flat]))
    text = console.export_text()
    assert "time per step" in text and "reward_last20" in text
    # busy-based idle (the simulator's) and the lease-based share are two labelled rows, never one
    assert "idle fraction, busy-based (as sim)" in text and "no-lease share (not sim's idle)" in text
    assert "sim: idle fraction (vs busy-based)" in text


def test_compare_rejects_a_directory_without_a_run(tmp_path: Path) -> None:
    assert compare.main([str(tmp_path)]) == 2


def test_tracker_reaches_the_target_step_and_prints_progress(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    synthetic_run(tmp_path, num_steps=3, reward_slope=0.1)
    tracker = RunTracker(target_steps=3)
    console = Console(record=True, force_terminal=False, width=200)
    with LiveProgress(tracker, console) as live:
        for record in read_events(tmp_path / EVENT_LOG_NAME):
            tracker.update(record)
            live.refresh()
    assert tracker.steps_done.is_set()
    assert tracker.step_versions == [1, 2, 3]
    assert tracker.roles == {"cpu0-0": "rollout", "cpu0-1": "rollout", "cpu0-2": "rollout", "cpu0-3": "train"}
    assert "step 3/3" in console.export_text()


def test_the_progress_line_never_counts_past_the_target_step(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    synthetic_run(tmp_path, num_steps=4, reward_slope=0.1)
    tracker = RunTracker(target_steps=3)
    for record in read_events(tmp_path / EVENT_LOG_NAME):
        tracker.update(record)
    assert tracker.version == 4
    assert tracker.line().startswith("step 3/3 (+1 while stopping)")


def test_a_resumed_execution_counts_as_live_again_not_as_ended() -> None:
    """A resumed run's tracker sees RESUMED for the executions its predecessor left running, then
    their ends: the progress line must read 1/1 when one ends, never '1 ended of 0 started'."""
    tracker = RunTracker(target_steps=3)
    for kind in ("KIND_RESUMED", "KIND_TRUNCATED"):
        tracker.update({"type": "ExecutionEvent", "event": {"execution_id": "e1", "kind": kind}})
    assert tracker.executions == {"started": 1, "ended": 1}
    assert "executions 1/1" in tracker.line()
