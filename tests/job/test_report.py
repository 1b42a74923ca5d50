"""The report builder on a SYNTHETIC event log (the `synthetic_run` fixture of conftest.py; no services run)."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from app.job.analysis import analyse, bootstrap_mean, window_steps
from app.job.eventlog import EVENT_LOG_NAME, EventLogWriter, read_events, to_record
from app.job.report import build_report
from gyre.v1 import events_pb2


def test_step_events_are_summarised_without_token_arrays(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    synthetic_run(tmp_path, num_steps=2, reward_slope=0.0)
    steps = [r for r in read_events(tmp_path / EVENT_LOG_NAME) if r["type"] == "StepEvent"]
    assert steps, "generator wrote step events"
    ev = steps[0]["event"]
    assert "prompt_token_ids" not in ev and "completion_logprobs" not in ev
    assert ev["num_prompt_tokens"] == 20 and ev["num_completion_tokens"] == 5
    assert sum(ev["completion_version_counts"].values()) == 5


def test_torn_last_line_is_skipped(tmp_path: Path, synthetic_run: Callable[..., Path]) -> None:
    path = synthetic_run(tmp_path, num_steps=1, reward_slope=0.0)
    n = len(read_events(path))
    with path.open("a") as fh:
        fh.write('{"type": "StepEvent", "ev')
    assert len(read_events(path)) == n


def test_rising_reward_is_judged_learned_and_report_is_written(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    synthetic_run(tmp_path, num_steps=10, reward_slope=0.06)
    report = build_report(tmp_path)
    a = report.analysis
    assert a.num_steps == 10
    assert a.verdict is not None and a.verdict.learned
    assert a.verdict.first20.mean < a.verdict.last20.mean
    assert a.verdict.first_steps == (0, 1) and a.verdict.last_steps == (8, 10)
    text = report.report_path.read_text()
    assert "reward_first20" in text and "reward_last20" in text and "learned: yes" in text
    for png in report.plot_paths.values():
        assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    summary = json.loads(report.summary_path.read_text())
    assert summary["learned"] is True
    assert (
        summary["reward_last20"]["low"]
        <= summary["reward_last20"]["mean"]
        <= summary["reward_last20"]["high"]
    )


def test_flat_reward_is_rarely_judged_learned(tmp_path: Path, synthetic_run: Callable[..., Path]) -> None:
    # a 95% interval rule: about 1 run in 20 with no trend may pass by chance, not more
    num_learned = 0
    for seed in range(20):
        run_dir = tmp_path / f"s{seed}"
        a = analyse(read_events(synthetic_run(run_dir, num_steps=10, reward_slope=0.0, seed=seed)))
        assert a.verdict is not None
        num_learned += a.verdict.learned
    assert num_learned <= 3


def test_device_time_tree_ratio_dedup_and_staleness_follow_the_events(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    synthetic_run(tmp_path, num_steps=4, reward_slope=0.0)
    a = analyse(read_events(tmp_path / EVENT_LOG_NAME))
    assert a.policy == "elastic"
    assert a.tree_token_ratio == pytest.approx(960 / 300)
    assert sum(r.num_exact_merged for r in a.steps) == 5 and sum(r.num_near_duplicates for r in a.steps) == 5
    # device 2 switches for 0.5 s in each of the 4 steps
    assert a.device_time_s["switching"] == pytest.approx(4 * 0.5)
    assert 0 < a.device_idle_fraction < 0.1
    # tokens are 0 or 1 versions behind when generated; batches follow within the step
    assert set(a.staleness_token_counts) <= {0, 1} and sum(a.staleness_token_counts.values()) > 0
    assert a.num_context_events == {"compaction": 5 * 16}
    assert a.steps[0].trainer_metrics["loss"] == pytest.approx(1.0)


def test_windows_cover_a_fifth_of_the_steps_each() -> None:
    assert window_steps(2) == ((0, 0), (1, 2))
    assert window_steps(10) == ((0, 1), (8, 10))
    assert window_steps(25) == ((0, 4), (20, 25))


def test_bootstrap_interval_contains_the_mean_and_shrinks_with_more_samples() -> None:
    rng = random.Random(1)
    small = bootstrap_mean([rng.random() for _ in range(10)])
    large = bootstrap_mean([rng.random() for _ in range(1000)])
    assert small.low <= small.mean <= small.high
    assert (large.high - large.low) < (small.high - small.low)
    assert math.isnan(bootstrap_mean([0.5]).low)


def test_an_empty_event_log_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / EVENT_LOG_NAME).write_text("")
    with pytest.raises(ValueError, match="no events"):
        build_report(tmp_path)


def test_a_group_scored_zero_counts_as_a_zero_reward_sample(tmp_path: Path) -> None:
    # proto3 JSON leaves out fields equal to 0: a 0.0 reward must still be a sample, not a missing one
    with EventLogWriter(tmp_path / EVENT_LOG_NAME) as writer:
        for i, reward in enumerate([0.0, 0.5]):
            ev = events_pb2.GroupScoredEvent(
                event_id=f"g{i}", run_id="r", reward_mean=reward, created_unix_s=1.0 + i
            )
            writer.write(to_record(ev, "gyre.paths.r.scored"))
    a = analyse(read_events(tmp_path / EVENT_LOG_NAME))
    assert a.steps[0].reward_samples == [0.0, 0.5]


def test_busy_time_logged_by_unpaced_workers_is_reported_beside_leased_time(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    from gyre.pacing import Pacer

    synthetic_run(tmp_path, num_steps=4, reward_slope=0.0)
    start = build_report(tmp_path).analysis.start_unix_s
    # Pacing off (the default): the pacer still logs the real busy intervals the workers report.
    # Its clock here is unix time, so the intervals land where they are written.
    pacer = Pacer(clock=time.time, busy_log_path=tmp_path / "pacing" / "rollout-0.jsonl")
    assert not pacer.enabled
    pacer.busy("rollout", "cpu0-0", start + 1.0, start + 4.0)  # 3 device-s
    pacer.busy("train", "trainer", start + 5.0, start + 6.0, devices=2)  # 2 device-s
    report = build_report(tmp_path)
    summary = json.loads(report.summary_path.read_text())
    assert summary["busy_device_s"] == pytest.approx({"rollout": 3.0, "train": 2.0}, abs=1e-3)
    pool_s = summary["num_devices"] * report.analysis.duration_s
    assert summary["idle_fraction_busy"] == pytest.approx(1 - 5.0 / pool_s, abs=1e-4)
    assert summary["train_busy_share"] == pytest.approx(2.0 / pool_s, abs=1e-4)
    assert summary["train_lease_share"] == pytest.approx(summary["train_device_s"] / pool_s)
    text = report.report_path.read_text()
    assert "device-seconds busy" in text and "Idle share by busy time" in text


def test_a_run_without_a_busy_log_says_so_instead_of_showing_zero(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    synthetic_run(tmp_path, num_steps=2, reward_slope=0.0)
    report = build_report(tmp_path)
    assert "busy_device_s" not in json.loads(report.summary_path.read_text())
    assert "No busy-time log" in report.report_path.read_text()


def test_report_lists_every_fault_and_recovery_and_marks_them_on_the_device_plot(
    tmp_path: Path, synthetic_run: Callable[..., Path]
) -> None:
    from tests.helpers.run_faults import write_fault_files
    from tests.job.conftest import T0

    synthetic_run(tmp_path, num_steps=6, reward_slope=0.0)
    plain = build_report(tmp_path)
    assert plain.analysis.start_unix_s == T0
    text = plain.report_path.read_text()
    assert "## Faults and recoveries" in text and "None: no restart, no injected fault, no stall." in text
    unmarked = plain.plot_paths["device_roles"].read_bytes()

    write_fault_files(tmp_path, T0)
    report = build_report(tmp_path)
    section = report.report_path.read_text().split("## Faults and recoveries")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows == [
        "| 9.9 | scheduler killed by gyre chaos (SIGKILL) | 1.7 |",
        "| 20.0 | engine rollout-0-e1 failed holding 4 requests (injected by gyre chaos) | 3.0 |",
        "| 30.0 | postgres shut down (fast) by gyre chaos | 2.1 |",
        "| 30.8 | scheduler exited (exit 1), restarted by the supervisor | 1.2 |",
        "| 40.0 | trainer exited (exit 1), restarted by the supervisor, never served again (did not report "
        "SERVING) | never |",
        "| 50.0 | stall: nothing advanced for 8 s at weight version 4; the watchdog ended the job at 58.0 s "
        "| never |",
    ]
    assert "The supervisor gave up on: trainer (5 restarts in 300 s)" in section
    assert report.plot_paths["device_roles"].read_bytes() != unmarked  # the marks are drawn
