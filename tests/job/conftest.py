"""Shared helpers of the job tests: a SYNTHETIC event log generator (no service process involved).

The generator writes the events a run of `num_steps` trainer steps would publish: device leases
moving between rollout and training, executions with steps (token versions), scored groups whose
reward follows a chosen trend plus seeded noise, batches and weight publications. The lease events
are not invented: the scheduler's own handoff state machine (services/scheduler/leases.py) makes
them and its own encoder (services/scheduler/wire.py) turns them into LeaseEvents, so a report that
reads them reads what a real run records. The other events are synthetic, and say so.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from app.job.eventlog import EVENT_LOG_NAME, EventLogWriter, to_record
from gyre.bus import subjects
from gyre.v1 import common_pb2, events_pb2
from services.scheduler.leases import DeviceInfo, LeaseBook, LeaseChange, MemoryLeaseStore
from services.scheduler.policies import Role
from services.scheduler.wire import lease_event

T0 = 1_800_000_000.0


def write_synthetic_run(run_dir: Path, *, num_steps: int, reward_slope: float, seed: int = 0) -> Path:
    """A synthetic events.jsonl: 4 devices, 4 groups of 4 executions per step, 10 s per step."""
    rng = random.Random(seed)
    path = run_dir / EVENT_LOG_NAME
    writer = EventLogWriter(path)
    run = "synthetic"

    # Lease events come from the scheduler's own code: its handoff state machine (LeaseBook, over
    # the in-memory store the scheduler's tests use) and its event encoding (wire.lease_event).
    book = LeaseBook(MemoryLeaseStore(), drain_timeout_s=60, grant_timeout_s=60, worker_timeout_s=3600)

    def publish(changes: list[LeaseChange]) -> None:
        for change in changes:
            ev = lease_event(run, change)
            writer.write(to_record(ev, subjects.leases(run, change.lease.device_id)))

    rollout_devices = [DeviceInfo(f"cpu0-{d}", index=d) for d in range(3)]
    publish(book.register_worker("rollout-0", "rollout", "127.0.0.1:1", rollout_devices, T0)[1])
    publish(
        book.register_worker("trainer-0", "trainer", "127.0.0.1:2", [DeviceInfo("cpu0-3", index=3)], T0)[1]
    )

    def move(device: str, to_role: Role, to_holder: str, holder: str, t: float) -> None:
        """One whole handoff: reassign (policy elastic), the holder drains and releases, the grantee acquires."""
        changes = book.reassign(device, to_role, to_holder, t, policy="elastic", reason="synthetic tail")
        publish(changes)
        epoch = changes[-1].lease.epoch
        publish(book.release(holder, device, epoch, t + 0.2)[1])
        publish(book.acquire(to_holder, device, epoch, t + 0.45)[1])  # 0.25 s switching (released/granted)

    for step in range(num_steps + 1):
        base = T0 + 10.0 * step
        if (
            step < num_steps
        ):  # device 2 lent to training in the tail of every step, then returned (0.5 s switching)
            move("cpu0-2", Role.TRAIN, "trainer-0", "rollout-0", base + 6)
            move("cpu0-2", Role.ROLLOUT, "rollout-0", "trainer-0", base + 9)
        for g in range(4):
            task, group = f"t{step:03d}{g}", f"t{step:03d}{g}-g0"
            reward = min(1.0, max(0.0, 0.2 + reward_slope * step + rng.gauss(0, 0.05)))
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
                        milestones_reached=min(20, max(0, round(20 * reward + rng.gauss(0, 1)))),
                        milestones_total=20,
                    ),
                    created_unix_s=base + 4.5,
                )
                writer.write(to_record(done, f"gyre.executions.{run}.{task}"))
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


@pytest.fixture
def synthetic_run() -> Callable[..., Path]:
    """write_synthetic_run(run_dir, *, num_steps, reward_slope, seed=0) -> path of events.jsonl."""
    return write_synthetic_run
