"""The report builder on a SYNTHETIC event log generated here (no services run in these tests).

The generator writes the events a run of `num_steps` trainer steps would publish: device leases
moving between rollout and training, executions with steps (token versions), scored groups whose
reward follows a chosen trend plus seeded noise, batches and weight publications.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from gyre.job.analysis import analyse, bootstrap_mean, window_steps
from gyre.job.eventlog import EVENT_LOG_NAME, EventLogWriter, read_events, to_record
from gyre.job.report import build_report
from gyre.v1 import common_pb2, events_pb2

T0 = 1_800_000_000.0


def write_synthetic_run(run_dir: Path, *, num_steps: int, reward_slope: float, seed: int = 0) -> Path:
    """A synthetic events.jsonl: 4 devices, 4 groups of 4 executions per step, 10 s per step."""
    rng = random.Random(seed)
    path = run_dir / EVENT_LOG_NAME
    writer = EventLogWriter(path)
    run = "synthetic"

    def lease(t: float, device: str, role: int, state: int, kind: int, epoch: int) -> None:
        ev = events_pb2.LeaseEvent(
            event_id=f"lease.{device}.{epoch}",
            run_id=run,
            kind=kind,
            lease=common_pb2.Lease(device_id=device, role=role, state=state, epoch=epoch),
            policy="elastic",
            created_unix_s=t,
        )
        writer.write(to_record(ev, f"gyre.leases.{run}.{device}"))

    ROLLOUT, TRAIN = common_pb2.DEVICE_ROLE_ROLLOUT, common_pb2.DEVICE_ROLE_TRAIN
    ACTIVE, RELEASED = common_pb2.LEASE_STATE_ACTIVE, common_pb2.LEASE_STATE_RELEASED
    for d in range(4):
        lease(T0, f"cpu0-{d}", ROLLOUT if d < 3 else TRAIN, ACTIVE, events_pb2.LeaseEvent.KIND_REGISTERED, 1)
    epoch = 1
    for step in range(num_steps + 1):
        base = T0 + 10.0 * step
        if step < num_steps:  # device 2 lent to training in the tail of every step, then returned
            epoch += 1
            lease(base + 6, "cpu0-2", ROLLOUT, RELEASED, events_pb2.LeaseEvent.KIND_RELEASED, epoch)
            epoch += 1
            lease(base + 6.5, "cpu0-2", TRAIN, ACTIVE, events_pb2.LeaseEvent.KIND_ACQUIRED, epoch)
            epoch += 1
            lease(base + 9.5, "cpu0-2", ROLLOUT, ACTIVE, events_pb2.LeaseEvent.KIND_ACQUIRED, epoch)
        for g in range(4):
            task, group = f"t{step:03d}{g}", f"t{step:03d}{g}-g0"
            for e in range(4):
                execution = f"{group}-e{e}"
                for call in range(3):
                    versions = [max(0, step - rng.choice([0, 0, 1]))] * 5
                    st = events_pb2.StepEvent(
                        event_id=f"{execution}.{call}",
                        run_id=run,
                        task_id=task,
                        group_id=group,
                        execution_id=execution,
                        call_seq=call,
                        prompt_token_ids=list(range(20 + call)),
                        completion_token_ids=[1, 2, 3, 4, 5],
                        completion_logprobs=[-0.5] * 5,
                        completion_versions=versions,
                        context_event="compaction" if call == 2 else "",
                        finished_unix_s=base + 1 + call,
                    )
                    writer.write(to_record(st, f"gyre.steps.{run}.{task}"))
                done = events_pb2.ExecutionEvent(
                    event_id=f"{execution}.end",
                    run_id=run,
                    task_id=task,
                    group_id=group,
                    execution_id=execution,
                    kind=events_pb2.ExecutionEvent.KIND_TRUNCATED,
                    progress=common_pb2.ProgressSignal(
                        milestones_reached=min(5, step // 2), milestones_total=5
                    ),
                    created_unix_s=base + 4.5,
                )
                writer.write(to_record(done, f"gyre.executions.{run}.{task}"))
            reward = min(1.0, max(0.0, 0.2 + reward_slope * step + rng.gauss(0, 0.05)))
            scored = events_pb2.GroupScoredEvent(
                event_id=f"scored.{group}",
                run_id=run,
                task_id=task,
                group_id=group,
                num_paths=4,
                num_exact_merged=1 if g == 0 else 0,
                num_near_duplicates=1 if g == 1 else 0,
                reward_mean=reward,
                num_partial=4,
                created_unix_s=base + 5,
            )
            writer.write(to_record(scored, f"gyre.paths.{run}.scored"))
        batch = events_pb2.BatchReadyEvent(
            event_id=f"batch.{step}",
            run_id=run,
            batch_id=f"b{step}",
            num_trees=4,
            num_paths=16,
            num_tokens=300,
            num_flat_tokens=960,
            min_policy_version=max(0, step - 1),
            max_policy_version=step,
            created_unix_s=base + 5.5,
        )
        writer.write(to_record(batch, f"gyre.paths.{run}.batch"))
        if step < num_steps:
            weights = events_pb2.WeightsPublishedEvent(
                event_id=f"weights.{run}.{step + 1}",
                run_id=run,
                weights=common_pb2.WeightVersion(
                    version=step + 1, train_step=step + 1, created_unix_s=base + 10
                ),
                metrics={"loss": 1.0 / (step + 1), "step_s": 3.0},
            )
            writer.write(to_record(weights, f"gyre.weights.{run}"))
    # a redelivered event is recorded once
    assert not writer.write(to_record(scored, f"gyre.paths.{run}.scored"))
    writer.close()
    return path


def test_step_events_are_summarised_without_token_arrays(tmp_path: Path) -> None:
    write_synthetic_run(tmp_path, num_steps=2, reward_slope=0.0)
    steps = [r for r in read_events(tmp_path / EVENT_LOG_NAME) if r["type"] == "StepEvent"]
    assert steps, "generator wrote step events"
    ev = steps[0]["event"]
    assert "prompt_token_ids" not in ev and "completion_logprobs" not in ev
    assert ev["num_prompt_tokens"] == 20 and ev["num_completion_tokens"] == 5
    assert sum(ev["completion_version_counts"].values()) == 5


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = write_synthetic_run(tmp_path, num_steps=1, reward_slope=0.0)
    n = len(read_events(path))
    with path.open("a") as fh:
        fh.write('{"type": "StepEvent", "ev')
    assert len(read_events(path)) == n


def test_rising_reward_is_judged_learned_and_report_is_written(tmp_path: Path) -> None:
    write_synthetic_run(tmp_path, num_steps=10, reward_slope=0.06)
    report = build_report(tmp_path)
    a = report.analysis
    assert a.num_steps == 10
    assert a.verdict is not None and a.verdict.learned
    assert a.verdict.first20.mean < a.verdict.last20.mean
    assert a.verdict.first_steps == (0, 1) and a.verdict.last_steps == (9, 10)
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


def test_flat_reward_is_rarely_judged_learned(tmp_path: Path) -> None:
    # a 95% interval rule: about 1 run in 20 with no trend may pass by chance, not more
    num_learned = 0
    for seed in range(20):
        run_dir = tmp_path / f"s{seed}"
        a = analyse(read_events(write_synthetic_run(run_dir, num_steps=10, reward_slope=0.0, seed=seed)))
        assert a.verdict is not None
        num_learned += a.verdict.learned
    assert num_learned <= 3


def test_device_time_tree_ratio_dedup_and_staleness_follow_the_events(tmp_path: Path) -> None:
    write_synthetic_run(tmp_path, num_steps=4, reward_slope=0.0)
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
    assert window_steps(1) == ((0, 0), (1, 1))
    assert window_steps(10) == ((0, 1), (9, 10))
    assert window_steps(24) == ((0, 4), (20, 24))


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
