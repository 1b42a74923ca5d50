"""Continuous rollout starts only the groups the staleness bound admits.

The agent here is a scripted stand-in at the outermost edge (it returns a finished outcome at once
instead of driving an environment through an engine); the ExecutionManager under test is real.
"""

from __future__ import annotations

from pathlib import Path

from gyre.pacing import Pacer
from gyre.workload import load_workload_file, sample_executions
from services.rollout.environments.base import TaskFamily
from services.rollout.environments.longhorizon import LongHorizonFamily, LongHorizonSpec
from services.rollout.environments.workload_plans import WorkloadFamily
from services.rollout.executions import ExecutionManager
from tests.helpers.agents import InstantAgent, settle

SMALL = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "small.yaml"


def _manager(family: TaskFamily, *, continuous: bool, **admission: int) -> ExecutionManager:
    """A real ExecutionManager over the scripted agent (`admission`: groups_per_version, staleness_bound)."""
    return ExecutionManager(
        InstantAgent(),  # type: ignore[arg-type]
        family,
        run_id="r",
        seed=0,
        max_live=64,
        continuous=continuous,
        **admission,
    )


def _longhorizon() -> LongHorizonFamily:
    return LongHorizonFamily(LongHorizonSpec(num_actions=4, max_turns=4, seed=0))


async def test_continuous_rollout_waits_for_a_new_weight_version_before_exceeding_the_bound() -> None:
    manager = _manager(_longhorizon(), continuous=True, groups_per_version=2, staleness_bound=1)
    manager.start(num_tasks=2, group_size=2)
    await settle()
    assert manager.groups_started == 4  # 2 * (version 0 + 1 + bound 1)
    await manager.on_version(1)
    await settle()
    assert manager.groups_started == 6
    await manager.on_version(3)
    await settle()
    assert manager.groups_started == 10
    await manager.stop()


async def test_without_a_group_budget_continuous_rollout_restarts_every_group() -> None:
    manager = _manager(_longhorizon(), continuous=True)
    manager.start(num_tasks=1, group_size=2)
    await settle()
    assert manager.groups_started > 4
    await manager.stop()


async def test_workload_groups_follow_the_simulators_steps_in_admission_order_whichever_task_runs_them() -> (
    None
):
    # A task whose groups end early must take the next group of the simulated order, not run ahead
    # through its own steps (on a drifting workload, into the wrap-around to the shortest plans).
    w = load_workload_file(SMALL)
    family = WorkloadFamily(w, Pacer(), time_scale=1e9)
    manager = _manager(family, continuous=False)
    boot = manager.start(num_tasks=w.tasks_per_step, group_size=1)
    assert boot == [f"wl-{i:05d}-g{i}-e0" for i in range(w.tasks_per_step)]  # step 0, one group per task
    fast = [manager.start_group("wl-00003", group_size=1)[0] for _ in range(2)]
    assert fast == [f"wl-00003-g{w.tasks_per_step}-e0", f"wl-00003-g{w.tasks_per_step + 1}-e0"]
    plans = sample_executions(w)
    for i, eid in enumerate(fast):  # step 1's first two tasks' plans, not task 3's steps 1 and 2
        assert family.plan_for(3, eid)[0] == plans[1][i * w.group_size]
    await manager.stop()


async def test_a_group_dropped_untrained_gives_its_slot_back_so_the_pipeline_cannot_stall() -> None:
    # The cycle `gyre chaos` stalled in: one group per version and no slack; the group is started, ends,
    # and the trajectory service drops it (empty or stale: it will never be trained). No batch, so no
    # new version; without the refund the rollout waits for that version forever.
    manager = _manager(_longhorizon(), continuous=True, groups_per_version=1, staleness_bound=0)
    (first,) = {e.rsplit("-e", 1)[0] for e in manager.start(num_tasks=1, group_size=2)}
    await settle()
    assert manager.groups_started == 1
    assert "waiting for a newer weight version" in manager.admission_wait()
    assert await manager.on_group_dropped(first)
    await settle()
    assert manager.groups_started == 2  # generated anew, without a new version
    assert manager.groups_refunded == 1
    await manager.stop()


async def test_a_group_is_refunded_once_and_only_by_the_process_that_started_it() -> None:
    manager = _manager(_longhorizon(), continuous=True, groups_per_version=1, staleness_bound=0)
    (first,) = {e.rsplit("-e", 1)[0] for e in manager.start(num_tasks=1, group_size=2)}
    await settle()
    assert not await manager.on_group_dropped("t0000-r1g7")  # a predecessor's group: never counted here
    assert await manager.on_group_dropped(first)
    assert not await manager.on_group_dropped(first)  # redelivered event
    await settle()
    assert manager.groups_started == 2
    assert manager.groups_refunded == 1
    await manager.stop()
