"""The role-change time Elastic weighs a move with prices the round trip, not the fast direction."""

from __future__ import annotations

import pytest

from services.scheduler.handoff_clock import HandoffClock
from services.scheduler.policies import Role


def _handoff(
    clock: HandoffClock, device: str, epoch: int, to_role: Role, start_s: float, took_s: float
) -> None:
    clock.reassigned(device, epoch, to_role, start_s)
    clock.acquired(device, epoch, start_s + took_s)


def test_an_untimed_run_prices_a_role_change_at_the_default() -> None:
    assert HandoffClock().role_change_s(15.0) == 15.0


def test_fast_lends_do_not_make_the_slow_return_look_cheap() -> None:
    clock = HandoffClock()
    for i in range(20):  # the quickstart's case: many 0.03-s moves to the trainer, no return yet
        _handoff(clock, f"d{i % 4}", i, Role.TRAIN, float(i), 0.03)
    assert clock.role_change_s(15.0) == pytest.approx((0.03 + 15.0) / 2)
    _handoff(clock, "d0", 100, Role.ROLLOUT, 100.0, 1.5)
    assert clock.role_change_s(15.0) == pytest.approx((0.03 + 1.5) / 2)


def test_each_direction_keeps_its_own_median_over_its_last_window() -> None:
    clock = HandoffClock(window=3)
    for i, took in enumerate([9.0, 1.0, 2.0, 3.0]):  # the 9-s handoff falls out of the window
        _handoff(clock, "d0", i, Role.ROLLOUT, 10.0 * i, took)
    _handoff(clock, "d1", 0, Role.TRAIN, 0.0, 0.5)
    assert clock.measured(Role.ROLLOUT) == pytest.approx([1.0, 2.0, 3.0])
    assert clock.role_change_s(15.0) == pytest.approx((2.0 + 0.5) / 2)


def test_an_acquire_without_its_reassign_and_moves_to_idle_are_not_timed() -> None:
    clock = HandoffClock()
    clock.acquired("d0", 7, 3.0)  # e.g. a restarted scheduler saw only the end of the handoff
    clock.reassigned("d1", 1, Role.IDLE, 0.0)
    clock.acquired("d1", 1, 4.0)
    _handoff(clock, "d2", 1, Role.TRAIN, 0.0, 0.2)
    clock.acquired("d2", 1, 9.0)  # a repeated ACQUIRED event is counted once
    assert clock.measured(Role.TRAIN) == pytest.approx([0.2])
    assert clock.measured(Role.ROLLOUT) == []
