"""app/job/faults.py on a SYNTHETIC run directory (tests/helpers/run_faults.py: what it holds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.job.faults import read_faults
from tests.helpers.run_faults import write_fault_files

T0 = 1_800_000_000.0


def test_every_supervisor_restart_is_read_with_its_exit_and_its_return(tmp_path: Path) -> None:
    write_fault_files(tmp_path, T0)
    faults = read_faults(tmp_path, T0)
    got = [(r.service, r.exited_s, r.serving_s, r.ended) for r in faults.restarts]
    assert got == [
        ("scheduler", pytest.approx(10.0), pytest.approx(11.5), "SIGKILL"),
        ("postgres", pytest.approx(30.1), pytest.approx(30.7), ""),
        ("scheduler", pytest.approx(30.8), pytest.approx(32.0), "exit 1"),
        ("trainer", pytest.approx(40.0), None, "exit 1"),
    ]
    assert faults.restarts[3].recovery_s is None
    assert faults.gave_up == {"trainer": "5 restarts in 300 s"}


def test_each_injected_fault_is_matched_to_the_restart_of_its_target_and_an_engine_fault_to_none(
    tmp_path: Path,
) -> None:
    write_fault_files(tmp_path, T0)
    faults = read_faults(tmp_path, T0)
    assert [f.target for f in faults.injected] == ["scheduler", "engine", "postgres"]  # unmade: left out
    scheduler, engine, postgres = faults.injected
    assert scheduler.restart is faults.restarts[0] and scheduler.recovered
    assert scheduler.injected_s == pytest.approx(9.9) and scheduler.recovery_s == pytest.approx(1.7)
    assert engine.restart is None and engine.detail["engine_killed"] == "rollout-0-e1"
    assert postgres.restart is faults.restarts[1]  # not the scheduler's restart that followed


def test_the_timeline_marks_each_fault_once_in_order_with_its_span_until_back(tmp_path: Path) -> None:
    write_fault_files(tmp_path, T0)
    marks = read_faults(tmp_path, T0).marks()
    assert [(m.kind, m.label) for m in marks] == [
        ("fault", "scheduler"),  # injected; its restart is not marked again
        ("fault", "engine"),
        ("fault", "postgres"),
        ("fault", "scheduler"),  # the restart no injection explains
        ("fault", "trainer"),
        ("stall", "stall"),
    ]
    assert marks[0].t_s == pytest.approx(9.9) and marks[0].recovered_after_s == pytest.approx(1.7)
    assert marks[3].until_s == pytest.approx(32.0)
    assert marks[4].until_s is None and "never served again" in marks[4].what
    assert "rollout-0-e1" in marks[1].what and "4 requests" in marks[1].what
    assert marks[5].t_s == pytest.approx(50.0, abs=0.01) and "8 s at weight version 4" in marks[5].what


def test_a_soak_s_kills_are_read_as_injected_faults(tmp_path: Path) -> None:
    write_fault_files(tmp_path, T0, stall=False)
    kills = [
        {"index": 0, "target": "scheduler", "injected_at": T0 + 9.9, "confirmed": True, "recovery_s": 1.6},
        {"index": 1, "target": "trainer", "injected_at": T0 + 39.5, "confirmed": False, "recovery_s": None},
        {"index": 2, "target": "rollout", "injected_at": 0.0, "confirmed": False},  # never made
    ]
    (tmp_path / "chaos.json").write_text(json.dumps({"mode": "soak", "kills": kills}))
    faults = read_faults(tmp_path, T0)
    assert [(f.target, f.recovered) for f in faults.injected] == [("scheduler", True), ("trainer", False)]
    assert faults.injected[1].restart is faults.restarts[3]
    assert faults.stall is None
    trainer = next(m for m in faults.marks() if m.label == "trainer")
    assert trainer.until_s is None and "NOT recovered" in trainer.what


def test_a_run_without_fault_files_has_no_fault(tmp_path: Path) -> None:
    faults = read_faults(tmp_path, T0)
    assert faults.marks() == [] and faults.gave_up == {}
