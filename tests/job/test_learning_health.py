"""Learning health in the report and the progress panel, and the stall warning.

The event logs here are CONSTRUCTED (real proto events through the real event-log writer, no
services run): one run collapses (reward flat at 0.66, every group's executions alike, entropy
near 0), one learns to the oracle's reward (its groups lose variance only once they are all right).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from app.job.analysis import StepRow, detect_stall
from app.job.eventlog import EVENT_LOG_NAME, EventLogWriter, read_events, to_record
from app.job.progress import LiveProgress, RunTracker
from app.job.report import build_report, headline
from app.job.stall_rule import STALL_WINDOW_STEPS
from gyre.v1 import common_pb2, events_pb2

T0 = 1_800_000_000.0
RUN = "health"


def write_run(run_dir: Path, *, num_steps: int, collapse: bool) -> Path:
    """4 groups of 4 executions per step (10 s per step), oracle reward 1.0 on every task.

    collapse: reward climbs to 0.66 by step 5, then every execution of a group scores the same
    (reward_std 0) and the policy entropy falls to ~0. Healthy: reward climbs 0.2 -> 1.0 with
    spread inside each group until the group is all right (reward 1.0, std 0: the optimum)."""
    path = run_dir / EVENT_LOG_NAME
    writer = EventLogWriter(path)
    for step in range(num_steps + 1):
        base = T0 + 10.0 * step
        if collapse:
            mean, std, entropy = (
                min(0.66, 0.2 + 0.1 * step),
                (0.2 if step < 5 else 0.0),
                max(0.01, 1.5 - 0.3 * step),
            )
        else:
            mean = min(1.0, 0.2 + 0.05 * step)
            std, entropy = (0.0 if mean >= 1.0 else 0.2), 1.5 - 0.01 * step
        for g in range(4):
            task, group = f"lh-{g:05d}", f"lh-{g:05d}-g{step}"
            scores = [mean] * 4 if std == 0 else [mean - std, mean + std, mean - std, mean + std]
            for e, score in enumerate(scores):
                done = score >= 1.0
                ev = events_pb2.ExecutionEvent(
                    event_id=f"{group}-e{e}.end",
                    run_id=RUN,
                    task_id=task,
                    group_id=group,
                    execution_id=f"{group}-e{e}",
                    kind=events_pb2.ExecutionEvent.KIND_FINISHED
                    if done
                    else events_pb2.ExecutionEvent.KIND_TRUNCATED,
                    progress=common_pb2.ProgressSignal(
                        milestones_reached=round(10 * min(1.0, max(0.0, score))),
                        milestones_total=10,
                        extra={"oracle_reward": 1.0},
                    ),
                    created_unix_s=base + 4,
                )
                if done:
                    ev.reward = 1.0
                writer.write(to_record(ev, f"gyre.executions.{RUN}.{task}"))
            scored = events_pb2.GroupScoredEvent(
                event_id=f"scored.{group}",
                run_id=RUN,
                task_id=task,
                group_id=group,
                num_paths=4,
                reward_mean=mean,
                reward_std=std,
                created_unix_s=base + 5,
            )
            writer.write(to_record(scored, f"gyre.paths.{RUN}.scored"))
        if step < num_steps:
            weights = events_pb2.WeightsPublishedEvent(
                event_id=f"weights.{RUN}.{step + 1}",
                run_id=RUN,
                weights=common_pb2.WeightVersion(
                    version=step + 1, train_step=step + 1, created_unix_s=base + 10
                ),
                metrics={"loss": 0.1, "entropy": entropy, "kl_behaviour": 0.002, "clip_fraction": 0.01},
            )
            writer.write(to_record(weights, f"gyre.weights.{RUN}"))
    writer.close()
    return path


def test_the_stall_warning_fires_on_a_collapsed_run_in_the_report_and_the_summary(tmp_path: Path) -> None:
    write_run(tmp_path, num_steps=40, collapse=True)
    report = build_report(tmp_path)
    stall = report.analysis.stall
    assert stall is not None
    assert stall.first_step <= 10 and stall.last_step == 40
    assert stall.zero_variance_fraction > 0.9 and stall.reward == pytest.approx(
        0.7
    )  # executions report 7 of 10 milestones
    assert stall.oracle == 1.0 and stall.oracle_reported
    text = report.report_path.read_text()
    assert "WARNING learning stalled" in text and "## Learning health" in text
    assert any("WARNING learning stalled" in line for line in headline(report.analysis))
    summary = json.loads(report.summary_path.read_text())
    assert summary["stall"]["first_step"] == stall.first_step
    assert summary["oracle_reward"] == 1.0
    assert summary["reward_last20_of_oracle"] == pytest.approx(0.7)
    assert summary["trainer_entropy_mean"] < 0.2
    png = report.plot_paths["learning_health"]
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"


def test_a_healthy_run_that_reaches_the_oracle_raises_no_warning(tmp_path: Path) -> None:
    write_run(tmp_path, num_steps=40, collapse=False)
    report = build_report(tmp_path)
    a = report.analysis
    assert a.stall is None
    # its groups do lose variance at the end, but with the reward at the oracle's: not a stall
    assert a.steps[-1].zero_variance_fraction == 1.0 and a.steps[-1].reward_mean == pytest.approx(1.0)
    assert "No stall." in report.report_path.read_text()
    assert not any("WARNING" in line for line in headline(a))
    summary = report.summary
    assert summary["stall"] is None and summary["reward_last20_of_oracle"] >= 0.9
    assert [r.oracle_mean for r in a.steps[:3]] == [1.0, 1.0, 1.0]
    assert a.steps[3].trainer_metrics["entropy"] == pytest.approx(1.5 - 0.03)  # the step that made v4


def _rows(zero: list[int], rewards: list[float], oracle: float | None = 1.0) -> list[StepRow]:
    return [
        StepRow(
            step=i,
            start_s=0.0,
            end_s=0.0,
            reward_samples=[r] * 4,
            num_groups=4,
            num_zero_variance_groups=z,
            oracle_samples=[oracle] * 4 if oracle is not None else [],
        )
        for i, (z, r) in enumerate(zip(zero, rewards, strict=True))
    ]


def test_detect_stall_needs_many_steps_of_silent_groups_below_the_oracle() -> None:
    n = STALL_WINDOW_STEPS
    stalled = detect_stall(_rows([4] * 2 * n, [0.5] * 2 * n))
    assert stalled is not None and not stalled.recovered and "raise trainer.entropy_coef" in stalled.message()
    recovered = detect_stall(_rows([4] * 2 * n + [0] * 2 * n, [0.5] * 4 * n))
    assert recovered is not None and recovered.recovered and recovered.last_step < 4 * n - 1
    assert f"signal again after step {recovered.last_step}" in recovered.message()
    brief = [0] * n + [4] * (n // 2 - 1) + [0] * n  # fewer silent steps than half a window
    assert detect_stall(_rows(brief, [0.5] * len(brief))) is None
    assert detect_stall(_rows([1] * 2 * n, [0.5] * 2 * n)) is None  # most groups still teach
    assert detect_stall(_rows([4] * 2 * n, [0.95] * 2 * n)) is None  # silent because it is right
    no_oracle = detect_stall(_rows([4] * 2 * n, [0.5] * 2 * n, oracle=None))
    assert no_oracle is not None and not no_oracle.oracle_reported and "no oracle" in no_oracle.message()


@pytest.mark.parametrize("collapse", [True, False])
def test_the_progress_panel_shows_health_and_warns_once_when_the_run_stalls(
    tmp_path: Path, collapse: bool
) -> None:
    write_run(tmp_path, num_steps=30, collapse=collapse)
    tracker = RunTracker(target_steps=30)
    console = Console(record=True, force_terminal=False, width=300)
    with LiveProgress(tracker, console) as live:
        for record in read_events(tmp_path / EVENT_LOG_NAME):
            tracker.update(record)
            live.refresh()
    out = console.export_text()
    assert "entropy" in out and "oracle 1.000" in out and "zero-var groups" in out
    assert out.count("WARNING learning stalled") == (1 if collapse else 0)
    assert (tracker.stall() is not None) is collapse


def test_a_group_teaches_nothing_only_when_its_rewards_agree_and_every_advantage_is_zero() -> None:
    from app.job.analysis import teaches_nothing

    assert teaches_nothing({})  # proto3 JSON omits zeros: equal rewards, no advantage
    assert not teaches_nothing({"reward_std": 0.2, "advantage_abs_max": 0.1})
    assert not teaches_nothing({"advantage_abs_max": 0.25})  # equal rewards, per-call signal
