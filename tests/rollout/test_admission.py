"""Continuous rollout starts only the groups the staleness bound admits.

The agent here is a scripted stand-in at the outermost edge (it returns a finished outcome at once
instead of driving an environment through an engine); the ExecutionManager under test is real.
"""

from __future__ import annotations

from services.rollout.environments.longhorizon import LongHorizonFamily, LongHorizonSpec
from services.rollout.executions import ExecutionManager
from tests.helpers.agents import InstantAgent, settle


async def test_continuous_rollout_waits_for_a_new_weight_version_before_exceeding_the_bound() -> None:
    family = LongHorizonFamily(LongHorizonSpec(num_actions=4, max_turns=4, seed=0))
    manager = ExecutionManager(
        InstantAgent(),  # type: ignore[arg-type]
        family,
        run_id="r",
        seed=0,
        max_live=64,
        continuous=True,
        groups_per_version=2,
        staleness_bound=1,
    )
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
    family = LongHorizonFamily(LongHorizonSpec(num_actions=4, max_turns=4, seed=0))
    manager = ExecutionManager(
        InstantAgent(),  # type: ignore[arg-type]
        family,
        run_id="r",
        seed=0,
        max_live=64,
        continuous=True,
    )
    manager.start(num_tasks=1, group_size=2)
    await settle()
    assert manager.groups_started > 4
    await manager.stop()
