"""Unit tests of the pure scheduling policies (no I/O)."""

from __future__ import annotations

from services.scheduler.policies import (
    AsyncPolicy,
    ColocatePolicy,
    DeviceState,
    ElasticPolicy,
    PoolSnapshot,
    Role,
    may_start_batch,
)


def _snap(
    roles: list[Role],
    *,
    live: int = 0,
    queued: int = 0,
    cap: int = 4,
    backlog: int = 0,
    busy: bool = False,
    per_device: list[int] | None = None,
    moving: set[int] | None = None,
) -> PoolSnapshot:
    per_device = per_device or [0] * len(roles)
    moving = moving or set()
    devices = tuple(
        DeviceState(f"d{i:02d}", r, moving=i in moving, live_executions=per_device[i])
        for i, r in enumerate(roles)
    )
    return PoolSnapshot(devices, live, queued, cap, backlog, busy)


def test_colocate_moves_whole_pool_to_training_when_batch_is_done() -> None:
    moves = ColocatePolicy().plan(_snap([Role.ROLLOUT] * 4, backlog=1))
    assert {m.device_id for m in moves} == {"d00", "d01", "d02", "d03"}
    assert all(m.to_role == Role.TRAIN for m in moves)


def test_colocate_returns_whole_pool_to_rollout_when_work_is_admitted() -> None:
    moves = ColocatePolicy().plan(_snap([Role.TRAIN] * 3, queued=5))
    assert [m.to_role for m in moves] == [Role.ROLLOUT] * 3


def test_colocate_is_synchronous_whatever_bound_is_asked() -> None:
    assert ColocatePolicy(staleness_bound=3).staleness_bound == 0


def test_async_keeps_its_fixed_split() -> None:
    moves = AsyncPolicy(2).plan(_snap([Role.IDLE] * 5))
    assert [(m.device_id, m.to_role) for m in moves] == [
        ("d00", Role.ROLLOUT),
        ("d01", Role.ROLLOUT),
        ("d02", Role.TRAIN),
        ("d03", Role.TRAIN),
        ("d04", Role.TRAIN),
    ]
    assert AsyncPolicy(2).plan(_snap([Role.ROLLOUT] * 2 + [Role.TRAIN] * 3, live=50)) == []


def test_elastic_lends_tail_devices_with_fewest_executions_to_training() -> None:
    snap = _snap([Role.ROLLOUT] * 4, live=3, cap=4, backlog=1, per_device=[1, 0, 2, 0])
    moves = ElasticPolicy().plan(snap)
    assert sorted(m.device_id for m in moves) == ["d00", "d01", "d03"]
    assert all(m.to_role == Role.TRAIN for m in moves)


def test_elastic_never_plans_fewer_slots_than_live_executions() -> None:
    for live in range(0, 17):
        snap = _snap([Role.ROLLOUT] * 4, live=live, cap=4, backlog=1, busy=True)
        remaining = 4 - len(ElasticPolicy().plan(snap))
        assert remaining * 4 >= live


def test_elastic_returns_devices_from_a_starved_trainer_only_when_rollout_needs_them() -> None:
    roles = [Role.ROLLOUT, Role.TRAIN, Role.TRAIN]
    assert ElasticPolicy().plan(_snap(roles, live=1, cap=4)) == []
    moves = ElasticPolicy().plan(_snap(roles, live=4, queued=6, cap=4))
    assert sorted(m.device_id for m in moves) == ["d01", "d02"]
    spread = ElasticPolicy(spread_when_trainer_idle=True).plan(_snap(roles, live=1, cap=4))
    assert sorted(m.device_id for m in spread) == ["d01", "d02"]


def test_elastic_does_not_lend_devices_when_role_changes_cost_more_than_they_save() -> None:
    base = dict(live=1, cap=4, busy=True)
    roles = [Role.ROLLOUT] * 3 + [Role.TRAIN]
    snap = _snap(roles, **base)
    cheap = PoolSnapshot(snap.devices, 1, 0, 4, 0, True, trainer_work_device_s=10.0, role_change_s=15.0)
    worth = PoolSnapshot(snap.devices, 1, 0, 4, 0, True, trainer_work_device_s=1000.0, role_change_s=15.0)
    assert ElasticPolicy().plan(cheap) == []
    assert len(ElasticPolicy().plan(worth)) == 2


def test_elastic_takes_devices_back_when_new_batch_is_admitted() -> None:
    snap = _snap([Role.ROLLOUT] + [Role.TRAIN] * 3, live=2, queued=8, cap=4, busy=True)
    moves = ElasticPolicy().plan(snap)
    assert len(moves) == 2 and all(m.to_role == Role.ROLLOUT for m in moves)


def test_elastic_leaves_moving_devices_alone() -> None:
    snap = _snap([Role.ROLLOUT] * 3, live=0, backlog=1, moving={0, 1, 2})
    assert ElasticPolicy().plan(snap) == []


def test_admission_bounds_staleness() -> None:
    assert may_start_batch(0, 0, 0) and not may_start_batch(1, 0, 0)
    assert may_start_batch(2, 1, 1) and not may_start_batch(3, 1, 1)


def test_elastic_with_a_home_split_holds_it_while_work_waits() -> None:
    # KV need alone (2 devices for 8 executions) would starve a bandwidth-bound rollout; the home split wins.
    roles = [Role.ROLLOUT] + [Role.TRAIN] * 5
    moves = ElasticPolicy(base_rollout_devices=3).plan(_snap(roles, live=0, queued=8, cap=4, busy=True))
    assert len(moves) == 2 and all(m.to_role == Role.ROLLOUT for m in moves)


def test_elastic_with_a_home_split_stays_put_when_nothing_waits_and_nothing_trains() -> None:
    roles = [Role.ROLLOUT] * 3 + [Role.TRAIN] * 3
    assert ElasticPolicy(base_rollout_devices=3).plan(_snap(roles, live=1, cap=4)) == []


def test_elastic_brings_lent_devices_home_when_the_trainer_runs_dry() -> None:
    roles = [Role.ROLLOUT] + [Role.TRAIN] * 5
    moves = ElasticPolicy(base_rollout_devices=3).plan(_snap(roles, live=1, cap=4))
    assert len(moves) == 2 and all(m.to_role == Role.ROLLOUT for m in moves)


def test_elastic_without_consolidation_lends_only_an_emptied_rollout() -> None:
    roles = [Role.ROLLOUT] * 3 + [Role.TRAIN] * 3
    busy = dict(cap=4, backlog=1, busy=True)
    policy = ElasticPolicy(base_rollout_devices=3, consolidate=False)
    assert policy.plan(_snap(roles, live=1, per_device=[1, 0, 0, 0, 0, 0], **busy)) == []
    moves = policy.plan(_snap(roles, live=0, **busy))
    assert len(moves) == 3 and all(m.to_role == Role.TRAIN for m in moves)
    consolidating = ElasticPolicy(base_rollout_devices=3).plan(
        _snap(roles, live=1, per_device=[1, 0, 0, 0, 0, 0], **busy)
    )
    assert sorted(m.device_id for m in consolidating) == ["d01", "d02"]  # emptiest engines first
